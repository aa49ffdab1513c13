"""Verdict rules and log replays of the real captures."""

from __future__ import annotations

import pytest

from app.core.checkpoints import CheckpointFigures
from app.core.verdict import MEANING, SEVERITY, WASTEFUL, Reuse, VerdictKind, judge, tolerance, worst
from app.sessions.watch import ResumeWatcher, judge_from_completion
from app.server.logparse import parse_line
from app.server.sidecar import SidecarStatus
from tests.conftest import B11434, SIDECAR_BUILD

# -- rules ---------------------------------------------------------------------


def test_hit_small_rollback_with_checkpoint():
    v = judge(Reuse(2892, 2880, 5, prompt_total=2885, restored=True, sidecar_status="present", sidecar_loaded_count=4, checkpoint_restored=CheckpointFigures(n_past=2880, pos_max=2880), prompt_ms=78.4))
    assert v.kind is VerdictKind.HIT
    assert v.rollback_tokens == 12 and v.checkpoints_loaded == 4
    assert "5 of 2,885" in v.reason and "2,880 of 2,892" in v.reason
    assert "4 context checkpoints loaded from the sidecar" in v.reason
    assert v.figures["tolerance_tokens"] == 57  # 2 % of 2,892
    assert v.ok


def test_hit_tolerance_is_32_for_short_sessions():
    assert judge(Reuse(300, 270, 40, prompt_total=310, restored=True, sidecar_status="not needed")).kind is VerdictKind.HIT
    assert judge(Reuse(300, 260, 50, prompt_total=310, restored=True, sidecar_status="not needed")).kind is VerdictKind.PARTIAL


def test_partial_says_how_far_back():
    v = judge(Reuse(10000, 6000, 4010, prompt_total=10010, restored=True, sidecar_status="present", sidecar_loaded_count=3))
    assert v.kind is VerdictKind.PARTIAL
    assert v.rollback_tokens == 4000
    assert "4,000 tokens before the tip" in v.reason


def test_unknown_without_query():
    assert judge(Reuse(2892, None, None, prompt_total=None, restored=True, sidecar_status="present")).kind is VerdictKind.UNKNOWN
    assert judge(Reuse(0, 0, 10, prompt_total=10, restored=True, sidecar_status="missing")).kind is VerdictKind.UNKNOWN


@pytest.mark.parametrize("kwargs, needle", [
    (dict(sidecar_status="present", ctx_checkpoints=0, build_persists=True), "--ctx-checkpoints 0"),
    (dict(sidecar_status="missing", build_persists=False), "this build does not persist context checkpoints (no sidecar)"),
    (dict(sidecar_status=SidecarStatus.MISSING, build_persists=None), "no checkpoint sidecar next to the state file"),
    (dict(sidecar_status="invalid", build_persists=True), "sidecar is invalid"),
    (dict(sidecar_status="present", sidecar_loaded_count=0, build_persists=False),
     "this build does not persist context checkpoints"),
    (dict(sidecar_status="present", sidecar_loaded_count=4, build_persists=True), "none of the 4 loaded checkpoints"),
    (dict(sidecar_status="not needed", common_prefix=12), "diverged from the saved tokens at token 12"),
])
def test_discarded_reasons_in_order(kwargs, needle):
    v = judge(Reuse(2892, 0, 2885, prompt_total=2885, restored=True, full_reprocess_logged=True, prompt_ms=11052.8, **kwargs))
    assert v.kind is VerdictKind.DISCARDED
    assert needle in v.reason, v.reason
    assert v.reason.startswith("re-processed 2,885 of 2,885 prompt tokens in 11,053 ms:")


def test_reason_precedence_ctx_checkpoints_beats_everything():
    v = judge(Reuse(2892, 0, 2885, prompt_total=2885, restored=True, sidecar_status="present", ctx_checkpoints=0, build_persists=False, sidecar_loaded_count=0, common_prefix=3))
    assert "--ctx-checkpoints 0" in v.reason


def test_example_sentence():
    v = judge(Reuse(2885, 0, 2885, prompt_total=2885, restored=True, sidecar_status="missing", build_persists=False))
    assert v.reason == ("re-processed 2,885 of 2,885 prompt tokens: this build does not persist context "
                        "checkpoints (no sidecar), so the restored cache was discarded")


