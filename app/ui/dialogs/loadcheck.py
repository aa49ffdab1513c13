"""The load check in the window: settings, progress, a per-stream table and a gap chart.

* :class:`GapChart`: per stream, the largest inter-token gap in each time slice of the
  run (log scale), the stall threshold as a dashed line, stalls as red dots. QPainter,
  no QtCharts (the Essentials wheel does not ship it).
* :class:`LoadCheckDialog`: spin boxes (streams, seconds, stall threshold), Start and
  Cancel, a progress bar, the table and the chart. The run is an asyncio task on the
  qasync loop (:func:`app.tools.loadcheck.run_load_check`): the window never blocks.
"""

from __future__ import annotations

import asyncio
import logging
import math

from PySide6.QtCore import QPointF, QRectF, Qt, Signal
from PySide6.QtGui import QFont, QFontMetrics, QPainter, QPen
from PySide6.QtWidgets import (QDialog, QDoubleSpinBox, QFormLayout, QHBoxLayout, QHeaderView, QLabel,
                               QProgressBar, QPushButton, QSizePolicy, QSpinBox, QTableWidget, QTableWidgetItem,
                               QVBoxLayout)

from app.core.background import track
from app.tools.loadcheck import (MAX_SECONDS, MAX_STREAMS, MIN_SECONDS, LoadCheckError, LoadReport, check_loopback,
                                fmt_ms, gap_series, run_load_check)
from app.ui.widgets import theme
from app.ui.dialogs.check_charts import Chart
from app.ui.widgets.theme import colour, stream_colour

log = logging.getLogger(__name__)

COLUMNS = ["stream", "requests", "tokens", "gap p50 ms", "gap p99 ms", "gap max ms", "stalls"]


