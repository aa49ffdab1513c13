"""The output check's comparison (app.core.output_check): pure, no server."""

from __future__ import annotations

from app.core.output_check import (OUTPUT_TOKENS, TIE_NATS, Alt, Continuation, Status, Step, after_resync,
                                   compare, continuation, off, resync_index, resync_prompt, sampling, unknown,
                                   with_output)
from app.core.verdict import SEVERITY, Verdict, VerdictKind, time_saved, worst


def step(tok: int, lp: float = -0.5, *runners: tuple[int, float]) -> Step:
    """A generated token and its top list: itself first, then the runners-up given."""
    return Step(tok, f"<{tok}>", lp, (Alt(tok, f"<{tok}>", lp), *(Alt(t, f"<{t}>", p) for t, p in runners)))


def cont(*steps: Step, cache_n: int | None = 0) -> Continuation:
    return Continuation(tuple(steps), cache_n=cache_n, prompt_n=100)


def same(n: int = OUTPUT_TOKENS, lp: float = -0.5) -> list[Step]:
    return [step(100 + i, lp, (900 + i, lp - 2)) for i in range(n)]


def test_the_same_tokens_match_and_log_prob_drift_is_a_figure_not_a_verdict():
    warm = cont(*[step(s.id, s.logprob - 0.2, (900, -3.0)) for s in same()])
    r = compare(warm, cont(*same()))
    assert r.status is Status.MATCH and r.passed and not r.differs
    assert r.compared == OUTPUT_TOKENS and r.first_diff is None
    assert abs(r.max_logprob_delta - 0.2) < 1e-9 and r.short() == f"same {OUTPUT_TOKENS}/{OUTPUT_TOKENS}"


def test_only_the_first_k_tokens_are_compared():
    cold = same(12)
    warm = same(12)
    warm[10] = step(555, -0.1, (cold[10].id, -5.0))
    assert compare(cont(*warm), cont(*cold), k=8).status is Status.MATCH
    assert compare(cont(*warm), cont(*cold), k=12).status is Status.DIFFERS


def test_the_first_differing_token_with_both_sides_and_their_top_log_probs():
    cold = same()
    warm = list(cold)
    warm[3] = step(777, -0.3, (cold[3].id, -2.1))  # the cold one's token far below on the warm side
    warm[4] = step(778, -0.3)  # after the first difference nothing is compared
    r = compare(cont(*warm), cont(*cold))
    assert r.status is Status.DIFFERS and r.differs and not r.passed
    d = r.first_diff
    assert (d.index, d.warm.id, d.cold.id, d.warm.piece, d.cold.piece) == (3, 777, cold[3].id, "<777>", "<103>")
    assert d.warm.top[1] == Alt(cold[3].id, "<103>", -2.1) and d.cold.top
    assert r.compared == 3 and r.short() == "DIFFERS at 3"
    assert "output differs from a cold prefill at token 3 of 8" in r.reason and "'<777>' (id 777)" in r.reason
    assert "below its top" in r.reason  # the warm token is not in the cold side's top list
    assert r.figures["warm_logprob_of_cold"] == -2.1
    assert r.to_dict()["first_diff"]["warm"]["top"][0]["id"] == 777


def test_a_near_tie_on_both_sides_is_not_a_difference():
    """A correct resume computes the restored positions in other batches: a near-tie may flip."""
    cold = same()
    warm = list(cold)
    cold[5] = step(20, -1.260, (21, -1.325))
    warm[5] = step(21, -1.261, (20, -1.322))
    r = compare(cont(*warm), cont(*cold))
    assert r.status is Status.TIE and r.passed and r.compared == 5 and r.first_diff.index == 5
    assert r.short() == "same to a tie at 5"