def test_nearly_whole_prompt_is_discarded():
    # 1 % or less of the restored tokens reused: a full re-prefill in practice
    assert judge(Reuse(2892, 20, 2880, prompt_total=2900, restored=True, sidecar_status="missing")).kind is VerdictKind.DISCARDED


def test_worst():
    a = judge(Reuse(2892, 2880, 5, prompt_total=2885, restored=True, sidecar_status="present"))
    b = judge(Reuse(2892, 0, 2885, prompt_total=2885, restored=True, sidecar_status="present"))
    assert worst([a, b]) is b and worst([a]) is a and worst([]) is None


def test_judge_from_completion_uses_timings_and_log():
    resp = {"tokens_evaluated": 2898, "timings": {"cache_n": 2880, "prompt_n": 18, "prompt_ms": 169.7}}
    lines = [parse_line("0.03.345.037 I slot process_sing: id  0 | task -1 | restored 4 context checkpoints from sidecar")]
    v = judge_from_completion(2892, resp, sidecar_status="present", log_events=lines)
    assert v.kind is VerdictKind.HIT and v.checkpoints_loaded == 4 and v.prompt_ms == 169.7


# -- log replays ----------------------------------------------------------------


def replay(path, watcher):
    got = []
    watcher.on_verdict(lambda slot, name, v: got.append((slot, name, v)))
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            watcher.feed(line)
    return got


def test_replay_stock_restart_reprefill():
    w = ResumeWatcher()
    # the capture has no restore line: register before feeding
    w.expect(0, 2892, "long", "missing", build_persists=False)
    got = replay(B11434 / "02-restart-restore-reprefill.log", w)
    assert len(got) == 1
    slot, name, v = got[0]
    assert (slot, name) == (0, "long")
    assert v.kind is VerdictKind.DISCARDED
    assert v.prompt_n == 2885 and v.cache_n == 0
    assert v.prompt_ms == pytest.approx(11052.83)
    assert v.figures["full_reprocess_logged"] is True
    assert "this build does not persist context checkpoints" in v.reason
    assert not w.pending()


def test_replay_sidecar_hit():
    w = ResumeWatcher()
    w.expect(0, 2892, "long", "present", build_persists=True)
    got = replay(SIDECAR_BUILD / "02-restart-restore-sidecar-hit.log", w)
    v = got[0][2]
    assert v.kind is VerdictKind.HIT
    assert (v.prompt_n, v.cache_n, v.checkpoints_loaded) == (5, 2880, 4)
    assert v.rollback_tokens == 12
    assert v.figures["checkpoint_n_past"] == 2880


def test_replay_sidecar_line_before_registration():
    """The sidecar line is logged during the restore request, before the app registers."""
    w = ResumeWatcher()
    lines = (SIDECAR_BUILD / "02-restart-restore-sidecar-hit.log").read_text(errors="replace").splitlines()
    i = next(i for i, line in enumerate(lines) if "from sidecar" in line)
    w.feed_lines(lines[: i + 1])
    w.expect(0, 2892, "long", "present")
    got = []
    w.on_verdict(lambda *a: got.append(a))
    w.feed_lines(lines[i + 1:])
    assert got[0][2].kind is VerdictKind.HIT and got[0][2].checkpoints_loaded == 4


def test_replay_sidecar_exact_tokens():
    w = ResumeWatcher()
    w.expect(0, 2892, "long", "present")
    v = replay(SIDECAR_BUILD / "03-restart-restore-sidecar-exact-tokens.log", w)[0][2]
    assert v.kind is VerdictKind.HIT and (v.prompt_n, v.cache_n) == (18, 2880)


def test_replay_sidecar_hidden():
    w = ResumeWatcher()
    w.expect(0, 2892, "long", "missing", build_persists=True)
    v = replay(SIDECAR_BUILD / "04-restart-restore-sidecar-hidden.log", w)[0][2]
    assert v.kind is VerdictKind.DISCARDED
    assert v.prompt_n == 2885 and v.cache_n == 0
    assert "no checkpoint sidecar" in v.reason


def test_other_slot_is_ignored():
    w = ResumeWatcher()
    w.expect(1, 2892, "other", "missing")
    assert replay(B11434 / "02-restart-restore-reprefill.log", w) == []
    assert 1 in w.pending()


