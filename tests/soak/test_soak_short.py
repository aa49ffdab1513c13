"""The soak, short: 30 park/resume cycles by clicks on the real server, then a log flood of
at least 20 s and 80,000 lines, its first 20,000 filling the bounded log stores (not judged)
(tests/soak/soak_window.py has the long run and the details).
Growth is a trend over every sample (a least-squares slope per cycle, per second of flood) of
open descriptors, threads, asyncio tasks, QTimers and the window's Qt objects; the log's stores
must stay at their bounds. RSS is reported, and judged only by the long run (its stores are
filled first; in a short flood its trend is the machine's speed: soak_window.py's docstring)."""

from __future__ import annotations

import pytest

from tests.conftest import run
from tests.soak.soak_window import make_window, profiles, soak

pytestmark = [pytest.mark.real_server, pytest.mark.gui]


def test_thirty_cycles_and_a_flood_leak_nothing(qtbot, qloop, tmp_path, real_binary, real_model):
    real, flood = profiles(tmp_path, real_binary, real_model)
    w = make_window()
    qtbot.addWidget(w)

    async def go():
        try:
            return await soak(w, real, flood, cycles=30, flood_seconds=20, flood_rate=5000, log_warmup=False,
                              flood_lines=80_000)
        finally:
            await w.shutdown()

    report = run(qloop, go(), 240)
    print(report.text())
    assert [p.phase for p in report.phases] == ["cycles", "flood"]
    assert report.failures == [], report.text()
    flood_phase = report.phases[1]
    assert int(flood_phase.extra["lines delivered"].split()[0].replace(",", "")) >= 80_000  # a count waited for
    assert set(flood_phase.slope) == {"rss_mb", "py_blocks", "fds", "threads", "tasks", "timers_active", "timers",
                                      "qobjects"}
    assert "passed its bound" not in report.text() and "lines kept (bound 20,000)" in flood_phase.extra["bounded"]
