"""Correct, not only warm: compare a resume's greedy continuation with a cold prefill's.

A verdict on reuse (:mod:`app.core.verdict`) says whether a resume skipped the prefill; it
cannot say whether what the server reused was right. Upstream has shipped cache-reuse bugs that
answered fast and wrong (``shared/reference/llama-server.md``, "Warm is not the same as
correct"), and a lax sidecar loader (the turboquant fork's) takes another chat's checkpoints
without a word. The output check is the proof by output: after the resume, the probe's first
query is a greedy continuation of :data:`OUTPUT_TOKENS` tokens (:func:`sampling`: temperature 0,
a fixed seed, the top log-probs asked for), and the same prompt is then prefilled *cold* and
continued the same way; the two continuations must agree.

What "cold" is (:mod:`app.sessions.check` runs it): the same prompt, in the same slot, after the
slot was erased, with ``cache_prompt: false``. The server then starts at ``n_past = 0``: it
removes every cell of the slot's sequence and processes every prompt token, and it consults the
slot's context checkpoints only when ``n_past > 0`` (build 11434's ``server-context.cpp``), so
nothing the restore brought (cells, tokens, checkpoints, even those the fork keeps across an
erase) takes part. The answer's own figures must say so (``cache_n`` 0): a reference that reused
anything is refused (:data:`Status.UNKNOWN`). A fresh server process would be no colder (the
check may already run each probe in one; the cold prefills follow the last probe, in its
process, so that no probe can reuse the checkpoints they make) and would cost a model load.

The comparison (:func:`compare`) is of token ids, index by index, over the first ``k``. It must
never call a correct restore wrong, and a correct restore is not bit-identical to a cold prefill:
the resumed server computed the restored positions in other batches than the cold one does, and
float sums in another order differ. Measured on Gemma 3 270M (Q4_K_M, CPU, build 11434 with the
sidecar patch): log-probs of the same token drift by up to 0.2 nats between a correct resume and
the cold prefill, greedy tokens agreed for 16 tokens on four of five prompts, and on the fifth a
near-tie (' red' -1.261 / ' Red' -1.322 warm, ' Red' -1.260 / ' red' -1.325 cold) flipped at
index 15. On the CI machine (another CPU, the same build) the fork's correct resume moved the cold
side's token by 0.207 nats and took the runner-up at index 2 (' So' -2.009 / ' This' -2.309 cold,
' So' -2.216 warm). Two tokens swap by drift alone when each moved by at most :data:`TIE_NATS`: then the
cold side's margin for its token plus the resumed side's margin for its own is at most twice that (the
margins add up to the two log-prob moves). So a first difference whose two margins add up to no more
than ``2 × TIE_NATS`` is a tie (:data:`Status.TIE`: the check passes, the tokens compared up to there
matched).

A bigger swing is not yet a verdict: on the CI machine a correct resume on the sidecar build took
``' valet'`` where the cold prefill took ``'\n'`` at token 3 (cold -1.017 / -1.391, 0.37 apart on the
cold side alone): drift there moves a token by more than 0.3 nats. One step's log-probs cannot tell
that from a wrong state; what follows can. After the first difference at index ``i`` the two
continuations no longer share a prefix, so the cold prefill is asked once more (:func:`resync_prompt`):
the same prompt with the resumed side's first ``i + 1`` tokens appended, cold again, continued for the
tokens the resumed side has left. A swap by drift changes one token and nothing else, so from the same
prefix the cold model goes on as the resume did (:func:`after_resync`: the rest matches, or ties: a
:data:`Status.TIE`, "the same but a swap at i"; ``k - 1`` tokens agree, as many as in a match less the
swapped one). A wrong state leaves it again (:data:`Status.DIFFERS`, both differences named). A wrong
restore (conversation A's state with conversation B's sidecar, on the fork build) left the cold
continuation at token 2 (the cold side sure by 1.15 nats, the resumed side by 0.06) and, given its
token, left it again. A first difference at the last compared token, or a second cold prefill that
fails or reuses a cached token, leaves the first rule's DIFFERS standing. The largest log-prob drift
over the matching tokens is kept as a figure (``max_logprob_delta``), not judged.

:func:`with_output` turns a reuse verdict into :attr:`VerdictKind.DIFFERS` when the output
differs: "output differs from a cold prefill", with the first differing token on each side.
Pure: no I/O, no clock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any

from app.core.verdict import Verdict, VerdictKind

#: tokens of greedy continuation compared
OUTPUT_TOKENS = 8
#: top log-probs asked for per token (the tie rule needs the runner-up; the report shows them)
TOP_LOGPROBS = 5
#: the seed sent with both continuations (greedy decoding does not draw, but the request is fixed)
SEED = 4242
#: the most a token's log-prob is allowed to move between a correct resume and a cold prefill (nats;
#: measured: 0.2 here, 0.207 on the CI machine); two tokens that swapped within it are a tie
TIE_NATS = 0.3

DIFFERS_WORDS = "output differs from a cold prefill"


def sampling() -> dict[str, Any]:
    """The ``/completion`` fields of a greedy continuation of ``k`` tokens with top log-probs
    (``n_predict`` is the caller's). ``ignore_eos`` keeps both sides at ``k`` tokens."""
    return {"temperature": 0.0, "top_k": 1, "seed": SEED, "n_probs": TOP_LOGPROBS, "ignore_eos": True}


class Status(enum.StrEnum):
    MATCH = "match"  # the first k tokens are the same
    TIE = "tie"  # the same but for one swap: a near-tie, or a swap the tokens after it show to be drift
    DIFFERS = "differs"  # a first difference that is not a tie
    UNKNOWN = "unknown"  # not compared (no tokens, a reference that was not cold, a failed request)
    OFF = "off"  # the output check was turned off


@dataclass(frozen=True)
class Alt:
    """One of the top tokens at a step: id, piece, log-prob."""

    id: int
    piece: str
    logprob: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "piece": self.piece, "logprob": self.logprob}


