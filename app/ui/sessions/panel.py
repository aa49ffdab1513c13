"""Parked sessions: park, resume, check, delete, rename — one click each.

The Sessions tab is two objects: this widget (:class:`SessionsPanel`: the slot chooser, the
buttons, the table widget :class:`~app.ui.sessions.table.SessionsTable`, the message line)
and its :class:`~app.ui.sessions.controller.SessionsController` (the workflows over one
:class:`app.sessions.protocol.Sessions`: a server here, its
:class:`app.sessions.service.SessionService`, or a host's, app.servers.remote_sessions; and
typed signals of their outcomes). A click reads the widgets and calls the controller; the
widget shows what the controller's signals say, its controls enabled from the shown
sessions' capabilities. The tray, the first-run guide and the menus subscribe to the
controller's signals and call the panel's public actions (:meth:`park_chosen`,
:meth:`resume_selected`, …); none reads a label's text. The CLI is the other face of the same service.
"""

from __future__ import annotations

from PySide6.QtCore import QUrl, Qt
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (QHBoxLayout, QLabel, QLineEdit, QProgressBar, QPushButton, QSizePolicy, QVBoxLayout,
                               QWidget)

from app.sessions.records import describe_usage, disk_usage
from app.ui.sessions.checks import Checks
from app.ui.sessions.controller import SessionsController
from app.ui.sessions.dialogs import ask_new_name, history_dialog
from app.ui.sessions.housekeeping import Housekeeping
from app.ui.sessions.slot_chooser import SlotChooser
from app.ui.sessions.table import SessionsTable
from app.ui.widgets import theme
from app.ui.widgets.common import wrapping_label


def _button(text: str, tip: str = "") -> QPushButton:
    b = QPushButton(text)
    b.setToolTip(tip)
    return b


