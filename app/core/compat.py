"""Can a parked session go to another target? The rules of a move, as pure functions.

A state file restores only into the same model file, the same K/V cache types, the
same V layout (flash attention decides whether V is stored transposed), the same
sliding-window cache size (``--swa-full``), a build that reads its state-file version,
and a slot whose ``n_ctx`` holds its tokens; anything else fails at the restore (and
a failed restore clears the slot) or corrupts it. Its checkpoint sidecar is worth
something only to a build whose loader reads that sidecar format, under a
``--ctx-checkpoints`` that admits its count (``shared/reference/llama-server.md``,
app.core.sidecar_behaviour). So a move checks all of it **before any byte moves**,
from two value types: :class:`SessionFacts` (the source's catalog row and file
headers) and :class:`TargetFacts` (the target profile, its binary, model and folder,
gathered on the target's machine: a remote host's ``kv-valet`` sends them as JSON).

Each rule returns :class:`Problem` objects: ``blocking`` ones refuse the move, the
others are warnings the move reports. Every problem names its remedy.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable

from app.core.sidecar_behaviour import SHORT, Behaviour
from app.core.restore_needs import CHECKPOINTED_KINDS
from app.core.units import fmt_bytes

KNOWN_STATE_VERSIONS = (2, 3, 4)
#: The PKCL sidecar version each build's loader reads (app.core.sidecar_behaviour).
READS_PKCL = {Behaviour.FORK: 1, Behaviour.PORT: 1, Behaviour.V2: 2}
#: Loaders that refuse a sidecar holding more checkpoints than the restoring server's --ctx-checkpoints.
STRICT_COUNT = (Behaviour.V2, Behaviour.PORT)


def base_build(build: str) -> str:
    """The llama.cpp build without KV Valet's ``+sidecars-MODE`` mark: what decides the state version."""
    return (build or "").split(" +sidecars-")[0].strip()


class _Json:
    """To and from JSON (the facts cross SSH as ``kv-valet --json`` output); a field this
    version does not know is ignored, a missing one takes its default."""

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        return cls(**{f.name: tuple(data[f.name]) if isinstance(data[f.name], list) else data[f.name]
                      for f in fields(cls) if f.name in data})


@dataclass(frozen=True, kw_only=True)
class _ModelAndFlags(_Json):
    """The model and the flags a state file was written under, or a server runs with."""

    model_size: int = 0  # 0: not known (the session) / not readable there (the target)
    model_sha256: str = ""
    model_quick_id: str = ""
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    flash_attn: str = "auto"
    swa_full: bool = False


@dataclass(frozen=True, kw_only=True)
class SessionFacts(_ModelAndFlags):
    """What a parked session needs from the server that will restore it."""

    name: str
    n_tokens: int
    model_name: str = ""  # the GGUF's file name
    memory_kind: str = "unknown"
    server_build: str = ""
    state_version: int | None = None  # from the state file's header
    sidecar_kind: str | None = None  # "PKCL", "LSCKPT2", "companion", "other"; None: no sidecar
    sidecar_version: int | None = None  # PKCL version
    sidecar_count: int = 0
    total_bytes: int = 0  # state file + sidecar


@dataclass(frozen=True, kw_only=True)
class TargetFacts(_ModelAndFlags):
    """What the target profile's server will be: gathered on the target's machine."""

    where: str  # "profile 'b'" or "host:b", for messages
    profile: str
    save_dir: str = ""
    model_path: str = ""
    ctx_checkpoints: int = 32
    n_ctx_slot: int | None = None  # tokens one slot holds; None: not known (-c not set)
    build: str = ""  # "" : the binary could not be identified
    build_keys: tuple[str, ...] = ()  # every name the catalog may know the build by
    state_version: int | None = None  # the state version the build writes, when learnt from its parks
    behaviour: str = Behaviour.UNKNOWN.value  # app.core.sidecar_behaviour.Behaviour of the binary
    free_bytes: int | None = None
    names: tuple[str, ...] = ()  # sessions the target profile holds already


@dataclass(frozen=True)
class Problem:
    rule: str  # "model", "cache types", "flash attention", "swa-full", "state version", "sidecar version",
    # "ctx-checkpoints", "slot context", "disk space", "name"
    message: str
    remedy: str
    blocking: bool = True

    def __str__(self) -> str:
        return f"{self.message} ({self.remedy})" if self.remedy else self.message


Rule = Callable[[SessionFacts, TargetFacts], "list[Problem]"]