def test_the_ci_machines_flip_is_a_tie_and_a_bigger_swing_is_not():
    """The fork's correct resume on the CI machine: the cold side chose ' So' by 0.30 nats, the
    resumed side moved ' So' by 0.207 and took ' This'. Each token moved less than TIE_NATS, so the
    swap is drift; the same cold margin with the resumed side sure of its token is not."""
    cold, warm = same(), same()
    cold[2] = step(4324, -2.009, (2094, -2.309))
    warm[2] = step(2094, -2.150, (4324, -2.216))
    r = compare(cont(*warm), cont(*cold))
    assert r.status is Status.TIE and r.compared == 2, r.reason
    assert "0.37 nats apart over both sides" in r.reason
    warm[2] = step(2094, -1.600, (4324, -2.216))  # 0.30 + 0.62: the resumed side is sure
    assert compare(cont(*warm), cont(*cold)).status is Status.DIFFERS
    # just within the bound a tie; just past it not
    warm[2] = step(2094, -2.216 + 2 * TIE_NATS - 0.301, (4324, -2.216))
    assert compare(cont(*warm), cont(*cold)).status is Status.TIE
    warm[2] = step(2094, -2.216 + 2 * TIE_NATS - 0.299, (4324, -2.216))
    assert compare(cont(*warm), cont(*cold)).status is Status.DIFFERS


def test_a_tie_on_one_side_only_is_a_difference():
    """The wrong restore seen on the real fork build: near-tied on the resumed side, a clear
    choice on the cold side."""
    cold, warm = same(), same()
    cold[2] = step(48, -0.880, (47, -2.030))
    warm[2] = step(47, -1.568, (48, -1.625))
    assert compare(cont(*warm), cont(*cold)).status is Status.DIFFERS
    # and the other way round
    cold[2] = step(48, -1.0, (47, -1.0 - TIE_NATS / 2))
    warm[2] = step(47, -0.2, (48, -3.0))
    assert compare(cont(*warm), cont(*cold)).status is Status.DIFFERS
    # a difference with no log-probs at all is never a tie
    cold[2], warm[2] = Step(48, "a"), Step(47, "b")
    assert compare(cont(*warm), cont(*cold)).status is Status.DIFFERS


def test_a_reference_that_reused_the_cache_or_no_tokens_is_unknown():
    r = compare(cont(*same()), cont(*same(), cache_n=1200))
    assert r.status is Status.UNKNOWN and "not cold" in r.reason and "1,200" in r.reason
    assert compare(cont(), cont(*same())).status is Status.UNKNOWN
    assert "the cold prefill returned no tokens" in compare(cont(*same()), cont()).reason
    assert not unknown("x").passed and not unknown("x").differs
    assert off().status is Status.OFF and off().short() == "off"


def test_shorter_continuations_are_compared_as_far_as_both_go():
    r = compare(cont(*same(3)), cont(*same(5)))
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
    v = with_output(hit, compare(cont(*warm), cont(*cold)))
    assert v.kind is VerdictKind.DIFFERS and not v.ok
    assert v.reason.startswith("output differs from a cold prefill at token 2") and "HIT, re-processed 19" in v.reason
    assert v.figures["reuse_kind"] == "HIT" and v.figures["first_diff_index"] == 2 and v.cache_n == 1310
    assert worst([hit, Verdict(VerdictKind.DISCARDED, "x"), v]) is v
    assert SEVERITY[VerdictKind.DIFFERS] > SEVERITY[VerdictKind.DISCARDED]
    assert time_saved(v, 1000.0) is None  # a wrong reuse saved nothing worth counting
    # a passing check keeps the verdict, with the check's word in its figures
    kept = with_output(hit, compare(cont(*same()), cont(*same())))
    assert kept.kind is VerdictKind.HIT and kept.reason == hit.reason and kept.figures["output_check"] == "match"
    assert with_output(hit, None) is hit
    assert with_output(hit, unknown("no tokens")).kind is VerdictKind.HIT


def _ci_valet_swap() -> tuple[list[Step], list[Step]]:
    """The sidecar build's correct resume on the CI machine (2026-12-02): the cold prefill took '\n'
    at token 3 by 0.374 nats over ' valet', the resume took ' valet' (its margin here 0.3): a swing of
    0.67, past 2 × TIE_NATS."""
    cold, warm = same(), same()
    cold[3] = Step(107, "\n", -1.017, (Alt(107, "\n", -1.017), Alt(143583, " valet", -1.391)))
    warm[3] = Step(143583, " valet", -1.05, (Alt(143583, " valet", -1.05), Alt(107, "\n", -1.35)))
    return warm, cold


