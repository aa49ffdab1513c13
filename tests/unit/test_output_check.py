"""The output check's comparison (app.core.output_check): pure, no server."""

from __future__ import annotations

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from app.core.output_check import (OUTPUT_TOKENS, Alt, Continuation, Status, Step, cold_prompt, cold_steps, compare,
                                   continuation, next_cold, off, position_delta, sampling, unknown, with_output)
from app.core.output_drift import Bound
from app.core.verdict import SEVERITY, Verdict, VerdictKind, time_saved, worst

#: a bound as the measurement gives one (measured 0.2, x1.5)
B = Bound(0.3, "gemma3", 120, 0.2, 1.5)


def step(tok: int, lp: float = -0.5, *runners: tuple[int, float]) -> Step:
    """A generated token and its top list: itself first, then the runners-up given."""
    return Step(tok, f"<{tok}>", lp, (Alt(tok, f"<{tok}>", lp), *(Alt(t, f"<{t}>", p) for t, p in runners)))


def cont(*steps: Step, cache_n: int | None = 0) -> Continuation:
    return Continuation(tuple(steps), cache_n=cache_n, prompt_n=100)


def same(n: int = OUTPUT_TOKENS, lp: float = -0.5) -> list[Step]:
    return [step(100 + i, lp, (900 + i, lp - 2)) for i in range(n)]


def moved(steps: list[Step], by: float) -> list[Step]:
    """The same tokens with every log-prob moved by ``by``."""
    return [Step(s.id, s.piece, s.logprob + by, tuple(Alt(a.id, a.piece, a.logprob + by) for a in s.top)) for s in steps]


def test_the_same_tokens_within_the_measured_drift_match():
    r = compare(cont(*moved(same(), -0.2)), cont(*same()), bound=B)
    assert r.status is Status.MATCH and r.passed and not r.differs
    assert r.compared == OUTPUT_TOKENS and r.first_diff is None
    assert abs(r.max_logprob_delta - 0.2) < 1e-9 and r.short() == f"same {OUTPUT_TOKENS}/{OUTPUT_TOKENS}"
    assert r.figures["deltas"] == [0.2] * OUTPUT_TOKENS and r.figures["bound"] == 0.3
    assert "within 0.200 nats" in r.reason and "under the 0.300" in r.reason


def test_the_same_greedy_tokens_with_log_probs_past_the_bound_differ():
    """The wrong restore measured on the fork-mode build (reference, "A wrong restore, measured"): the
    greedy tokens may stay the same while the log-probs move 0.437 nats; a correct restore moved 0.067."""
    cold = same()
    warm = list(cold)
    warm[4] = step(cold[4].id, -0.5 - 0.437, (904, -2.5))
    r = compare(cont(*warm), cont(*cold), bound=B)
    assert r.status is Status.DIFFERS and r.differs and r.first_diff.index == 4 and r.compared == 4
    assert r.reason.startswith("output differs from a cold prefill at token 4 of 8: the resumed side's log-probs "
                               "moved 0.437 nats")
    assert "more than correct restores move them (0.300: the largest drift measured on 120 correct restores of " \
           "gemma3, 0.200 nats, x1.5)" in r.reason
    assert r.short() == "DIFFERS at 4"
    assert compare(cont(*moved(warm, 0)), cont(*cold), bound=Bound(0.45, "gemma3", 120, 0.3, 1.5)).passed


def test_only_the_first_k_positions_are_compared():
    cold = same(12)
    warm = list(cold)
    warm[10] = step(555, -0.1, (cold[10].id, -5.0))
    assert compare(cont(*warm), cont(*cold), k=8, bound=B).status is Status.MATCH
    assert compare(cont(*warm), cont(*cold), k=12, bound=B).status is Status.DIFFERS