@dataclass(frozen=True)
class Step:
    """One generated token and the top tokens the server ranked at that step."""

    id: int
    piece: str
    logprob: float | None = None
    top: tuple[Alt, ...] = ()

    def logprob_of(self, token_id: int) -> float | None:
        if token_id == self.id and self.logprob is not None:
            return self.logprob
        return next((a.logprob for a in self.top if a.id == token_id), None)


@dataclass(frozen=True)
class Continuation:
    steps: tuple[Step, ...]
    cache_n: int | None = None  # what the answer said it reused (a cold one must say 0)
    prompt_n: int | None = None

    @property
    def ids(self) -> list[int]:
        return [s.id for s in self.steps]

    @property
    def text(self) -> str:
        return "".join(s.piece for s in self.steps)


def continuation(resp: dict[str, Any]) -> Continuation:
    """The continuation in a ``/completion`` answer asked with ``n_probs``: the
    ``completion_probabilities`` list (``id``, ``token``, ``logprob``, ``top_logprobs``), or
    the ``tokens`` list without log-probs when that is all there is."""
    steps: list[Step] = []
    for p in resp.get("completion_probabilities") or ():
        if not isinstance(p, dict) or "id" not in p:
            continue
        top = tuple(Alt(int(a["id"]), str(a.get("token", "")), _f(a.get("logprob")))
                    for a in p.get("top_logprobs") or () if isinstance(a, dict) and "id" in a)
        steps.append(Step(int(p["id"]), str(p.get("token", "")), _f(p.get("logprob")), top))
    if not steps:
        steps = [Step(int(t), "") for t in resp.get("tokens") or () if isinstance(t, int)]
    timings = resp.get("timings") or {}
    return Continuation(tuple(steps), _i(timings.get("cache_n")), _i(timings.get("prompt_n")))


def _f(x) -> float | None:
    try:
        return None if x is None else float(x)
    except (TypeError, ValueError):
        return None


def _i(x) -> int | None:
    try:
        return None if x is None else int(x)
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class FirstDiff:
    """Where the warm continuation first left the cold one."""

    index: int  # in the continuation (0: the first generated token)
    warm: Step
    cold: Step

    def to_dict(self) -> dict[str, Any]:
        def side(s: Step) -> dict[str, Any]:
            return {"id": s.id, "piece": s.piece, "logprob": s.logprob, "top": [a.to_dict() for a in s.top]}

        return {"index": self.index, "warm": side(self.warm), "cold": side(self.cold)}


