"""What the move rules read before any byte moves: the facts of each side on this machine.

A parked session here: its row, its files and its header facts (:func:`source_session`); a profile
here as a target: its model identity, binary, folder, free space and slot context
(:func:`describe_target`; another host's come from its ``kv-valet sessions receive --describe``,
which runs this). Describing a target also finishes or rolls back the commits of moves into it that
a killed process left (:func:`app.sessions.move_in.recover_moves`) and removes stale temporary files
(:func:`app.move.receive.clean_stale`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from app import paths
from app.core.compat import SessionFacts, TargetFacts
from app.move.receive import clean_stale
from app.move.values import MoveError, SourceFile, SourceSession
from app.sessions.journal import Recovery
from app.sessions.move_in import SIDECAR_SUFFIXES, recover_moves
from app.store.catalog import Catalog, CatalogError, SessionRecord

log = logging.getLogger(__name__)


def session_facts(rec: SessionRecord) -> SessionFacts:
    """What ``rec`` needs from the server that restores it (reads the file headers only)."""
    from app.server.sidecar import read_facts
    from app.server.statefile import StateFileError, read_state_header

    try:
        version = read_state_header(rec.state_path).version
    except StateFileError:
        version = None
    try:
        sc = read_facts(rec.state_path)
    except OSError:
        sc = None
    present = sc is not None and sc.present
    # the space check (app.core.compat's "disk space") needs the files' actual sizes, which a parked
    # session has: a prediction (app.core.park_size) is only for a park that has not run; the catalog's
    # recorded sizes stand in when the files cannot be read here
    size = sum(f.size for f in _files_of(rec)) or (rec.state_size + (rec.sidecar_size or 0))
    return SessionFacts(
        name=rec.name, n_tokens=rec.n_tokens, model_name=os.path.basename(rec.model_path or ""),
        model_size=rec.model_size, model_sha256=rec.model_sha256, model_quick_id=rec.model_quick_id,
        cache_type_k=rec.cache_type_k, cache_type_v=rec.cache_type_v, flash_attn=rec.flash_attn,
        swa_full=bool(rec.swa_full), memory_kind=str(rec.memory_kind), server_build=rec.server_build,
        state_version=version, sidecar_kind=sc.kind if present else None,
        sidecar_version=sc.version if present else None,
        sidecar_count=(len(sc.checkpoints) or (sc.count or 0)) if present else 0, total_bytes=size)


def _files_of(rec: SessionRecord) -> list[SourceFile]:
    out = []
    for suffix in ("", *SIDECAR_SUFFIXES):
        p = Path(str(rec.state_path) + suffix)
        if p.is_file() and not p.is_symlink():
            out.append(SourceFile(suffix, str(p), p.stat().st_size))
    return out


def source_session(catalog: Catalog, name: str, profile: str | None) -> SourceSession:
    """The session ``name`` of ``profile`` here, its files and facts; raises MoveError."""
    from app.sessions.records import AmbiguousName, get_session, leaves_its_folder

    try:
        rec = get_session(catalog, name, profile)
    except AmbiguousName:
        raise  # the caller says how to name the profile (the CLI: --profile)
    except CatalogError as e:
        raise MoveError(str(e)) from None
    if leaves_its_folder(rec) or rec.state_path.is_symlink():
        raise MoveError(f"the state file of '{name}' is a symbolic link: KV Valet does not move it")
    files = _files_of(rec)
    if not files or files[0].suffix:
        raise MoveError(f"the state file of '{name}' is missing: {rec.state_path}")
    from app.sessions.files_check import look

    problems = list(look(catalog, rec, hash_changed=False).problems)  # the bytes are hashed as they are sent
    return SourceSession(rec, session_facts(rec), files, problems)


def _nearest_existing(folder: Path) -> Path | None:
    for p in (folder, *folder.parents):
        if p.exists():
            return p
    return None


def _binary_keys(profile) -> tuple[str | None, list[str]]:
    from app.tools.diagnose import build_keys
    from app.server.discovery import DiscoveryError, binary_info, find_server_binary

    try:
        found = find_server_binary(profile.server_binary)
        _caps, version = binary_info(found.path)
    except (DiscoveryError, OSError) as e:
        log.info("move: the binary of profile %s is not known: %s", profile.name, e)
        return None, []
    return found.path, build_keys(version)


def _learnt_state_version(catalog: Catalog, keys: list[str]) -> int | None:
    from app.core.compat import base_build
    from app.server.statefile import StateFileError, read_state_header

    bases = {base_build(k) for k in keys}
    for r in catalog.list():
        if base_build(r.server_build) in bases:
            try:
                return read_state_header(r.state_path).version
            except StateFileError:
                continue
    return None


def _load_profile(name: str):
    """The profile ``name`` here, read as app.server.targets.load_profile reads it, from the store itself:
    that module and app.server.launcher import the HTTP client and the supervisor, a tenth of a second
    of each move's host process (app.move.host_side) for nothing. Raises MoveError."""
    from app.core.profile import ProfileError
    from app.store.profiles import ProfileStore

    store = ProfileStore()
    try:
        return store.ensure_default() if name == "default" else store.load(name)
    except ProfileError as e:
        raise MoveError(str(e)) from None


