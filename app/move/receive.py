"""The target's half of a move, on this machine: the temporary files checked, renamed and listed.

The sender streams each file to a temporary name in the target's folder; :func:`adopt` checks them
(size, SHA-256 read back from this disk, the state header), then, under the catalog's files lock
and a ``move-in`` journal entry, renames them into place (both or neither) and writes the row. It
runs here for a move between two profiles and on a host through ``kv-valet sessions receive``.
:func:`discard` removes a move's temporary files (an abort), :func:`clean_stale` those a crash
left, :func:`settle` answers a sender that lost its commit's answer. Finishing or rolling back a commit a killed process left is :mod:`app.sessions.move_in`.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import re
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Callable

from app import files as fileio
from app.move.values import ChecksumMismatch, MoveError, check_move_id
from app.sessions.journal import Recovery
from app.sessions.move_in import (MOVE_PREFIX, SIDECAR_SUFFIXES, discard_temps, recover_moves, settle_move,
                                  sha256_of, temp_name, write_receipt)
from app.store.catalog import Catalog, SessionRecord

log = logging.getLogger(__name__)

#: A temporary file of a move nobody has written for this long is a crash's leftover.
STALE_AFTER_S = 600.0
_TEMP_RE = re.compile(r"kvv-move-[0-9a-f]{12}\.(state|ckpt|checkpoints|json)\.part")


def clean_stale(save_dir: str | os.PathLike, *, now: float | None = None,
                max_age: float = STALE_AFTER_S) -> list[Path]:
    """Remove the temporary files of moves nobody has written for ``max_age`` seconds."""
    folder = Path(save_dir)
    if not folder.is_dir():
        return []
    now = time.time() if now is None else now
    removed = []
    for p in folder.glob(MOVE_PREFIX + "*"):
        if not _TEMP_RE.fullmatch(p.name):
            continue
        try:
            if p.lstat().st_mtime < now - max_age:
                p.unlink()
                removed.append(p)
        except FileNotFoundError:
            continue
    return removed


def discard(save_dir: str | os.PathLike, move_id: str) -> list[Path]:
    """Remove every temporary file of move ``move_id`` (an aborted or finished move)."""
    return discard_temps(save_dir, check_move_id(move_id))


def manifest_path(save_dir: str | os.PathLike, move_id: str) -> Path:
    """Where the sender wrote the manifest of move ``move_id`` before asking for its commit."""
    return Path(save_dir) / temp_name(check_move_id(move_id), ".json")


def settle(catalog: Catalog, move_id: str, save_dir: str | os.PathLike) -> tuple[SessionRecord | None, list[str]]:
    """What became of move ``move_id`` here, for a sender that gave up on it or lost its commit's
    answer (:func:`app.sessions.move_in.settle_move`): the row when its commit listed the session,
    else None (rolled back: its files removed), and what recovery did."""
    return settle_move(catalog, check_move_id(move_id), save_dir)


def _free_state_name(catalog: Catalog, save_dir: Path, name: str) -> str:
    """``<slug>.bin`` (or ``<slug>-N.bin``) that no session, no file and no stray sidecar holds."""
    from app.sessions.park import slugify

    taken = {r.state_file for r in catalog.list() if Path(r.save_dir) == save_dir}
    base = slugify(name)
    for i in range(1, 1000):
        cand = f"{base}.bin" if i == 1 else f"{base}-{i}.bin"
        if cand in taken or any(os.path.lexists(save_dir / (cand + s)) for s in ("", *SIDECAR_SUFFIXES)):
            continue
        return cand
    raise MoveError(f"no free file name for '{name}' in {save_dir}")


_RESET = {"id": None, "last_restore_ms": None, "last_n_restored": None, "last_restore_at": None,
          "last_verdict": None, "last_verdict_reason": None, "time_saved_s": 0.0, "last_time_saved_s": None,
          "files_verified": ""}  # the sender's stamps: the first look here hashes (parked_files travels: same bytes)


def _sync_file_range() -> Callable[[int, int, int], None] | None:
    """Linux's ``sync_file_range(fd, offset, n, SYNC_FILE_RANGE_WRITE)``: the kernel starts writing a
    range's dirty pages to the disk and returns; the pages stay in its cache (a restore of the session
    reads them from there). None where there is none (not Linux); Python's ``os`` does not have it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    call.restype = ctypes.c_int

    def start_writeback(fd: int, offset: int, n: int) -> None:
        if call(fd, offset, n, _SYNC_FILE_RANGE_WRITE) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    return start_writeback


