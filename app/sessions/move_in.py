"""The receiving side of a move after a crash: the ``move-in`` journal's commits finished or rolled back.

A move into this machine journals its commit (``catalog.pending``, kind ``move-in``:
:mod:`app.sessions.journal`) before its first rename. A process killed during the commit leaves
that entry; whoever opens the catalog next (the session service's connect, the next move,
``kv-valet sessions …``, ``kv-valet sessions receive``) finishes it (every file in place or still
at its temporary name, inode, size and SHA-256 as sent: renamed and listed) or rolls it back (its
files removed). The move itself (:mod:`app.move.receive`) writes the entries; this module, in the
sessions layer, reads them, so a session service recovers without importing the move layer above it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from app import files
from app.sessions.files_lock import files_locked
from app.sessions.journal import JournalKind, MoveInJournal, Recovery, recover, recovers, replay
from app.store.catalog import Catalog, SessionRecord

MOVE_PREFIX = "kvv-move-"
#: Sidecar conventions stored next to the state file (as app.sessions.park_commit.SIDECAR_SUFFIXES).
SIDECAR_SUFFIXES = (".ckpt", ".checkpoints")
_ID_RE = re.compile(r"[0-9a-f]{12}")
#: The catalog's pending table holds a receipt per move listed here (its sender may have lost the
#: answer: a cut connection, a killed ``move-host`` or ``receive --commit``) until the sender settles it, or this long.
RECEIPT_KIND = "move-done"
RECEIPT_KEEP_S = 30 * 86400.0


def temp_name(move_id: str, suffix: str) -> str:
    """The temporary name of a move's file: ``suffix`` "" (state), ".ckpt", ".checkpoints", ".json"."""
    return f"{MOVE_PREFIX}{move_id}{suffix or '.state'}.part"


def discard_temps(save_dir: str | os.PathLike, move_id: str) -> list[Path]:
    """Remove every temporary file of move ``move_id`` (a well-formed id: the caller checked it)."""
    if not _ID_RE.fullmatch(move_id):
        raise ValueError(f"not a move id: {move_id!r}")
    removed = []
    for suffix in ("", *SIDECAR_SUFFIXES, ".json"):
        p = Path(save_dir) / temp_name(move_id, suffix)
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            removed.append(p)
    return removed