def test_info_level_log_estimates():
    """Without trace lines only prompt eval and release appear."""
    w = ResumeWatcher()
    w.expect(0, 2892, "s", "missing", build_persists=False)
    v = w.feed("0.14.937.219 I slot print_timing: id  0 | task 2 | prompt eval time =   11052.83 ms /  2885 tokens "
               "(    3.83 ms per token,   261.02 tokens per second)")
    assert v is not None and v.kind is VerdictKind.DISCARDED and v.figures["estimated"]


# -- the one judge, for a proxied request and a resume alike -------------------

V = VerdictKind


def test_new_when_told_or_nothing_to_reuse_without_a_restore():
    assert judge(Reuse(1000, 0, 500, new=True)).kind is V.NEW
    assert judge(Reuse(1000, 900, 100, new=True)).kind is V.NEW
    assert judge(Reuse(0, 0, 500)).kind is V.NEW
    assert judge(Reuse(0, None, None)).kind is V.NEW
    assert judge(Reuse(0, 0, 500, restored=True)).kind is V.UNKNOWN  # a restore of nothing: no resume to judge
    assert judge(Reuse(1000, None, None)).kind is V.UNKNOWN  # no figures


@pytest.mark.parametrize("cache_n, without_restore, after_restore", [
    (1000, V.HIT, V.HIT), (1200, V.HIT, V.HIT),  # all of it (a longer reuse than expected is fine)
    (968, V.HIT, V.HIT),  # reusable - tolerance (32 of 1,000): the re-tokenised tail and the one token
    (967, V.PARTIAL, V.PARTIAL),  # one more short
    (500, V.PARTIAL, V.PARTIAL),
    (33, V.PARTIAL, V.PARTIAL),  # tolerance + 1: reused something
    (32, V.MISS, V.DISCARDED),  # the tolerance: nothing useful
    (0, V.MISS, V.DISCARDED),
])
def test_one_tolerance_at_both_ends_one_word_per_case(cache_n, without_restore, after_restore):
    assert judge(Reuse(1000, cache_n, 10)).kind is without_restore
    assert judge(Reuse(1000, cache_n, 10, restored=True)).kind is after_restore


def test_the_tolerance_grows_with_what_could_be_reused():
    assert tolerance(100) == 32 and tolerance(1600) == 32 and tolerance(10_000) == 200
    assert judge(Reuse(10_000, 9_800, 10)).kind is V.HIT
    assert judge(Reuse(10_000, 9_799, 10)).kind is V.PARTIAL
    assert judge(Reuse(10_000, 200, 10)).kind is V.MISS


def test_a_small_reuse_lost_is_no_miss():
    assert judge(Reuse(32, 0, 40)).kind is V.HIT  # all of it is within the tolerance
    assert judge(Reuse(40, 0, 40)).kind is V.MISS
    assert judge(Reuse(40, 8, 40)).kind is V.HIT  # 40 - 32


@pytest.mark.parametrize("prompt_n, verdict", [
    (0, V.HIT), (32, V.HIT),  # at most the tolerance processed: the rest was reused
    (33, V.PARTIAL), (967, V.PARTIAL),
    (968, V.MISS), (5000, V.MISS),  # processed (almost) all it could have reused
])
def test_without_cache_n_it_is_estimated(prompt_n, verdict):
    v = judge(Reuse(1000, None, prompt_n))
    assert v.kind is verdict and v.figures["estimated"]


def test_a_logged_full_reprocess_is_no_partial():
    assert judge(Reuse(1000, 500, 500, restored=True)).kind is V.PARTIAL
    assert judge(Reuse(1000, 500, 500, restored=True, full_reprocess_logged=True)).kind is V.DISCARDED
    assert judge(Reuse(1000, 990, 10, restored=True, full_reprocess_logged=True)).kind is V.HIT


def test_the_evidence_is_frozen_and_every_word_has_a_meaning():
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        Reuse(1, 1, 1).cache_n = 2  # type: ignore[misc]
    assert set(MEANING) == set(VerdictKind) and set(SEVERITY) == set(VerdictKind)
    assert WASTEFUL == {V.PARTIAL, V.MISS, V.DISCARDED}
