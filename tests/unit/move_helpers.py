"""Parked sessions on disk without a server, for the move tests: profiles, state files, sidecars, rows."""

from __future__ import annotations

import os
from pathlib import Path

from app import paths
from app.core.profile import LaunchProfile
from app.server.gguf_info import model_quick_id
from app.server.sidecar import Checkpoint, write_pkcl
from app.server.statefile import write_state_file
from app.sessions.files_check import digest
from app.store.catalog import Catalog, SessionRecord
from app.store.profiles import ProfileStore
from tests.conftest import free_port

N_TOKENS = 300


def model_file(folder: Path, name: str = "model.gguf", seed: bytes = b"GGUF") -> Path:
    p = folder / name
    if not p.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(seed + bytes(range(256)) * 64)
    return p


def profile(folder: Path, name: str, model: Path, **kw) -> LaunchProfile:
    """A profile with its own save folder; a binary that is not there (its build stays unknown); a port
    nothing listens on (not the default 8080, where another test's server may answer the move's look-ups)."""
    kw.setdefault("port", free_port())
    p = LaunchProfile(name=name, model=str(model), server_binary=str(folder / "no-such-llama-server"),
                      ctx_size=4096, parallel=2, slot_save_path=str(folder / f"{name}-slots") + "/", **kw)
    ProfileStore().save(p)
    os.makedirs(p.slot_save_path, exist_ok=True)
    return p


def park_file(catalog: Catalog, prof: LaunchProfile, name: str, *, sidecar: bool = True,
              payload: int = 300_000, hashed: bool = False) -> SessionRecord:
    """A parked session of ``prof`` as a park leaves it: state file, PKCL v1 sidecar, catalog row.
    ``hashed``: the row records its files' sizes and SHA-256, as app.sessions.park's does (a move then
    leaves the hashing to its target); without it, a row from before parks recorded them."""
    folder = Path(prof.slot_save_path)
    state = folder / (name.replace(" ", "-") + ".bin")
    size = write_state_file(state, list(range(N_TOKENS)), os.urandom(payload))
    sc_size = 0
    if sidecar:
        cp = Checkpoint(n_tokens=N_TOKENS - 10, pos_min=0, pos_max=N_TOKENS - 11, size_tgt=0, size_dft=0)
        sc_size = write_pkcl(str(state) + ".ckpt", [(cp, os.urandom(50_000), b"")])
    return catalog.add_or_replace(SessionRecord(
        name=name, profile=prof.name, state_file=state.name, save_dir=str(folder),
        sidecar_file=state.name + ".ckpt" if sidecar else None, state_size=size, sidecar_size=sc_size,
        n_tokens=N_TOKENS, server_build="b11434-test", model_path=prof.model,
        model_size=os.path.getsize(prof.model), model_quick_id=model_quick_id(prof.model), cache_type_k="f16",
        cache_type_v="f16", flash_attn="auto", memory_kind="sliding-window",
        sidecar_status="present" if sidecar else "missing", sidecar_count=1 if sidecar else 0,
        n_ctx_slot=2048, slot_id=0, parked_files=digest(state).to_json() if hashed else ""))


def open_catalog() -> Catalog:
    return Catalog(paths.catalog_path())


def folder_names(folder: str | Path) -> list[str]:
    return sorted(os.listdir(folder))