def _model(s: SessionFacts, t: TargetFacts) -> list[Problem]:
    rule = "model"
    fix = (f"point the target profile '{t.profile}' at the same GGUF the session was parked from "
           f"({s.model_name or 'unknown'}, {s.model_size:,} bytes)")
    if not (s.model_sha256 or s.model_quick_id or s.model_size):
        return [Problem(rule, f"the session '{s.name}' records no model identity (parked from a server whose "
                        "model file was not readable here): the target cannot be checked for the same model",
                        "make sure the target profile runs the same GGUF", blocking=False)]
    if not t.model_size:
        return [Problem(rule, f"the model file of {t.where} ({t.model_path or 'none set'}) is not readable there",
                        fix)]
    if s.model_sha256 and t.model_sha256:
        if s.model_sha256 == t.model_sha256:
            return []
        how = "the SHA-256 of the whole file"
    elif s.model_quick_id and t.model_quick_id:
        if s.model_quick_id == t.model_quick_id:
            return []
        how = "size and the SHA-256 of the first 16 MiB"
    else:
        if s.model_size == t.model_size and (not s.model_name or s.model_name == os.path.basename(t.model_path)):
            return [Problem(rule, "the model is compared by file name and size only (no hash recorded)",
                            "make sure both run the same GGUF", blocking=False)]
        how = "file name and size"
    return [Problem(rule, f"a different model (compared by {how}): the session was parked from "
                    f"{s.model_name or 'unknown'} ({s.model_size:,} bytes), {t.where} runs "
                    f"{os.path.basename(t.model_path)} ({t.model_size:,} bytes)", fix)]


def _cache_types(s: SessionFacts, t: TargetFacts) -> list[Problem]:
    out = []
    for which, want, have in (("K", s.cache_type_k, t.cache_type_k), ("V", s.cache_type_v, t.cache_type_v)):
        if want and have and want != have:
            out.append(Problem("cache types", f"different {which} cache type: the session was parked with {want}, "
                               f"{t.where} uses {have}",
                               f"set -ct{which.lower()} {want} (cache_type_{which.lower()}) in the target profile"))
    return out


def _flash_attn(s: SessionFacts, t: TargetFacts) -> list[Problem]:
    want, have = s.flash_attn or "auto", t.flash_attn or "auto"
    if want == have:
        return []
    fix = f"set -fa {want if want != 'auto' else have} in both profiles"
    if "auto" in (want, have):
        return [Problem("flash attention", f"flash attention was '{want}' at the park and is '{have}' on "
                        f"{t.where}: 'auto' resolves per machine, and the V cache layout depends on it (a "
                        "mismatch fails the restore)", fix, blocking=False)]
    return [Problem("flash attention", f"flash attention was '{want}' at the park and is '{have}' on {t.where}: "
                    "the V cache is laid out differently, so the restore would fail", fix)]


def _swa_full(s: SessionFacts, t: TargetFacts) -> list[Problem]:
    if s.memory_kind == "dense" or bool(s.swa_full) == bool(t.swa_full):
        return []
    was, now = ("with", "without") if s.swa_full else ("without", "with")
    return [Problem("swa-full", f"the session was parked {was} --swa-full and {t.where} runs {now} it: the "
                    "sliding-window cache has a different size, so the restore would fail",
                    f"{'add' if s.swa_full else 'remove'} --swa-full (swa_full) in the target profile")]


def _state_version(s: SessionFacts, t: TargetFacts) -> list[Problem]:
    if s.state_version is None:
        return [Problem("state version", "the state file's header cannot be read", "park the session again")]
    if s.server_build and base_build(s.server_build) in {base_build(b) for b in (t.build, *t.build_keys) if b}:
        return []
    if t.state_version is not None:
        if t.state_version == s.state_version:
            return []
        return [Problem("state version", f"state file version {s.state_version}, but the build of {t.where} "
                        f"({t.build or 'unknown'}) reads only version {t.state_version}",
                        f"run the target profile on a llama.cpp build that writes version {s.state_version} "
                        f"(the session was parked by {s.server_build or 'an unknown build'})")]
    if s.state_version not in KNOWN_STATE_VERSIONS:
        return [Problem("state version", f"unknown state file version {s.state_version}",
                        "park it again on a known build")]
    return [Problem("state version", f"which state file version the build of {t.where} ({t.build or 'unknown'}) "
                    f"reads is not known yet (the session has version {s.state_version}, parked by "
                    f"{s.server_build or 'an unknown build'})",
                    "park something on the target once, or run the same build on both", blocking=False)]


def _has_sidecar(s: SessionFacts) -> bool:
    return s.memory_kind in CHECKPOINTED_KINDS and s.sidecar_kind is not None


