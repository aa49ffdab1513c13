"""A park's files on disk against what the park wrote (:mod:`app.core.park_files` decides and words).

* **At the park** (:func:`digest`, in a worker thread: files can be gigabytes): each file's size and
  SHA-256, and the sidecar's checkpoint positions from its header (a lax read, so even a sidecar the
  loaders would refuse has its positions kept). The park hashes its temporary files before they are
  renamed into place, then records their stamps (:func:`stamp_files`).
* **Before a resume, a check, an A/B or a move** (:func:`look`), kept cheap for big state files: a
  file whose **stamp** (device, inode, size, mtime, ctime) is the one recorded when it was last
  found to be the parked file is that file, and costs one ``stat()``: anything that writes a file
  (a copy over it, ``cp -p`` and ``rsync -a`` included) changes its ctime, which no tool can set
  back, and a rename puts another inode there. A file whose stamp changed is looked at: its size,
  a sidecar's checkpoint positions from its header (a few hundred bytes with ``seek()``: another
  chat's sidecar has other positions, so the issue's case is named without a hash), then its
  SHA-256; a hash that matches records the new stamp, so the next look is a ``stat()`` again.
* ``hash_changed=False`` (a listing, the window's refresh): a changed stamp with the same size and
  positions is "not verified yet" instead of a hash; a resume, a check and a move always hash.
  A filesystem whose ctime does not change on a write would let a same-size rewrite with the same
  positions through the stamp; the hash of :func:`digest` still catches it at a move (its bytes are
  hashed as they are sent).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import stat
from pathlib import Path

from app.core.confirmation import NeedsConfirmation
from app.core.park_files import STATE, FilesCheck, FilesStatus, FoundFile, ParkedFile, ParkedFiles, Position, compare
from app.sessions.move_in import sha256_of
from app.server.sidecar import read_facts
from app.store.catalog import Catalog, SessionRecord

log = logging.getLogger(__name__)

#: The sidecar suffixes next to a state file (as app.sessions.park_commit.SIDECAR_SUFFIXES).
SIDECAR_SUFFIXES = (".ckpt", ".checkpoints")
SUFFIXES = (STATE, *SIDECAR_SUFFIXES)

_Stamp = list[int]


def _stamp(path: Path) -> _Stamp | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _positions(state: Path) -> tuple[Position, ...] | None:
    """The ``.ckpt`` sidecar's checkpoint positions from its header (None: no PKCL header to read)."""
    facts = read_facts(state)
    if facts.kind != "PKCL" or not str(facts.path or "").endswith(".ckpt"):
        return None
    return tuple((c.n_tokens, c.pos_min, c.pos_max) for c in facts.checkpoints)


def _path(state: Path, suffix: str) -> Path:
    return state.with_name(state.name + suffix)


def digest(state: str | os.PathLike) -> ParkedFiles:
    """What a park wrote: ``state`` and each sidecar next to it (size, SHA-256, checkpoint positions).
    Reads every byte: call it off the event loop."""
    state = Path(state)
    files = []
    for suffix in SUFFIXES:
        p = _path(state, suffix)
        if suffix != STATE and not p.is_file():
            continue
        cps = _positions(state) if suffix == ".ckpt" else None
        files.append(ParkedFile(suffix, p.stat().st_size, sha256_of(p), cps))
    return ParkedFiles(tuple(files))


def stamps_of(state: str | os.PathLike) -> str:
    """The stamps of ``state`` and its sidecars now, as the catalog's ``files_verified`` text."""
    state = Path(state)
    out = {s: st for s in SUFFIXES if (st := _stamp(_path(state, s))) is not None}
    return json.dumps(out, sort_keys=True, separators=(",", ":"))


def stamp_files(catalog: Catalog, rec: SessionRecord) -> None:
    """The park's files are in place: the next look at them is a ``stat()``, not a hash."""
    if rec.id is not None and rec.parked_files:
        catalog.set_files_verified(rec.id, stamps_of(rec.state_path), parked_files=rec.parked_files)


