"""The Monitor tab: live slots, VRAM per GPU, the server process and the host.

Everything shown comes from one :class:`app.monitor.snapshot.Snapshot` per
tick; this module only turns snapshots into widgets. Sampling (HTTP, NVML,
psutil) lives in :mod:`app.monitor`: the :class:`Sampler` runs on the qasync
loop and the blocking NVML/psutil calls run in a worker thread there, so the
window never blocks on a sick GPU.

The sampler runs while the server is Ready and the tab is visible: hidden or
minimised it is paused (no NVML or HTTP traffic for a window nobody looks at),
and it ticks at once when shown again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from PySide6.QtCore import (QAbstractTableModel, QEvent, QLineF, QModelIndex, QObject, QPointF, QRectF, QSize, Qt,
                            Signal)
from PySide6.QtGui import QBrush, QFont, QPainter, QPalette, QPen, QPolygonF
from PySide6.QtWidgets import (QAbstractItemView, QFrame, QGridLayout, QGroupBox, QHBoxLayout, QHeaderView, QLabel,
                               QProgressBar, QPushButton, QScrollArea, QSizePolicy,
                               QStyledItemDelegate, QStyleOptionViewItem, QTableView, QVBoxLayout, QWidget)

from app.monitor.gpu import GpuHistory, GpuMonitor, GpuSample, GpuSnapshot
from app.monitor.process import ProcessMonitor
from app.monitor.sampler import Sampler
from app.monitor.slots import LastTask, RestoredSlot, SlotRow
from app.monitor.snapshot import Snapshot, take_snapshot
from app.monitor.units import MiB, fmt_bytes, is_na, fmt_uptime
from app.monitor.warnings import CRITICAL
from app.ui import theme
from app.ui.theme import colour

log = logging.getLogger(__name__)

__all__ = ["SlotsTableModel", "GpuHistoryChart", "GpuCard", "MonitorPanel", "RESTORED_TOOLTIP", "FILL_ROLE",
           "ROW_ROLE"]

RESTORED_TOOLTIP = ("After a restore /slots does not show the restored tokens; this is the count KV Valet knows "
                    "from the restore.")
FILL_ROLE = Qt.UserRole + 1  # float 0..1 (or None) for the fill bar
ROW_ROLE = Qt.UserRole + 2  # the SlotRow itself



def _num(v: Any) -> str:
    return "-" if v is None else f"{v:,}"


def _uptime(s: float | None) -> str:
    return fmt_uptime(s)


def _cache_ram_text(budget_mib: int | None) -> str:
    if budget_mib is None:
        return "-"
    if budget_mib < 0:
        return "unlimited"
    if budget_mib == 0:
        return "disabled"
    return fmt_bytes(budget_mib * MiB)


# Widgets are touched only when a value changes: most figures are the same from
# one tick to the next, and an unchanged setText still relayouts and repaints.
# (It also keeps the number of void Qt calls per tick low: PySide6 6.12.0 on
# Python 3.11 drops a reference to None on every void call, see the report.)
def _set_text(label: QLabel, text: str) -> None:
    if label.text() != text:
        label.setText(text)


def _set_visible(w: QWidget, on: bool) -> None:
    if w.isHidden() == on:
        w.setVisible(on)


def _set_style(w: QWidget, template: str) -> None:
    """A style with theme roles in braces (app.ui.theme.tint), set only when it changes."""
    if w.property("kv_tint") != template:
        theme.tint(w, template)


def _set_bar(bar: QProgressBar, value: int, fmt: str) -> None:
    if bar.value() != value:
        bar.setValue(value)
    if bar.format() != fmt:
        bar.setFormat(fmt)


# -- slots ---------------------------------------------------------------------


class SlotsTableModel(QAbstractTableModel):
    """One row per llama-server slot; fed whole lists of :class:`SlotRow`.

    With the same number of rows the model updates in place (``dataChanged``
    for the rows that changed) so the view keeps its selection and scroll
    position; a different count resets the model.
    """

    COLUMNS = ("Slot", "State", "n_ctx", "Tokens held", "Fill", "Cached", "Processed", "Decoded", "Task",
               "Session")
    COL_SLOT, COL_STATE, COL_NCTX, COL_TOKENS, COL_FILL, COL_CACHED, COL_PROCESSED, COL_DECODED, COL_TASK, \
        COL_SESSION = range(10)
    _NUMERIC = {COL_SLOT, COL_NCTX, COL_TOKENS, COL_FILL, COL_CACHED, COL_PROCESSED, COL_DECODED, COL_TASK}
    _HEADER_TIPS = {
        COL_STATE: "processing: the slot is running a task now",
        COL_NCTX: "Context size of the slot (tokens)",
        COL_TOKENS: "Tokens the slot holds (prompt and generated), or the count known from a restore",
        COL_FILL: "Tokens held as a share of n_ctx",
        COL_CACHED: "Prompt tokens taken from the cache in the last task",
        COL_PROCESSED: "Prompt tokens processed (prefilled) in the last task",
        COL_DECODED: "Tokens generated in the last task",
        COL_TASK: "id of the slot's last task",
        COL_SESSION: "The parked session restored into this slot",
    }

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._rows: list[SlotRow] = []

    @property
    def rows(self) -> list[SlotRow]:
        return list(self._rows)

    def set_rows(self, rows: Sequence[SlotRow]) -> None:
        rows = list(rows)
        if len(rows) != len(self._rows):
            self.beginResetModel()
            self._rows = rows
            self.endResetModel()
            return
        old, self._rows = self._rows, rows
        last = self.columnCount() - 1
        for i, (a, b) in enumerate(zip(old, rows)):
            if a != b:
                self.dataChanged.emit(self.index(i, 0), self.index(i, last))

    # -- Qt model API ------------------------------------------------------

    def rowCount(self, parent: QModelIndex = QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self._rows)

    def columnCount(self, parent: QModelIndex = QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self.COLUMNS)

    def headerData(self, section: int, orientation: Qt.Orientation, role: int = Qt.DisplayRole) -> Any:
        if orientation != Qt.Horizontal or not 0 <= section < len(self.COLUMNS):
            return None
        if role == Qt.DisplayRole:
            return self.COLUMNS[section]
        if role == Qt.ToolTipRole:
            return self._HEADER_TIPS.get(section)
        return None

    def data(self, index: QModelIndex, role: int = Qt.DisplayRole) -> Any:
        if not index.isValid() or not 0 <= index.row() < len(self._rows):
            return None
        r = self._rows[index.row()]
        col = index.column()
        if role == Qt.DisplayRole:
            return self._text(r, col)
        if role == ROW_ROLE:
            return r
        if role == FILL_ROLE:
            return r.fill_fraction if col == self.COL_FILL else None
        if role == Qt.ToolTipRole:
            if col == self.COL_TOKENS and r.tokens_known_from_restore:
                return RESTORED_TOOLTIP
            return None
        if role == Qt.TextAlignmentRole:
            if col in self._NUMERIC:
                return int(Qt.AlignRight | Qt.AlignVCenter)
            return int(Qt.AlignLeft | Qt.AlignVCenter)
        if role == Qt.ForegroundRole and col == self.COL_STATE:
            return QBrush(colour("accent" if r.busy else "muted"))
        if role == Qt.FontRole and col == self.COL_STATE and r.busy:
            f = QFont()
            f.setBold(True)
            return f
        return None

    def _text(self, r: SlotRow, col: int) -> str:
        if col == self.COL_SLOT:
            return "-" if r.id is None else str(r.id)
        if col == self.COL_STATE:
            return "processing" if r.busy else "idle"
        if col == self.COL_NCTX:
            return _num(r.n_ctx)
        if col == self.COL_TOKENS:
            if r.tokens_held is None:
                return "-"
            return f"{r.tokens_held:,}" + (" (restored)" if r.tokens_known_from_restore else "")
        if col == self.COL_FILL:
            f = r.fill_fraction
            return "-" if f is None else f"{f:.0%}"
        if col == self.COL_CACHED:
            return _num(r.n_cached)
        if col == self.COL_PROCESSED:
            return _num(r.n_processed)
        if col == self.COL_DECODED:
            return _num(r.n_decoded)
        if col == self.COL_TASK:
            return _num(r.id_task)
        if col == self.COL_SESSION:
            return r.session or ""
        return ""


class FillBarDelegate(QStyledItemDelegate):
    """Paints the Fill column as a bar with the percentage on it."""

    def paint(self, painter: QPainter, option: QStyleOptionViewItem, index: QModelIndex) -> None:
        frac = index.data(FILL_ROLE)
        if frac is None:
            super().paint(painter, option, index)
            return
        painter.save()
        painter.setRenderHint(QPainter.Antialiasing)
        rect = QRectF(option.rect).adjusted(4, 4, -4, -4)
        painter.setPen(Qt.NoPen)
        painter.setBrush(colour("track"))
        painter.drawRoundedRect(rect, 3, 3)
        colour_ = colour("crit" if frac >= 1.0 else "warn" if frac >= 0.9 else "bar")
        filled = QRectF(rect)
        filled.setWidth(rect.width() * max(0.0, min(1.0, frac)))
        painter.setBrush(colour_)
        painter.drawRoundedRect(filled, 3, 3)
        painter.setPen(colour("text"))
        painter.drawText(rect, Qt.AlignCenter, index.data(Qt.DisplayRole) or "")
        painter.restore()

    def sizeHint(self, option: QStyleOptionViewItem, index: QModelIndex) -> QSize:
        s = super().sizeHint(option, index)
        return QSize(max(s.width(), 90), s.height())


# -- GPUs ----------------------------------------------------------------------


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
        _set_text(self.title_label, f"<b>GPU {g.index}</b> · {name}")
        _set_text(self.bus_label, f"bus {'N/A' if is_na(g.bus_id) else g.bus_id}")
        if g.lost:
            _set_text(self.state_label, "LOST")
            _set_style(self.state_label, "color: {on_crit}; background: {crit}; padding: 1px 6px; "
                                         "border-radius: 3px; font-weight: bold")
            tip = "The GPU stopped answering (Xid / driver reset?); last known identity shown"
        else:
            _set_text(self.state_label, "ok")
            _set_style(self.state_label, "color: {ok}; font-weight: bold")
            tip = ""
        if self.state_label.toolTip() != tip:
            self.state_label.setToolTip(tip)
        frac = g.mem_used_fraction
        if frac is None:
            _set_bar(self.mem_bar, 0, "memory N/A")
        else:
            _set_bar(self.mem_bar, int(round(frac * 1000)), f"{frac:.0%} of memory used")
        _set_text(self.mem_label, f"used {fmt_bytes(g.mem_used)} / total {fmt_bytes(g.mem_total)} · "
                                  f"free {fmt_bytes(g.mem_free)}")
        _set_text(self.util_label, f"util {'N/A' if is_na(g.util_gpu_pct) else f'{g.util_gpu_pct} %'}")
        _set_text(self.temp_label, f"temp {'N/A' if is_na(g.temperature_c) else f'{g.temperature_c} °C'}")
        _set_text(self.power_label, f"power {'N/A' if is_na(g.power_w) else f'{g.power_w:.0f} W'}")
        _set_text(self.server_label, f"used by the server {'-' if g.server_mem is None else fmt_bytes(g.server_mem)}")


# -- the panel -----------------------------------------------------------------


def _group(title: str) -> tuple[QGroupBox, QVBoxLayout]:
    box = QGroupBox(title)
    lay = QVBoxLayout(box)
    lay.setContentsMargins(8, 8, 8, 8)
    lay.setSpacing(6)
    return box, lay


class MonitorPanel(QWidget):
    """The Monitor tab. ``attach(controller)`` makes it follow a ServerController.

    ``restored`` maps slot id -> ``(n_restored, session name)``; the park /
    resume code updates it after a restore (``/slots`` does not show restored
    tokens) and may call :meth:`request_tick` to show it at once.
    """

    sig_snapshot = Signal(object)  # every Snapshot applied to the view
    sig_sampling = Signal(bool)  # True: a sampler started for a Ready server; False: sampling stopped

    SAMPLE_STATES = ("Ready",)
    STOP_STATES = ("Stopping", "Stopped", "Crashed")

    def __init__(self, parent: QWidget | None = None, *, gpu_monitor: GpuMonitor | None = None,
                 interval: float = 1.0, busy_interval: float = 0.25, history_window_s: float = 600.0) -> None:
        super().__init__(parent)
        # What the session service knows and /slots does not (shared with it by the wiring).
        self.restored: dict[int, RestoredSlot] = {}
        self.last_tasks: dict[int, LastTask] = {}
        self._gpu = gpu_monitor
        self._own_gpu = gpu_monitor is None
        # Used for the next sampler (set them before the server is Ready).
        self.interval = interval
        self.busy_interval = busy_interval
        self.history = GpuHistory(window_s=history_window_s)
        self.sampler: Sampler | None = None
        self._client: Any = None
        self._sampling_key: tuple[str, int | None] | None = None
        self._controller: Any = None
        self._lock: asyncio.Lock | None = None
        self._tasks: set[asyncio.Task] = set()
        self._watched_window: QWidget | None = None
        self.last_snapshot: Snapshot | None = None
        self.gpu_cards: dict[int, GpuCard] = {}
        self._shown_warnings: tuple = ()
        self._closed = False
        self._build()

    # -- layout ------------------------------------------------------------

    def _build(self) -> None:
        self.status_label = QLabel("Not sampling: the server is not running.")
        self.status_label.setObjectName("monitor_status")
        theme.tint(self.status_label, "color: {muted}")

        # Warnings: a banner of word-wrapped labels (grows with the text, no scroll bar).
        self.warnings_box = QFrame()
        self.warnings_box.setObjectName("monitor_warnings")
        theme.tint(self.warnings_box, "#monitor_warnings {{ border: 1px solid {note_border}; border-radius: 4px; "
                                      "background: {note_bg}; }}")
        self._warnings_layout = QVBoxLayout(self.warnings_box)
        self._warnings_layout.setContentsMargins(8, 4, 8, 4)
        self._warnings_layout.setSpacing(2)
        self.warning_labels: list[QLabel] = []
        self.warnings_box.hide()

        # Slots
        self.slots_model = SlotsTableModel(self)
        self.slots_view = QTableView()
        self.slots_view.setModel(self.slots_model)
        self.slots_view.setItemDelegateForColumn(SlotsTableModel.COL_FILL, FillBarDelegate(self.slots_view))
        self.slots_view.verticalHeader().hide()
        self.slots_view.setSelectionBehavior(QAbstractItemView.SelectRows)
        self.slots_view.setEditTriggers(QAbstractItemView.NoEditTriggers)
        self.slots_view.setAlternatingRowColors(True)
        hh = self.slots_view.horizontalHeader()
        hh.setSectionResizeMode(QHeaderView.ResizeToContents)
        hh.setSectionResizeMode(SlotsTableModel.COL_FILL, QHeaderView.Fixed)
        hh.resizeSection(SlotsTableModel.COL_FILL, 110)
        hh.setStretchLastSection(True)
        self.slots_view.setSizePolicy(QSizePolicy.Expanding, QSizePolicy.Fixed)
        self.slots_error_label = QLabel()
        self.slots_error_label.setObjectName("slots_error")
        self.slots_error_label.setWordWrap(True)
        theme.tint(self.slots_error_label, "color: {warn}; font-weight: bold")
        self.slots_error_label.hide()
        slots_box, slots_lay = _group("Slots")
        slots_lay.addWidget(self.slots_error_label)
        slots_lay.addWidget(self.slots_view)
        self.slots_model.modelReset.connect(self._fit_slots_height)
        self._fit_slots_height()

        # GPUs
        self.gpu_message_label = QLabel()
        self.gpu_message_label.setObjectName("gpu_message")
        self.gpu_message_label.setWordWrap(True)
        self.gpu_message_label.hide()
        self.driver_label = QLabel()
        theme.tint(self.driver_label, "color: {muted}")
        self.driver_label.hide()
        self._cards_layout = QGridLayout()
        self._cards_layout.setSpacing(8)
        gpu_box, gpu_lay = _group("GPUs")
        gpu_lay.addWidget(self.gpu_message_label)
        gpu_lay.addWidget(self.driver_label)
        gpu_lay.addLayout(self._cards_layout)

        # Process & host
        self.proc_labels: dict[str, QLabel] = {}
        self.host_labels: dict[str, QLabel] = {}
        proc_box = QGroupBox("Server process")
        pgrid = QGridLayout(proc_box)
        for row, (key, title) in enumerate((("pid", "pid"), ("cpu", "CPU"), ("rss", "RSS"),
                                            ("threads", "threads"), ("uptime", "uptime"))):
            pgrid.addWidget(QLabel(title), row, 0)
            self.proc_labels[key] = QLabel("-")
            self.proc_labels[key].setAlignment(Qt.AlignRight | Qt.AlignVCenter)
            pgrid.addWidget(self.proc_labels[key], row, 1)
        self.proc_note = QLabel("no server process known")
        theme.tint(self.proc_note, "color: {muted}")
        pgrid.addWidget(self.proc_note, 5, 0, 1, 2)
        pgrid.setColumnStretch(1, 1)

        host_box = QGroupBox("Host RAM")
        hgrid = QGridLayout(host_box)
        self.host_bar = QProgressBar()
        self.host_bar.setRange(0, 1000)
        self.host_bar.setMaximumHeight(18)
        hgrid.addWidget(self.host_bar, 0, 0, 1, 2)
        for row, (key, title, tip) in enumerate((
                ("used", "used", "RAM used on this machine"),
                ("available", "available", "RAM the kernel can hand out without swapping"),
                ("total", "total", ""),
                ("server_rss", "server RSS", "Resident memory of the server (prompt cache included)"),
                ("cache_ram", "--cache-ram", "The profile's prompt-cache budget in host RAM")), start=1):
            t = QLabel(title)
            t.setToolTip(tip)
            hgrid.addWidget(t, row, 0)
            self.host_labels[key] = QLabel("-")
            self.host_labels[key].setAlignment(Qt.AlignRight | Qt.AlignVCenter)
            self.host_labels[key].setToolTip(tip)
            hgrid.addWidget(self.host_labels[key], row, 1)
        hgrid.setColumnStretch(1, 1)

        middle = QHBoxLayout()
        middle.addWidget(proc_box, 1)
        middle.addWidget(host_box, 1)

        body = QWidget()
        blay = QVBoxLayout(body)
        blay.setContentsMargins(8, 8, 8, 8)
        blay.setSpacing(8)
        blay.addWidget(self.status_label)
        # Cache health badge: a finding of the runtime detectors (see the Cache health tab)
        self.health_badge = QPushButton("")
        self.health_badge.setObjectName("health_badge")
        self.health_badge.setFlat(True)
        theme.tint(self.health_badge, "#health_badge {{ color: {crit}; font-weight: 600; text-align: left; }}")
        self.health_badge.setToolTip("The server's log shows cache trouble: open the Cache health tab for the "
                                     "cause and the remedy.")
        self.health_badge.hide()
        blay.addWidget(self.health_badge)
        # What this build does with checkpoint sidecars (app.core.sidecar_behaviour), from its start
        # line, its binary and its parks: every resume prediction follows from it.
        self.sidecar_label = QLabel("Checkpoint sidecars: -")
        self.sidecar_label.setObjectName("sidecar_behaviour")
        self.sidecar_label.setWordWrap(True)
        blay.addWidget(self.sidecar_label)
        blay.addWidget(self.warnings_box)
        blay.addWidget(slots_box)
        blay.addLayout(middle)
        blay.addWidget(gpu_box)
        blay.addStretch(1)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QFrame.NoFrame)
        scroll.setWidget(body)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(scroll)

    def _fit_slots_height(self) -> None:
        """Show up to 8 rows without a scroll bar; no big empty table for 2 slots."""
        v = self.slots_view
        rows = max(1, min(8, self.slots_model.rowCount()))
        row_h = v.verticalHeader().defaultSectionSize()
        h = v.horizontalHeader().sizeHint().height() + rows * row_h + 2 * v.frameWidth() + 2
        v.setFixedHeight(h)

    # -- applying a snapshot ---------------------------------------------------

    def apply_snapshot(self, snap: Snapshot) -> None:
        """Show one snapshot (public: tests feed synthetic ones) and emit sig_snapshot."""
        self.last_snapshot = snap
        when = time.strftime("%H:%M:%S", time.localtime(snap.taken_at))
        health = snap.health
        colour_ = theme.hex_of("ok" if health == "ok" else "warn" if health == "loading" else "crit")
        _set_text(self.status_label, f"{snap.url or 'server'} · health <b style='color:{colour_}'>{health}</b> · "
                                     f"sampled {when}")
        self._apply_warnings(snap)
        self._apply_slots(snap)
        self._apply_gpus(snap.gpu, snap.taken_at)
        self._apply_process_host(snap)
        self.sig_snapshot.emit(snap)

    def _apply_warnings(self, snap: Snapshot) -> None:
        if snap.warnings == self._shown_warnings:
            return
        self._shown_warnings = snap.warnings
        for lab in self.warning_labels:
            self._warnings_layout.removeWidget(lab)
            lab.hide()  # deleteLater waits for the loop; do not paint it meanwhile
            lab.deleteLater()
        self.warning_labels = []
        for w in snap.warnings:
            crit = w.level == CRITICAL
            lab = QLabel(("✖ " if crit else "⚠ ") + w.text)
            lab.setWordWrap(True)
            lab.setProperty("level", w.level)
            theme.tint(lab, "color: {crit}; font-weight: bold" if crit else "color: {warn}")
            self._warnings_layout.addWidget(lab)
            self.warning_labels.append(lab)
        _set_visible(self.warnings_box, bool(self.warning_labels))

    def warning_texts(self) -> list[str]:
        return [lab.text() for lab in self.warning_labels]

    def warning_levels(self) -> list[str]:
        return [lab.property("level") for lab in self.warning_labels]

    def _apply_slots(self, snap: Snapshot) -> None:
        self.slots_model.set_rows(snap.slots)
        _set_text(self.slots_error_label, snap.slots_error or "")
        _set_visible(self.slots_error_label, bool(snap.slots_error))
        _set_visible(self.slots_view, not snap.slots_error)

    def _apply_gpus(self, g: GpuSnapshot, taken_at: float) -> None:
        if g.gpus:
            self.history.add(g, t=taken_at)
        no_gpu = not g.available and not g.gpus
        show_msg = no_gpu or bool(g.message and g.message != "ok")
        _set_text(self.gpu_message_label, g.message or "")
        _set_visible(self.gpu_message_label, show_msg)
        _set_style(self.gpu_message_label,
                   "color: {muted}; font-size: 13pt" if no_gpu else "color: {crit}; font-weight: bold")
        _set_text(self.driver_label, f"NVIDIA driver {g.driver_version}" if g.driver_version else "")
        _set_visible(self.driver_label, bool(g.driver_version) and not no_gpu)

        indices = [x.index for x in g.gpus]
        if indices != list(self.gpu_cards):
            for card in self.gpu_cards.values():
                self._cards_layout.removeWidget(card)
                card.hide()
                card.deleteLater()
            self.gpu_cards = {}
            cols = 2 if len(indices) > 1 else 1
            for n, i in enumerate(indices):
                card = GpuCard(i)
                self.gpu_cards[i] = card
                self._cards_layout.addWidget(card, n // cols, n % cols)
        for x in g.gpus:
            card = self.gpu_cards[x.index]
            card.set_sample(x)
            total = None if is_na(x.mem_total) else int(x.mem_total)
            card.chart.set_series(self.history.series(x.index), total, self.history.window_s, taken_at)

    def _apply_process_host(self, snap: Snapshot) -> None:
        p = snap.process
        L = self.proc_labels
        alive = p is not None and p.alive
        _set_text(L["pid"], "-" if p is None else str(p.pid))
        _set_text(L["cpu"], "-" if not alive or p.cpu_pct is None else f"{p.cpu_pct:.1f} %")
        _set_text(L["rss"], fmt_bytes(p.rss) if alive and p.rss is not None else "-")
        _set_text(L["threads"], _num(p.threads) if alive else "-")
        _set_text(L["uptime"], _uptime(p.uptime_s) if alive else "-")
        if p is None:
            note = "no server process known"
        elif not p.alive:
            note = f"pid {p.pid}: not running"
        else:
            note = "RSS, threads and CPU include child processes" if p.children_pids else ""
        _set_text(self.proc_note, note)
        _set_visible(self.proc_note, bool(note))
        h = snap.host
        H = self.host_labels
        _set_text(H["used"], fmt_bytes(h.ram_used))
        _set_text(H["available"], fmt_bytes(h.ram_available))
        _set_text(H["total"], fmt_bytes(h.ram_total))
        _set_text(H["server_rss"], L["rss"].text())
        _set_text(H["cache_ram"], _cache_ram_text(snap.cache_ram_mib))
        if h.ram_used is not None and h.ram_total:
            frac = h.ram_used / h.ram_total
            _set_bar(self.host_bar, int(round(frac * 1000)), f"{frac:.0%} used")
        else:
            _set_bar(self.host_bar, 0, "N/A")

    # -- following the server --------------------------------------------------

    def attach(self, controller: Any) -> None:
        """Follow ``controller`` (a ServerController or anything with sig_state,
        ``url``, ``supervisor.pid`` and ``plan.profile``)."""
        self._controller = controller
        controller.sig_state.connect(self._on_server_state)

    def _on_server_state(self, state: str, detail: str) -> None:
        if self._closed:
            return  # after aclose (the window stops the server after closing its panels)
        if state in self.SAMPLE_STATES:
            self._spawn(self._start_sampling())
        elif state in self.STOP_STATES:
            self._spawn(self._stop_sampling(state))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._on_task_done)

    def _on_task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("monitor panel task failed", exc_info=task.exception())

    def _get_lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def _start_sampling(self) -> None:
        from app.server.client import LlamaClient  # no Qt; kept local to keep the import graph small
        from app.server.launcher import resolve_api_key

        c = self._controller
        if c is None:
            return
        async with self._get_lock():
            url = c.url
            sup = getattr(c, "supervisor", None)
            pid = getattr(sup, "pid", None)
            if not url:
                return
            key = (url, pid)
            if self.sampler is not None and self._sampling_key == key and self.sampler.is_running:
                return
            await self._stop_sampler_locked()
            profile = getattr(getattr(c, "plan", None), "profile", None)
            cache_ram = getattr(profile, "effective_cache_ram", None)
            client = LlamaClient(url, resolve_api_key(profile))
            if self._gpu is None:
                self._gpu = GpuMonitor()
            gpu = self._gpu
            proc = ProcessMonitor(pid) if pid else None

            async def fetch_health() -> Any:
                h = await client.health()
                return "ok" if h.ok else "loading" if h.loading else f"unreachable: {h.message}"

            async def take() -> Snapshot:
                return await take_snapshot(fetch_health, client.slots, gpu, proc, dict(self.restored),
                                           cache_ram, url, last_tasks=dict(self.last_tasks))

            self._client = client
            self._sampling_key = key
            self.sampler = Sampler(take, on_snapshot=self.apply_snapshot, interval=self.interval,
                                   busy_interval=self.busy_interval, url=url, cache_ram_mib=cache_ram)
            self.sampler.start()
            self._update_pause()
        self.sig_sampling.emit(True)

    def set_rates(self, interval: float, busy_interval: float) -> None:
        """The polling rates from the preferences; a running sampler takes them at its next tick."""
        self.interval, self.busy_interval = float(interval), float(busy_interval)
        if self.sampler is not None:
            self.sampler.interval, self.sampler.busy_interval = self.interval, self.busy_interval
            self.request_tick()

    async def _stop_sampling(self, state: str = "Stopped") -> None:
        async with self._get_lock():
            was_sampling = self.sampler is not None
            await self._stop_sampler_locked()
        _set_text(self.status_label, f"Not sampling: the server is {state.lower()}.")
        if was_sampling:
            self.sig_sampling.emit(False)

    async def _stop_sampler_locked(self) -> None:
        sampler, self.sampler = self.sampler, None
        client, self._client = self._client, None
        self._sampling_key = None
        if sampler is not None:
            await sampler.stop()
        if client is not None:
            await client.aclose()

    def set_sidecar_behaviour(self, behaviour) -> None:
        """Show what the running build does with checkpoint sidecars (None: no server)."""
        from app.core.sidecar_behaviour import LABELS, Behaviour

        if behaviour is None:
            self.sidecar_label.setText("Checkpoint sidecars: -")
            self.sidecar_label.setToolTip("")
            return
        b = Behaviour(behaviour)
        self.sidecar_label.setText(f"Checkpoint sidecars: {LABELS[b]}")
        self.sidecar_label.setToolTip("What this llama-server build does with checkpoint sidecars, from its own "
                                      "start line, its binary and what its parks wrote. The resume warnings, the "
                                      "sidecar column and the verdict's reason follow from it.")

    def set_health(self, count: int, worst) -> None:
        """Show the Cache health badge: ``count`` findings, the worst of severity ``worst``."""
        if count <= 0:
            self.health_badge.hide()
            return
        self.health_badge.setText(f"⚠ Cache health: {count} finding{'s' if count != 1 else ''} "
                                  f"(worst: {worst}) — open")
        self.health_badge.show()

    def request_tick(self) -> None:
        """Sample now (after a park/resume changed ``restored``)."""
        if self.sampler is not None:
            self.sampler.request_tick()

    @property
    def paused(self) -> bool:
        return self.sampler is not None and self.sampler.paused

    async def aclose(self) -> None:
        """Stop sampling and release the HTTP client and NVML; leaves no task behind."""
        self._closed = True
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            try:
                await t
            except BaseException:  # noqa: BLE001 - cancelled or already logged
                pass
        async with self._get_lock():
            await self._stop_sampler_locked()
        if self._gpu is not None and self._own_gpu:
            gpu, self._gpu = self._gpu, None
            await asyncio.to_thread(gpu.close)

    # -- pause while nobody can see it -------------------------------------

    def _should_sample(self) -> bool:
        if not self.isVisible():
            return False
        win = self.window()
        return not (win is not None and win.windowState() & Qt.WindowMinimized)

    def _update_pause(self) -> None:
        s = self.sampler
        if s is None:
            return
        if self._should_sample():
            s.resume()
        else:
            s.pause()

    def _watch_window(self) -> None:
        win = self.window()
        if win is self._watched_window:
            return
        if self._watched_window is not None:
            self._watched_window.removeEventFilter(self)
        self._watched_window = win
        if win is not None and win is not self:
            win.installEventFilter(self)

    def showEvent(self, event: Any) -> None:  # noqa: N802
        super().showEvent(event)
        self._watch_window()
        self._update_pause()

    def hideEvent(self, event: Any) -> None:  # noqa: N802
        super().hideEvent(event)
        self._update_pause()

    def changeEvent(self, event: Any) -> None:  # noqa: N802
        super().changeEvent(event)
        if event.type() == QEvent.WindowStateChange:
            self._update_pause()

    def eventFilter(self, obj: QObject, event: QEvent) -> bool:  # noqa: N802
        if obj is self._watched_window and event.type() in (QEvent.WindowStateChange, QEvent.Show, QEvent.Hide):
            self._update_pause()
        return False
