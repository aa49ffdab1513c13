"""What a model file is, for a park's row and a restore's check: its size and quick id at once, its
full SHA-256 once computed, and its memory kind (read from the GGUF metadata, cached by size and
mtime). Parks, resumes and a move's target facts ask it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from app import files, paths

log = logging.getLogger(__name__)


def model_hash_cache() -> Path:
    return paths.data_dir() / "model-hashes.json"


def model_kind_cache() -> Path:
    return paths.data_dir() / "model-kinds.json"


def _cached_memory_kind(model_path: str) -> str:
    """read_model_info's memory kind, cached by (path, size, mtime_ns).

    gguf.GGUFReader parses every metadata array in Python: 13 s for Gemma 3
    270M's 262,144-entry vocabulary, which would dominate every park/resume.
    """
    import json

    from app.server.gguf_info import read_model_info

    path = os.path.abspath(model_path)
    st = os.stat(path)
    stamp = [st.st_size, st.st_mtime_ns]
    cache_file = model_kind_cache()
    try:
        cache = json.loads(cache_file.read_text(encoding="utf-8"))
        if not isinstance(cache, dict):
            cache = {}
    except (OSError, ValueError):
        cache = {}
    entry = cache.get(path)
    if isinstance(entry, dict) and entry.get("stamp") == stamp and isinstance(entry.get("kind"), str):
        return entry["kind"]
    info = read_model_info(path)
    kind = getattr(info.memory_kind, "value", str(info.memory_kind))
    with contextlib.suppress(OSError):  # re-read under its lock: another process may have added entries
        files.update_json(cache_file, lambda cache: cache.__setitem__(path, {"stamp": stamp, "kind": kind}))
    return kind


@dataclass(frozen=True)
class ModelIdentity:
    """What is known about a model file now: its size and quick id at once, the
    full SHA-256 only once computed (in the background: minutes for 20 GB)."""

    size: int = 0
    quick_id: str = ""
    sha256: str = ""  # "" until computed
    memory_kind: str = "unknown"


async def model_identity(model_path: str, *, full: bool = False, kind: bool = True) -> ModelIdentity:
    """The model's identity without waiting for the full hash (unless ``full``), or an
    empty identity when the file is not readable here (attach mode to another machine).
    The memory kind is read from the GGUF metadata, cached by size + mtime."""
    from app.server.gguf_info import cached_model_sha256, known_identity, model_quick_id, model_sha256

    if not model_path or not os.path.isfile(model_path):
        return ModelIdentity()
    if not kind:
        known = known_identity(model_path, model_hash_cache())  # what this process knows of it now: no thread
        if known is not None and (known[2] or not full):
            return ModelIdentity(*known, "unknown")

    def quick() -> tuple[int, str, str]:
        size = os.path.getsize(model_path)
        digest = model_sha256(model_path, model_hash_cache()) if full else \
            cached_model_sha256(model_path, model_hash_cache()) or ""
        return size, model_quick_id(model_path), digest

    try:
        size, quick_id, digest = await asyncio.to_thread(quick)
    except Exception:  # report: unreadable: identity unknown, not an error for the park (logged)
        log.warning("cannot identify the model file %s: its identity stays unknown", model_path, exc_info=True)
        return ModelIdentity()
    memory_kind = "unknown"
    if kind:
        try:
            memory_kind = await asyncio.to_thread(_cached_memory_kind, model_path)
        except Exception:  # report: the memory kind stays "unknown", not an error for the park (logged)
            log.warning("cannot read the memory kind of the model %s: it stays unknown", model_path, exc_info=True)
    return ModelIdentity(size, quick_id, digest, memory_kind)
