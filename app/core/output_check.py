"""Correct, not only warm: compare a resume's log-probs with a cold prefill's, position by position.

A verdict on reuse (:mod:`app.core.verdict`) says whether a resume skipped the prefill; it
cannot say whether what the server reused was right. Upstream has shipped cache-reuse bugs that
answered fast and wrong (``shared/reference/llama-server.md``, "Warm is not the same as
correct"), and a lax sidecar loader (the turboquant fork's, which KV Valet's sidecar build
reproduces in fork mode) takes another chat's checkpoints without a word. The output check is the
proof by output: after the resume, the probe's first query is a greedy continuation of
:data:`OUTPUT_TOKENS` tokens with the top :data:`TOP_LOGPROBS` log-probs of every step
(:func:`sampling`), and the same prompt is then prefilled *cold* and scored on the same tokens.

What "cold" is (:mod:`app.sessions.check` runs it): the same prompt, in the same slot, after the
slot was erased, with ``cache_prompt: false``. The server then starts at ``n_past = 0``: it
removes every cell of the slot's sequence and processes every prompt token, and it consults the
slot's context checkpoints (and the RAM prompt cache) only when ``n_past > 0`` (build 11434's
``server-context.cpp``), so nothing the restore brought takes part. The answer's own figures must
say so (``cache_n`` 0): a reference that reused anything is refused (:data:`Status.UNKNOWN`).

**The evidence** is the two sides' log-probs at every one of the ``k`` positions, each pair taken
after the *same* prefix. The cold prefill continues greedily; while it takes the resumed side's
tokens, both sides stand on the same prefix. Where it takes another token (position ``i``), that
position is still compared (its prefix was the same), and another cold prefill starts from the
prompt followed by the resumed side's first ``i + 1`` tokens (:func:`next_cold`, :func:`cold_prompt`:
cold again, never a rollback inside the slot), until every position has a cold partner. At each
position :func:`position_delta` takes the largest log-prob move of a token either side ranks in its
top list (for a token only one side ranks, the least the move can be). The check's statistic is the
largest over the ``k`` positions.

**The bound** is measured, not chosen: :mod:`app.core.output_drift` reads how far that statistic
went on correct restores (every family of the resume matrix; stock, fork-mode and v2-mode servers;
one and two threads; at least 20 restores each) and gives the bound for the model's architecture.
Then (:func:`compare`):

* every position within the bound and the same greedy token on both sides: :data:`Status.MATCH`;
* every position within the bound, but at some position the sides ranked the other of two
  near-tied tokens first: :data:`Status.TIE` (a swap by float drift: the tokens moved no more than
  correct restores move them);
* a position whose log-probs moved further than the bound: :data:`Status.DIFFERS`, naming it, the
  token and both log-probs. No rule calls a move larger than the measured drift a tie.

:func:`with_output` turns a reuse verdict into :attr:`VerdictKind.DIFFERS` when the output
differs: "output differs from a cold prefill", with the position and the two log-probs.
Pure: no I/O, no clock (the bound's file is read by :mod:`app.core.output_drift`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from app.core.output_drift import Bound, bound_for
from app.core.verdict import Verdict, VerdictKind

#: tokens of greedy continuation compared
OUTPUT_TOKENS = 8
#: top log-probs asked for per token (the tie rule needs the runner-up; the report shows them)
TOP_LOGPROBS = 5
#: the seed sent with both continuations (greedy decoding does not draw, but the request is fixed)
SEED = 4242
DIFFERS_WORDS = "output differs from a cold prefill"


def sampling() -> dict[str, Any]:
    """The ``/completion`` fields of a greedy continuation of ``k`` tokens with top log-probs
    (``n_predict`` is the caller's). ``ignore_eos`` keeps both sides at ``k`` tokens."""
    return {"temperature": 0.0, "top_k": 1, "seed": SEED, "n_probs": TOP_LOGPROBS, "ignore_eos": True}


class Status(enum.StrEnum):
    MATCH = "match"  # the first k tokens are the same
    TIE = "tie"  # every log-prob within the measured drift, but a near-tie swapped at some position
    DIFFERS = "differs"  # a position whose log-probs moved further than correct restores move them
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
    compared: int = 0  # positions compared (k for MATCH and TIE; the position over the bound for DIFFERS)
    first_diff: FirstDiff | None = None  # DIFFERS: the position over the bound; TIE: the first swap
    max_logprob_delta: float | None = None  # the largest log-prob move over the compared positions
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
        """A table cell: "same 8/8", "same but a swap at 5", "DIFFERS at 3", "unknown", "off"."""
        if self.status is Status.MATCH:
            return f"same {self.compared}/{self.k}"
        if self.status is Status.TIE and self.first_diff is not None:
            return f"same but a swap at {self.first_diff.index}"
        if self.status is Status.DIFFERS and self.first_diff is not None:
            return f"DIFFERS at {self.first_diff.index}"
        return self.status.value

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status.value, "reason": self.reason, "k": self.k, "compared": self.compared,
                "first_diff": self.first_diff.to_dict() if self.first_diff is not None else None,
                "max_logprob_delta": None if self.max_logprob_delta is None else round(self.max_logprob_delta, 4),
                "deltas": self.figures.get("deltas"), "bound": self.figures.get("bound"),
                "bound_source": self.figures.get("bound_source"), "cold_prefills": self.figures.get("cold_prefills"),
                "warm_text": self.warm_text, "cold_text": self.cold_text}