@dataclass(frozen=True)
class OutputCheck:
    status: Status
    reason: str
    k: int = OUTPUT_TOKENS
    compared: int = 0  # tokens that matched before the first difference (k for MATCH)
    first_diff: FirstDiff | None = None  # DIFFERS and TIE
    resynced: int | None = None  # judged again from the resumed side's tokens: how many then matched
    max_logprob_delta: float | None = None  # over the matching tokens
    warm_text: str = ""
    cold_text: str = ""
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def differs(self) -> bool:
        return self.status is Status.DIFFERS

    @property
    def passed(self) -> bool:
        return self.status in (Status.MATCH, Status.TIE)

    def short(self) -> str:
        """A table cell: "same 8/8", "tie at 5", "DIFFERS at 3", "unknown", "off"."""
        if self.status is Status.MATCH:
            return f"same {self.compared}/{self.k}"
        if self.status is Status.TIE and self.resynced is not None:
            return f"same but a swap at {self.compared}"
        if self.status is Status.TIE:
            return f"same to a tie at {self.compared}"
        if self.status is Status.DIFFERS and self.first_diff is not None:
            return f"DIFFERS at {self.first_diff.index}"
        return self.status.value

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status.value, "reason": self.reason, "k": self.k, "compared": self.compared,
                "first_diff": self.first_diff.to_dict() if self.first_diff is not None else None,
                "max_logprob_delta": None if self.max_logprob_delta is None else round(self.max_logprob_delta, 4),
                "resynced": self.resynced, "warm_text": self.warm_text, "cold_text": self.cold_text}


def off() -> OutputCheck:
    return OutputCheck(Status.OFF, "the output check was turned off (--no-output-check)", compared=0)


def unknown(reason: str, k: int = OUTPUT_TOKENS) -> OutputCheck:
    return OutputCheck(Status.UNKNOWN, reason, k=k)


def _piece(s: Step) -> str:
    return repr(s.piece) if s.piece else f"token {s.id}"


def _swing(warm: Step, cold: Step) -> float | None:
    """How far the two tokens moved against each other between the sides: the cold side's margin
    for its token over the resumed one's, plus the resumed side's margin for its own (None when a
    log-prob is missing)."""
    cw, cc = cold.logprob_of(warm.id), cold.logprob_of(cold.id)
    ww, wc = warm.logprob_of(warm.id), warm.logprob_of(cold.id)
    if None in (cw, cc, ww, wc):
        return None
    return (cc - cw) + (ww - wc)


def compare(warm: Continuation, cold: Continuation, k: int = OUTPUT_TOKENS, *, tie_nats: float = TIE_NATS
            ) -> OutputCheck:
    """The warm continuation against the cold one, over the first ``k`` tokens (see the module).

    UNKNOWN when either has no tokens or the cold answer reused a cached token; MATCH when the
    first ``k`` (or all both have, at least one) agree; TIE when the first difference is a
    near-tie (the two margins add up to at most ``2 × tie_nats``); DIFFERS otherwise, with the first differing token."""
    if cold.cache_n:
        return unknown(f"the reference was not cold: the server reused {cold.cache_n:,} cached tokens", k)
    if not warm.steps or not cold.steps:
        side = "the resumed query" if not warm.steps else "the cold prefill"
        return unknown(f"{side} returned no tokens to compare", k)
    n = min(k, len(warm.steps), len(cold.steps))
    delta = None
    texts = {"warm_text": "".join(s.piece for s in warm.steps[:k]), "cold_text": "".join(s.piece for s in cold.steps[:k])}
    for i in range(n):
        w, c = warm.steps[i], cold.steps[i]
        if w.id == c.id:
            if w.logprob is not None and c.logprob is not None:
                d = abs(w.logprob - c.logprob)
                delta = d if delta is None or d > delta else delta
            continue
        diff = FirstDiff(i, w, c)
        swing = _swing(w, c)
        if swing is not None and swing <= 2 * tie_nats:
            return OutputCheck(Status.TIE, f"the first {i} of {k} tokens match the cold prefill's; at token {i} "
                                           f"the two sides took the other of two near-tied tokens ({_piece(w)} / "
                                           f"{_piece(c)}, {swing:.2f} nats apart over both sides, within "
                                           f"{2 * tie_nats:g})",
                               k=k, compared=i, first_diff=diff, max_logprob_delta=delta, **texts)
        cold_w, warm_c = c.logprob_of(w.id), w.logprob_of(c.id)
        how = ""
        if c.logprob is not None:
            how = (f" (log-prob cold {c.logprob:.3f} for its token, "
                   + (f"{cold_w:.3f}" if cold_w is not None else "below its top")
                   + f" for the resumed one's)")
        return OutputCheck(Status.DIFFERS, f"{DIFFERS_WORDS} at token {i} of {k}: the resume continued with "
                                           f"{_piece(w)} (id {w.id}), the cold prefill with {_piece(c)} "
                                           f"(id {c.id}){how}",
                           k=k, compared=i, first_diff=diff, max_logprob_delta=delta,
                           figures={"warm_logprob_of_cold": warm_c, "cold_logprob_of_warm": cold_w}, **texts)
    return OutputCheck(Status.MATCH, f"the first {n} tokens match the cold prefill's"
                       + (f" (log-probs within {delta:.3f} nats)" if delta is not None else ""),
                       k=k, compared=n, max_logprob_delta=delta, **texts)