def _folder_and_model(profile) -> tuple[object, Path, str]:
    """(the profile as launched, its save folder, its model path) on this machine. The folder is
    app.server.launcher.slot_save_path_for's (tests/unit/test_move_cli.py holds them equal)."""
    from app.core.argv import absorb_extra_args

    profile = absorb_extra_args(profile)[0]
    model = str(Path(profile.model).expanduser()) if profile.model else ""
    return profile, Path(profile.slot_save_path or paths.sessions_dir(profile.name)).expanduser(), model


def receiving_folder(profile_name: str) -> tuple[Path, str]:
    """(save folder, model path) of ``profile_name`` here: all a commit or an abort needs (the
    rules ran at :func:`describe_target`). Raises MoveError for an unknown profile."""
    return _folder_and_model(_load_profile(profile_name))[1:]


def _target_facts_sync(catalog: Catalog, profile, where: str) -> TargetFacts:
    from app.core.rules import Facts, slot_ctx
    from app.core.sidecar_behaviour import Behaviour
    from app.sessions.behaviour import identify_server

    profile, save_dir, model_path = _folder_and_model(profile)
    for msg in recover_moves(Recovery(catalog)):
        log.warning("move: %s", msg)
    clean_stale(save_dir)
    binary, keys = _binary_keys(profile)
    log_path = paths.server_log_path(profile.name)
    behaviour = Behaviour.UNKNOWN
    for key in keys:
        behaviour = identify_server(catalog, key, log_path=log_path if log_path.is_file() else None, binary=binary)
        if behaviour is not Behaviour.UNKNOWN:
            break
    probe = _nearest_existing(save_dir)
    free = None
    if probe is not None:
        with contextlib.suppress(OSError):
            free = shutil.disk_usage(probe).free
    return TargetFacts(
        where=where, profile=profile.name, save_dir=str(save_dir),
        model_path=model_path, cache_type_k=profile.cache_type_k or "f16", cache_type_v=profile.cache_type_v or "f16",
        flash_attn=profile.flash_attn or "auto", swa_full=bool(profile.swa_full),
        ctx_checkpoints=32 if profile.ctx_checkpoints is None else profile.ctx_checkpoints,
        n_ctx_slot=slot_ctx(profile, Facts()), build=keys[0] if keys else "", build_keys=tuple(keys),
        state_version=_learnt_state_version(catalog, keys), behaviour=behaviour.value, free_bytes=free,
        names=tuple(r.name for r in catalog.list(profile.name)))


async def describe_target(catalog: Catalog, profile_name: str, *, where: str | None = None) -> TargetFacts:
    """The facts of ``profile_name`` on this machine for the move rules (also cleans up the
    leftovers of crashed moves into its folder). Raises MoveError for an unknown profile."""
    from dataclasses import replace

    from app.sessions.model_identity import model_identity

    profile = _load_profile(profile_name)
    facts = await asyncio.to_thread(_target_facts_sync, catalog, profile, where or f"profile '{profile_name}'")
    ident = await model_identity(facts.model_path, kind=False)
    facts = replace(facts, model_size=ident.size, model_sha256=ident.sha256, model_quick_id=ident.quick_id)
    if facts.n_ctx_slot is None:  # the profile sets no -c: its running server knows what a slot holds
        n_ctx = await running_slot_ctx(profile)
        if n_ctx is not None:
            facts = replace(facts, n_ctx_slot=n_ctx)
    return facts


#: how long a move waits for a running server's GET /slots (a server that does not run answers at once)
SLOTS_TIMEOUT_S = 5.0


def slots_ctx(slots: Any) -> int | None:
    """Tokens a slot holds by a ``GET /slots`` answer (``n_ctx`` per slot; the smallest), or None."""
    ns = [s["n_ctx"] for s in slots if isinstance(s, dict) and type(s.get("n_ctx")) is int and s["n_ctx"] > 0] \
        if isinstance(slots, list) else []
    return min(ns) if ns else None


async def running_slot_ctx(profile) -> int | None:
    """Tokens a slot of ``profile``'s server holds when that server runs here (its ``GET /slots``,
    through the server service's resolver: the server an earlier KV Valet left running, else the
    profile's URL); None when it does not run or does not say."""
    from app.server.targets import client_for
    from app.server.client import ServerError, ServerUnreachable

    try:
        async with client_for(profile) as client:
            return slots_ctx(await asyncio.wait_for(client.slots(), SLOTS_TIMEOUT_S))
    except (ServerError, ServerUnreachable, OSError, asyncio.TimeoutError, ValueError) as e:
        log.info("move: the server of profile %s does not say its slot context: %s", profile.name, e)
        return None

