"""A park's files swapped in together, and a park a crash interrupted finished or rolled back.

The server saves to a temporary name (:data:`TMP_PREFIX`); once the park verified the file,
:func:`commit_park` renames the old state file and its sidecar aside, the new ones into place, and
writes the catalog row, all under a ``park`` journal entry (:mod:`app.sessions.journal`), so any
failure before the row puts the old files back byte-identical (:func:`roll_back_park`). A process
killed on the way leaves the entry: :func:`recover_parks` finishes the park (its new state file in
place) or rolls it back, and sweeps the temporary files nobody journaled.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from app import files, paths
from app.sessions.journal import Journal, JournalKind, ParkJournal, ParkPhase, Recovery, recovers, replay
from app.server.statefile import StateFileError, read_state_header
from app.store.catalog import Catalog, SessionRecord

TMP_PREFIX = "kvv-tmp-"
#: Sidecar conventions stored next to the state file: turboquant #206 / upstream
#: PR #24028 use ``.ckpt``, upstream PR #20819 a ``.checkpoints`` companion.
SIDECAR_SUFFIXES = (".ckpt", ".checkpoints")


def _rm(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _save_companions(tmp: Path) -> list[Path]:
    """What a save to ``tmp`` may write besides it: its sidecars, and the file KV Valet's
    sidecar build writes a PKCL v2 sidecar through (``<state>.ckpt.tmp``, renamed when whole).
    A server killed mid-sidecar leaves that one: a failed park removes it too, and recovery
    counts it as the park's own (another process's park in flight must keep it)."""
    return [Path(str(tmp) + s + t) for s in SIDECAR_SUFFIXES for t in ("", ".tmp")]



def roll_back_park(p: ParkJournal) -> None:
    """Undo a park whose new state file is not in place: old files back, temps gone."""
    d, tmp, final, backup = p.paths
    if backup.exists():
        os.replace(backup, final)
    for suf in SIDECAR_SUFFIXES:
        bak = Path(str(backup) + suf)
        if bak.exists():
            os.replace(bak, Path(str(final) + suf))
    for companion in _save_companions(tmp):  # first: a sidecar never outlives its state file
        _rm(companion)
    _rm(tmp)


def _finish(catalog: Catalog, p: ParkJournal) -> SessionRecord:
    """Complete a park whose new state file is in place: its sidecars, its record, the previous
    copy dropped. The end of every park's commit (:func:`commit_park`), and of one a crash interrupted."""
    stored = _list_new(catalog, p)
    _drop_previous(p)
    return stored


def _list_new(catalog: Catalog, p: ParkJournal) -> SessionRecord:
    """The new sidecars next to the state file in place, then the session's record written."""
    d, tmp, final, backup = p.paths
    for suf in SIDECAR_SUFFIXES:
        new = Path(str(tmp) + suf)
        if new.exists():
            os.replace(new, Path(str(final) + suf))
    files.fsync_dir(d)  # the renames are durable before the row says the session is there
    rec = SessionRecord(**(p.record or {}))
    rec.id = None
    return catalog.add_or_replace(rec)


def _drop_previous(p: ParkJournal) -> None:
    d, tmp, final, backup = p.paths
    _rm(backup)
    for suf in SIDECAR_SUFFIXES:
        _rm(Path(str(backup) + suf))


def _listed_as_is(catalog: Catalog, p: ParkJournal, final: Path) -> bool:
    """The catalog lists ``final`` as it is on disk now (size and token count)."""
    rec = catalog.get(p.profile, p.name)
    if rec is None or rec.state_file != p.final or Path(rec.save_dir) != Path(p.save_dir):
        return False
    try:
        header = read_state_header(final)
    except (StateFileError, OSError):
        return False
    return header.file_size == rec.state_size and header.token_count == rec.n_tokens


def _discard(p: ParkJournal) -> None:
    """Remove what an interrupted park left aside: its previous copy and its temporary files."""
    d, tmp, final, backup = p.paths
    for f in [backup, *(Path(str(backup) + s) for s in SIDECAR_SUFFIXES), tmp, *_save_companions(tmp)]:
        _rm(f)