def off() -> OutputCheck:
    return OutputCheck(Status.OFF, "the output check was turned off (--no-output-check)", compared=0)


def unknown(reason: str, k: int = OUTPUT_TOKENS) -> OutputCheck:
    return OutputCheck(Status.UNKNOWN, reason, k=k)


def _piece(s: Step) -> str:
    return repr(s.piece) if s.piece else f"token {s.id}"


def _ranked(s: Step) -> dict[int, float]:
    """The tokens a step ranks with their log-probs: its top list and its own token."""
    out = {a.id: a.logprob for a in s.top if a.logprob is not None}
    if s.logprob is not None:
        out.setdefault(s.id, s.logprob)
    return out


def position_delta(warm: Step, cold: Step) -> float | None:
    """How far the log-probs moved between the two sides at one position (both after the same
    prefix): the largest ``|warm - cold|`` over the tokens both rank; for a token only one side
    ranks, the least its move can be (the other side gives it less than the lowest it lists, so the
    move is at least the difference to that, when positive). None when a side has no log-probs."""
    w, c = _ranked(warm), _ranked(cold)
    if not w or not c:
        return None
    moves = [abs(w[t] - c[t]) for t in w.keys() & c.keys()]
    floor_w, floor_c = min(w.values()), min(c.values())
    moves += [w[t] - floor_c for t in w.keys() - c.keys() if len(c) > 1]
    moves += [c[t] - floor_w for t in c.keys() - w.keys() if len(w) > 1]
    return max([0.0, *moves])


def cold_steps(warm: Continuation, colds: list[Continuation], k: int = OUTPUT_TOKENS) -> list[Step]:
    """The cold partner of each position, from the cold prefills made so far: the first starts after
    the prompt, each next one after the prompt and the resumed side's tokens up to and including the
    position where the previous one took another token. A cold step is kept while its prefix is the
    resumed side's (its own position included: the step that left was made after the same prefix)."""
    n = min(k, len(warm.steps))
    steps: list[Step] = []
    for c in colds:
        for st in c.steps:
            if len(steps) >= n:
                break
            pos = len(steps)
            steps.append(st)
            if st.id != warm.steps[pos].id:
                break
    return steps


def next_cold(warm: Continuation, colds: list[Continuation], k: int = OUTPUT_TOKENS) -> int | None:
    """Where the next cold prefill starts (after the prompt and the resumed side's first ``i``
    tokens: :func:`cold_prompt`), or None when every position has its cold partner."""
    have = len(cold_steps(warm, colds, k))
    return have if have < min(k, len(warm.steps)) else None


def cold_prompt(prompt: str | list[int], warm: Continuation, start: int) -> str | list:
    """The prompt of the cold prefill that starts at position ``start``: ``prompt`` followed by the
    resumed side's first ``start`` tokens. A token prompt gets them appended; a text prompt becomes
    llama-server's mixed prompt (``["text", 12, 34]``: the text tokenized as it would be alone, BOS
    included, then the ids as they are), so the text is never re-tokenized across the join."""
    if start <= 0:
        return prompt
    ids = warm.ids[:start]
    if isinstance(prompt, str):
        return [prompt, *ids]
    return [*prompt, *ids]


def _lp(x: float | None) -> str:
    return "below its top" if x is None else f"{x:.3f}"


