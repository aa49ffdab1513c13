"""Two real llama-servers (b11434) under two profiles at once, through one ServerService (issue #20).

Each parks and resumes a chat under the SAME session name: every file lands in its own
profile's --slot-save-path, every catalog row carries its own profile and folder, each resume
restores its own server's chat (its own token count) into its own slot, and the other server's
slots and files stay as they were. The server list's local source lists both with their slots.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from app import paths
from app.core.states import ServerState
from app.servers.server_list import LocalServerSource, SlotUse
from app.servers.service import ServerService
from app.store.catalog import Catalog
from tests.conftest import free_port
from tests.real.helpers import TEXT

pytestmark = pytest.mark.real_server

PROMPTS = {"left": TEXT, "right": TEXT + " " + TEXT}  # two chats of different lengths: no mix-up hides


def held(rows) -> dict[int, int]:
    return {r.id: r.tokens_held for r in rows if (r.tokens_held or 0) > 0}


def files_in(folder) -> set[str]:
    return {p.name for p in folder.iterdir()}


async def test_two_profiles_park_and_resume_each_into_their_own_folder_and_catalog(real_profile, tmp_path):
    profiles = {name: real_profile.replace(name=name, port=free_port(), ctx_size=4096, parallel=2,
                                           slot_save_path=str(tmp_path / name) + "/")
                for name in ("left", "right")}
    catalog = Catalog(paths.catalog_path())
    servers = ServerService(catalog)
    source = LocalServerSource(servers)
    try:
        left, right = await asyncio.gather(*(servers.launch(p) for p in profiles.values()))
        assert left is not None and right is not None
        assert {h.state for h in (left, right)} == {ServerState.READY} and left.pid != right.pid
        svc = {"left": await servers.sessions(left.id), "right": await servers.sessions(right.id)}
        assert svc["left"] is not svc["right"] and svc["left"].target.client is not svc["right"].target.client
        # what each server itself said of the model at load (print_info), read from its own run's log
        assert {s.target.model_kind_from_log for s in svc.values()} == {"sliding-window"}

        for name, s in svc.items():
            await s.target.client.completion(PROMPTS[name], slot_id=0, n_predict=2)
        await source.refresh()
        assert {r.name: r.slots for r in source.rows()} == {"left": SlotUse(2, 1, 0), "right": SlotUse(2, 1, 0)}
        assert all(r.process is not None and r.process.rss > 0 for r in source.rows())

        parks = {name: (await s.park(0, "chat")).record for name, s in svc.items()}
        for name, rec in parks.items():
            assert (rec.profile, rec.name, rec.slot_id, rec.memory_kind) == (name, "chat", 0, "sliding-window")
            assert rec.state_path.parent == tmp_path / name and rec.state_path.is_file()
            assert files_in(tmp_path / name) == {rec.state_file}  # one file, in its own folder only
        assert parks["right"].n_tokens > parks["left"].n_tokens  # each server saved its own chat
        assert sorted((r.profile, r.name, Path(r.save_dir)) for r in catalog.list()) == [
            ("left", "chat", tmp_path / "left"), ("right", "chat", tmp_path / "right")]

        # resume on the left only: the right server's slots do not change
        right_before = held(await svc["right"].slot_rows())
        done = await svc["left"].resume("chat", 1, force=True)
        assert (done.record.profile, done.slot_id, done.n_restored) == ("left", 1, parks["left"].n_tokens)
        assert held(await svc["right"].slot_rows()) == right_before
        assert 1 not in held(await svc["right"].slot_rows())
        done = await svc["right"].resume("chat", 1, force=True)
        assert (done.record.profile, done.slot_id, done.n_restored) == ("right", 1, parks["right"].n_tokens)
        # each server's own record of what it restored where
        assert svc["left"].target.restored[1].n_tokens == parks["left"].n_tokens
        assert svc["right"].target.restored[1].n_tokens == parks["right"].n_tokens
        with Catalog(paths.catalog_path()) as cat:  # another connection, as another process reads it
            assert all(r.last_restore_at is not None and r.last_verdict == "UNKNOWN" for r in cat.list())
    finally:
        await source.aclose()
        await servers.aclose()
        catalog.close()
    assert left.supervisor.state is ServerState.STOPPED and right.supervisor.state is ServerState.STOPPED
