"""The runtime detectors on the real captures and on the log lines quoted in the seeds."""

from __future__ import annotations

from app.core.findings import Severity
from app.tools.cache_health import CacheHealth, elapsed_seconds
from app.server.outcome import Cause, Outcome
from tests.conftest import B11434, SIDECAR_BUILD

# Seed 004 (llama.cpp #30252), as quoted: two idle-slot saves and an LRU prompt-cache update.
SEED_004 = """\
20.410333 I slot process_sing: id  2 | task -1 | saving idle slot to prompt cache
20.410627 I srv   prompt_save:  - saving prompt with length 357, total state size = 26.675 MiB (draft: 0.000 MiB)
21.338846 D slot process_sing: id  2 | task -1 | __TEST_TAG_CACHE_IDLE_SLOT__
21.339045 I slot process_sing: id  3 | task -1 | saving idle slot to prompt cache
""".splitlines()
SEED_004_LRU = "0.30.721.686 I srv  get_availabl: prompt cache update took 569.17 ms"
# Seed 002 (llama.cpp #26128): the last lines before the abort.
SEED_002 = [
    "0.57.834.622 I slot get_availabl: id 30 | task -1 | selected slot by LRU, t_last = -1",
    "0.57.834.674 I slot launch_slot_: id 30 | task 189 | processing task, is_child = 0",
    'D:/a/llama.cpp/llama.cpp/ggml/src/ggml-backend.cpp:359: GGML_ASSERT(tensor->data != NULL && '
    '"tensor not allocated") failed',
]


def test_log_clock_formats():
    assert elapsed_seconds("0.13.116.678") == 13.116678
    assert elapsed_seconds("1.02.000.500") == 62.0005
    assert elapsed_seconds("20.410333") == 20.410333
    assert elapsed_seconds("x") is None


def test_seed_004_idle_slot_saves_are_timed_and_flagged_with_the_remedy():
    h = CacheHealth()
    h.feed_lines(SEED_004 + [SEED_004_LRU])
    ms = [round(s.ms) for s in h.figures.idle_saves]
    assert ms == [929, 569]  # from save line to the line after prompt_save; the server's own figure
    assert [s.slot for s in h.figures.idle_saves] == [2, None]
    stalls = [f for f in h.findings if f.rule_id == "idle-slot-save-stall"]
    assert len(stalls) == 2 and stalls[0].slot == 2 and "929 ms" in stalls[0].message
    assert [r.changes for r in stalls[0].remedies] == [{"cache_idle_slots": False}, {"kv_unified": False}]
    assert "#30252" in stalls[0].source
    assert dict(h.figures.histogram())[1000] == 2


def test_seed_002_crash_maps_to_the_known_issue_and_its_remedies():
    h = CacheHealth()
    h.feed_lines(SEED_002)
    assert h.figures.slot_selection["LRU"] == 1
    outcome = Outcome(None, 6, Cause.ASSERT, 'GGML_ASSERT(tensor->data != NULL && "tensor not allocated") failed',
                      tuple(SEED_002))
    f = h.crashed(outcome)
    assert f.rule_id == "rpc-prompt-cache-assert" and f.severity is Severity.ERROR
    assert [r.changes for r in f.remedies] == [{"cache_ram": 0}, {"parallel": 1}]
    assert "--no-cache-prompt does not help" in f.message and "#26128" in f.source
    other = h.crashed(Outcome(None, 9, Cause.KILLED, "", ()))
    assert other.rule_id == "server-crashed" and other.remedies == ()


def test_stock_capture_restore_then_forced_reprocessing():
    h = CacheHealth()
    h.feed_lines((B11434 / "01-start-fill-save.log").read_text().splitlines())
    assert h.figures.checkpoints_created == 4
    assert h.figures.slot_selection["id"] == 2
    assert len(h.figures.idle_saves) == 2 and h.findings == []  # empty slots: nothing to save, no stall
    h.feed_lines((B11434 / "02-restart-restore-reprefill.log").read_text().splitlines())
    assert h.figures.full_reprocess[0] == 1
    assert [f.rule_id for f in h.findings] == ["forced-full-reprocess"] and h.findings[0].slot == 0


def test_sidecar_capture_loads_and_rolls_back_to_a_checkpoint():
    h = CacheHealth()
    h.feed_lines((SIDECAR_BUILD / "02-restart-restore-sidecar-hit.log").read_text().splitlines())
    assert h.figures.sidecar_checkpoints_loaded == 4 and h.figures.checkpoints_restored == 1
    assert h.figures.full_reprocess == {} and h.findings == []


def test_idle_save_figures_stay_bounded_on_a_busy_server():
    """A day of a busy multi-slot server logs an idle-slot save per request switch: the count,
    the histogram and the worst cover every one, but only the newest are kept one by one
    (the soak found the list growing 0.3 MB a minute under a log flood)."""
    from app.tools.cache_health import IDLE_SAVES_KEPT

    h = CacheHealth()
    n = IDLE_SAVES_KEPT * 3
    for i in range(n):
        h._idle_save(i % 4, float(i % 300))
    fig = h.figures
    assert fig.idle_save_count == n and len(fig.idle_saves) == IDLE_SAVES_KEPT
    assert fig.idle_saves[-1].ms == float((n - 1) % 300) and fig.worst_idle_save_ms == 299.0
    assert sum(c for _, c in fig.histogram()) == n
    assert dict(fig.histogram())[10] == sum(1 for i in range(n) if i % 300 <= 10)