def test_a_near_tie_within_the_drift_is_a_swap_and_every_later_position_is_still_compared():
    """A correct resume computes the restored positions in other batches: a near-tie may flip. The
    cold side is then scored again from the resumed side's tokens, and every position is judged."""
    cold = same()
    warm = list(cold)
    cold[5] = step(20, -1.260, (21, -1.325))
    warm[5] = step(21, -1.261, (20, -1.322))
    first = cont(*cold)
    assert next_cold(cont(*warm), [first]) == 6  # positions 0..5 have a partner; 6 and 7 need another
    assert len(cold_steps(cont(*warm), [first])) == 6
    r = compare(cont(*warm), [first], bound=B)
    assert r.status is Status.UNKNOWN and "only 6 of 8 positions" in r.reason
    again = cont(*warm[6:])
    assert next_cold(cont(*warm), [first, again]) is None
    r = compare(cont(*warm), [first, again], bound=B)
    assert r.status is Status.TIE and r.passed and r.compared == OUTPUT_TOKENS and r.first_diff.index == 5
    assert r.short() == "same but a swap at 5" and r.figures["cold_prefills"] == 2
    # a wrong state after the swap: the second cold prefill is sure of another token
    wrong = list(warm[6:])
    wrong[1] = step(666, -0.2, (warm[7].id, -2.5))
    r = compare(cont(*warm), [first, cont(*wrong)], bound=B)
    assert r.status is Status.DIFFERS and r.first_diff.index == 7, r.reason


def test_no_swing_larger_than_the_measured_drift_is_a_tie():
    """The issue's rule: the CI machine's ' valet' / newline swap moved the tokens 0.374 and 0.3 nats;
    with a bound of 0.3 that is a difference, with a measured bound above it a swap."""
    cold, warm = same(), same()
    cold[3] = Step(107, "\n", -1.017, (Alt(107, "\n", -1.017), Alt(143583, " valet", -1.391)))
    warm[3] = Step(143583, " valet", -1.05, (Alt(143583, " valet", -1.05), Alt(107, "\n", -1.35)))
    colds = [cont(*cold[:4]), cont(*warm[4:])]
    r = compare(cont(*warm), colds, bound=B)
    assert r.status is Status.DIFFERS and r.first_diff.index == 3 and abs(r.max_logprob_delta - 0.341) < 1e-9
    assert compare(cont(*warm), colds, bound=Bound(0.35, "gemma3", 100, 0.3, 1.0)).status is Status.TIE


def test_a_token_one_side_does_not_rank_moved_at_least_to_the_other_sides_floor():
    cold = step(1, -0.1, (2, -2.0), (3, -3.0))
    warm = step(1, -0.1, (2, -2.0), (4, -1.0))  # 4: cold ranks it below -3.0, so it moved at least 2.0
    assert position_delta(warm, cold) == 2.0
    assert position_delta(Step(1, "a"), cold) is None
    assert position_delta(step(1, -0.5), step(1, -0.25)) == 0.25


def test_a_difference_with_no_log_probs_is_never_a_tie():
    cold, warm = same(), same()
    cold = [Step(s.id, "a") for s in cold]
    warm = [Step(s.id, "a") for s in warm]
    warm[2] = Step(47, "b")
    r = compare(cont(*warm), [cont(*cold[:3]), cont(*warm[3:])], bound=B)
    assert r.status is Status.DIFFERS and "no log-probs" in r.reason
    assert compare(cont(*cold), cont(*cold), bound=B).status is Status.MATCH


def test_the_cold_prompt_appends_the_resumed_sides_tokens_without_retokenizing_text():
    warm = cont(*same())
    assert cold_prompt([1, 2, 3], warm, 0) == [1, 2, 3]
    assert cold_prompt([1, 2, 3], warm, 2) == [1, 2, 3, 100, 101]
    assert cold_prompt("Parking log.", warm, 3) == ["Parking log.", 100, 101, 102]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-0.6, 0.6, allow_nan=False), min_size=OUTPUT_TOKENS, max_size=OUTPUT_TOKENS),
       st.floats(0.01, 1.0))
