"""The one judge of cache reuse: how well a request reused what its slot held, in one vocabulary.

Two callers judge requests, and one event can reach both: the resume watcher judges the first
query after a restore (app.sessions.watch, the Sessions tab, ``kv-valet sessions``), and the
proxy judges every request it passes (app.proxy.service, the Conversations tab, ``kv-valet
conversations``). A proxied conversation brought back from its park is both at once, so both
call :func:`judge` with one :class:`Reuse` and say the same word.

The figures: ``cache_n`` (prompt tokens reused from the slot) and ``prompt_n`` (tokens
processed), from the response timings or the server log, against ``reusable``: the tokens the
slot held that the request could have reused (the tokens restored, for a resume). A reuse is
never exact: the server processes at least one token, and a chat client's re-tokenised tail
moves a BPE boundary, so it rolls back a little (to a context checkpoint before the tip on an
SWA/hybrid model). One tolerance covers that, at both ends: :func:`tolerance`.

The vocabulary (:class:`VerdictKind`), the words users already saw where they meant the same:

* **HIT**: it reused all it could, but for the tolerance;
* **PARTIAL**: it reused some, and re-processed more than it had to;
* **DISCARDED**: the slot's tokens came from a restore and it reused (almost) none of them:
  the restore bought nothing (the Sessions tab's old word; the proxy said MISS for it);
* **MISS**: it reused (almost) none of what the slot held, no restore involved (another
  conversation took the slot, the server restarted, an earlier message changed ...);
* **NEW**: nothing to reuse: a conversation's first request;
* **UNKNOWN**: not judged yet (no query since the restore, or no figures).

And one word on correctness, not reuse: **DIFFERS**: the resume was warm (it may have reused
all it could) but its greedy output differs from a cold prefill of the same prompt, so the
reused state was wrong. Only a check's output check says it
(:func:`app.core.output_check.with_output`, run by ``kv-valet check`` and the A/B); :func:`judge`
never does (a request's figures cannot show it). It is distinct from DISCARDED (a restore that
bought nothing but whose output is right) and the worst word of all.

"Almost none" is at most the tolerance. Why a request re-processed is the explanations' job,
each in the order its reasons are tried: a discarded restore's reason in
:mod:`app.core.discard_reasons`, a proxied request's cause in :mod:`app.proxy.explain`.

Stored verdicts (the catalog's ``last_verdict``, the conversation store's ``verdict``) are
these words; every word stored before (HIT, PARTIAL, DISCARDED, UNKNOWN, MISS, NEW) still
reads back as itself. Pure: no I/O, no clock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from app.core.checkpoints import CheckpointFigures
from app.core.discard_reasons import count, plural, status_of, why_discarded


class VerdictKind(enum.StrEnum):
    HIT = "HIT"
    PARTIAL = "PARTIAL"
    DISCARDED = "DISCARDED"
    MISS = "MISS"
    NEW = "NEW"
    UNKNOWN = "UNKNOWN"
    DIFFERS = "DIFFERS"  # warm but wrong: the output differs from a cold prefill (a check's output check)


#: What each word means, for a tooltip or a help text (the Conversations tab, the CLI).
MEANING = {
    VerdictKind.HIT: "The server reused what the slot could have reused (a few re-tokenised tail tokens aside).",
    VerdictKind.PARTIAL: "It reused some of it, and re-processed more than it had to.",
    VerdictKind.DISCARDED: "The slot's tokens came from a restore, and the server re-processed (almost) all of "
                           "them: the restore bought nothing.",
    VerdictKind.MISS: "It reused (almost) nothing the slot held of it.",
    VerdictKind.NEW: "The conversation's first request: nothing to reuse yet.",
    VerdictKind.UNKNOWN: "Not judged yet.",
    VerdictKind.DIFFERS: "Warm but wrong: the output differs from a cold prefill of the same prompt (the greedy "
                         "continuation after the resume left the cold one's), so the state the server reused "
                         "was not this conversation's.",
}

#: How bad a verdict is, to pick the worst of several probes.
SEVERITY = {VerdictKind.UNKNOWN: 0, VerdictKind.NEW: 0, VerdictKind.HIT: 1, VerdictKind.PARTIAL: 2,
            VerdictKind.MISS: 3, VerdictKind.DISCARDED: 3, VerdictKind.DIFFERS: 4}
#: The verdicts of a request that re-processed more than it had to (worth an explanation).
WASTEFUL = frozenset({VerdictKind.PARTIAL, VerdictKind.MISS, VerdictKind.DISCARDED})

#: The one tolerance: this many tokens (or TOLERANCE_FRACTION of what could be reused, whichever
#: is larger) short of a full reuse is still a HIT, and a reuse of at most that is none at all.
TOLERANCE_TOKENS = 32
TOLERANCE_FRACTION = 0.02


def tolerance(reusable: int) -> int:
    return max(TOLERANCE_TOKENS, int(reusable * TOLERANCE_FRACTION))


@dataclass(frozen=True)
class Reuse:
    """What is known of one request that could reuse its slot's tokens: the judge's one parameter.

    The first fields decide the verdict; the rest say why a restore was discarded
    (:mod:`app.core.discard_reasons`) and are left at their defaults by a caller that does not
    know them (the proxy).
    """

    reusable: int | None  # tokens the slot held that it could reuse (the tokens restored, for a resume)
    cache_n: int | None  # prompt tokens the server reused (None: not known)
    prompt_n: int | None  # prompt tokens it processed (None: not known)
    prompt_total: int | None = None  # the whole prompt (None: cache_n + prompt_n)
    prompt_ms: float | None = None
    restored: bool = False  # the slot's tokens came from a restore (a resume; a conversation back from its park)
    new: bool = False  # a conversation's first request: nothing to reuse
    full_reprocess_logged: bool = False  # the log said "forcing full prompt re-processing"
    checkpoint_restored: CheckpointFigures | None = None  # the log's "restored context checkpoint (...)"
    common_prefix: int | None = None  # tokens the new prompt shares with the saved ones, when known
    # -- why a restore was discarded
    sidecar_status: Any = None  # "present" / "present, unverified" / "missing" / "invalid" / "not needed"
    sidecar_loaded_count: int | None = None  # N of "restored N context checkpoints from sidecar" (0: none logged)
    sidecar_count: int | None = None  # checkpoints in the sidecar file (from the park)
    build_persists: bool | None = None
    ctx_checkpoints: int | None = 32
    behaviour: Any = None  # the build's sidecar behaviour (app.core.sidecar_behaviour) ...
    prediction: Any = None  # ... and what its loader was predicted to do before the restore
    # the (n_tokens, pos_min, pos_max) of each checkpoint the park's sidecar held when it was parked
    # (app.core.park_files; None: not recorded): a rollback to another position is called out
    parked_positions: tuple[tuple[int, int, int], ...] | None = None


@dataclass(frozen=True)
class Verdict:
    kind: VerdictKind
    reason: str
    n_restored: int | None = None  # what the slot held that could be reused (the tokens restored, for a resume)
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


#: a restored session's verdict until the next query on its slot is judged
RESTORED_NOT_JUDGED = "no query on this slot since the restore yet"


def unknown(reason: str = RESTORED_NOT_JUDGED, n_restored: int | None = None) -> Verdict:
    return Verdict(VerdictKind.UNKNOWN, reason, n_restored=n_restored)


def worst(verdicts) -> Verdict | None:
    """The most severe of ``verdicts`` (the first one among equals)."""
    best = None
    for v in verdicts:
        if v is not None and (best is None or SEVERITY[v.kind] > SEVERITY[best.kind]):
            best = v
    return best


def judge(e: Reuse) -> Verdict:
    """The verdict on one request, from ``e``:

    * NEW: ``e.new``, or nothing to reuse and no restore;
    * UNKNOWN: neither ``cache_n`` nor ``prompt_n`` known, or a restore of nothing;
    * HIT: ``cache_n >= reusable - tolerance``;
    * DISCARDED (after a restore) / MISS (without one): ``cache_n <= tolerance``, or the log
      said it forced a full re-processing and it reused less than a HIT;
    * PARTIAL otherwise.

    Without ``cache_n`` (no trace log, an older server) it is estimated: the prompt less what was
    processed, or what could be reused less what was processed. The reason is a sentence with the
    figures; a DISCARDED one says why (:func:`app.core.discard_reasons.why_discarded`).
    """
    reusable, cache_n, prompt_n, total, ms_ = e.reusable, e.cache_n, e.prompt_n, e.prompt_total, e.prompt_ms
    if e.new or (not reusable and not e.restored):
        return Verdict(VerdictKind.NEW, "nothing to reuse yet: the conversation's first request",
                       n_restored=reusable, prompt_n=prompt_n, cache_n=cache_n, prompt_ms=ms_)
    if cache_n is None and prompt_n is None:
        return unknown(n_restored=reusable) if e.restored else unknown(
            "the server reported neither cache_n nor prompt_n", n_restored=reusable)
    if not reusable:
        return Verdict(VerdictKind.UNKNOWN, "nothing was restored into the slot, so there is no resume to judge",
                       n_restored=reusable, prompt_n=prompt_n, cache_n=cache_n, prompt_ms=ms_)

    estimated = cache_n is None
    if total is None and cache_n is not None and prompt_n is not None:
        total = cache_n + prompt_n
    if cache_n is None:
        cache_n = max(0, (total if total is not None else reusable) - prompt_n)
    if prompt_n is None:
        prompt_n = max(0, total - cache_n) if total is not None else None

    tol = tolerance(reusable)
    rollback = max(0, reusable - cache_n)
    ms = f" in {ms_:,.0f} ms" if ms_ is not None else ""
    processed = f"re-processed {count(prompt_n)} of {count(total)} prompt tokens{ms}"
    held = "restored" if e.restored else "the slot held"
    figures: dict[str, Any] = {
        "n_restored": reusable, "prompt_tokens_total": total, "cache_n": cache_n, "prompt_n": prompt_n,
        "prompt_ms": ms_, "rollback_tokens": rollback, "tolerance_tokens": tol, "restored": e.restored,
        "sidecar_status": status_of(e.sidecar_status) or None, "sidecar_loaded_count": e.sidecar_loaded_count,
        "build_persists": e.build_persists, "ctx_checkpoints": e.ctx_checkpoints,
        "full_reprocess_logged": e.full_reprocess_logged, "common_prefix": e.common_prefix,
        "estimated": estimated,
    }
    if e.checkpoint_restored is not None:
        figures["checkpoint_n_past"] = e.checkpoint_restored.n_past
        figures["checkpoint_pos_max"] = e.checkpoint_restored.pos_max
    est = " (estimated: the log has no trace lines; run the server with -lv 4)" if estimated else ""
    foreign = None
    if e.checkpoint_restored is not None and e.restored:
        from app.core.park_files import foreign_rollback

        foreign = foreign_rollback(e.checkpoint_restored.pos_min, e.checkpoint_restored.pos_max, reusable,
                                   e.parked_positions)
        if foreign:
            figures["foreign_rollback"] = e.checkpoint_restored.pos_max

    def verdict(kind: VerdictKind, reason: str) -> Verdict:
        if foreign:
            reason = f"{reason}; {foreign}"
        return Verdict(kind, reason + est, n_restored=reusable, prompt_n=prompt_n, cache_n=cache_n,
                       prompt_ms=ms_, rollback_tokens=rollback, checkpoints_loaded=e.sidecar_loaded_count,
                       figures=figures)

    loaded = ""
    if e.sidecar_loaded_count:
        loaded = f"; {plural(e.sidecar_loaded_count, 'context checkpoint')} loaded from the sidecar"
    diverged = e.common_prefix is not None and e.common_prefix < reusable - tol
    if cache_n >= reusable - tol:
        how = ""
        if e.checkpoint_restored is not None and e.checkpoint_restored.n_past is not None:
            how = f", rolled back {plural(rollback, 'token')} to a context checkpoint"
        elif rollback:
            how = f", rolled back {plural(rollback, 'token')}"
        return verdict(VerdictKind.HIT,
                       f"{processed}: resumed at token {count(cache_n)} of {count(reusable)} {held}{how}{loaded}")
    if cache_n > tol and not e.full_reprocess_logged:
        why = (f"; the new prompt leaves the saved tokens at token {count(e.common_prefix)}" if diverged else "")
        return verdict(VerdictKind.PARTIAL,
                       f"{processed}: rolled back to a checkpoint {plural(rollback, 'token')} before the tip "
                       f"(resumed at token {count(cache_n)} of {count(reusable)} {held}){why}{loaded}")
    if not e.restored:
        return verdict(VerdictKind.MISS, f"{processed}: reused {count(cache_n)} of the {count(reusable)} tokens "
                                         f"the slot held")
    return verdict(VerdictKind.DISCARDED, f"{processed}: {why_discarded(e, diverged)}")


def time_saved(verdict: Verdict, prefill_rate: float | None) -> float | None:
    """Seconds of prefill a resume avoided: the tokens it reused at this server's
    measured prefill rate (tokens/s). 0 for DISCARDED (it re-prefilled), None when
    not known yet (UNKNOWN, DIFFERS: a wrong reuse saved nothing worth counting, or no
    prefill rate measured on this server)."""
    if verdict.kind is VerdictKind.DISCARDED:
        return 0.0
    if verdict.kind not in (VerdictKind.HIT, VerdictKind.PARTIAL) or not prefill_rate or prefill_rate <= 0:
        return None
    return max(0, verdict.cache_n or 0) / prefill_rate


TIME_SAVED_HELP = ("Prefill time the resumes avoided: for each resume judged HIT or PARTIAL, the tokens the "
                   "server reused from the restored cache (cache_n of the first query) divided by this "
                   "profile's measured prefill rate (the median of its recent prompts of 32 tokens or more). "
                   "A resume judged DISCARDED re-prefilled everything and adds 0; one whose output differed from a "
                   "cold prefill (DIFFERS) adds nothing. Checks and A/B runs are "
                   "measurements and add nothing.")