def _verified_stamps(rec: SessionRecord) -> dict[str, list]:
    return dict(_stamps_text(rec.files_verified or "{}"))


@functools.lru_cache(maxsize=1024)
def _stamps_text(text: str) -> dict[str, list]:
    """(Read once per text: a restore's check reads it per request. Copied by its caller.)"""
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def look_unchanged(rec: SessionRecord) -> FilesCheck | None:
    """:func:`look`'s answer when none of ``rec``'s files was written since it was found to be the parked
    one (a ``stat`` of each, no read, nothing to record: cheap enough for a request's path); None when one
    was, or a file came or went: then :func:`look` reads what it must (off the event loop)."""
    parked = ParkedFiles.from_json(rec.parked_files)
    stamps = _verified_stamps(rec)
    if parked is None or not stamps:
        return None
    state = rec.state_path
    found: dict[str, FoundFile] = {}
    for suffix in SUFFIXES:
        p = _path(state, suffix)
        try:
            now = os.stat(p)
        except OSError:
            if suffix in stamps:
                return None  # gone since
            continue
        was = parked.get(suffix)
        st = [now.st_dev, now.st_ino, now.st_size, now.st_mtime_ns, now.st_ctime_ns]  # (:func:`_stamp`)
        if was is None or stamps.get(suffix) != st or not stat.S_ISREG(now.st_mode):
            return None
        found[suffix] = FoundFile(suffix, p.name, st[2], was.sha256, was.checkpoints)
    if set(found) != set(stamps):
        return None
    return compare(parked, found, state_name=state.name)


def look(catalog: Catalog | None, rec: SessionRecord, *, hash_changed: bool = True) -> FilesCheck:
    """``rec``'s files now against what its park wrote (see the module doc for what is read when).
    A file found by its hash to be the parked one gets its stamp recorded (``catalog`` given)."""
    parked = ParkedFiles.from_json(rec.parked_files)
    if parked is None:
        return compare(None, {})
    state = rec.state_path
    stamps = _verified_stamps(rec)
    found: dict[str, FoundFile] = {}
    positions = None
    for suffix in SUFFIXES:
        p = _path(state, suffix)
        st = _stamp(p)
        if st is None or not p.is_file():
            continue
        was = parked.get(suffix)
        sha = None
        if was is not None and stamps.get(suffix) == st:
            # not written since it was found to be the parked file: its bytes and positions are those
            found[suffix] = FoundFile(suffix, p.name, st[2], was.sha256, was.checkpoints)
            continue
        if suffix == ".ckpt":
            try:
                positions = _positions(state)
            except OSError as exc:
                log.info("cannot read the sidecar header of %s: %s", p, exc)
        if was is not None and st[2] == was.size and hash_changed and \
                (was.checkpoints is None or positions is None or tuple(positions) == tuple(was.checkpoints)):
            try:
                sha = sha256_of(p)
            except OSError as exc:
                log.info("cannot hash %s: %s", p, exc)
        found[suffix] = FoundFile(suffix, p.name, st[2], sha, positions if suffix == ".ckpt" else None)
    check = compare(parked, found, state_name=state.name)
    if catalog is not None and rec.id is not None and check.status is FilesStatus.AS_PARKED:
        now = {s: _stamp(_path(state, s)) for s in found}
        if any(stamps.get(s) != st for s, st in now.items()) or set(stamps) != set(now):
            catalog.set_files_verified(rec.id, json.dumps(now, sort_keys=True, separators=(",", ":")),
                                       parked_files=rec.parked_files)
    return check


def confirm(catalog: Catalog | None, rec: SessionRecord, force: bool, what: str) -> FilesCheck:
    """The check before ``what`` ("the resume", "the check", "the A/B", "the move"): raises
    :class:`NeedsConfirmation` when a file is not the one parked and ``force`` is not given."""
    check = look(catalog, rec)
    if check.refuses and not force:
        raise NeedsConfirmation([f"{p}: {what} would use it" for p in check.problems])
    return check