def test_a_swing_past_the_tie_bound_is_judged_again_from_the_resumed_sides_tokens():
    """The CI failure: one step's log-probs cannot tell drift from a wrong state. Given the resumed
    side's token, a second cold prefill that goes on as the resume did makes it a swap by drift."""
    warm, cold = _ci_valet_swap()
    first = compare(cont(*warm), cont(*cold))
    assert first.status is Status.DIFFERS and resync_index(first) == 3
    # the second cold prefill: the prompt and the resumed side's tokens 0..3, continued for the 4 left
    assert resync_prompt([1, 2, 3], cont(*warm), 3) == [1, 2, 3, 100, 101, 102, 143583]
    assert resync_prompt("Parking log.", cont(*warm), 3) == ["Parking log.", 100, 101, 102, 143583]
    again = cont(*[step(s.id, s.logprob - 0.1, (900, -3.0)) for s in warm[4:]])
    r = after_resync(first, cont(*warm), again)
    assert r.status is Status.TIE and r.passed and not r.differs, r.reason
    assert (r.compared, r.resynced, r.first_diff.index) == (3, 4, 3)
    assert r.short() == "same but a swap at 3" and r.to_dict()["resynced"] == 4
    assert "a second cold prefill went on as the resume did" in r.reason and "0.67 nats apart" in r.reason
    assert abs(r.max_logprob_delta - 0.1) < 1e-9
    # a further near-tie after the resync still passes
    tied = list(again.steps)
    tied[2] = step(31, -1.0, (30, -1.05))
    near = [step(s.id, s.logprob, (900, -3.0)) for s in warm[4:]]
    near[2] = step(30, -1.01, (31, -1.04))
    assert after_resync(first, cont(*warm[:4], *near), cont(*tied)).status is Status.TIE


def test_a_wrong_state_leaves_the_cold_continuation_again_and_stays_differs():
    warm, cold = _ci_valet_swap()
    first = compare(cont(*warm), cont(*cold))
    again = [step(s.id, s.logprob, (900, -3.0)) for s in warm[4:]]
    again[1] = step(666, -0.2, (warm[5].id, -2.5))  # the cold model, given the same tokens, is sure of another
    r = after_resync(first, cont(*warm), cont(*again))
    assert r.status is Status.DIFFERS and r.differs and r.first_diff.index == 3 and r.resynced == 1
    assert r.reason.startswith("output differs from a cold prefill at token 3 of 8")
    assert "left the resume again at token 5: '<105>' resumed, '<666>' cold" in r.reason
    assert r.short() == "DIFFERS at 3"


def test_no_second_prefill_when_nothing_is_left_to_compare_or_it_cannot_be_trusted():
    warm, cold = same(), same()
    warm[-1] = step(777, -0.1, (cold[-1].id, -4.0))  # the last compared token
    last = compare(cont(*warm), cont(*cold))
    assert last.status is Status.DIFFERS and resync_index(last) is None
    assert after_resync(last, cont(*warm), cont(*same())) is last
    for s in (compare(cont(*same()), cont(*same())), unknown("x"), off()):
        assert resync_index(s) is None
    warm, cold = _ci_valet_swap()
    first = compare(cont(*warm), cont(*cold))
    # a second cold prefill that reused the cache, or failed, leaves the DIFFERS standing, saying why
    r = after_resync(first, cont(*warm), cont(*warm[4:], cache_n=40))
    assert r.status is Status.DIFFERS and "could not say more (the reference was not cold" in r.reason
    r = after_resync(first, cont(*warm), "the cold prefill failed: HTTP 500")
    assert r.status is Status.DIFFERS and r.reason.endswith("could not say more (the cold prefill failed: HTTP 500)")
