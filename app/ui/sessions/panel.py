"""Parked sessions: park, resume, check, delete, rename — one click each.

A thin face of :class:`app.sessions.protocol.Sessions` (a server here: its
:class:`app.sessions.service.SessionService`; a host's: app.servers.remote_sessions),
shown through its one entry point :meth:`SessionsPanel.set_sessions`, its controls
enabled from the sessions' capabilities: every decision (which
slot, which key, what to warn about, what a resume does to the catalog) is the
service's; this widget shows results, asks the user when the service says a
workflow needs confirmation, and keeps the window responsive (busy bar, queue
label). The CLI is the other face of the same service.

This module keeps the layout and follows the server (the glue); the parts are
mixed in from their own modules: the table, its filter box and the selection
(:mod:`app.ui.sessions.table`, over the Qt model/view classes of
:mod:`app.ui.sessions.model` and :mod:`app.ui.widgets.delegates`), park / resume / check
(:mod:`app.ui.sessions.actions`), rename / delete / delete older
(:mod:`app.ui.sessions.cleanup`); the dialogs are built in
:mod:`app.ui.sessions.dialogs`, the slot chooser is :mod:`app.ui.sessions.slot_chooser`.
"""

from __future__ import annotations

import asyncio
import logging
import weakref

from PySide6.QtCore import QTimer, Qt, Signal
from PySide6.QtWidgets import (QHBoxLayout, QInputDialog, QLabel, QLineEdit, QMessageBox, QProgressBar, QPushButton,
                               QVBoxLayout, QWidget)

from app import paths
from app.sessions.protocol import Sessions
from app.sessions.service import ServiceError, SessionService
from app.store.catalog import Catalog
from app.store.profiles import ProfileStore
from app.ui.widgets import theme
from app.ui.widgets.questions import AsksQuestions
from app.ui.sessions.actions import SessionActions
from app.ui.sessions.cleanup import SessionCleanup
from app.ui.sessions.dialogs import answer, chosen_folder, folder_dialog
# re-exported (__all__): the model, its columns and roles were defined here
from app.ui.sessions.model import (COL_AGE, COL_MODEL, COL_NAME, COL_RESTORE, COL_SAVED, COL_SIDECAR,
                                   COL_SIZE, COL_TOKENS, COL_VERDICT, COLUMNS, FILTER_ROLE, FIRST_CLICK_ORDER,
                                   SIDECAR_HELP, SORT_ROLE, VERDICT_ROLE, SessionsModel, ShownSessions, _age, _Row,
                                   _size, _when, filter_pattern)
from app.ui.sessions.table import SessionsTable
from app.ui.sessions.slot_chooser import SlotChooser
from app.ui.widgets.tasks import RunsTasks
from app.ui.widgets.common import wrapping_label
from app.ui.widgets.common import wrapping_label as _wrapping_label  # was defined here

log = logging.getLogger(__name__)

__all__ = ["SessionsPanel", "SLOTS_POLL_MS",
           # defined in app.ui.sessions.model (and app.ui.widgets.common), importable from here as before
           "SessionsModel", "ShownSessions", "filter_pattern", "SIDECAR_HELP", "COLUMNS", "COL_NAME", "COL_MODEL",
           "COL_TOKENS", "COL_SIZE", "COL_AGE", "COL_SIDECAR", "COL_RESTORE", "COL_SAVED", "COL_VERDICT",
           "FIRST_CLICK_ORDER", "SORT_ROLE", "FILTER_ROLE", "VERDICT_ROLE", "_Row", "_age", "_size", "_when",
           "_wrapping_label"]

SLOTS_POLL_MS = 2000


