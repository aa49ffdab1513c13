"""The soak's judge: a leak is a trend over every sample, for descriptors and RSS alike."""

from __future__ import annotations

from tests.soak.soak_window import COUNT_SLOPE, RSS_SLOPE_MB, Sample, judge, slope


def samples(fds, rss=None) -> list[Sample]:
    rss = rss or [100.0] * len(fds)
    return [Sample("cycles", i, float(i), r, f, 10, 5, 2, 20, 300) for i, (f, r) in enumerate(zip(fds, rss))]


def test_the_slope_is_growth_per_sample():
    assert slope([5, 6, 7, 8]) == 1.0 and slope([3, 3, 3]) == 0.0 and slope([7]) == 0.0


def test_one_step_of_one_descriptor_is_not_a_leak():
    # the CI failure "cycles: fds grew from 77 to 78": one more descriptor half-way, for good
    rep = judge("cycles", samples([77] * 16 + [78] * 16))
    assert rep.grew == [] and 0 < rep.slope["fds"] < COUNT_SLOPE


def test_a_descriptor_leaked_every_other_cycle_is_one():
    rep = judge("cycles", samples([77 + i // 2 for i in range(32)]))
    assert [g.split(":")[1].split()[0] for g in rep.grew] == ["fds"], rep.grew


def test_rss_that_keeps_growing_is_judged_in_a_short_run_too():
    rss = [100.0 + 0.5 * i for i in range(32)]  # half a MB a cycle
    rep = judge("cycles", samples([77] * 32, rss))
    assert len(rep.grew) == 1 and "rss_mb" in rep.grew[0] and rep.slope["rss_mb"] >= RSS_SLOPE_MB["cycles"]
    flat = judge("cycles", samples([77] * 32, [100.0 + (i % 3) for i in range(32)]))  # noise, no trend
    assert flat.grew == []


def test_too_few_samples_judge_nothing():
    assert judge("flood", samples(list(range(1, 11)))).grew == []  # 9 after the warm-up


def test_one_transient_among_many_samples_is_not_a_leak():
    fds = [34] * 20
    fds[17] = 36  # a poll in flight near the end
    assert judge("flood", samples(fds)).grew == []


def test_rss_is_only_reported_where_memory_is_not_judged():
    rss = [100.0 + 0.5 * i for i in range(32)]
    rep = judge("flood", samples([77] * 32, rss), memory=False)
    assert rep.grew == [] and rep.slope["rss_mb"] == 0.5
    fds = judge("flood", samples([77 + i for i in range(32)], rss), memory=False)  # counts are judged regardless
    assert [g.split(":")[1].split()[0] for g in fds.grew] == ["fds"]