class SessionsPanel(QWidget):
    def __init__(self, controller: SessionsController, parent=None):
        super().__init__(parent)
        self.controller = controller
        controller.set_dialog_parent(self)
        self.housekeeping = Housekeeping(controller)
        self.checks = Checks(controller)
        self.report_dialog = None
        self.history_dialog = None
        # The slot chooser shows the server's one slot picture (app.ui.sessions.slot_picture): its
        # sampler's snapshots and the reads a park or a resume made, never a poll of its own.
        self._build()
        c = controller
        c.said.connect(self._show_message)
        c.changed.connect(self.refresh)
        c.connected.connect(self._set_connected)
        c.queue_changed.connect(self._show_queue)
        c.slots_changed.connect(self.set_slot_rows)
        c.plan_offered.connect(self._show_plan)
        c.parked.connect(lambda result: self.list.select(result.record.name))
        c.checked.connect(self._show_report)
        self.refresh()
        self._set_connected(False)

    # -- layout -----------------------------------------------------------
    def _build(self) -> None:
        self.list = lst = SessionsTable()
        # the table widget's parts, as tests and the drag-and-drop (app.ui.sessions.move) reach them
        self.table, self.model, self.source_model = lst.view, lst.model, lst.source_model
        self.filter, self.shown_label, self.usage_label = lst.filter, lst.shown_label, lst.usage_label
        self.slot = SlotChooser()
        self.slot.setToolTip("The slot to park from, or to resume into. It follows the server's live /slots.")
        self.name = QLineEdit(placeholderText="session name (default: date, time and slot)")
        self.name.setToolTip("Name of the parked session. Parking under an existing name replaces it — only "
                             "after the new copy is safely on disk.")
        self.name.setMinimumWidth(80)
        self.park_button = _button("Park slot", "Save the chosen slot's KV cache to disk as a session.")
        self.park_all_button = _button("Park all", "Park every slot that holds tokens.")
        self.park_stop_button = _button("Park all && stop", "Park every non-empty slot, then stop the server: use "
                                        "it before a reboot. The next start of this profile offers to resume them all.")
        self.resume_button = _button("Resume", "Load the selected session into the chosen slot (default: the slot "
                                     "it was parked from if empty, else an empty one).")
        self.check_button = _button("Check resume…", "Resume and send a probe to measure whether the prefill was "
                                    "skipped.")
        self.ab_button = _button("A/B check…", "Resume the same state file with its sidecar and with the sidecar "
                                 "hidden, and compare the first query's prompt time (the seeds' proof table).")
        self.history_button = _button("History…", "Every resume, check and A/B run of this session over time.")
        self.rename_button = _button("Rename…")
        self.delete_button = _button("Delete")
        self.delete_old_button = _button("Delete older than…", "Delete the sessions last parked more than a number "
                                         "of days ago, with their files (asks for the days, then confirms with the "
                                         "count and size).")
        self.folder_button = _button("Show in folder")
        self.resume_all_button = _button("Resume all")
        self.resume_all_button.hide()
        self.busy = QProgressBar()
        self.busy.setRange(0, 0)
        self.busy.setMaximumWidth(160)
        self.busy.hide()
        # the labels of the operations waiting: never wider than the room the row has
        self.queue_label = QLabel("")
        self.queue_label.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)
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
        # two rows of actions: what acts on the server, then the catalog's housekeeping
        row2 = QHBoxLayout()
        for b in (self.resume_button, self.resume_all_button, self.check_button, self.ab_button,
                  self.history_button):
            row2.addWidget(b)
        row2.addWidget(self.queue_label, 1)
        row2.addWidget(self.busy)
        row3 = QHBoxLayout()
        for b in (self.rename_button, self.delete_button, self.delete_old_button, self.folder_button):
            row3.addWidget(b)
        row3.addStretch(1)
        lay = QVBoxLayout(self)
        lay.addLayout(top)
        lay.addWidget(self.hint)
        lay.addWidget(lst, 1)
        lay.addLayout(row2)
        lay.addLayout(row3)
        lay.addWidget(self.message)

        c = self.controller
        self.park_button.clicked.connect(self.park_chosen)
        self.park_all_button.clicked.connect(self.park_all)
        self.park_stop_button.clicked.connect(lambda: c.spawn(c.park_all_and_stop()))
        self.resume_button.clicked.connect(self.resume_selected)
        lst.activated.connect(self.resume_selected)
        self.check_button.clicked.connect(lambda: self._check(ab=False))
        self.ab_button.clicked.connect(lambda: self._check(ab=True))
        self.history_button.clicked.connect(self._on_history)
        self.rename_button.clicked.connect(self._on_rename)
        self.delete_button.clicked.connect(self._on_delete)
        self.delete_old_button.clicked.connect(lambda: c.spawn(self.delete_older()))
        self.folder_button.clicked.connect(self._on_folder)
        self.resume_all_button.clicked.connect(self.resume_all)

    # -- the public actions (the buttons, the menus, the tray) ------------------
    def can_park(self) -> bool:
        return self.park_button.isEnabled()

    def can_park_all(self) -> bool:
        return self.park_all_button.isEnabled()

    def can_resume(self) -> bool:
        return self.resume_button.isEnabled()

    def park_chosen(self) -> None:
        """Park the chosen slot under the name typed (this machine's server, or the shown host's)."""
        self.controller.spawn(self.controller.park(self.slot.currentData(), self.name.text().strip() or None))

    def park_all(self) -> None:
        self.controller.spawn(self.controller.park_all())

    def resume_selected(self) -> None:
        """Resume the selected session into the chosen slot."""
        rec = self.selected()
        if rec is None:
            self.controller.say("Select a session to resume.", ok=False)
            return
        self.controller.spawn(self.controller.resume(rec.name, self.slot.currentData()))

    def resume_all(self) -> None:
        self.controller.spawn(self.controller.resume_planned())

    def _check(self, ab: bool) -> None:
        rec = self.selected()
        if rec is None or self.controller.sessions is None:
            self.controller.say("Select a session to check.", ok=False)
            return
        self.controller.spawn(self.checks.check(rec.name, self.slot.currentData(), ab=ab))

    def _show_report(self, report, history) -> None:
        from app.ui.dialogs.check import CheckDialog

        self.report_dialog = CheckDialog(report, self, history=history)
        self.report_dialog.show()

    def _on_history(self) -> None:
        rec = self.selected()
        if rec is not None:
            self.history_dialog = dlg = history_dialog(self, rec.name, self.controller.catalog.history(rec.id))
            dlg.show()

    def _on_rename(self) -> None:
        rec = self.selected()
        new = ask_new_name(self, rec.name) if rec is not None else None
        if new is not None and self.housekeeping.rename(rec.name, new, rec.profile):
            self.select(new)

    def _on_delete(self) -> None:
        rec = self.selected()
        if rec is not None:
            self.controller.spawn(self.housekeeping.confirm_then_delete(rec))

    async def delete_older(self):
        """'Delete older than…' (:meth:`Housekeeping.delete_older`), one at a time."""
        self.delete_old_button.setEnabled(False)
        try:
            return await self.housekeeping.delete_older(filtered=self.list.filtered())
        finally:
            if not self.controller.closed:
                self.delete_old_button.setEnabled(True)

    def _on_folder(self) -> None:
        rec, svc = self.selected(), self.controller.service
        folder = rec.save_dir if rec else (svc.save_dir if svc else None)
        if folder:
            QDesktopServices.openUrl(QUrl.fromLocalFile(str(folder)))

    # -- the table ---------------------------------------------------------------
    def refresh(self) -> None:
        """The shown sessions' records (this machine's catalog, or a host's), or the catalog's without a server."""
        if self.controller.closed:
            return
        records = self.controller.records()
        usage = disk_usage(self.controller.catalog, records=records)
        self.list.show_records(records, "; ".join(describe_usage(p, u) for p, u in usage.items())
                               or "No parked sessions.")

    def selected(self):
        return self.list.selected()

    def select(self, name: str, profile: str | None = None, *, session_id: int | None = None) -> bool:
        return self.list.select(name, profile, session_id=session_id)

    # -- what the controller says --------------------------------------------------
    def say(self, text: str, ok: bool = True, op=None) -> None:
        self.controller.say(text, ok, op)

    def _show_message(self, _op, ok: bool, text: str) -> None:
        theme.tint(self.message, "" if ok else "color: {crit};")
        self.message.setText(text)

    def set_busy(self, on: bool) -> None:
        self.busy.setVisible(on)

    def _show_queue(self, labels: list) -> None:
        self.queue_label.setText(" · ".join(labels))
        self.queue_label.setToolTip(" · ".join(labels) or "Slot operations run one at a time per server; the rest "
                                                           "wait here.")
        self.busy.setVisible(bool(labels))

    def _show_plan(self, plan: list) -> None:
        s = self.controller.sessions
        if not plan or s is None or not s.capabilities.resume_all:
            self.resume_all_button.hide()
            return
        self.resume_all_button.setText(f"Resume all ({len(plan)})")
        self.resume_all_button.setToolTip("Parked before the server went away: " + ", ".join(
            f"{e.session} → slot {e.slot}" for e in plan))
        self.resume_all_button.show()

    def set_slot_rows(self, rows) -> None:
        """Show ``rows`` (SlotRows of this server: its one slot picture) in the chooser."""
        if not self.controller.closed:
            self.slot.set_rows(rows)

    def _set_connected(self, on: bool) -> None:
        """The controls the shown sessions' capabilities allow (app.sessions.protocol), while their server runs."""
        s = self.controller.sessions if on else None
        caps = s.capabilities if s is not None else None
        live = s is not None and s.running
        self.source_model.server_view = s.on_this_server if s is not None else None
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

    async def aclose(self) -> None:
        await self.controller.aclose()
