"""The check results' charts, drawn with QPainter (no QtCharts: the Essentials wheel
does not ship it, and two charts do not need it).

* :class:`ABChart`: one horizontal bar per run (probe or A/B arm), restore time
  then first-query prompt time stacked, so the bar length is the end-to-end
  resume cost; ratio labels underneath.
* :class:`HistoryChart`: restore ms and first-query ms of a session over time,
  points coloured by verdict.
* :class:`Chart`: their base, a widget drawn by ``paint(painter, area)`` (also
  used to render PNG exports, and by the load check's chart).
"""

from __future__ import annotations

import math
import time

from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QFont, QFontMetrics, QPainter, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget

from app.sessions.check_export import ratios
from app.sessions.check_report import ABReport, CheckReport, ProbeRow
from app.ui.widgets import theme
from app.ui.widgets.theme import colour


def verdict_color(kind) -> QColor:
    return theme.verdict_colour(kind)


def fmt_ms(x: float | None) -> str:
    if x is None:
        return "–"
    if x >= 10000:
        return f"{x / 1000:,.1f} s"
    return f"{x:,.1f} ms" if x < 100 else f"{x:,.0f} ms"


def fmt_ratio(x: float | None) -> str:
    return "–" if x is None else f"{x:,.1f}×"


def _rows_of(report) -> list[ProbeRow]:
    if report is None:
        return []
    if isinstance(report, ABReport):
        return list(report.rows)
    return list(report.probes) + (list(report.ab.rows) if report.ab else [])


def _ab_of(report) -> ABReport | None:
    if isinstance(report, ABReport):
        return report
    return report.ab if isinstance(report, CheckReport) else None


# --------------------------------------------------------------------------- A/B chart

class Chart(QWidget):
    """A widget drawn by ``paint(painter, area)`` (also used to render PNG exports)."""

    def paintEvent(self, _event) -> None:
        p = QPainter(self)
        try:
            p.setRenderHint(QPainter.Antialiasing)
            self.paint(p, QRectF(self.rect()))
        finally:
            p.end()

    def paint(self, p: QPainter, area: QRectF) -> None:
        raise NotImplementedError

    @staticmethod
    def draw_log_grid(p: QPainter, area: QRectF, left: float, right: float, lo: float, hi: float, y_of,
                      label_width: float, label) -> None:
        """A horizontal line and a left-hand label per decade from ``lo`` to ``hi``."""
        decade = lo
        while decade <= hi * 1.0001:
            y = y_of(decade)
            p.setPen(QPen(colour("grid"), 1))
            p.drawLine(QPointF(left, y), QPointF(right, y))
            p.setPen(colour("muted"))
            p.drawText(QRectF(area.left(), y - 8, label_width, 16), Qt.AlignRight | Qt.AlignVCenter, label(decade))
            decade *= 10