def resync_index(check: OutputCheck) -> int | None:
    """The index after which the cold prefill is asked again (:func:`resync_prompt`): the first
    difference of a DIFFERS with tokens left after it to compare; None otherwise."""
    if check.status is not Status.DIFFERS or check.first_diff is None:
        return None
    i = check.first_diff.index
    return i if i + 1 < check.k else None


def resync_prompt(prompt: str | list[int], warm: Continuation, index: int) -> list:
    """The prompt of the second cold prefill: ``prompt`` followed by the resumed side's first
    ``index + 1`` tokens. A token prompt gets them appended; a text prompt becomes llama-server's
    mixed prompt (``["text", 12, 34]``: the text tokenized as it would be alone, BOS included, then
    the ids as they are), so the text is never re-tokenized across the join."""
    ids = warm.ids[:index + 1]
    if isinstance(prompt, str):
        return [prompt, *ids]
    return [*prompt, *ids]


def after_resync(first: OutputCheck, warm: Continuation, resynced: Continuation | str, *,
                 tie_nats: float = TIE_NATS) -> OutputCheck:
    """``first`` (a DIFFERS at index ``i``, :func:`resync_index`) judged again with the cold
    continuation of :func:`resync_prompt` (or why there is none): TIE when the resumed side's
    tokens after ``i`` match it (or tie), DIFFERS naming both differences when they leave it,
    ``first`` with the reason added when it could not be compared."""
    i = resync_index(first)
    if i is None:
        return first
    rest = Continuation(warm.steps[i + 1:first.k])
    again = resynced if isinstance(resynced, str) else compare(rest, resynced, len(rest.steps), tie_nats=tie_nats)
    if isinstance(again, str) or again.status is Status.UNKNOWN:
        why = again if isinstance(again, str) else again.reason
        return replace(first, reason=f"{first.reason}; a second cold prefill from the resumed side's tokens "
                                     f"could not say more ({why})")
    delta = max((d for d in (first.max_logprob_delta, again.max_logprob_delta) if d is not None), default=None)
    assert first.first_diff is not None
    w, c = first.first_diff.warm, first.first_diff.cold
    swing = _swing(w, c)
    apart = f", {swing:.2f} nats apart over both sides" if swing is not None else ""
    if again.passed:
        return replace(first, status=Status.TIE, max_logprob_delta=delta, resynced=again.compared,
                       reason=f"the first {i} of {first.k} tokens match the cold prefill's; at token {i} the resume "
                              f"took {_piece(w)} where the cold prefill took {_piece(c)}{apart}; given the "
                              f"resumed side's token, a second cold prefill went on as the resume did "
                              f"({again.short()} over the {len(rest.steps)} tokens left): a swap by float drift, "
                              f"not another state")
    assert again.first_diff is not None
    w2, c2 = again.first_diff.warm, again.first_diff.cold
    return replace(first, max_logprob_delta=delta, resynced=again.compared,
                   reason=f"{first.reason}; given the resumed side's token, a second cold prefill left the resume "
                          f"again at token {i + 1 + again.first_diff.index}: {_piece(w2)} resumed, {_piece(c2)} cold")


def with_output(verdict: Verdict, check: OutputCheck | None) -> Verdict:
    """``verdict`` (on reuse) with the output check's result: DIFFERS when the output differs
    (the reuse verdict kept in the figures as ``reuse_kind``), else the same verdict with the
    check's figures added."""
    if check is None:
        return verdict
    figures = {**verdict.figures, "output_check": check.status.value}
    if check.differs:
        figures["reuse_kind"] = verdict.kind.value
        if check.first_diff is not None:
            figures["first_diff_index"] = check.first_diff.index
        return Verdict(VerdictKind.DIFFERS, f"{check.reason}; the reuse itself: {verdict.kind.value}, {verdict.reason}",
                       n_restored=verdict.n_restored, prompt_n=verdict.prompt_n, cache_n=verdict.cache_n,
                       prompt_ms=verdict.prompt_ms, rollback_tokens=verdict.rollback_tokens,
                       checkpoints_loaded=verdict.checkpoints_loaded, figures=figures)
    return Verdict(verdict.kind, verdict.reason, n_restored=verdict.n_restored, prompt_n=verdict.prompt_n,
                   cache_n=verdict.cache_n, prompt_ms=verdict.prompt_ms, rollback_tokens=verdict.rollback_tokens,
                   checkpoints_loaded=verdict.checkpoints_loaded, figures=figures)
