"""A power cut in the middle of a park, on the real server.

A power cut cannot be made in a test, but what it leaves can: the files exactly as the
park had written them at that point (the temporary state file the real server saved
under the name the app gives it, the previous copy renamed aside) and the journal entry
the park had written before touching them (app.sessions.park_commit, app.sessions.journal), whose owner
is a process that no longer exists (after a reboot its pid belongs to another process).
The next start (``kv-valet resume`` in a new process) must clean the temporary files,
keep the previous copy listed, byte-identical, and say what it did.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from app import paths
from app.sessions.journal import JournalKind, Owner, ParkJournal, ParkPhase, _payload
from app.server.client import LlamaClient
from app.server.statefile import read_state_header
from app.store.catalog import Catalog
from tests.faults.helpers import MORE, SHORT, Server, assert_consistent, cli, state_bytes

pytestmark = pytest.mark.real_server

#: pid 1 exists but started long before "0.0": the owner is recognised as gone (pid reused).
REBOOTED = Owner(1, 0.0)


async def _server_saves_temp_file(srv: Server, slot: int) -> ParkJournal:
    """What a park of "chat" has on disk after the server's save: its journal entry (not
    written yet) and the temporary state file, saved by the real server under its name."""
    hexid = secrets.token_hex(6)
    entry = ParkJournal(save_dir=str(srv.save_dir), tmp=f"kvv-tmp-{hexid}.bin", final="chat.bin",
                        backup=f"kvv-tmp-{hexid}.prev.bin", name="chat", profile="real", owner=REBOOTED)
    async with LlamaClient(srv.plan.url) as c:
        await c.save_slot(slot, entry.tmp)
    return entry


def _journal(entry: ParkJournal) -> None:
    with Catalog(paths.catalog_path()) as cat:
        cat.add_pending(str(JournalKind.PARK), _payload(entry))


def _commit_entry(entry: ParkJournal) -> ParkJournal:
    """The commit phase's entry: the verified file's inode and the row it will write."""
    _d, tmp, final, _backup = entry.paths
    with Catalog(paths.catalog_path()) as cat:
        rec = cat.get("real", "chat")
    header = read_state_header(tmp)
    new = replace(rec, id=None, n_tokens=header.token_count, state_size=header.file_size)
    return replace(entry, phase=ParkPhase.COMMIT, ino=tmp.stat().st_ino, record=asdict(new))


async def _next_start(n_old: int, old_bytes: bytes, save_dir: Path, note: str) -> None:
    rc, out, err = await cli("resume", "real", "chat", "--slot", "1", "--yes")
    assert rc == 0 and f"resumed 'chat' into slot 1: {n_old:,} tokens" in out, (out, err)
    assert note in err, err
    listed = assert_consistent([save_dir])
    assert listed["chat"].n_tokens == n_old
    assert state_bytes(save_dir, "chat.bin") == old_bytes


def test_power_cut_before_the_rename_keeps_the_old_copy(stock_profile):
    async def go():
        srv = await Server(stock_profile).start()
        try:
            await srv.fill(0)
            svc, cat = await srv.service()
            try:
                old = (await svc.park(0, "chat")).record
            finally:
                await svc.aclose()
                cat.close()
            assert old.state_file == "chat.bin"
            old_bytes = state_bytes(srv.save_dir, "chat.bin")
            await srv.fill(0, SHORT + MORE)  # the new copy would hold more tokens

            # 1. cut while saving: the journal says "saving", the temporary file is whole
            entry = await _server_saves_temp_file(srv, 0)
            _journal(entry)
            await _next_start(old.n_tokens, old_bytes, srv.save_dir,
                              "park of 'chat' was interrupted while saving: temporary files removed")

            # 2. cut after the commit was journaled, before the first rename
            entry = await _server_saves_temp_file(srv, 0)
            _journal(_commit_entry(entry))
            await _next_start(old.n_tokens, old_bytes, srv.save_dir,
                              "park of 'chat' was interrupted: rolled back, the previous copy is kept")

            # 3. cut between the two renames: the old copy aside, the new one not in place yet
            # (the listed session has no file until the next start puts the old copy back)
            entry = await _server_saves_temp_file(srv, 0)
            commit = _commit_entry(entry)
            _journal(commit)
            _d, tmp, final, backup = commit.paths
            final.rename(backup)
            assert not final.exists() and tmp.exists()
            await _next_start(old.n_tokens, old_bytes, srv.save_dir,
                              "park of 'chat' was interrupted: rolled back, the previous copy is kept")

            # 4. the journal entry itself lost (sqlite's last transaction, not yet on disk, went
            # with the power): a temporary file nobody journaled is swept at the next start
            entry = await _server_saves_temp_file(srv, 0)
            await _next_start(old.n_tokens, old_bytes, srv.save_dir,
                              f"deleted leftover temporary file {entry.paths[1]}")
        finally:
            await srv.aclose()

    asyncio.run(go())


def test_a_park_that_says_parked_is_on_disk_in_the_order_a_power_cut_needs(stock_profile):
    """A power cut keeps what was fsynced, nothing else. So a park that says "parked" has, in
    this order: the new state file's bytes fsynced (else the rename could survive with an empty
    or partial file), the file renamed into place, its folder fsynced (else the rename itself
    could be lost), and only then the catalog row committed, by a catalog that syncs every commit
    (PRAGMA synchronous = FULL: under NORMAL the newest row could be lost). Every fsync and rename
    the park makes is recorded and its order checked."""
    import os

    from app.sessions import park_commit

    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", f"{src} -> {dst}"))
        return real_replace(src, dst)

    async def go():
        srv = await Server(stock_profile).start()
        try:
            await srv.fill(0)
            svc, cat = await srv.service()
            assert cat._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
            real_add = cat.add_or_replace

            def add_or_replace(rec):
                events.append(("row", rec.name))
                return real_add(rec)

            try:
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(cat, "add_or_replace", add_or_replace)
                    mp.setattr(park_commit.os, "replace", replace)
                    mp.setattr(os, "fsync", fsync)
                    parked = (await svc.park(0, "chat")).record
            finally:
                await svc.aclose()
                cat.close()
            return parked
        finally:
            await srv.aclose()

    rec = asyncio.run(go())
    save_dir = str(rec.state_path.parent)
    final = str(rec.state_path)

    def first(kind: str, test) -> int:
        return next(i for i, (k, what) in enumerate(events) if k == kind and test(what))

    into_place = first("rename", lambda w: w.endswith(" -> " + final))
    tmp = events[into_place][1].split(" -> ")[0]
    data_synced = first("fsync", lambda w: w == tmp)
    folder_synced = first("fsync", lambda w: w == save_dir)
    row = first("row", lambda w: w == "chat")
    assert data_synced < into_place < folder_synced < row, events
    assert state_bytes(Path(save_dir), rec.state_file)  # and the parked file is whole on disk