def test_a_move_past_the_bound_anywhere_is_never_passed(moves, bound):
    """Whatever the moves, the check passes exactly when the largest is within the bound."""
    cold = same()
    warm = [Step(s.id, s.piece, s.logprob + m, tuple(Alt(a.id, a.piece, a.logprob + m) for a in s.top))
            for s, m in zip(cold, moves)]
    assume(abs(max(abs(m) for m in moves) - bound) > 1e-9)  # not on the float edge of the bound itself
    r = compare(cont(*warm), cont(*cold), bound=Bound(bound, "x", 20, bound, 1.0))
    assert r.passed == (max(abs(m) for m in moves) <= bound), (r.reason, moves, bound)


def test_a_reference_that_reused_the_cache_or_no_tokens_is_unknown():
    r = compare(cont(*same()), cont(*same(), cache_n=1200), bound=B)
    assert r.status is Status.UNKNOWN and "not cold" in r.reason and "1,200" in r.reason
    assert compare(cont(), cont(*same()), bound=B).status is Status.UNKNOWN
    assert "the cold prefill returned no tokens" in compare(cont(*same()), cont(), bound=B).reason
    assert not unknown("x").passed and not unknown("x").differs
    assert off().status is Status.OFF and off().short() == "off"


def test_shorter_continuations_are_compared_as_far_as_both_go():
    r = compare(cont(*same(3)), cont(*same(5)), bound=B)
    assert r.status is Status.MATCH and r.compared == 3


def test_parse_a_llama_server_answer():
    resp = {"content": " The valet", "timings": {"cache_n": 0, "prompt_n": 7},
            "completion_probabilities": [
                {"id": 669, "token": " The", "bytes": [32], "logprob": -2.07,
                 "top_logprobs": [{"id": 669, "token": " The", "logprob": -2.07},
                                  {"id": 108, "token": "\n\n", "logprob": -2.16}]},
                {"id": 143583, "token": " valet", "logprob": -1.30, "top_logprobs": []}]}
    c = continuation(resp)
    assert c.ids == [669, 143583] and c.text == " The valet" and (c.cache_n, c.prompt_n) == (0, 7)
    assert c.steps[0].logprob_of(108) == -2.16 and c.steps[0].logprob_of(5) is None
    # without log-probs: the token ids alone, when the server gave them
    assert continuation({"tokens": [1, 2]}).ids == [1, 2] and continuation({}).steps == ()


def test_the_request_is_greedy_with_a_seed_and_top_log_probs():
    s = sampling()
    assert s["temperature"] == 0 and s["n_probs"] >= 2 and "seed" in s and s["ignore_eos"] is True


def test_differs_replaces_the_reuse_verdict_and_is_the_worst():
    hit = Verdict(VerdictKind.HIT, "re-processed 19 of 1,346 prompt tokens", n_restored=1327, prompt_n=19,
                  cache_n=1310, figures={"n_restored": 1327})
    cold, warm = same(), same()
    warm[2] = step(47, -1.5, (cold[2].id, -1.6 - 1.0))
    v = with_output(hit, compare(cont(*warm), [cont(*cold[:3]), cont(*warm[3:])], bound=B))
    assert v.kind is VerdictKind.DIFFERS and not v.ok
    assert v.reason.startswith("output differs from a cold prefill at token 2") and "HIT, re-processed 19" in v.reason
    assert v.figures["reuse_kind"] == "HIT" and v.figures["first_diff_index"] == 2 and v.cache_n == 1310
    assert worst([hit, Verdict(VerdictKind.DISCARDED, "x"), v]) is v
    assert SEVERITY[VerdictKind.DIFFERS] > SEVERITY[VerdictKind.DISCARDED]
    assert time_saved(v, 1000.0) is None  # a wrong reuse saved nothing worth counting
    # a passing check keeps the verdict, with the check's word in its figures
    kept = with_output(hit, compare(cont(*same()), cont(*same()), bound=B))
    assert kept.kind is VerdictKind.HIT and kept.reason == hit.reason and kept.figures["output_check"] == "match"
    assert with_output(hit, None) is hit
    assert with_output(hit, unknown("no tokens")).kind is VerdictKind.HIT
