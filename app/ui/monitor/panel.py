"""The Monitor tab: live slots, VRAM per GPU, the server process and the host.

Everything shown comes from one :class:`app.monitor.snapshot.Snapshot` per
tick; this module only turns snapshots into widgets. Sampling (HTTP, NVML,
psutil) lives in :mod:`app.monitor`: each server's one :class:`Sampler` (the
server service's, ``service.sampler(target_id)``: the server list and the status
bar read the same one) runs on the qasync loop and the blocking NVML/psutil calls
run in a worker thread there, so the window never blocks on a sick GPU.

The shown server's sampler ticks while it is Ready and the tab is visible: hidden or
minimised it is paused (no fast NVML or HTTP traffic for a window nobody looks at),
and it ticks at once when shown again (:class:`app.ui.widgets.visibility.PausesWhenHidden`).

The parts: the slot table's model (:mod:`app.ui.sessions.slots_model`, shown through a
sorting proxy, its Fill column painted by :mod:`app.ui.widgets.delegates`), the GPU
cards and charts (:mod:`app.ui.monitor.gpus`), the process and host boxes
(:mod:`app.ui.monitor.host`). This module keeps the layout and follows the server.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QAbstractItemView, QFrame, QHBoxLayout, QHeaderView, QLabel, QPushButton, QScrollArea,
                               QSizePolicy, QTableView, QVBoxLayout, QWidget)

from app.core.background import TaskGroup
from app.core.states import ServerState
from app.monitor.gpu import GpuHistory, GpuSnapshot
from app.monitor.sampler import Sampler, Samplers
from app.monitor.snapshot import Snapshot
from app.monitor.warnings import CRITICAL
from app.ui.widgets import theme
from app.ui.widgets.delegates import FILL_ROLE, FillBarDelegate
from app.ui.widgets.status_bar import HEALTH_ROLES
from app.ui.monitor.gpus import GpuBox, GpuCard, GpuHistoryChart
from app.ui.monitor.host import HostBox, ProcessBox
from app.ui.sessions.slots_model import RESTORED_TOOLTIP, ROW_ROLE, ShownSlots, SlotsTableModel
from app.ui.widgets.visibility import PausesWhenHidden
from app.ui.widgets.common import group as _group
from app.ui.widgets.common import set_text as _set_text
from app.ui.widgets.common import set_visible as _set_visible

log = logging.getLogger(__name__)

__all__ = ["SlotsTableModel", "GpuHistoryChart", "GpuCard", "MonitorPanel", "RESTORED_TOOLTIP", "FILL_ROLE",
           "ROW_ROLE", "FillBarDelegate"]


class MonitorPanel(PausesWhenHidden, QWidget):
    """The Monitor tab. ``attach(controller)`` makes it follow a ServerController: the sampler
    of the server it shows. The park / resume code may call :meth:`request_tick` after a restore
    (the sampler reads what the session service restored: ``/slots`` does not show it)."""

    sig_snapshot = Signal(object)  # every Snapshot applied to the view
    sig_sampling = Signal(bool)  # True: a sampler started for a Ready server; False: sampling stopped

    SAMPLE_STATES = (ServerState.READY,)
    STOP_STATES = (ServerState.STOPPING, ServerState.STOPPED, ServerState.CRASHED)

    def __init__(self, parent: QWidget | None = None, *, interval: float = 1.0, busy_interval: float = 0.25,
                 history_window_s: float = 600.0) -> None:
        super().__init__(parent)
        # The rates of the sampler shown (set them before the server is Ready, or with set_rates).
        self.interval = interval
        self.busy_interval = busy_interval
        self.history = GpuHistory(window_s=history_window_s)
        self.sampler: Sampler | None = None  # the shown server's (the server service's, not this tab's)
        self._samplers: Samplers | None = None
        self._sampling_key: str | None = None  # its target id
        self._controller: Any = None
        self._lock: asyncio.Lock | None = None
        self._tasks = TaskGroup("the Monitor")
        self.last_snapshot: Snapshot | None = None
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

        # Slots: the model (every slot, in the server's order) shown through a proxy that
        # sorts by the clicked header; a third click goes back to the server's order.
        self.slots_model = SlotsTableModel(self)
        self.shown_slots = ShownSlots(self.slots_model, self)
        self.slots_view = QTableView()
        self.slots_view.setModel(self.shown_slots)
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
        hh.setSortIndicatorClearable(True)
        hh.setSortIndicator(-1, Qt.AscendingOrder)
        self.slots_view.setSortingEnabled(True)
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

        # GPUs (the cards and the history are the box's: the same dict and history for the panel's life)
        self.gpu_box = GpuBox(self.history)
        self.gpu_cards = self.gpu_box.cards
        self.gpu_message_label = self.gpu_box.message_label
        self.driver_label = self.gpu_box.driver_label
        self._cards_layout = self.gpu_box.cards_layout

        # Process & host
        self.proc_box, self.host_box = ProcessBox(), HostBox()
        self.proc_labels, self.proc_note = self.proc_box.labels, self.proc_box.note
        self.host_labels, self.host_bar = self.host_box.labels, self.host_box.bar
        middle = QHBoxLayout()
        middle.addWidget(self.proc_box, 1)
        middle.addWidget(self.host_box, 1)

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
        blay.addWidget(self.gpu_box)
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
        colour_ = theme.hex_of(HEALTH_ROLES.get(snap.health, "crit"))
        _set_text(self.status_label, f"{snap.url or 'server'} · health <b style='color:{colour_}'>{snap.health_text}</b> · "
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
        self.gpu_box.apply(g, taken_at)

    def _apply_process_host(self, snap: Snapshot) -> None:
        self.proc_box.apply(snap.process)
        self.host_box.apply(snap.host, self.proc_labels["rss"].text(), snap.cache_ram_mib)

    # -- following the server --------------------------------------------------

    def attach(self, controller: Any) -> None:
        """Follow ``controller`` (a ServerController or anything with sig_state,
        ``url``, ``supervisor.pid`` and ``plan.profile``)."""
        self._controller = controller
        controller.sig_state.connect(self._on_server_state)

    def _on_server_state(self, state: ServerState, detail: str) -> None:
        if self._closed:
            return  # after aclose (the window stops the server after closing its panels)
        if state in self.SAMPLE_STATES:
            self._spawn(self._start_sampling())
        elif state in self.STOP_STATES:
            self._spawn(self._stop_sampling(state))

    def _spawn(self, coro: Any) -> None:
        self._tasks.start(coro, str(getattr(coro, "__qualname__", coro)))  # logged with it if it fails

    def _get_lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def _start_sampling(self) -> None:
        c = self._controller
        if c is None:
            return
        async with self._get_lock():
            key, service = c.target_id, c.service
            sampler = service.sampler(key)  # the one sampler of that server (the list reads it too)
            if sampler is None:
                return
            if sampler is self.sampler and sampler.is_running:
                return
            await self._stop_sampler_locked()
            if self._samplers is not service.samplers:
                if self._samplers is not None:
                    self._samplers.unsubscribe(self._on_published)
                self._samplers = service.samplers
                self._samplers.subscribe(self._on_published)
            self._samplers.set_rates(self.interval, self.busy_interval)
            self._sampling_key, self.sampler = key, sampler
            self.update_pause()  # resumed while the tab is seen
        self.sig_sampling.emit(True)

    def _on_published(self, key: str, snap: Snapshot) -> None:
        """A snapshot of any server's sampler: shown when it is the shown server's."""
        if key == self._sampling_key and not self._closed:
            self.apply_snapshot(snap)

    def set_rates(self, interval: float, busy_interval: float) -> None:
        """The polling rates from the preferences; a running sampler takes them at its next tick."""
        self.interval, self.busy_interval = float(interval), float(busy_interval)
        if self._samplers is not None:
            self._samplers.set_rates(self.interval, self.busy_interval)
            self.request_tick()

    async def _stop_sampling(self, state: ServerState = ServerState.STOPPED) -> None:
        async with self._get_lock():
            was_sampling = self.sampler is not None
            await self._stop_sampler_locked()
        _set_text(self.status_label, f"Not sampling: the server is {state.lower()}.")
        if was_sampling:
            self.sig_sampling.emit(False)

    async def _stop_sampler_locked(self) -> None:
        """Let go of the shown server's sampler: paused (the service stops it when its server goes)."""
        sampler, self.sampler = self.sampler, None
        self._sampling_key = None
        if sampler is not None:
            sampler.pause()

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

    def clear_shown(self, why: str) -> None:
        """No snapshot for the server shown now (a host's, not answered yet): say why, no stale slots."""
        self.slots_model.set_rows([])
        _set_text(self.status_label, why)

    def request_tick(self) -> None:
        """Sample now (after a park/resume changed ``restored``)."""
        if self.sampler is not None:
            self.sampler.request_tick()

    @property
    def paused(self) -> bool:
        return self.sampler is not None and self.sampler.paused

    async def aclose(self) -> None:
        """Let go of the sampler shown (the server service's); leaves no task behind."""
        self._closed = True
        await self._tasks.cancel_all()
        async with self._get_lock():
            await self._stop_sampler_locked()
        if self._samplers is not None:
            self._samplers.unsubscribe(self._on_published)