class GapChart(Chart):
    """Largest inter-token gap per time slice, one line per stream, log scale."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self._report: LoadReport | None = None
        self.setMinimumSize(480, 200)
        self.setSizePolicy(QSizePolicy.Expanding, QSizePolicy.Expanding)

    def set_report(self, report: LoadReport | None) -> None:
        self._report = report
        self.update()

    def series(self, buckets: int = 200) -> list[list[tuple[float, float]]]:
        r = self._report
        if r is None:
            return []
        span = max(r.elapsed_s, 1e-3)
        return [gap_series(s, span, buckets) for s in r.per_stream]

    def paint(self, p: QPainter, area: QRectF) -> None:
        p.fillRect(area, colour("background"))
        r = self._report
        font = QFont(self.font())
        p.setFont(font)
        fm = QFontMetrics(font)
        left, right = area.left() + 64, area.right() - 12
        top, bottom = area.top() + 26, area.bottom() - 24
        buckets = max(10, int((right - left) / 3))
        all_series = self.series(buckets)
        values = [g for s in all_series for _, g in s if g > 0]
        if r is None or not values:
            p.setPen(colour("faint"))
            p.drawText(area, Qt.AlignCenter, "no load check results yet" if r is None else "no gaps measured")
            return
        lo = 10 ** math.floor(math.log10(max(min(values), 0.1)))
        hi = 10 ** math.ceil(math.log10(max(max(values), r.stall_ms) * 1.01))
        if hi <= lo:
            hi = lo * 10
        span = max(r.elapsed_s, 1e-3)

        def x_of(t: float) -> float:
            return left + (right - left) * min(max(t / span, 0.0), 1.0)

        def y_of(v: float) -> float:
            v = min(max(v, lo), hi)
            return bottom - (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)) * (bottom - top)

        p.setPen(colour("text"))
        p.drawText(QRectF(area.left() + 8, area.top() + 2, area.width() - 16, 20), Qt.AlignLeft | Qt.AlignVCenter,
                   "largest gap between two tokens (ms, log) over the run; red dots: stalls")
        self.draw_log_grid(p, area, left, right, lo, hi, y_of, 60, _short_ms)
        # time axis
        p.setPen(colour("muted"))
        for i in range(5):
            t = span * i / 4
            x = x_of(t)
            label = f"{t:.0f} s" if span >= 8 else f"{t:.1f} s"
            w = fm.horizontalAdvance(label)
            p.drawText(QPointF(min(max(x - w / 2, left - 20), right - w), bottom + 16), label)
        # the stall threshold
        pen = QPen(colour("crit"), 1, Qt.DashLine)
        p.setPen(pen)
        ys = y_of(r.stall_ms)
        p.drawLine(QPointF(left, ys), QPointF(right, ys))
        # one line per stream
        for i, s in enumerate(all_series):
            p.setPen(QPen(stream_colour(i), 1.2))
            prev = None
            for t, g in s:
                cur = QPointF(x_of(t), y_of(g))
                if prev is not None:
                    p.drawLine(prev, cur)
                prev = cur
        # stalls
        p.setPen(QPen(colour("background"), 1))
        p.setBrush(colour("crit"))
        for stats in r.per_stream:
            for t, g in stats.stalls:
                p.drawEllipse(QPointF(x_of(t), y_of(g)), 4, 4)
        p.setBrush(Qt.NoBrush)


def _short_ms(v: float) -> str:
    return f"{v / 1000:g} s" if v >= 1000 else f"{v:g} ms"


def _cell(text: str, align=Qt.AlignRight | Qt.AlignVCenter) -> QTableWidgetItem:
    item = QTableWidgetItem(text)
    item.setTextAlignment(align)
    item.setFlags(item.flags() & ~Qt.ItemIsEditable)
    return item


class LoadCheckDialog(QDialog):
    """N streams for T seconds against ``url``; the result as a table and a chart.

    ``sig_finished(report)`` when a run ends (also a cancelled one, with what it
    measured); ``sig_failed(message)`` when it could not run."""

    sig_finished = Signal(object)  # LoadReport
    sig_failed = Signal(str)

    def __init__(self, url: str, api_key: str | None = None, parent=None, *, streams: int = 4,
                 seconds: float = 10, stall_ms: float = 500, client=None):
        super().__init__(parent)
        self.url = url
        self.api_key = api_key
        self.client = client  # the server's shared client (app.servers.service), else one of its own
        self.report: LoadReport | None = None
        self._task: asyncio.Task | None = None
        self._cancel: asyncio.Event | None = None
        self.setWindowTitle(f"Load check: {url}")
        self.resize(820, 640)
        lay = QVBoxLayout(self)

        intro = QLabel("Parallel streaming requests, back to back, for the time set; per stream the gap "
                       "between two tokens and every stall above the threshold. Run it before and after a "
                       "remedy (for example without --cache-idle-slots).")
        intro.setWordWrap(True)
        theme.tint(intro, "color: {muted}")
        lay.addWidget(intro)

        form = QFormLayout()
        self.streams_spin = QSpinBox()
        self.streams_spin.setRange(1, MAX_STREAMS)
        self.streams_spin.setValue(streams)
        self.seconds_spin = QSpinBox()
        self.seconds_spin.setRange(int(MIN_SECONDS), int(MAX_SECONDS))
        self.seconds_spin.setSuffix(" s")
        self.seconds_spin.setValue(int(seconds))
        self.stall_spin = QDoubleSpinBox()
        self.stall_spin.setRange(1, 600000)
        self.stall_spin.setDecimals(0)
        self.stall_spin.setSuffix(" ms")
        self.stall_spin.setValue(stall_ms)
        form.addRow("Streams", self.streams_spin)
        form.addRow("Duration", self.seconds_spin)
        form.addRow("Stall above", self.stall_spin)
        lay.addLayout(form)

        row = QHBoxLayout()
        self.start_button = QPushButton("Start")
        self.start_button.clicked.connect(self.start)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setEnabled(False)
        self.cancel_button.clicked.connect(self.cancel)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setValue(0)
        self.progress.setFormat("%p%")
        row.addWidget(self.start_button)
        row.addWidget(self.cancel_button)
        row.addWidget(self.progress, 1)
        lay.addLayout(row)

        self.status_label = QLabel("")
        self.status_label.setWordWrap(True)
        lay.addWidget(self.status_label)

        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.verticalHeader().setVisible(False)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeToContents)
        self.table.horizontalHeader().setStretchLastSection(True)
        lay.addWidget(self.table, 1)

        self.chart = GapChart()
        lay.addWidget(self.chart, 2)

        close_row = QHBoxLayout()
        close_row.addStretch(1)
        self.close_button = QPushButton("Close")
        self.close_button.clicked.connect(self.reject)
        close_row.addWidget(self.close_button)
        lay.addLayout(close_row)

    # -- state
    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def _set_running(self, running: bool) -> None:
        self.start_button.setEnabled(not running)
        self.cancel_button.setEnabled(running)
        for w in (self.streams_spin, self.seconds_spin, self.stall_spin):
            w.setEnabled(not running)

    # -- actions
    def start(self) -> asyncio.Task | None:
        """Start a run as a task on the running (qasync) loop; None if one is running."""
        if self.running:
            return None
        try:
            check_loopback(self.url)
        except LoadCheckError as e:
            self._show_error(str(e))
            self.sig_failed.emit(str(e))
            return None
        self._cancel = asyncio.Event()
        self._set_running(True)
        self.progress.setValue(0)
        theme.tint(self.status_label, "")
        self.status_label.setText(f"running {self.streams_spin.value()} streams for {self.seconds_spin.value()} s…")
        self._task = track(self._run(self.streams_spin.value(), float(self.seconds_spin.value()),
                                                     float(self.stall_spin.value()), self._cancel), "the load check")
        return self._task

    def cancel(self) -> None:
        if self._cancel is not None:
            self._cancel.set()
            self.status_label.setText("cancelling…")

    async def aclose(self) -> None:
        """Cancel a run and wait until it has stopped."""
        self.cancel()
        task = self._task
        if task is not None and not task.done():
            await asyncio.gather(task, return_exceptions=True)

    def reject(self) -> None:
        self.cancel()  # the run stops by itself, its connections are closed
        super().reject()

    async def _run(self, streams: int, seconds: float, stall_ms: float, cancel: asyncio.Event) -> None:
        from app.servers.service import client_for  # the window passes its server's own client

        def on_progress(fraction: float, tokens: int) -> None:
            self.progress.setValue(int(fraction * 1000))
            self.progress.setFormat(f"%p% · {tokens:,} tokens")

        try:
            if self.client is not None:
                report = await run_load_check(self.client, streams=streams, seconds=seconds, stall_ms=stall_ms,
                                              on_progress=on_progress, cancel=cancel)
            else:
                async with client_for(self.url, api_key=self.api_key) as client:
                    report = await run_load_check(client, streams=streams, seconds=seconds, stall_ms=stall_ms,
                                                  on_progress=on_progress, cancel=cancel)
        except LoadCheckError as e:
            self._show_error(str(e))
            self.sig_failed.emit(str(e))
            return
        except asyncio.CancelledError:
            self.status_label.setText("cancelled")
            raise
        except Exception as e:  # report: a clear message in the dialog; the traceback goes to the log, not stderr
            log.exception("load check of %s (%d streams, %g s) failed", self.url, streams, seconds)
            self._show_error(f"the load check failed: {e}")
            self.sig_failed.emit(str(e))
            return
        finally:
            self._set_running(False)
        self.show_report(report)
        self.sig_finished.emit(report)

    # -- results
    def _show_error(self, message: str) -> None:
        theme.tint(self.status_label, "color: {crit}")
        self.status_label.setText(message)

    def show_report(self, report: LoadReport) -> None:
        self.report = report
        self.table.setRowCount(len(report.per_stream))
        for i, s in enumerate(report.per_stream):
            vals = [str(s.stream), f"{s.requests:,}", f"{s.tokens:,}", fmt_ms(s.gap_p50_ms), fmt_ms(s.gap_p99_ms),
                    fmt_ms(s.gap_max_ms), str(len(s.stalls))]
            for j, v in enumerate(vals):
                item = _cell(v)
                if j == 6 and s.stalls:
                    item.setForeground(colour("crit"))
                    item.setToolTip("\n".join(f"at {t:.2f} s: {g:,.0f} ms" for t, g in s.stalls[:30]))
                if j == 0:
                    item.setForeground(stream_colour(i))
                self.table.setItem(i, j, item)
        self.chart.set_report(report)
        self.progress.setValue(1000 if not report.cancelled else self.progress.value())
        text = (f"{report.tokens:,} tokens in {report.elapsed_s:.1f} s ({report.tokens_per_s:,.1f} tokens/s) · "
                f"{report.requests:,} requests · gap p50 {fmt_ms(report.gap_p50_ms)} ms · "
                f"p99 {fmt_ms(report.gap_p99_ms)} ms · max {fmt_ms(report.gap_max_ms)} ms · "
                f"{report.n_stalls} stall(s) above {report.stall_ms:g} ms")
        if report.cancelled:
            text = "cancelled · " + text
        if report.n_errors:
            text += f" · {report.n_errors} failed request(s): {report.errors[0]}"
        theme.tint(self.status_label, "color: {crit}" if report.n_stalls or report.n_errors else "")
        self.status_label.setText(text)
