"""Did a resume really skip the prefill? One pure function answers it.

After a restore the first query on the slot tells the truth: ``cache_n`` (prompt
tokens reused from the slot) and ``prompt_n`` (tokens actually processed). A
resume that worked reuses all but a few tail tokens (the server must process at
least one token, and re-tokenising the tail can move a BPE boundary, so it rolls
back to a context checkpoint just before the tip). A discarded restore shows
``cache_n`` = 0 and ``prompt_n`` = the whole prompt; the *reason* is what the user
needs, and it is picked from what we know, in this order:

1. a sidecar is there but the server runs with ``--ctx-checkpoints 0`` (it is not read);
2. no sidecar next to the state file / the sidecar is invalid;
3. this build does not persist context checkpoints;
4. no loaded checkpoint covers the resume point;
5. the new prompt diverged early from the saved tokens.

Pure: no I/O, no clock. Every reason is a user-facing sentence with the figures.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from app.core.checkpoints import CheckpointFigures


class VerdictKind(enum.StrEnum):
    HIT = "HIT"
    PARTIAL = "PARTIAL"
    DISCARDED = "DISCARDED"
    UNKNOWN = "UNKNOWN"


#: How bad a verdict is, to pick the worst of several probes.
SEVERITY = {VerdictKind.UNKNOWN: 0, VerdictKind.HIT: 1, VerdictKind.PARTIAL: 2, VerdictKind.DISCARDED: 3}

#: A rollback of at most this many tokens (or TOLERANCE_FRACTION of the restored
#: tokens, whichever is larger) still counts as a hit.
TOLERANCE_TOKENS = 32
TOLERANCE_FRACTION = 0.02
#: Reusing at most this fraction of the restored tokens counts as a full re-prefill.
DISCARD_FRACTION = 0.01


@dataclass(frozen=True)
class Verdict:
    kind: VerdictKind
    reason: str
    n_restored: int | None = None
    prompt_n: int | None = None
    cache_n: int | None = None
    prompt_ms: float | None = None
    rollback_tokens: int | None = None
    checkpoints_loaded: int | None = None
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.kind in (VerdictKind.HIT, VerdictKind.PARTIAL)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value, "reason": self.reason, "n_restored": self.n_restored,
            "prompt_n": self.prompt_n, "cache_n": self.cache_n, "prompt_ms": self.prompt_ms,
            "rollback_tokens": self.rollback_tokens, "checkpoints_loaded": self.checkpoints_loaded,
            "figures": dict(self.figures),
        }


def unknown(reason: str = "no query on this slot since the restore yet", n_restored: int | None = None) -> Verdict:
    return Verdict(VerdictKind.UNKNOWN, reason, n_restored=n_restored)


def worst(verdicts) -> Verdict | None:
    """The most severe of ``verdicts`` (the first one among equals)."""
    best = None
    for v in verdicts:
        if v is not None and (best is None or SEVERITY[v.kind] > SEVERITY[best.kind]):
            best = v
    return best


def tolerance(n_restored: int) -> int:
    return max(TOLERANCE_TOKENS, int(n_restored * TOLERANCE_FRACTION))


def _n(x: int | None) -> str:
    return f"{x:,}" if x is not None else "?"


def _status(s) -> str:
    s = getattr(s, "value", s)
    return str(s or "").lower()


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def judge(
    n_restored: int | None,
    prompt_tokens_total: int | None,
    cache_n: int | None,
    prompt_n: int | None,
    *,
    sidecar_status=None,
    sidecar_loaded_count: int | None = None,
    build_persists: bool | None = None,
    ctx_checkpoints: int | None = 32,
    full_reprocess_logged: bool = False,
    checkpoint_restored: CheckpointFigures | None = None,
    common_prefix: int | None = None,
    prompt_ms: float | None = None,
    sidecar_count: int | None = None,
    behaviour=None,
    prediction=None,
) -> Verdict:
    """Judge the first query after restoring ``n_restored`` tokens.

    ``sidecar_status``: "present" / "present, unverified" / "missing" / "invalid" /
    "not needed" (or a :class:`app.core.states.SidecarStatus`).
    ``sidecar_loaded_count``: N from ``restored N context checkpoints from sidecar``
    (None when the log is not available, 0 when the log shows none).
    ``sidecar_count``: checkpoints in the sidecar file (from the park), for the reason.
    ``checkpoint_restored``: the figures of ``restored context checkpoint (...)``.
    ``common_prefix``: tokens the new prompt shares with the saved ones, when known.
    ``behaviour`` / ``prediction``: the build's sidecar behaviour and what its loader
    was predicted to do before the restore (:mod:`app.core.sidecar_behaviour`): a
    discard the build's own loader explains gets that reason.
    """
    status = _status(sidecar_status)
    if cache_n is None and prompt_n is None:
        return unknown(n_restored=n_restored)
    if not n_restored:
        return Verdict(VerdictKind.UNKNOWN, "nothing was restored into the slot, so there is no resume to judge",
                       n_restored=n_restored, prompt_n=prompt_n, cache_n=cache_n, prompt_ms=prompt_ms)

    estimated = False
    if prompt_tokens_total is None and cache_n is not None and prompt_n is not None:
        prompt_tokens_total = cache_n + prompt_n
    if cache_n is None:
        # Only the prompt eval line (no trace log): estimate from the processed count.
        estimated = True
        if prompt_tokens_total is not None:
            cache_n = max(0, prompt_tokens_total - prompt_n)
        else:
            cache_n = max(0, n_restored - prompt_n) if prompt_n < n_restored * (1 - DISCARD_FRACTION) else 0
    if prompt_n is None:
        prompt_n = max(0, prompt_tokens_total - cache_n) if prompt_tokens_total is not None else None
    total = prompt_tokens_total

    tol = tolerance(n_restored)
    rollback = max(0, n_restored - cache_n)
    ms = f" in {prompt_ms:,.0f} ms" if prompt_ms is not None else ""
    processed = f"re-processed {_n(prompt_n)} of {_n(total)} prompt tokens{ms}"
    figures: dict[str, Any] = {
        "n_restored": n_restored, "prompt_tokens_total": total, "cache_n": cache_n, "prompt_n": prompt_n,
        "prompt_ms": prompt_ms, "rollback_tokens": rollback, "tolerance_tokens": tol,
        "sidecar_status": status or None, "sidecar_loaded_count": sidecar_loaded_count,
        "build_persists": build_persists, "ctx_checkpoints": ctx_checkpoints,
        "full_reprocess_logged": full_reprocess_logged, "common_prefix": common_prefix,
        "estimated": estimated,
    }
    if checkpoint_restored is not None:
        figures["checkpoint_n_past"] = checkpoint_restored.n_past
        figures["checkpoint_pos_max"] = checkpoint_restored.pos_max
    est = " (estimated: the log has no trace lines; run the server with -lv 4)" if estimated else ""

    def verdict(kind: VerdictKind, reason: str) -> Verdict:
        return Verdict(kind, reason + est, n_restored=n_restored, prompt_n=prompt_n, cache_n=cache_n,
                       prompt_ms=prompt_ms, rollback_tokens=rollback, checkpoints_loaded=sidecar_loaded_count,
                       figures=figures)

    loaded = ""
    if sidecar_loaded_count:
        loaded = f"; {_plural(sidecar_loaded_count, 'context checkpoint')} loaded from the sidecar"
    diverged = common_prefix is not None and common_prefix < n_restored - tol

    discarded = (cache_n <= max(1, int(n_restored * DISCARD_FRACTION))
                 or (full_reprocess_logged and cache_n < n_restored - tol))
    if not discarded and cache_n >= n_restored - tol:
        how = ""
        if checkpoint_restored is not None and checkpoint_restored.n_past is not None:
            how = f", rolled back {_plural(rollback, 'token')} to a context checkpoint"
        elif rollback:
            how = f", rolled back {_plural(rollback, 'token')}"
        return verdict(VerdictKind.HIT,
                       f"{processed}: resumed at token {_n(cache_n)} of {_n(n_restored)} restored{how}{loaded}")
    if not discarded:
        why = (f"; the new prompt leaves the saved tokens at token {_n(common_prefix)}" if diverged else "")
        return verdict(VerdictKind.PARTIAL,
                       f"{processed}: rolled back to a checkpoint {_plural(rollback, 'token')} before the tip "
                       f"(resumed at token {_n(cache_n)} of {_n(n_restored)} restored){why}{loaded}")

    tail = "so the restored cache was discarded"
    present = status.startswith("present")
    from app.core.sidecar_behaviour import Behaviour, discard_reason

    b = Behaviour(str(getattr(behaviour, "value", behaviour) or "unknown"))
    refused = discard_reason(b, prediction) if not sidecar_loaded_count else None
    tip = prediction is not None and getattr(prediction, "tip", False) and not sidecar_loaded_count
    if refused:
        reason = f"{refused}, {tail}"
    elif status == "missing" and tip:
        reason = (f"there is no checkpoint sidecar next to the state file: this build made a tip checkpoint "
                  f"over the restored tokens instead, which cannot serve a rollback before the tip, {tail}")
    elif status == "missing" and b is Behaviour.NONE:
        reason = f"this build does not persist context checkpoints (no sidecar), {tail}"
    elif present and ctx_checkpoints == 0:
        reason = (f"the sidecar was not loaded because the server runs with --ctx-checkpoints 0, {tail}")
    elif status == "missing" and build_persists is False:
        reason = f"this build does not persist context checkpoints (no sidecar), {tail}"
    elif status == "missing":
        reason = f"there is no checkpoint sidecar next to the state file, {tail}"
    elif status == "invalid":
        reason = f"the checkpoint sidecar is invalid, {tail}"
    elif present and not sidecar_loaded_count and (build_persists is False or sidecar_loaded_count == 0):
        if build_persists is False:
            reason = (f"this build does not persist context checkpoints (it did not load the sidecar), {tail}")
        else:
            reason = f"the server did not load the sidecar's checkpoints, {tail}"
    elif present and sidecar_loaded_count and diverged:
        reason = (f"no loaded checkpoint covers the resume point: the new prompt leaves the saved tokens at "
                  f"token {_n(common_prefix)} of {_n(n_restored)}, {tail}")
    elif present and sidecar_loaded_count:
        of = f" of the {_plural(sidecar_loaded_count, 'loaded checkpoint')}"
        reason = f"none{of} covers the resume point, {tail}"
    elif present and not diverged:
        held = f" ({_plural(sidecar_count, 'checkpoint')} in the file)" if sidecar_count else ""
        reason = (f"the server did not use the sidecar's checkpoints{held}: none covers the resume point, "
                  f"or this build does not read sidecars, {tail}")
    elif diverged:
        reason = (f"the new prompt diverged from the saved tokens at token {_n(common_prefix)} of "
                  f"{_n(n_restored)}, {tail}")
    elif status == "not needed":
        reason = f"the server did not reuse the restored tokens (a dense model needs no checkpoint), {tail}"
    elif full_reprocess_logged:
        reason = f"the server logged a forced full prompt re-processing, {tail}"
    else:
        reason = f"the server did not reuse the restored tokens, {tail}"
    return verdict(VerdictKind.DISCARDED, f"{processed}: {reason}")


def time_saved(verdict: Verdict, prefill_rate: float | None) -> float | None:
    """Seconds of prefill a resume avoided: the tokens it reused at this server's
    measured prefill rate (tokens/s). 0 for DISCARDED (it re-prefilled), None when
    not known yet (UNKNOWN, or no prefill rate measured on this server)."""
    if verdict.kind is VerdictKind.DISCARDED:
        return 0.0
    if verdict.kind not in (VerdictKind.HIT, VerdictKind.PARTIAL) or not prefill_rate or prefill_rate <= 0:
        return None
    return max(0, verdict.cache_n or 0) / prefill_rate


TIME_SAVED_HELP = ("Prefill time the resumes avoided: for each resume judged HIT or PARTIAL, the tokens the "
                   "server reused from the restored cache (cache_n of the first query) divided by this "
                   "profile's measured prefill rate (the median of its recent prompts of 32 tokens or more). "
                   "A resume judged DISCARDED re-prefilled everything and adds 0. Checks and A/B runs are "
                   "measurements and add nothing.")