def compare(warm: Continuation, cold: Continuation | list[Continuation], k: int = OUTPUT_TOKENS, *,
            bound: Bound | None = None, arch: str | None = None, precision: str | None = None) -> OutputCheck:
    """The resumed side's continuation against its cold partners over the first ``k`` positions
    (see the module). ``cold``: the cold prefills made (:func:`next_cold`), or one. ``bound``: the
    measured drift (by default :func:`app.core.output_drift.bound_for` of ``arch`` and ``precision``).

    UNKNOWN when either side has no tokens, a cold answer reused a cached token, or positions have
    no cold partner; MATCH, TIE or DIFFERS as the module says."""
    colds = [cold] if isinstance(cold, Continuation) else list(cold)
    reused = next((c.cache_n for c in colds if c.cache_n), None)
    if reused:
        return unknown(f"the reference was not cold: the server reused {reused:,} cached tokens", k)
    if not warm.steps or not colds or not any(c.steps for c in colds):
        side = "the resumed query" if not warm.steps else "the cold prefill"
        return unknown(f"{side} returned no tokens to compare", k)
    bound = bound if bound is not None else bound_for(arch, precision)
    n = min(k, len(warm.steps))
    partners = cold_steps(warm, colds, k)
    texts = {"warm_text": "".join(s.piece for s in warm.steps[:k]),
             "cold_text": "".join(s.piece for s in colds[0].steps[:k])}
    deltas = [position_delta(warm.steps[i], partners[i]) for i in range(len(partners))]
    figures = {"deltas": [None if d is None else round(d, 4) for d in deltas], "bound": bound.nats,
               "bound_source": bound.source(), "cold_prefills": len(colds)}
    known = [d for d in deltas if d is not None]
    top = max(known, default=None)
    swaps = [i for i, c in enumerate(partners) if c.id != warm.steps[i].id]
    over = next((i for i, d in enumerate(deltas) if d is not None and d > bound.nats), None)
    if over is not None:
        w, c = warm.steps[over], partners[over]
        moved = max(_ranked(w).keys() & _ranked(c).keys(), default=w.id,
                    key=lambda t: abs(_ranked(w)[t] - _ranked(c)[t]))
        worded = next((a.piece for a in (*w.top, *c.top) if a.id == moved), "") or (w.piece if moved == w.id else "")
        return OutputCheck(
            Status.DIFFERS,
            f"{DIFFERS_WORDS} at token {over} of {k}: the resumed side's log-probs moved {deltas[over]:.3f} nats from "
            f"the cold prefill's (token {worded!r}: resumed {_lp(w.logprob_of(moved))}, cold {_lp(c.logprob_of(moved))}; "
            f"the resume took {_piece(w)}, the cold prefill {_piece(c)}), more than correct restores move them "
            f"({bound.nats:.3f}: {bound.source()})",
            k=k, compared=over, first_diff=FirstDiff(over, w, c), max_logprob_delta=top,
            figures={**figures, "warm_logprob_of_cold": w.logprob_of(c.id), "cold_logprob_of_warm": c.logprob_of(w.id)},
            **texts)
    if len(partners) < n:
        return OutputCheck(Status.UNKNOWN, f"only {len(partners)} of {n} positions have a cold partner to compare",
                           k=k, compared=len(partners), max_logprob_delta=top, figures=figures, **texts)
    if not known and swaps:
        i = swaps[0]
        return OutputCheck(Status.DIFFERS, f"{DIFFERS_WORDS} at token {i} of {k}: the resume continued with "
                                           f"{_piece(warm.steps[i])}, the cold prefill with {_piece(partners[i])} "
                                           f"(no log-probs to tell drift from another state)",
                           k=k, compared=i, first_diff=FirstDiff(i, warm.steps[i], partners[i]), figures=figures, **texts)
    within = f"log-probs within {top:.3f} nats of the cold prefill's" if top is not None else "no log-probs to compare"
    limit = f", under the {bound.nats:.3f} correct restores reach" if top is not None else ""
    if swaps:
        i = swaps[0]
        return OutputCheck(Status.TIE, f"all {n} positions agree with the cold prefill within the measured drift "
                                       f"({within}{limit}); at token {i} the two sides ranked the other of two "
                                       f"near-tied tokens first ({_piece(warm.steps[i])} / {_piece(partners[i])})",
                           k=k, compared=n, first_diff=FirstDiff(i, warm.steps[i], partners[i]),
                           max_logprob_delta=top, figures=figures, **texts)
    return OutputCheck(Status.MATCH, f"the first {n} tokens match the cold prefill's ({within}{limit})",
                       k=k, compared=n, max_logprob_delta=top, figures=figures, **texts)


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