_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>
#: starts the writeback of a file's range (None: not on this system)
start_writeback = _sync_file_range()


class ReadBack:
    """The SHA-256 of a move's temporary file read back from this disk while its sender still writes
    it: :meth:`advance` reads the bytes the sender says are written (its writes are sequential and
    done), so the commit reads only the rest (:meth:`digest`) instead of the whole file after the
    last byte arrived. Never raises: a file it could not follow (or that was replaced meanwhile) is
    read back whole at the commit. What it has read it hands to the disk's writeback at once, so the
    commit's fsync finds little left to write."""

    BLOCK = 1 << 20

    def __init__(self, path: Path):
        self.path = path
        self.done = 0
        self._h = hashlib.sha256()
        self._fd: int | None = None
        self._buf = bytearray(self.BLOCK)  # one buffer reused (see app.sessions.move_in.sha256_of)
        self._broken = False
        self._no_writeback = False

    def advance(self, upto: int) -> None:
        if self._broken:
            return
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
            view = memoryview(self._buf)
            start = self.done
            while self.done < upto:
                n = os.preadv(self._fd, [view[:min(self.BLOCK, upto - self.done)]], self.done)
                if n <= 0:
                    break  # fewer bytes than said: digest() says so
                self._h.update(view[:n])
                self.done += n
        except OSError as e:
            log.info("move: %s cannot be read back as it comes: %s", self.path.name, e)
            self._broken = True
            return
        if self.done > start and start_writeback is not None and not self._no_writeback:
            # the kernel starts writing these pages to the disk now, not at the commit's fsync (0.3 s of a
            # 1 GiB move's end here); only a hint: the commit's fsync still waits for every page
            try:
                start_writeback(self._fd, start, self.done - start)
            except OSError as e:
                log.info("move: %s: the disk's writeback cannot be started early (%s); the commit syncs it all",
                         self.path.name, e)
                self._no_writeback = True

    def digest(self, size: int) -> str | None:
        """The SHA-256 of the file's ``size`` bytes (the rest read now), or None: read it whole."""
        self.advance(size)
        if self._broken or self._fd is None or self.done != size:
            return None
        try:
            held, now = os.fstat(self._fd), os.lstat(self.path)
        except OSError:
            return None
        if (held.st_dev, held.st_ino) != (now.st_dev, now.st_ino) or now.st_size != size:
            return None
        return self._h.hexdigest()

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _verify_temps(save_dir: Path, move_id: str, files: list[dict], n_tokens: int,
                  read_back: dict[str, ReadBack] | None = None) -> None:
    from app.server.statefile import StateFileError, read_state_header

    suffixes = [f.get("suffix", "") for f in files]
    if suffixes.count("") != 1 or any(s not in ("", *SIDECAR_SUFFIXES) for s in suffixes):
        raise MoveError("the move's manifest does not name one state file and its sidecars")
    for f in files:
        p = save_dir / temp_name(move_id, f["suffix"])
        if not p.is_file() or p.is_symlink():
            raise MoveError(f"the copied {'state file' if not f['suffix'] else 'sidecar'} is not there: {p.name}")
        size = p.stat().st_size
        if size != int(f["size"]):
            raise MoveError(f"{p.name} has {size:,} bytes, {int(f['size']):,} were sent")
        follower = (read_back or {}).get(f["suffix"])
        digest = (follower.digest(size) if follower is not None else None) or sha256_of(p)
        if digest != f["sha256"]:
            role = "state file" if not f["suffix"] else "sidecar"
            raise ChecksumMismatch(f"checksum mismatch: {p.name} arrived with SHA-256 {digest[:12]}…, "
                                   f"{str(f['sha256'])[:12]}… was expected", file=f"the {role}",
                                   got=digest, expected=str(f["sha256"]))
    try:
        header = read_state_header(save_dir / temp_name(move_id, ""))
    except StateFileError as e:
        raise MoveError(f"the copied state file is not usable: {e}") from None
    if n_tokens and header.token_count != n_tokens:
        raise MoveError(f"the copied state file holds {header.token_count:,} tokens, the session "
                        f"{n_tokens:,}: it changed during the move")