def _sidecar_version(s: SessionFacts, t: TargetFacts) -> list[Problem]:
    if not _has_sidecar(s):
        return []
    b = Behaviour(t.behaviour) if t.behaviour in Behaviour._value2member_map_ else Behaviour.UNKNOWN
    what = f"{s.sidecar_kind}" + (f" v{s.sidecar_version}" if s.sidecar_version is not None else "")
    lost = f"its {s.sidecar_count:,} context checkpoints would be lost and every resume there re-prefills"
    if b is Behaviour.UNKNOWN:
        return [Problem("sidecar version", f"the session's checkpoint sidecar is {what}; what the build of "
                        f"{t.where} reads is not known yet", "run the same sidecar build on both "
                        "(kv-valet build-server)", blocking=False)]
    reads = READS_PKCL.get(b)
    if reads is not None and s.sidecar_kind == "PKCL" and s.sidecar_version == reads:
        return []
    reader = "reads no sidecars" if reads is None else f"reads PKCL v{reads} sidecars only"
    return [Problem("sidecar version", f"the session's checkpoint sidecar is {what}, and the build of {t.where} "
                    f"({SHORT[b]}) {reader}: {lost}",
                    f"run the target profile on a build that reads {what} (the one that parked it: "
                    f"{s.server_build or 'unknown'})")]


def _ctx_checkpoints(s: SessionFacts, t: TargetFacts) -> list[Problem]:
    if not _has_sidecar(s):
        return []
    if t.ctx_checkpoints <= 0:
        return [Problem("ctx-checkpoints", f"{t.where} runs with --ctx-checkpoints 0, so it reads no sidecar: "
                        f"the session's {s.sidecar_count:,} checkpoints would be lost",
                        f"set --ctx-checkpoints {max(s.sidecar_count, 1)} or more in the target profile")]
    if s.sidecar_count > t.ctx_checkpoints:
        b = Behaviour(t.behaviour) if t.behaviour in Behaviour._value2member_map_ else Behaviour.UNKNOWN
        msg = (f"the session's sidecar holds {s.sidecar_count:,} checkpoints and {t.where} runs with "
               f"--ctx-checkpoints {t.ctx_checkpoints}")
        fix = f"set --ctx-checkpoints {s.sidecar_count} or more in the target profile"
        if b in STRICT_COUNT:
            return [Problem("ctx-checkpoints", f"{msg}: its loader refuses such a sidecar", fix)]
        if b is Behaviour.UNKNOWN:
            return [Problem("ctx-checkpoints", f"{msg}: a strict loader refuses such a sidecar", fix,
                            blocking=False)]
    return []


def _slot_context(s: SessionFacts, t: TargetFacts) -> list[Problem]:
    if t.n_ctx_slot is None:
        return [Problem("slot context", f"how many tokens a slot of {t.where} holds is not known (its profile "
                        f"sets no -c); the session has {s.n_tokens:,}", "set -c (ctx_size) in the target profile",
                        blocking=False)]
    if s.n_tokens > t.n_ctx_slot:
        return [Problem("slot context", f"a slot of {t.where} holds {t.n_ctx_slot:,} tokens, the session has "
                        f"{s.n_tokens:,}", "raise -c or lower -np in the target profile")]
    return []


def _disk_space(s: SessionFacts, t: TargetFacts) -> list[Problem]:
    if t.free_bytes is not None and t.free_bytes < s.total_bytes:
        return [Problem("disk space", f"the disk holding {t.save_dir} on {t.where} has {fmt_bytes(t.free_bytes)} "
                        f"free, the session needs {fmt_bytes(s.total_bytes)}", "free some space there first")]
    return []


RULES: tuple[tuple[str, Rule], ...] = (
    ("model", _model), ("cache types", _cache_types), ("flash attention", _flash_attn), ("swa-full", _swa_full),
    ("state version", _state_version), ("sidecar version", _sidecar_version),
    ("ctx-checkpoints", _ctx_checkpoints), ("slot context", _slot_context), ("disk space", _disk_space),
)


@dataclass(frozen=True)
class Compatibility:
    refusals: tuple[Problem, ...] = ()
    warnings: tuple[Problem, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not self.refusals


def check_move(s: SessionFacts, t: TargetFacts, *, name: str | None = None) -> Compatibility:
    """Every rule on the session and the target; ``name``: the name it gets there."""
    problems: list[Problem] = []
    name = name or s.name
    if name in t.names:
        problems.append(Problem("name", f"{t.where} already has a session named '{name}'",
                                "pass --rename NEW, or delete or rename that one first"))
    for _, rule in RULES:
        problems += rule(s, t)
    return Compatibility(tuple(p for p in problems if p.blocking), tuple(p for p in problems if not p.blocking))
