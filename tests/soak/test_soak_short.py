"""The soak, short: 30 park/resume cycles by clicks on the real server, then 15 s of log
flood (tests/soak/soak_window.py has the long run and the details). In 30 cycles RSS is
noise, so only what must not grow at all is asserted: open descriptors, threads, asyncio
tasks, QTimers and the window's Qt objects."""

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
            return await soak(w, real, flood, cycles=30, flood_seconds=15, flood_rate=5000, log_warmup=False)
        finally:
            await w.shutdown()

    report = run(qloop, go(), 240)
    print(report.text())
    assert not report.rss_judged
    assert [p.phase for p in report.phases] == ["cycles", "flood"]
    assert report.failures == [], report.text()
    flood_phase = report.phases[1]
    assert int(flood_phase.extra["lines delivered"].split()[0].replace(",", "")) > 15 * 5000 * 0.8