class SessionsPanel(SessionsTable, SessionActions, SessionCleanup, AsksQuestions, RunsTasks, QWidget):
    sig_changed = Signal()  # the catalog changed (parked, resumed, renamed, deleted, judged)
    sig_done = Signal(str, bool, str)  # operation label, ok, message
    sig_restored = Signal(int, object)  # slot, RestoredSlot
    sig_verdict = Signal(int, str, object)  # slot, session, Verdict
    sig_service = Signal(object)  # SessionService once connected (None when gone)

    def __init__(self, parent=None, *, catalog: Catalog | None = None, store: ProfileStore | None = None,
                 confirm=None):
        super().__init__(parent)
        self._owns_catalog = catalog is None
        self.catalog = catalog or Catalog(paths.catalog_path())
        self.store = store or ProfileStore()
        self.service: SessionService | None = None  # the session service of the server followed here
        self.sessions: Sessions | None = None  # what the tab shows and acts on: that service, or a host's
        self.controller = None
        # confirm(title, text) -> bool or awaitable bool; a test may replace the dialog.
        self.confirm = confirm or self._ask
        # ask_days() -> int or None (or awaitable): "Delete older than…"'s first question; a test may replace it.
        self.ask_days = self._ask_days
        self.question_box: QMessageBox | None = None
        self.days_dialog: QInputDialog | None = None
        self.report_dialog = None
        self._reading_slots = False
        self._hashing = False
        self._hash_tried: set = set()
        # The slot chooser follows the live /slots while the tab is visible
        # (the Monitor's ticks feed it too, but the Monitor pauses when hidden).
        self.slots_timer = QTimer(self)
        self.slots_timer.setInterval(SLOTS_POLL_MS)
        self.slots_timer.timeout.connect(self._on_slots_timer)
        self._tasks: set[asyncio.Task] = set()
        self._bound: weakref.WeakSet = weakref.WeakSet()  # the session services this tab hooked
        self._closed = False
        self._build()
        self.refresh()
        self._set_connected(False)

    # -- layout -----------------------------------------------------------
    def _build(self) -> None:
        self._build_table()
        self.delete_old_button = QPushButton("Delete older than…")
        self.delete_old_button.setToolTip("Delete the sessions last parked more than a number of days ago, with "
                                          "their files (asks for the days, then confirms with the count and size).")

        self.slot = SlotChooser()
        self.slot.setToolTip("The slot to park from, or to resume into. It follows the server's live /slots.")
        self.name = QLineEdit(placeholderText="session name (default: date, time and slot)")
        self.name.setToolTip("Name of the parked session. Parking under an existing name replaces it — only "
                             "after the new copy is safely on disk.")
        self.park_button = QPushButton("Park slot")
        self.park_button.setToolTip("Save the chosen slot's KV cache to disk as a session.")
        self.park_all_button = QPushButton("Park all")
        self.park_all_button.setToolTip("Park every slot that holds tokens.")
        self.park_stop_button = QPushButton("Park all && stop")
        self.park_stop_button.setToolTip("Park every non-empty slot, then stop the server: use it before a "
                                         "reboot. The next start of this profile offers to resume them all.")
        self.resume_button = QPushButton("Resume")
        self.resume_button.setToolTip("Load the selected session into the chosen slot (default: the slot it was "
                                      "parked from if empty, else an empty one).")
        self.check_button = QPushButton("Check resume…")
        self.check_button.setToolTip("Resume and send a probe to measure whether the prefill was skipped.")
        self.ab_button = QPushButton("A/B check…")
        self.ab_button.setToolTip("Resume the same state file with its sidecar and with the sidecar hidden, and "
                                  "compare the first query's prompt time (the seeds' proof table).")
        self.history_button = QPushButton("History…")
        self.history_button.setToolTip("Every resume, check and A/B run of this session over time.")
        self.rename_button = QPushButton("Rename…")
        self.delete_button = QPushButton("Delete")
        self.folder_button = QPushButton("Show in folder")
        self.resume_all_button = QPushButton("Resume all")
        self.resume_all_button.hide()
        self.busy = QProgressBar()
        self.busy.setRange(0, 0)
        self.busy.setMaximumWidth(160)
        self.busy.hide()
        self.queue_label = QLabel("")
        self.queue_label.setToolTip("Slot operations run one at a time per server; the rest wait here.")
        self.message = wrapping_label()
        self.message.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.hint = wrapping_label()
        self.hint.setStyleSheet("color: #666;")

        top = QHBoxLayout()
        top.addWidget(QLabel("Slot"))
        top.addWidget(self.slot)
        top.addWidget(self.name, 1)
        for b in (self.park_button, self.park_all_button, self.park_stop_button):
            top.addWidget(b)
        row2 = QHBoxLayout()
        for b in (self.resume_button, self.check_button, self.ab_button, self.history_button, self.rename_button,
                  self.delete_button, self.delete_old_button, self.folder_button, self.resume_all_button):
            row2.addWidget(b)
        row2.addStretch(1)
        row2.addWidget(self.queue_label)
        row2.addWidget(self.busy)
        filter_row = QHBoxLayout()
        filter_row.addWidget(self.filter, 1)
        filter_row.addWidget(self.shown_label)
        lay = QVBoxLayout(self)
        lay.addLayout(top)
        lay.addWidget(self.hint)
        lay.addLayout(filter_row)
        lay.addWidget(self.table, 1)
        lay.addWidget(self.usage_label)
        lay.addLayout(row2)
        lay.addWidget(self.message)

        self.park_button.clicked.connect(self._on_park)
        self.park_all_button.clicked.connect(lambda: self.spawn(self.park_all()))
        self.park_stop_button.clicked.connect(lambda: self.spawn(self.park_all_and_stop()))
        self.resume_button.clicked.connect(self._on_resume)
        self.check_button.clicked.connect(lambda: self._on_check(ab=False))
        self.ab_button.clicked.connect(lambda: self._on_check(ab=True))
        self.history_button.clicked.connect(self._on_history)
        self.rename_button.clicked.connect(self._on_rename)
        self.delete_button.clicked.connect(self._on_delete)
        self.delete_old_button.clicked.connect(lambda: self.spawn(self.delete_older()))
        self.folder_button.clicked.connect(self._on_folder)
        self.resume_all_button.clicked.connect(lambda: self.spawn(self.resume_planned()))

    @property
    def profile_name(self) -> str | None:
        return self.sessions.profile_name if self.sessions else None

    # -- server -----------------------------------------------------------
    def attach(self, controller) -> None:
        """Follow the server the controller shows: its session service is connected (and closed)
        by the server service (app.servers.service), and shared with the quit and logind paths."""
        self.controller = controller
        controller.sig_sessions.connect(self._on_sessions)
        controller.sig_notice.connect(lambda text, ok: None if ok or self._closed else self._say(text, ok=False))

    def _on_sessions(self, svc) -> None:
        if self._closed:
            return
        if svc is None:
            self._drop_service()
        else:
            self.spawn(self.bind_service(svc))

    def _drop_service(self) -> None:
        gone, self.service = self.service, None  # the server service closes it
        if self.sessions is None or self.sessions is gone:  # a host's server shown stays shown
            self.set_sessions(None)
        if gone is not None:
            self.sig_service.emit(None)

    def set_sessions(self, sessions: Sessions | None) -> None:
        """Show ``sessions`` (a server here, or a host's; None: no server): its records, its slots,
        the controls its capabilities allow. The tab's one entry point: nothing else sets them."""
        if self._closed:
            return
        self.sessions = sessions
        self.source_model.server_view = sessions.on_this_server if sessions is not None else None
        if sessions is not None and sessions not in self._bound:  # shown again after another server: hooked once
            self._bound.add(sessions)
            sessions.on_queue(lambda s=sessions: self.sessions is s and self._on_queue())
            sessions.on_change(lambda s=sessions: self.sessions is s and self._on_service_changed())
            sessions.on_restored(lambda slot, entry, s=sessions: self.sessions is s and
                                 self.sig_restored.emit(slot, entry))
            sessions.on_verdict(lambda *a, s=sessions: self.sessions is s and self._on_verdict(*a))
        self._on_queue()
        self._set_connected(sessions is not None)
        self.refresh()

    async def connect_service(self) -> SessionService | None:
        """The session service of the server the controller runs or watches (connected once)."""
        c = self.controller
        if c is None or c.handle is None:
            return None
        try:
            svc = await c.service.sessions(c.target_id)
        except ServiceError as e:
            self._say(f"Cannot connect the Sessions tab: {e}", ok=False)
            return None
        return await self.bind_service(svc)

    async def bind_service(self, svc: SessionService) -> SessionService | None:
        """Show ``svc``'s server in the tab: its sessions, its slots, its verdicts."""
        if self._closed:
            return None
        if self.service is svc:
            return svc
        self.service = svc
        first = svc not in self._bound  # shown again after another server (the server list)
        self.set_sessions(svc)
        if first:
            self.spawn(svc.warm_model_identity())
        await self._read_slots()
        if self.service is not svc:
            return None  # it went while the slots were read
        self.sig_service.emit(svc)
        if svc.recovery_messages:
            self._say("Recovered after an interruption: " + "; ".join(svc.recovery_messages), ok=True)
        self._profile = svc.profile
        self._offer_resume_all(svc.resume_plan(), auto=first)  # shown again: offered, never resumed unasked
        return svc

    def _on_service_changed(self) -> None:
        if not self._closed:
            self.refresh()
            self._set_connected(self.sessions is not None)  # a host's server may have started or stopped
            self.spawn(self._read_slots())  # the slots as they are after the change (a park, a host's answer)
            self.sig_changed.emit()

    # -- the slot chooser follows the live /slots ---------------------------
    async def _read_slots(self) -> None:
        if not self.sessions or self._reading_slots:
            return
        self._reading_slots = True
        try:
            rows = await self.sessions.slot_rows()
        except Exception as e:  # report: said on the hint line; the slot chooser stays empty
            log.warning("sessions tab: reading the server's slots failed", exc_info=e)
            self.hint.setText(f"Slots unavailable: {e}")
            rows = []
        finally:
            self._reading_slots = False
        self.set_slot_rows(rows)

    def _on_slots_timer(self) -> None:
        if self.sessions is not None and self.isVisible() and not self._closed:
            self.spawn(self._read_slots())

    def showEvent(self, event) -> None:  # noqa: N802
        super().showEvent(event)
        self._on_slots_timer()

    def set_slot_rows(self, rows) -> None:
        """Show ``rows`` (SlotRows of this server, e.g. from each Monitor tick) in the chooser."""
        if self._closed:
            return
        self.slot.set_rows(rows)

    def _set_connected(self, on: bool) -> None:
        """The controls the shown sessions' capabilities allow (app.sessions.protocol), while their server runs."""
        s = self.sessions if on else None
        caps = s.capabilities if s is not None else None
        live = s is not None and s.running
        if live:
            self.slots_timer.start()
        else:
            self.slots_timer.stop()
        for b, can in ((self.park_button, "park"), (self.park_all_button, "park_all"),
                       (self.park_stop_button, "park_and_stop"), (self.resume_button, "resume"),
                       (self.check_button, "check"), (self.ab_button, "check"), (self.slot, "resume"),
                       (self.name, "park")):
            b.setEnabled(live and getattr(caps, can))
        for b in (self.history_button, self.rename_button, self.delete_button, self.delete_old_button,
                  self.folder_button):  # this machine's catalog and folders: listed with or without a server
            b.setEnabled(caps is None or caps.local_files)
        if caps is None or not caps.resume_all:
            self.resume_all_button.hide()
        if s is None:
            self.hint.setText("Start or attach to a server to park and resume. Parked sessions stay listed.")
            self.slot.forget()
        else:
            self.hint.setText(s.describe())

    def _on_queue(self) -> None:
        labels = self.sessions.queue_labels() if self.sessions else []
        self.queue_label.setText(" · ".join(labels))
        self.busy.setVisible(bool(labels))

    # -- running actions ---------------------------------------------------
    def _task_failed(self, exc: BaseException) -> None:
        self._say(f"Failed: {exc}", ok=False)

    def _say(self, text: str, ok: bool = True, label: str = "") -> None:
        if self._closed:
            return
        theme.tint(self.message, "" if ok else "color: {crit};")
        self.message.setText(text)
        self.sig_done.emit(label, ok, text)

    def _chosen_slot(self) -> int | None:
        return self.slot.currentData()

    async def _ensure_save_dir(self) -> bool:
        if self.sessions is None:
            self._say("Start or attach to a server first.", ok=False)
            return False
        if self.sessions.save_dir is None and self.sessions.capabilities.choose_save_dir:
            self.folder_dialog = dlg = folder_dialog(self)
            try:
                folder = await answer(dlg, lambda r: chosen_folder(dlg, r))
            finally:
                self.folder_dialog = None
            if not folder or self.service is None:
                return False
            self.service.set_save_dir(folder)
            self._set_connected(True)
        return True

    # -- closing -------------------------------------------------------------

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.slots_timer.stop()
        if self.controller is not None:
            self.controller.sig_sessions.disconnect(self._on_sessions)
        await self.end_tasks()
        self.service = None  # the server service closes it with its server
        if self._owns_catalog:
            self.catalog.close()