@recovers(JournalKind.PARK)
def recover_parks(run: Recovery) -> list[str]:
    """Finish or roll back parks a crash interrupted; delete orphaned temp files in ``run.save_dirs``.

    Run at app/CLI start (:func:`app.sessions.journal.recover`) and by a park before its commit.
    A journaled park whose temp state file still exists is rolled back (old state file and
    sidecar restored); one whose new state file is already in place (same inode as journaled)
    is finished (sidecar moved, record written). Parks still running, here or in another live
    process, are left alone.
    """
    catalog = run.catalog
    assert catalog is not None
    dirs = {Path(d) for d in run.save_dirs if d}
    # List files before reading the journal: a temp file seen here was journaled
    # before it was created, so a concurrent park cannot lose its file.
    leftovers = {p for d in dirs if d.is_dir() for p in d.glob(TMP_PREFIX + "*")}
    referenced: set[Path] = set()
    parks = [e.entry for e in Journal(catalog).entries(JournalKind.PARK) if isinstance(e.entry, ParkJournal)]
    committing = {p.tmp for p in parks if p.phase is ParkPhase.COMMIT}
    for p in parks:
        d, tmp, final, backup = p.paths
        referenced.update([tmp, backup, *_save_companions(tmp)] + [Path(str(backup) + s) for s in SIDECAR_SUFFIXES])

    def handle(p: ParkJournal) -> str | None:
        d, tmp, final, backup = p.paths
        name = p.name or p.final
        if p.phase is not ParkPhase.COMMIT:
            if p.tmp in committing:
                return None  # its commit entry decides
            roll_back_park(p)
            return f"park of '{name}' was interrupted while saving: temporary files removed"
        if tmp.exists():
            roll_back_park(p)
            return f"park of '{name}' was interrupted: rolled back, the previous copy is kept"
        if final.exists() and final.stat().st_ino == p.ino:
            _finish(catalog, p)
            return f"park of '{name}' was interrupted after the state file was moved: finished"
        if final.exists() and _listed_as_is(catalog, p, final):
            # parked again since (another process): that copy and its row stand; restoring this
            # park's previous copy over it would pair the newer row with an older file
            _discard(p)
            return f"park of '{name}' was interrupted and parked again since: leftovers removed"
        roll_back_park(p)
        return f"park of '{name}' was interrupted and its new file is gone: rolled back"

    messages = replay(catalog, JournalKind.PARK, handle, lambda p: f"the park of '{p.name or p.final}'")
    for f in sorted(leftovers - referenced):
        if f.exists():
            with contextlib.suppress(OSError):
                f.unlink()
                messages.append(f"deleted leftover temporary file {f}")
    return messages


def known_save_dirs(catalog: Catalog, extra=()) -> list[Path]:
    """Folders to sweep in recover_parks: journaled, catalogued, profile folders."""
    dirs = {Path(r.save_dir) for r in catalog.list()}
    dirs |= {Path(e.entry.save_dir) for e in Journal(catalog).entries(JournalKind.PARK)
             if isinstance(e.entry, ParkJournal)}
    sessions = paths.data_dir() / "sessions"
    if sessions.is_dir():
        dirs |= {d for d in sessions.iterdir() if d.is_dir()}
    dirs |= {Path(x) for x in extra if x}
    return sorted(dirs)


def commit_park(catalog: Catalog, p: ParkJournal) -> SessionRecord:
    """Swap in the new state file and its sidecar, then write the record.

    Old state file and sidecars are renamed aside first; if anything fails
    before the record is written they go back (the caller's :func:`roll_back_park`).
    """
    d, tmp, final, backup = p.paths
    # durable: the new files' bytes on disk before they are renamed in, the renames on disk before
    # the row (FULL: on disk when it returns) says "parked"; a power cut then keeps this park
    for f in (tmp, *(Path(str(tmp) + s) for s in SIDECAR_SUFFIXES)):
        if f.exists():
            files.fsync_file(f)
    for suf in SIDECAR_SUFFIXES:
        old = Path(str(final) + suf)
        if old.exists():  # stale or previous sidecar: never paired with the new state file
            os.replace(old, Path(str(backup) + suf))
    if final.exists():
        os.replace(final, backup)
    os.replace(tmp, final)
    try:
        stored = _list_new(catalog, p)
    except BaseException:
        # Put the new files back under their temp names so roll_back_park sees "not moved"
        # (every old sidecar was renamed aside first, so what sits at final+suf is new).
        for suf in SIDECAR_SUFFIXES:
            moved = Path(str(final) + suf)
            if moved.exists():
                with contextlib.suppress(OSError):
                    os.replace(moved, Path(str(tmp) + suf))
        with contextlib.suppress(OSError):
            os.replace(final, tmp)
        raise
    _drop_previous(p)
    return stored