class ABChart(Chart):
    """Restore + first-query prompt time per run, as stacked horizontal bars."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self._report = None
        self.show_ratios = True  # off where the ratios are shown next to the chart
        self.setMinimumSize(480, 200)
        self.setSizePolicy(QSizePolicy.Expanding, QSizePolicy.Preferred)

    def set_report(self, report) -> None:
        self._report = report
        rows = len(_rows_of(report))
        self.setMinimumHeight(80 + 40 * max(1, rows))
        self.update()

    def ratio_text(self) -> str:
        ab = _ab_of(self._report)
        if ab is None:
            return ""
        r = ratios(ab)
        parts = [f"delta prefill {fmt_ratio(r['delta_prefill_speedup'])}",
                 f"end-to-end resume {fmt_ratio(r['end_to_end_speedup'])}"]
        if r["baseline_speedup"] is not None:
            parts.append(f"vs full prefill {fmt_ratio(r['baseline_speedup'])}")
        text = f"sidecar speed-up ({ab.protocol}): " + " · ".join(parts)
        if ab.confounded:
            text += f"  — confounded: {', '.join(r.name for r in ab.confounded)}; do not trust this ratio"
        if ab.note and not ab.had_sidecar:
            text += f"  ({ab.note})"
        return text

    def paint(self, p: QPainter, area: QRectF) -> None:
        p.fillRect(area, colour("background"))
        rows = _rows_of(self._report)
        font = QFont(self.font())
        font.setPointSizeF(max(8.0, font.pointSizeF()))
        p.setFont(font)
        fm = QFontMetrics(font)
        if not rows:
            p.setPen(colour("faint"))
            p.drawText(area, Qt.AlignCenter, "no check results yet")
            return
        label_w = max(fm.horizontalAdvance(r.name) for r in rows) + 16
        value_w = fm.horizontalAdvance("restore 99,999 ms + prompt 99.9 s") + 12
        top, bottom = area.top() + 28, area.bottom() - 34
        left = area.left() + label_w
        right = max(left + 60, area.right() - value_w)
        vmax = max(((r.restore_ms or 0) + (r.prompt_ms or 0)) for r in rows) or 1.0
        # title and legend
        p.setPen(colour("text"))
        p.drawText(QRectF(area.left() + 8, area.top() + 4, area.width() - 16, 20), Qt.AlignLeft | Qt.AlignVCenter,
                   "restore + first-query prompt time")
        lx = area.right() - 190
        for color, name in ((colour("restore"), "restore"), (colour("prompt"), "prompt")):
            p.fillRect(QRectF(lx, area.top() + 9, 10, 10), color)
            p.setPen(colour("text"))
            p.drawText(QPointF(lx + 14, area.top() + 18), name)
            lx += 90
        # grid
        p.setPen(QPen(colour("grid"), 1))
        for i in range(5):
            x = left + (right - left) * i / 4
            p.drawLine(QPointF(x, top), QPointF(x, bottom))
        slot_h = (bottom - top) / len(rows)
        bar_h = min(24.0, slot_h * 0.6)
        for i, r in enumerate(rows):
            cy = top + slot_h * (i + 0.5)
            y = cy - bar_h / 2
            p.setPen(colour("text"))
            p.drawText(QRectF(area.left() + 4, y, label_w - 12, bar_h), Qt.AlignRight | Qt.AlignVCenter, r.name)
            scale = (right - left) / vmax
            rw = max(0.0, (r.restore_ms or 0) * scale)
            pw = max(0.0, (r.prompt_ms or 0) * scale)
            if r.restore_ms:
                p.fillRect(QRectF(left, y, max(1.5, rw), bar_h), colour("restore"))
            if r.prompt_ms is not None:
                p.fillRect(QRectF(left + rw, y, max(1.5, pw), bar_h), colour("prompt"))
            # verdict marker
            p.fillRect(QRectF(area.left() + 2, y, 4, bar_h), verdict_color(r.verdict.kind))
            p.setPen(colour("text"))
            label = (f"restore {fmt_ms(r.restore_ms)} + prompt {fmt_ms(r.prompt_ms)}" if r.restore_ms is not None
                     else f"prompt {fmt_ms(r.prompt_ms)}")
            p.drawText(QRectF(left + rw + pw + 6, y, value_w + 200, bar_h), Qt.AlignLeft | Qt.AlignVCenter, label)
        text = self.ratio_text() if self.show_ratios else ""
        if text:
            bold = QFont(font)
            bold.setBold(True)
            p.setFont(bold)
            p.setPen(colour("text"))
            p.drawText(QRectF(area.left() + 8, bottom + 6, area.width() - 16, 24), Qt.AlignLeft | Qt.AlignVCenter,
                       text)


# --------------------------------------------------------------------------- history chart

class HistoryChart(Chart):
    """Restore ms and first-query ms of one session over time (log scale)."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self._events: list = []
        self.setMinimumSize(420, 180)

    def set_events(self, events) -> None:
        self._events = [e for e in events if e.restore_ms is not None or e.prompt_ms is not None]
        self._events.sort(key=lambda e: (e.at or 0.0))
        self.update()

    def points(self) -> list[tuple[float, float | None, float | None, str]]:
        return [(e.at, e.restore_ms, e.ttft_ms if e.ttft_ms is not None else e.prompt_ms, e.verdict or "UNKNOWN")
                for e in self._events]

    def paint(self, p: QPainter, area: QRectF) -> None:
        p.fillRect(area, colour("background"))
        pts = self.points()
        if not pts:
            p.setPen(colour("faint"))
            p.drawText(area, Qt.AlignCenter, "no resumes or checks yet")
            return
        left, right = area.left() + 72, area.right() - 12
        top, bottom = area.top() + 26, area.bottom() - 24
        values = [v for _, r, q, _ in pts for v in (r, q) if v is not None and v > 0] or [1.0]
        lo = 10 ** math.floor(math.log10(min(values)))
        hi = 10 ** math.ceil(math.log10(max(values)))
        if hi <= lo:
            hi = lo * 10

        def y_of(v: float) -> float:
            v = max(v, lo)
            return bottom - (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)) * (bottom - top)

        def x_of(i: int) -> float:
            return left + (right - left) * (i / (len(pts) - 1) if len(pts) > 1 else 0.5)

        p.setPen(colour("text"))
        p.drawText(QRectF(area.left() + 8, area.top() + 2, area.width(), 20), Qt.AlignLeft | Qt.AlignVCenter,
                   "restore ms (blue) and first query ms (dots: verdict) over time")
        self.draw_log_grid(p, area, left, right, lo, hi, y_of, 68, fmt_ms)
        for idx, series in ((1, colour("restore")), (2, colour("faint"))):
            p.setPen(QPen(series, 1.5))
            prev = None
            for i, pt in enumerate(pts):
                v = pt[idx]
                if v is None:
                    prev = None
                    continue
                cur = QPointF(x_of(i), y_of(v))
                if prev is not None:
                    p.drawLine(prev, cur)
                prev = cur
        for i, (_at, restore, query, verdict) in enumerate(pts):
            if restore is not None:
                p.setPen(Qt.NoPen)
                p.setBrush(colour("restore"))
                p.drawEllipse(QPointF(x_of(i), y_of(restore)), 3, 3)
            if query is not None:
                p.setPen(QPen(colour("background"), 1))
                p.setBrush(verdict_color(verdict))
                p.drawEllipse(QPointF(x_of(i), y_of(query)), 5, 5)
        p.setPen(colour("muted"))
        first, last = pts[0][0], pts[-1][0]
        p.drawText(QRectF(left - 30, bottom + 4, 140, 18), Qt.AlignLeft,
                   time.strftime("%Y-%m-%d %H:%M", time.localtime(first)))
        if len(pts) > 1:
            p.drawText(QRectF(right - 140, bottom + 4, 140, 18), Qt.AlignRight,
                       time.strftime("%Y-%m-%d %H:%M", time.localtime(last)))