def sha256_of(path: Path) -> str:
    """The file's SHA-256, read through one small reused buffer (``hashlib.file_digest``): a 4 MiB
    ``read()`` per chunk in each worker thread left that much resident per thread's malloc arena, which
    the soak test saw as RSS growing 0.7 MB per park/resume cycle."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@recovers(JournalKind.MOVE_IN)
def recover_moves(run: Recovery) -> list[str]:
    """Finish or roll back the commits of moves into this machine a killed process left
    (journal ``move-in``; commits still running, here or in another live process, are left
    alone); returns what was done, for the user. A commit whose files are all there (at the
    final or the temporary name, the inode journaled, size and SHA-256 as sent) and whose
    name is free is finished: renamed and listed. Any other is rolled back: its files are
    removed. ``run.roll_back``: the move id of a move its sender gave up on (``receive --abort``):
    rolled back whatever its state, so the sender's "nothing was added" stays true. Run through
    :func:`app.sessions.journal.recover` (under the catalog's files lock)."""
    catalog = run.catalog
    assert catalog is not None
    known = {f.name for f in fields(SessionRecord)}

    def what(m: MoveInJournal) -> str:
        return f"the move of '{m.record.get('name')}' into profile '{m.record.get('profile')}'"

    def handle(m: MoveInJournal) -> str | None:
        rec = SessionRecord(**{k: v for k, v in m.record.items() if k in known})
        folder = Path(m.save_dir)
        row = catalog.get(rec.profile, rec.name)
        msg = None
        if row is not None and Path(row.save_dir) == folder and row.state_file == m.final:
            write_receipt(catalog, m.move_id, row)  # the row was written: the commit was done
        elif m.move_id != run.roll_back and row is None and _finish_move(catalog, m, rec):
            write_receipt(catalog, m.move_id, rec)
            msg = (f"{what(m)} was interrupted after its files were copied and checked: finished (listed, "
                   "SHA-256 checked)")
        else:
            _roll_back_move(m)
            msg = (f"{what(m)} was interrupted before it was listed: its files there were removed (the source "
                   "still has it)")
        discard_temps(folder, m.move_id)
        return msg

    now = time.time()
    for jid, kind, _payload, at in catalog.list_pending():
        if kind == RECEIPT_KIND and isinstance(at, (int, float)) and at < now - RECEIPT_KEEP_S:
            catalog.remove_pending(jid)  # nobody asked for it: its sender had the answer
    return replay(catalog, JournalKind.MOVE_IN, handle, what)


def write_receipt(catalog: Catalog, move_id: str, rec: SessionRecord) -> None:
    """Say that move ``move_id`` listed ``rec`` here: :func:`settle_move` answers its sender by it."""
    catalog.add_pending(RECEIPT_KIND, {"move_id": move_id, "profile": rec.profile, "name": rec.name,
                                       "save_dir": str(rec.save_dir), "state_file": rec.state_file})


def settle_move(catalog: Catalog, move_id: str, save_dir: str | os.PathLike | None = None
                ) -> tuple[SessionRecord | None, list[str]]:
    """What became of move ``move_id`` here, for its sender, who gave up on it or lost the answer of
    its commit (a cut SSH connection, a killed ``move-host`` or ``receive --commit``): returns (the listed row, or
    None, and what recovery did). Under the catalog's files lock, so a commit of it that still runs
    in another process is waited for. A commit that got as far as listing the session (its
    receipt, or its journal entry with the row written) is kept: its row is returned and the
    sender deletes its source. Any other is rolled back (its files removed): the sender keeps its
    source. Either way exactly one listed copy remains. ``save_dir``: the move's folder here, whose
    temporary files of ``move_id`` are removed too."""
    if not _ID_RE.fullmatch(move_id):
        raise ValueError(f"not a move id: {move_id!r}")
    with files_locked(catalog):
        messages = recover([JournalKind.MOVE_IN], Recovery(catalog, roll_back=move_id, lock_held=True))
        listed = None
        for jid, kind, payload, _at in catalog.list_pending():
            if kind != RECEIPT_KIND or payload.get("move_id") != move_id:
                continue
            row = catalog.get(str(payload.get("profile")), str(payload.get("name")))
            if row is not None and row.state_file == payload.get("state_file") \
                    and Path(row.save_dir) == Path(str(payload.get("save_dir"))):
                listed = row
            catalog.remove_pending(jid)
        if save_dir is not None:
            discard_temps(save_dir, move_id)  # under the lock: never under a commit that renames them
        return listed, messages


def _located(m, suffix: str, info: dict[str, Any]) -> Path | None:
    """Where the journaled file ``suffix`` of commit ``m`` is now (its inode and size), or None."""
    folder = Path(m.save_dir)
    for p in (folder / (m.final + suffix), folder / temp_name(m.move_id, suffix)):
        try:
            st = p.lstat()
        except FileNotFoundError:
            continue
        if st.st_ino == info.get("ino") and st.st_size == int(info.get("size", -1)):
            return p
    return None


def _finish_move(catalog: Catalog, m, rec: SessionRecord) -> bool:
    """Complete the commit ``m``: True when its files are whole (SHA-256 read back) and it is listed."""
    folder = Path(m.save_dir)
    found = {s: _located(m, s, info) for s, info in m.files.items()}
    if any(p is None for p in found.values()) or "" not in found:
        return False
    if any(r.state_file == m.final and Path(r.save_dir) == folder for r in catalog.list()):
        return False  # the file name went to another session meanwhile
    if any(sha256_of(p) != m.files[s].get("sha256") for s, p in found.items()):
        return False
    for s, p in sorted(found.items(), key=lambda kv: kv[0] == ""):
        dest = folder / (m.final + s)
        if p != dest:
            os.replace(p, dest)
    files.fsync_dir(folder)
    catalog.add_or_replace(rec)
    return True


def _roll_back_move(m) -> None:
    """Remove the files commit ``m`` put in place (the journaled inodes only) and its temporary files."""
    folder = Path(m.save_dir)
    for s, info in m.files.items():
        p = _located(m, s, info)
        if p is not None:
            p.unlink()
    discard_temps(folder, m.move_id)
