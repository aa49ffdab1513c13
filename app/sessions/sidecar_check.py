"""Re-check a session's sidecar on disk each time it is listed or shown.

A sidecar can be removed, replaced or overwritten after the park (a later save
of the same name by another tool, an A/B interrupted by power loss, a user
cleaning a folder). So the session list and ``kv-valet sessions show`` look at
the files again each time, and for a PKCL v2 sidecar the state file's FNV-1a
hash only when the state file changed since it was last hashed
(:func:`state_hash`, cached by size and mtime). The hash reads the whole state
file (gigabytes for a 100K-token chat), so the window asks for it off the GUI
thread; a park computes it while the bytes are fresh in the page cache.

With a thousand sessions, reading every sidecar's headers on every refresh of
the Sessions tab adds up, so a look is remembered (in memory, per process) with
the *stamps* of the state file and of each sidecar candidate: device, inode,
size, mtime and ctime. The next look only ``stat()``-s the files, and reads the
headers again only when a stamp changed, so a sidecar removed, replaced (new
inode) or rewritten (new size/mtime/ctime) still shows as such. Two cases are
never remembered: a look whose PKCL v2 hash was not checked yet (it can change
without the files changing, when the hash gets computed), and a look at a file
modified in the last :data:`RACY_S` seconds, whose mtime may not change again
on a same-size rewrite within the filesystem's timestamp granularity (git's
"racy clean" problem).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from pathlib import Path

from app import paths
from app import files
from app.server.sidecar import SidecarReport, fnv1a64_file, inspect_sidecar, sidecar_candidates
from app.core.states import SidecarStatus
from app.store.catalog import Catalog, SessionRecord

log = logging.getLogger(__name__)

_LOCK = threading.Lock()

#: A file modified less than this long ago is looked at again next time (see the module doc).
RACY_S = 2.0
#: Remembered looks kept at most (a bound, not a tuning knob: beyond it the memory is dropped).
MAX_REMEMBERED = 50_000

_Stamp = tuple[int, int, int, int, int] | None
# (state path, n_tokens, memory kind) -> (stamps of the state file and sidecar candidates, report)
_looks: dict[tuple[str, int | None, str], tuple[tuple[_Stamp, ...], SidecarReport]] = {}
# what sidecar_candidates() appends to a state file's name (".ckpt", ".checkpoints"), for plain-text paths
_SUFFIXES = tuple(p.name[len("state"):] for p in sidecar_candidates("state"))
# the parsed state-hashes.json and the stamp of the file it was parsed from
_hashes: tuple[tuple | None, dict] = (None, {})


def _cache_file() -> Path:
    return paths.data_dir() / "state-hashes.json"


def _stamp(path: Path) -> tuple[str, list[int]] | None:
    """(key, stamp): keyed by device and inode, so the hash a park computes on the
    temporary file still holds after the rename into place."""
    try:
        st = path.stat()
    except OSError:
        return None
    return f"{st.st_dev}:{st.st_ino}", [st.st_size, st.st_mtime_ns]


def _load() -> dict:
    """The state-hash cache (do not mutate it: copy first). Parsed again only when the file changed."""
    global _hashes
    cache = _cache_file()
    try:
        st = cache.stat()
    except OSError:
        return {}
    stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if _hashes[0] == stamp and not _racy(st.st_mtime_ns):
        return _hashes[1]
    try:
        data = json.loads(cache.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    data = data if isinstance(data, dict) else {}
    _hashes = (stamp, data)
    return data


def state_hash(path: str | os.PathLike, *, compute: bool) -> int | None:
    """The FNV-1a of the state file, from the cache while its size and mtime are
    unchanged; computed (slow) only when ``compute``, else None."""
    path = Path(path)
    found = _stamp(path)
    if found is None:
        return None
    key, stamp = found
    with _LOCK:
        entry = _load().get(key)
    if isinstance(entry, dict) and entry.get("stamp") == stamp and isinstance(entry.get("hash"), int):
        return entry["hash"]
    if not compute:
        return None
    value = fnv1a64_file(path)
    if _stamp(path) != found:
        return None  # written while we read it: the next look hashes it again
    with _LOCK, contextlib.suppress(OSError):  # re-read under its lock: another process may have added entries
        files.update_json(_cache_file(), lambda data: data.__setitem__(
            key, {"stamp": stamp, "hash": value, "path": str(path)}))
    return value


def forget() -> None:
    """Drop every remembered look (the next one reads all headers again)."""
    with _LOCK:
        _looks.clear()


def _racy(mtime_ns: int) -> bool:
    return mtime_ns > (time.time() - RACY_S) * 1e9


def _file_stamp(path: str) -> _Stamp:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _stamps(state: str) -> tuple[_Stamp, ...]:
    """Stamps of the state file and of each place its sidecar may be."""
    return (_file_stamp(state), *(_file_stamp(state + suffix) for suffix in _SUFFIXES))


def inspect(state_path: Path, n_tokens: int | None, memory_kind, *, verify_hash: bool) -> SidecarReport:
    """The sidecar of ``state_path`` as it is on disk now: remembered while no file changed."""
    key = (os.fspath(state_path), n_tokens, str(memory_kind))
    stamps = _stamps(key[0])
    seen = _looks.get(key)
    if seen is not None and seen[0] == stamps:
        return seen[1]
    hashed: list[bool] = []

    def current_hash() -> int | None:
        value = state_hash(state_path, compute=verify_hash)
        hashed.append(value is not None)
        return value

    report = inspect_sidecar(state_path, n_tokens, memory_kind, state_hash=current_hash)
    # Kept with the stamps taken *before* the read: a file changed during the read has
    # other stamps by now, so the next look reads it again.
    settled = all(hashed) and not any(s is not None and _racy(s[3]) for s in stamps)
    if settled:
        with _LOCK:
            if len(_looks) >= MAX_REMEMBERED:
                _looks.clear()
            _looks[key] = (stamps, report)
    return report


def _state(rec: SessionRecord) -> str:
    """``rec.state_path`` as text, without building a Path (a thousand of them per list)."""
    return os.path.join(rec.save_dir, rec.state_file)


def needs_hash(rec: SessionRecord) -> bool:
    """A PKCL v2 sidecar whose state file has not been hashed since it last changed."""
    report = inspect(_state(rec), rec.n_tokens, rec.memory_kind, verify_hash=False)
    return report.version == 2 and "not checked yet" in report.reason


def recheck(catalog: Catalog, rec: SessionRecord, *, verify_hash: bool) -> SessionRecord:
    """``rec`` with its sidecar as it is on disk now; the catalog is updated when it changed. A file
    that is not the one this session parked (app.core.park_files: another chat's sidecar copied over
    its own) makes the sidecar "invalid", with the park's own sentence as the reason (what
    ``sessions show``, the Sessions tab and ``doctor`` show). ``verify_hash``: a file changed on disk
    with the same size and checkpoint positions is hashed (else it is "not verified yet": no claim)."""
    from app.sessions.files_check import look

    report = inspect(_state(rec), rec.n_tokens, rec.memory_kind, verify_hash=verify_hash)
    sidecar_file = report.path.name if report.path else None
    status, reason = report.status, report.reason
    try:
        files = look(catalog, rec, hash_changed=verify_hash)
    except OSError as exc:
        files = None
        log.info("session %r: its files were not compared with the park's (%s)", rec.name, exc)
    if files is not None and files.refuses:
        status, reason = SidecarStatus.INVALID, files.sentence
    new = (status, reason, len(report.checkpoints), report.size, sidecar_file)
    old = (rec.sidecar_status, rec.sidecar_reason, rec.sidecar_count, rec.sidecar_size, rec.sidecar_file)
    if new == old or rec.id is None:
        return rec
    catalog.update_sidecar(rec.id, status=status, reason=reason, count=len(report.checkpoints),
                           size=report.size, file=sidecar_file)
    return catalog.get_by_id(rec.id) or rec


def recheck_all(catalog: Catalog, records: list[SessionRecord], *, verify_hash: bool) -> list[SessionRecord]:
    return [recheck(catalog, r, verify_hash=verify_hash) for r in records]
