"""The Monitor's GPUs: one card per GPU (identity, memory, util/temp/power, the
server's share) with a chart of the last minutes, and the box that holds them.

:class:`GpuBox` turns each snapshot's :class:`~app.monitor.gpu.GpuSnapshot`
into cards; a GPU that appears or goes changes the set of cards, a lost GPU
keeps its card (marked LOST).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from PySide6.QtCore import QLineF, QPointF, QRectF, Qt
from PySide6.QtGui import QPainter, QPalette, QPen, QPolygonF
from PySide6.QtWidgets import (QFrame, QGridLayout, QGroupBox, QHBoxLayout, QLabel, QProgressBar, QSizePolicy,
                               QVBoxLayout, QWidget)

from app.monitor.gpu import GpuHistory, GpuSample, GpuSnapshot
from app.core.units import fmt_bytes, is_na
from app.ui.widgets import theme
from app.ui.widgets.theme import colour
from app.ui.widgets.common import set_bar, set_style, set_text, set_visible

__all__ = ["GpuHistoryChart", "GpuCard", "GpuBox"]


class GpuHistoryChart(QWidget):
    """Memory used (filled, blue) and utilisation (line, green) over the last minutes.

    Both are drawn on a 0..100 % scale: memory as a share of the GPU's total.
    ``None`` readings (lost GPU, N/A) are gaps.
    """

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._points: list[tuple[float, int | None, int | None]] = []
        self._mem_total: int | None = None
        self._window_s = 600.0
        self._now: float | None = None
        self.setMinimumSize(220, 70)
        self.setSizePolicy(QSizePolicy.Expanding, QSizePolicy.Fixed)
        self.setFixedHeight(80)
        self.setToolTip("Memory used (blue area) and GPU utilisation (green line), 0–100 %")

    @property
    def points(self) -> list[tuple[float, int | None, int | None]]:
        return list(self._points)

    def set_series(self, points: Sequence[tuple[float, int | None, int | None]], mem_total: int | None,
                   window_s: float, now: float) -> None:
        self._points = list(points)
        self._mem_total = mem_total if mem_total else None
        self._window_s = max(1.0, float(window_s))
        self._now = now
        self.update()

    def _segments(self, values: list[tuple[float, float | None]]) -> list[list[tuple[float, float]]]:
        segs: list[list[tuple[float, float]]] = []
        cur: list[tuple[float, float]] = []
        for t, v in values:
            if v is None:
                if cur:
                    segs.append(cur)
                cur = []
            else:
                cur.append((t, v))
        if cur:
            segs.append(cur)
        return segs

    def paintEvent(self, event: Any) -> None:  # noqa: N802 (Qt name)
        # One polygon/polyline per unbroken run of readings: a handful of
        # painter calls per paint however many points the window holds.
        p = QPainter(self)
        p.setRenderHint(QPainter.Antialiasing)
        r = QRectF(self.rect()).adjusted(0.5, 0.5, -0.5, -14.5)
        pal = self.palette()
        p.fillRect(r, pal.color(QPalette.Base))
        p.setPen(QPen(colour("grid"), 1))
        p.drawLines([QLineF(r.left(), r.bottom() - r.height() * f, r.right(), r.bottom() - r.height() * f)
                     for f in (0.25, 0.5, 0.75)])
        p.drawRect(r)

        now = self._now if self._now is not None else time.time()
        t0 = now - self._window_s

        def pt(t: float, frac: float) -> QPointF:
            x = r.left() + (t - t0) / self._window_s * r.width()
            y = r.bottom() - max(0.0, min(1.0, frac)) * r.height()
            return QPointF(max(r.left(), x), y)

        total = self._mem_total
        mem = [(t, (m / total) if (m is not None and total) else None) for t, m, _ in self._points]
        util = [(t, (u / 100.0) if u is not None else None) for t, _, u in self._points]
        fill = colour("accent")
        fill.setAlpha(70)
        p.setBrush(fill)
        mem_pen = QPen(colour("accent"), 1.5)
        for seg in self._segments(mem):
            line = [pt(t, v) for t, v in seg]
            p.setPen(Qt.NoPen)
            p.drawPolygon(QPolygonF([pt(seg[0][0], 0), *line, pt(seg[-1][0], 0)]))
            p.setPen(mem_pen)
            p.drawPolyline(QPolygonF(line))
        p.setPen(QPen(colour("ok"), 1.5))
        for seg in self._segments(util):
            p.drawPolyline(QPolygonF([pt(t, v) for t, v in seg]))

        f = p.font()
        f.setPointSizeF(max(6.0, f.pointSizeF() * 0.8))
        p.setFont(f)
        minutes = self._window_s / 60.0
        label_r = QRectF(r.left(), r.bottom() + 1, r.width(), 13)
        p.setPen(pal.color(QPalette.PlaceholderText))
        p.drawText(label_r, Qt.AlignLeft | Qt.AlignVCenter, f"−{minutes:g} min")
        p.drawText(label_r, Qt.AlignRight | Qt.AlignVCenter, "now")
        fm = p.fontMetrics()
        mem_txt, util_txt, gap = "■ memory", "■ util", "    "
        x = label_r.center().x() - fm.horizontalAdvance(mem_txt + gap + util_txt) / 2
        p.setPen(colour("accent"))
        p.drawText(QRectF(x, label_r.top(), r.width(), label_r.height()), Qt.AlignLeft | Qt.AlignVCenter, mem_txt)
        p.setPen(colour("ok"))
        x += fm.horizontalAdvance(mem_txt + gap)
        p.drawText(QRectF(x, label_r.top(), r.width(), label_r.height()), Qt.AlignLeft | Qt.AlignVCenter, util_txt)
        p.end()


class GpuCard(QFrame):
    """One GPU: identity, memory bar, util/temp/power, the server's share, history."""

    def __init__(self, index: int, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.index = index
        self.setObjectName(f"gpu_card_{index}")
        self.setFrameShape(QFrame.StyledPanel)
        self.title_label = QLabel()
        self.title_label.setTextFormat(Qt.RichText)
        self.state_label = QLabel()
        self.bus_label = QLabel()
        theme.tint(self.bus_label, "color: {muted}")
        self.mem_bar = QProgressBar()
        self.mem_bar.setRange(0, 1000)
        self.mem_bar.setTextVisible(True)
        self.mem_bar.setMaximumHeight(18)
        self.mem_label = QLabel()
        self.util_label = QLabel()
        self.temp_label = QLabel()
        self.power_label = QLabel()
        self.server_label = QLabel()
        self.server_label.setToolTip("Memory on this GPU used by the server process (and its children)")
        self.setMinimumWidth(300)
        self.chart = GpuHistoryChart()

        head = QHBoxLayout()
        head.addWidget(self.title_label, 1)
        head.addWidget(self.state_label)
        grid = QGridLayout()
        grid.setHorizontalSpacing(16)
        grid.setVerticalSpacing(2)
        grid.addWidget(self.mem_label, 0, 0, 1, 2)
        grid.addWidget(self.server_label, 1, 0, 1, 2)
        grid.addWidget(self.util_label, 2, 0)
        grid.addWidget(self.temp_label, 2, 1)
        grid.addWidget(self.power_label, 2, 2)
        grid.setColumnStretch(2, 1)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(8, 6, 8, 6)
        lay.setSpacing(4)
        lay.addLayout(head)
        lay.addWidget(self.bus_label)
        lay.addWidget(self.mem_bar)
        lay.addLayout(grid)
        lay.addWidget(self.chart)

    def set_sample(self, g: GpuSample) -> None:
        name = "N/A" if is_na(g.name) else str(g.name)
        set_text(self.title_label, f"<b>GPU {g.index}</b> · {name}")
        set_text(self.bus_label, f"bus {'N/A' if is_na(g.bus_id) else g.bus_id}")
        if g.lost:
            set_text(self.state_label, "LOST")
            set_style(self.state_label, "color: {on_crit}; background: {crit}; padding: 1px 6px; "
                                         "border-radius: 3px; font-weight: bold")
            tip = "The GPU stopped answering (Xid / driver reset?); last known identity shown"
        else:
            set_text(self.state_label, "ok")
            set_style(self.state_label, "color: {ok}; font-weight: bold")
            tip = ""
        if self.state_label.toolTip() != tip:
            self.state_label.setToolTip(tip)
        frac = g.mem_used_fraction
        if frac is None:
            set_bar(self.mem_bar, 0, "memory N/A")
        else:
            set_bar(self.mem_bar, int(round(frac * 1000)), f"{frac:.0%} of memory used")
        set_text(self.mem_label, f"used {fmt_bytes(g.mem_used)} / total {fmt_bytes(g.mem_total)} · "
                                  f"free {fmt_bytes(g.mem_free)}")
        set_text(self.util_label, f"util {'N/A' if is_na(g.util_gpu_pct) else f'{g.util_gpu_pct} %'}")
        set_text(self.temp_label, f"temp {'N/A' if is_na(g.temperature_c) else f'{g.temperature_c} °C'}")
        set_text(self.power_label, f"power {'N/A' if is_na(g.power_w) else f'{g.power_w:.0f} W'}")
        set_text(self.server_label, f"used by the server {'-' if g.server_mem is None else fmt_bytes(g.server_mem)}")


class GpuBox(QGroupBox):
    """The "GPUs" group: a message when there is no GPU (or NVML says something), the
    driver version, and a :class:`GpuCard` per GPU, fed by :meth:`apply`.

    ``cards`` (GPU index -> card) and ``history`` are the panel's ``gpu_cards`` and
    ``history``: the same objects, kept for the life of the box.
    """

    def __init__(self, history: GpuHistory, parent: QWidget | None = None) -> None:
        super().__init__("GPUs", parent)
        self.history = history
        self.cards: dict[int, GpuCard] = {}
        self.message_label = QLabel()
        self.message_label.setObjectName("gpu_message")
        self.message_label.setWordWrap(True)
        self.message_label.hide()
        self.driver_label = QLabel()
        theme.tint(self.driver_label, "color: {muted}")
        self.driver_label.hide()
        self.cards_layout = QGridLayout()
        self.cards_layout.setSpacing(8)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(8, 8, 8, 8)
        lay.setSpacing(6)
        lay.addWidget(self.message_label)
        lay.addWidget(self.driver_label)
        lay.addLayout(self.cards_layout)

    def apply(self, g: GpuSnapshot, taken_at: float) -> None:
        if g.gpus:
            self.history.add(g, t=taken_at)
        no_gpu = not g.available and not g.gpus
        show_msg = no_gpu or bool(g.message and g.message != "ok")
        set_text(self.message_label, g.message or "")
        set_visible(self.message_label, show_msg)
        set_style(self.message_label,
                  "color: {muted}; font-size: 13pt" if no_gpu else "color: {crit}; font-weight: bold")
        set_text(self.driver_label, f"NVIDIA driver {g.driver_version}" if g.driver_version else "")
        set_visible(self.driver_label, bool(g.driver_version) and not no_gpu)

        indices = [x.index for x in g.gpus]
        if indices != list(self.cards):
            for card in self.cards.values():
                self.cards_layout.removeWidget(card)
                card.hide()
                card.deleteLater()
            self.cards.clear()
            cols = 2 if len(indices) > 1 else 1
            for n, i in enumerate(indices):
                card = GpuCard(i)
                self.cards[i] = card
                self.cards_layout.addWidget(card, n // cols, n % cols)
        for x in g.gpus:
            card = self.cards[x.index]
            card.set_sample(x)
            total = None if is_na(x.mem_total) else int(x.mem_total)
            card.chart.set_series(self.history.series(x.index), total, self.history.window_s, taken_at)
