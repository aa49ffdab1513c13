"""The Cache health tab: what the server's log says, the known issue, and the fix in one click.

The detectors are Qt-free (app.tools.cache_health); the remedy workflow too
(app.tools.remedy). This panel lists the findings with their time, slot and
source, shows the figures (idle-slot save durations, forced re-processing,
checkpoints, slot selection), and applies a remedy when the user clicks it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (QHBoxLayout, QHeaderView, QLabel, QPushButton, QSizePolicy,
                               QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget)

from app.core.findings import Finding, Severity
from app.tools.cache_health import CacheHealth
from app.monitor.rpc import RpcWatcher
from app.core.states import ServerState
from app.ui.widgets import theme
from app.ui.widgets.questions import Questions
from app.ui.widgets.tasks import Tasks

log = logging.getLogger(__name__)

COLUMNS = ["Time", "Slot", "Severity", "Finding", "Known from"]
SEVERITY_ROLES = {Severity.ERROR: "crit", Severity.WARNING: "warn", Severity.INFO: "muted"}


class HealthPanel(QWidget):
    sig_findings = Signal(int, object)  # number of findings, worst Severity (None: none)
    sig_remedy_done = Signal(bool, str)  # ok, what happened

    def __init__(self, parent=None, *, store=None, confirm=None):
        super().__init__(parent)
        self.store = store
        self.shown: str | None = None  # the server the window shows: its own log's findings
        self._healths: dict[str | None, CacheHealth] = {}
        self.health = self._health_for(None)
        self.controller = None
        self.sessions = None  # the SessionsPanel: its service parks and resumes
        self.window_ref = None  # the MainWindow: to show the new profile
        self._restored_at_crash: dict = {}
        self._last_service = None
        # a test may answer in place of the box: questions.confirm(title, text) -> bool
        self.questions = Questions(self, confirm)
        self.tasks = Tasks("HealthPanel", self._task_failed)
        self._closed = False
        self.rpc: RpcWatcher | None = None  # the RPC workers of the running profile (--rpc)
        self._rpc_reported: set[str] = set()  # rule:endpoint already in the table for this run
        self._build()

    # -- layout ---------------------------------------------------------------
    def _build(self) -> None:
        intro = QLabel("Runtime detectors over the server's own log: crash causes, idle-slot save stalls, forced "
                       "full re-processing, checkpoints. Each finding names the known issue and, when there is "
                       "one, the fix — applied to a copy of the profile, parking your slots first and resuming "
                       "them after.")
        intro.setWordWrap(True)
        intro.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.verticalHeader().hide()
        self.table.setSelectionBehavior(QTableWidget.SelectRows)
        self.table.setSelectionMode(QTableWidget.SingleSelection)
        self.table.setEditTriggers(QTableWidget.NoEditTriggers)
        self.table.setWordWrap(True)
        hh = self.table.horizontalHeader()
        hh.setSectionResizeMode(QHeaderView.ResizeToContents)
        hh.setSectionResizeMode(3, QHeaderView.Stretch)
        self.table.itemSelectionChanged.connect(self._show_remedies)
        self.detail = QLabel("No finding: the server's log shows no cache trouble.")
        self.detail.setWordWrap(True)
        self.detail.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)
        self.detail.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.remedy_row = QHBoxLayout()
        self.remedy_buttons: list[QPushButton] = []
        self.figures = QLabel("")
        self.figures.setWordWrap(True)
        self.figures.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)
        self.figures.setStyleSheet("font-family: monospace;")
        self.message = QLabel("")
        self.message.setWordWrap(True)
        self.message.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)
        lay = QVBoxLayout(self)
        lay.addWidget(intro)
        lay.addWidget(self.table, 1)
        lay.addWidget(self.detail)
        lay.addLayout(self.remedy_row)
        lay.addWidget(self.message)
        self.rpc_label = QLabel("")  # one line per RPC worker: reachable, RTT; hidden without --rpc
        self.rpc_label.setWordWrap(True)
        self.rpc_label.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)
        self.rpc_label.hide()
        lay.addWidget(self.rpc_label)
        lay.addWidget(self.figures)
        self.figures_timer = QTimer(self)
        self.figures_timer.setInterval(1000)
        self.figures_timer.timeout.connect(self._show_figures)
        self._show_figures()

    # -- following the server ------------------------------------------------------
    def attach(self, controller, sessions=None, window=None) -> None:
        self.controller = controller
        self.sessions = sessions
        self.window_ref = window
        controller.sig_plan.connect(self._on_plan)
        controller.sig_crashed.connect(self._on_crashed)
        controller.sig_state.connect(self._on_state)
        controller.sig_selected.connect(self._on_selected)
        if sessions is not None:
            sessions.service_changed.connect(self._on_service)

    def _health_for(self, target_id: str | None) -> CacheHealth:
        """Each server's detectors over its own log (a server list shows several)."""
        if target_id not in self._healths:
            health = self._healths[target_id] = CacheHealth()
            health.on_finding(lambda f, tid=target_id: self._on_finding(f) if tid == self.shown else None)
        return self._healths[target_id]

    def _on_selected(self, target_id: str) -> None:
        """Another server shown: its findings and figures, not the others'."""
        self.shown = target_id or None
        self.health = self._health_for(self.shown)
        self.table.setRowCount(0)
        for f in list(self.health.findings):
            self._add_row(f)
        if not self.health.findings:
            self.detail.setText("No finding: the server's log shows no cache trouble.")
            self._show_remedies()
        self.sig_findings.emit(len(self.health.findings), self.health.worst)
        self._show_figures()

    def _on_plan(self, _plan) -> None:
        sup = self.controller.supervisor
        if sup is not None:
            sup.on_line(self._health_for(self.controller.target_id).feed)
        self._watch_rpc(sup)

    # -- RPC workers (app.monitor.rpc) ------------------------------------------------
    def _watch_rpc(self, sup) -> None:
        if self.rpc is not None:
            self.tasks.spawn(self.rpc.stop())
        profile = self.controller.profile if self.controller is not None else None
        self.rpc, self._rpc_reported = None, set()
        if profile is None or not profile.rpc or sup is None:
            self.rpc_label.hide()
            return
        self.rpc = RpcWatcher(profile.rpc, pid=lambda: sup.pid)
        sup.on_line(self._rpc_line)
        self.rpc.on_change(lambda _st: self._show_rpc())
        self.rpc.start()
        self.rpc_label.setText("RPC workers: checking…")
        self.rpc_label.show()

    def _rpc_line(self, line) -> None:
        if self.rpc is not None and self.rpc.feed(line) is not None:
            self._show_rpc()

    def _show_rpc(self) -> None:
        if self._closed or self.rpc is None:
            return
        self.rpc_label.setText("RPC workers: " + "; ".join(st.describe() for st in self.rpc.statuses.values()))
        for f in self.rpc.findings:
            key = f"{f.rule_id}:{f.details.get('endpoint', '')}"
            if key not in self._rpc_reported:  # each worker's trouble once per run, in the findings table
                self._rpc_reported.add(key)
                self.health.findings.append(f)
                self._on_finding(f)

    def _on_service(self, service) -> None:
        if service is not None:
            self._last_service = service

    def _on_state(self, state, _detail) -> None:
        if state == ServerState.READY:
            self.figures_timer.start()
        elif state in (ServerState.STOPPED, ServerState.CRASHED):
            self.figures_timer.stop()
            self._show_figures()
            if self.rpc is not None:
                self.tasks.spawn(self.rpc.stop())  # the last statuses stay shown

    def _on_crashed(self, outcome) -> None:
        svc = self._last_service
        self._restored_at_crash = dict(svc.target.restored) if svc is not None else {}
        self.health.crashed(outcome)

    # -- findings ---------------------------------------------------------------
    def _on_finding(self, f: Finding) -> None:
        if self._closed:
            return
        self._add_row(f)
        self.sig_findings.emit(len(self.health.findings), self.health.worst)
        self._show_figures()

    def _add_row(self, f: Finding) -> None:
        row = self.table.rowCount()
        self.table.insertRow(row)
        values = [time.strftime("%H:%M:%S", time.localtime(f.at or time.time())),
                  "-" if f.slot is None else str(f.slot), str(f.severity), f.message, f.source]
        for col, v in enumerate(values):
            item = QTableWidgetItem(v)
            item.setToolTip(f.message if col == 3 else v)
            if col == 2:
                item.setForeground(theme.colour(SEVERITY_ROLES.get(f.severity, "muted")))
            self.table.setItem(row, col, item)
        self.table.selectRow(row)

    def selected(self) -> Finding | None:
        rows = self.table.selectionModel().selectedRows()
        return self.health.findings[rows[0].row()] if rows else None

    def _show_remedies(self) -> None:
        for b in self.remedy_buttons:
            self.remedy_row.removeWidget(b)
            b.deleteLater()
        self.remedy_buttons = []
        f = self.selected()
        if f is None:
            return
        self.detail.setText(f"<b>{f.severity}</b>: {f.message}<br><i>Known from: {f.source or '-'}</i>")
        todo = [r.label for r in f.remedies if not r.changes]  # done elsewhere (on a worker's machine): said
        if todo:
            self.detail.setText(self.detail.text() + "".join(f"<br>To do: {t}" for t in todo))
        for remedy in (r for r in f.remedies if r.changes):
            b = QPushButton(f"Apply: {remedy.label}")
            b.setToolTip("Apply this change to a copy of the profile and restart the server with it. Slots that "
                         "hold tokens are parked first and resumed after the restart.")
            b.clicked.connect(lambda _=False, r=remedy, fi=f: self.tasks.spawn(self.apply(fi, r)))
            self.remedy_row.addWidget(b)
            self.remedy_buttons.append(b)
        self.remedy_row.addStretch(0)

    def _show_figures(self) -> None:
        fig = self.health.figures
        lines = []
        if fig.idle_save_count:
            lines.append(f"Idle-slot / prompt-cache saves: {fig.idle_save_count:,}, worst "
                         f"{fig.worst_idle_save_ms:,.0f} ms")
            prev = 0
            for bound, n in fig.histogram():
                label = f"> {prev:g} ms" if bound == float("inf") else f"{prev:g}–{bound:g} ms"
                lines.append(f"  {label:>14} {'█' * min(n, 40)} {n}")
                prev = bound
        else:
            lines.append("Idle-slot / prompt-cache saves: none seen")
        reproc = ", ".join(f"slot {s}: {n}" for s, n in sorted(fig.full_reprocess.items())) or "none"
        lines.append(f"Forced full re-processing: {reproc}")
        lines.append(f"Context checkpoints: {fig.checkpoints_created} created, {fig.checkpoints_erased} erased, "
                     f"{fig.checkpoints_restored} rolled back to, {fig.sidecar_checkpoints_loaded} loaded from "
                     "sidecars")
        sel = ", ".join(f"{k}: {v}" for k, v in fig.slot_selection.most_common()) or "none yet"
        lines.append(f"How requests picked their slot: {sel}")
        self.figures.setText("\n".join(lines))

    # -- the remedy -------------------------------------------------------------
    def _task_failed(self, exc: BaseException) -> None:
        self._say(f"The remedy failed: {exc}", ok=False)

    def _say(self, text: str, ok: bool = True) -> None:
        if self._closed:
            return
        theme.tint(self.message, "" if ok else "color: {crit};")
        self.message.setText(text)
        self.sig_remedy_done.emit(ok, text)

    async def apply(self, finding: Finding, remedy) -> object | None:
        from app.tools.remedy import apply_remedy, fixed_copy

        c = self.controller
        profile = c.profile if c is not None else None
        if profile is None or c.attached is not None:
            self._say("Only a server KV Valet launched from a profile can be restarted with a fix.", ok=False)
            return None
        new = fixed_copy(profile, remedy, finding.rule_id)
        running = c.state == ServerState.READY and self.sessions is not None and self.sessions.service is not None
        question = (f"{remedy.label}.\n\nKV Valet saves a copy of profile '{profile.name}' as '{new.name}' with "
                    "this change and restarts the server with it. "
                    + ("Every slot that holds tokens is parked first and resumed after the restart."
                       if running else "The sessions that had been resumed into the crashed server are resumed."))
        if not await self.questions.confirmed("Apply the remedy", question):
            self._say("Remedy not applied.")
            return None
        self._say(f"Applying: {remedy.label}…")
        outcome = await apply_remedy(profile, remedy, finding.rule_id,
                                     service=self.sessions.service if running else None,
                                     restored=None if running else self._restored_at_crash,
                                     store=self.store, restart=self._restart)
        if self.window_ref is not None:
            self.window_ref.reload_profiles(select=outcome.profile.name)
        self._say("Remedy applied: " + outcome.summary() + ". The verdicts come with the next query on each slot.")
        return outcome

    async def _restart(self, profile):
        """Stop the server, start ``profile``, and return the session service connected to it."""
        connected = asyncio.get_running_loop().create_future()

        def on_service(svc) -> None:
            if svc is not None and not connected.done():
                connected.set_result(svc)

        self.sessions.service_changed.connect(on_service)
        try:
            await self.controller.stop_async()
            if not await self.controller.start_async(profile):
                return None
            return await asyncio.wait_for(connected, 60)
        finally:
            self.sessions.service_changed.disconnect(on_service)


    async def aclose(self) -> None:
        self._closed = True
        self.figures_timer.stop()
        if self.rpc is not None:
            await self.rpc.stop()
        await self.tasks.end()
