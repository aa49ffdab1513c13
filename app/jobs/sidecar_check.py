"""Re-check a session's sidecar on disk each time it is listed or shown.

A sidecar can be removed, replaced or overwritten after the park (a later save
of the same name by another tool, an A/B interrupted by power loss, a user
cleaning a folder). So the session list and ``kv-valet sessions show`` look at
the file again: headers and sizes every time (cheap: ``seek()`` only), and for
a PKCL v2 sidecar the state file's FNV-1a hash only when the state file changed
since it was last hashed (:func:`state_hash`, cached by size and mtime). The
hash reads the whole state file (gigabytes for a 100K-token chat), so the
window asks for it off the GUI thread; a park computes it while the bytes are
fresh in the page cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path

from app import paths
from app.server.sidecar import SidecarReport, fnv1a64_file, inspect_sidecar
from app.store.catalog import Catalog, SessionRecord

_LOCK = threading.Lock()


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
    try:
        data = json.loads(_cache_file().read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


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
    with _LOCK:
        data = _load()
        data[key] = {"stamp": stamp, "hash": value, "path": str(path)}
        with contextlib.suppress(OSError):
            cache = _cache_file()
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(cache.name + f".tmp{os.getpid()}.{threading.get_ident()}")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
            os.replace(tmp, cache)
    return value


def inspect(state_path: Path, n_tokens: int | None, memory_kind, *, verify_hash: bool) -> SidecarReport:
    return inspect_sidecar(state_path, n_tokens, memory_kind,
                           state_hash=lambda: state_hash(state_path, compute=verify_hash))


def needs_hash(rec: SessionRecord) -> bool:
    """A PKCL v2 sidecar whose state file has not been hashed since it last changed."""
    report = inspect(rec.state_path, rec.n_tokens, rec.memory_kind, verify_hash=False)
    return report.version == 2 and "not checked yet" in report.reason


def recheck(catalog: Catalog, rec: SessionRecord, *, verify_hash: bool) -> SessionRecord:
    """``rec`` with its sidecar as it is on disk now; the catalog is updated when it changed."""
    report = inspect(rec.state_path, rec.n_tokens, rec.memory_kind, verify_hash=verify_hash)
    sidecar_file = report.path.name if report.path else None
    new = (report.status, report.reason, len(report.checkpoints), report.size, sidecar_file)
    old = (rec.sidecar_status, rec.sidecar_reason, rec.sidecar_count, rec.sidecar_size, rec.sidecar_file)
    if new == old or rec.id is None:
        return rec
    catalog.update_sidecar(rec.id, status=report.status, reason=report.reason, count=len(report.checkpoints),
                           size=report.size, file=sidecar_file)
    return catalog.get_by_id(rec.id) or rec


def recheck_all(catalog: Catalog, records: list[SessionRecord], *, verify_hash: bool) -> list[SessionRecord]:
    return [recheck(catalog, r, verify_hash=verify_hash) for r in records]