def adopt(catalog: Catalog, profile_name: str, save_dir: str | os.PathLike, manifest: dict[str, Any], *,
          model_path: str = "", receipt: bool = True, read_back: dict[str, ReadBack] | None = None) -> SessionRecord:
    """The target's half of a move: check the temporary files (size, SHA-256 read back from
    this disk, state header), then rename them into place and write the catalog row, under
    the catalog's files lock and a journal entry (:func:`app.sessions.move_in.recover_moves`); returns the stored
    row. On any failure the temporary files are removed and nothing is listed.
    ``model_path``: the target profile's model. ``receipt``: leave the move's receipt for a
    sender in another process that may lose this answer (:func:`app.sessions.move_in.settle_move`); a move within
    this process has the answer. ``read_back``: per file suffix, the hash of what was read back as the
    file was written (:class:`ReadBack`); a file without one is read back whole here."""
    folder = Path(save_dir)
    move_id = check_move_id(manifest.get("move_id", ""))
    try:
        name = str(manifest["name"]).strip()
        files = list(manifest["files"])
        src = dict(manifest["record"])
        if not name:
            raise MoveError("a session name cannot be empty")
        _verify_temps(folder, move_id, files, int(src.get("n_tokens") or 0), read_back)
        from app.sessions.files_lock import files_locked

        with files_locked(catalog):
            for msg in recover_moves(Recovery(catalog, lock_held=True)):  # a commit a killed process left: its name, its files
                log.info("move %s: %s", move_id, msg)
            if catalog.get(profile_name, name) is not None:
                raise MoveError(f"profile '{profile_name}' already has a session named '{name}'")
            final = _free_state_name(catalog, folder, name)
            sidecar = next((f["suffix"] for f in files if f["suffix"]), None)
            known = {f.name for f in fields(SessionRecord)}
            values = {k: v for k, v in src.items() if k in known}
            values.update(_RESET)
            values.update(name=name, profile=profile_name, save_dir=str(folder), state_file=final,
                          sidecar_file=final + sidecar if sidecar else None,
                          model_path=model_path or values.get("model_path", ""),
                          notes=f"copied from {manifest.get('source') or src.get('profile', '?')}")
            rec = SessionRecord(**values)
            stored = _commit(catalog, folder, move_id, final, files, rec, receipt=receipt)
    finally:
        discard(folder, move_id)
    return stored


def _commit(catalog: Catalog, folder: Path, move_id: str, final: str, files: list[dict],
            rec: SessionRecord, *, receipt: bool = True) -> SessionRecord:
    """Rename the verified temporary files to ``final`` (+ suffix) and write ``rec``, under a
    journal entry written first (the files lock held by the caller)."""
    from app.sessions.journal import Journal, MoveInJournal, Owner

    journaled: dict[str, dict[str, Any]] = {}
    for f in files:
        tmp = folder / temp_name(move_id, f["suffix"])
        fileio.make_private(tmp)
        _fsync_file(tmp)  # an SFTP upload is not on the disk yet: the row must never outlive the bytes
        journaled[f["suffix"]] = {"size": int(f["size"]), "sha256": str(f["sha256"]), "ino": tmp.stat().st_ino}
    journal = Journal(catalog)
    jid = journal.begin(MoveInJournal(save_dir=str(folder), move_id=move_id, final=final, files=journaled,
                                      record=asdict(rec), owner=Owner.me()))
    placed: list[Path] = []
    try:
        for f in sorted(files, key=lambda f: f["suffix"] == ""):  # the sidecar first, the state file last
            dest = folder / (final + f["suffix"])
            os.replace(folder / temp_name(move_id, f["suffix"]), dest)
            placed.append(dest)
        fileio.fsync_dir(folder)
        stored = catalog.add_or_replace(rec)
    except BaseException:
        for p in placed:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        journal.end(jid)
        raise
    # listed: the receipt tells a sender that lost this answer (a cut connection) what became of its move
    if receipt:
        write_receipt(catalog, move_id, stored)
    journal.end(jid)
    return stored


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
