"""Parked sessions: park, resume, check, delete, rename — one click each.

A thin face of :class:`app.jobs.service.SessionService`: every decision (which
slot, which key, what to warn about, what a resume does to the catalog) is the
service's; this widget shows results, asks the user when the service says a
workflow needs confirmation, and keeps the window responsive (busy bar, queue
label). The CLI is the other face of the same service.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from pathlib import Path
from typing import Any

from PySide6.QtCore import (QAbstractTableModel, QModelIndex, QRegularExpression, QSortFilterProxyModel, Qt, QTimer,
                            QUrl, Signal)
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (QAbstractItemView, QComboBox, QDialog, QFileDialog, QHBoxLayout, QHeaderView,
                               QInputDialog, QLabel, QLineEdit, QMessageBox, QProgressBar, QPushButton, QStyle,
                               QTableView, QVBoxLayout, QWidget)

from app import paths
from app.core.verdict import TIME_SAVED_HELP, Verdict, VerdictKind, format_duration
from app.jobs.resume import ResumeFailed, ResumeNeedsConfirmation, ResumeRefused
from app.jobs.service import NeedsConfirmation, ServiceError, SessionService
from app.jobs.sessions import (cutoff, delete_older_than, describe_usage, disk_usage, list_sessions, older_than,
                               usage_of)
from app.jobs.slots import Purpose, default_slot
from app.monitor.slots import RestoredSlot, SlotRow
from app.server.sidecar import SidecarStatus
from app.server.supervisor import ServerState
from app.store.catalog import Catalog, CatalogError, SessionRecord
from app.store.profiles import ProfileStore
from app.ui import theme
from app.ui.questions import AsksQuestions
from app.ui.tasks import RunsTasks

log = logging.getLogger(__name__)

SIDECAR_HELP = {
    "present": "A checkpoint sidecar was saved with this session: a resume after a restart can roll back a few "
               "tokens instead of re-reading the whole chat.",
    "missing": "No checkpoint sidecar: on this sliding-window/hybrid model the first query after a restart will "
               "re-prefill the whole session. A server build that writes sidecars (turboquant PR #206) fixes it.",
    "invalid": "The sidecar is damaged or does not belong to this state file, so it will not help the resume.",
    "not needed": "A dense model keeps every position: resumes need no checkpoint.",
    "present, unverified": "A companion checkpoint file is there, in a format KV Valet cannot check.",
}
SLOTS_POLL_MS = 2000
COLUMNS = ["Name", "Model", "Tokens", "Size", "Age", "Sidecar", "Last restore", "Time saved", "Verdict"]
(COL_NAME, COL_MODEL, COL_TOKENS, COL_SIZE, COL_AGE, COL_SIDECAR, COL_RESTORE, COL_SAVED,
 COL_VERDICT) = range(len(COLUMNS))
#: The order a first click on a header sorts in: biggest, oldest and most recent restore first.
FIRST_CLICK_ORDER = {COL_TOKENS: Qt.DescendingOrder, COL_SIZE: Qt.DescendingOrder, COL_AGE: Qt.DescendingOrder,
                     COL_RESTORE: Qt.DescendingOrder, COL_SAVED: Qt.DescendingOrder}
SORT_ROLE = int(Qt.UserRole) + 1  # numbers for numeric columns, case-folded text for the others
FILTER_ROLE = int(Qt.UserRole) + 2  # column 0: name, model file, profile and verdict, for the filter box
# Plain ints: looking up and comparing a PySide6 enum costs microseconds, and a sort or a
# repaint of a thousand rows calls data() tens of thousands of times.
_DISPLAY, _DECORATION, _TOOLTIP = int(Qt.DisplayRole), int(Qt.DecorationRole), int(Qt.ToolTipRole)
_FOREGROUND, _ALIGNMENT = int(Qt.ForegroundRole), int(Qt.TextAlignmentRole)
_INITIAL_SORT_ORDER = int(Qt.InitialSortOrderRole)
_RIGHT = int((Qt.AlignRight | Qt.AlignVCenter).value)


def _age(ts: float | None) -> str:
    if not ts:
        return "-"
    d = max(0, time.time() - ts)
    for unit, sec in (("d", 86400), ("h", 3600), ("min", 60)):
        if d >= sec:
            return f"{d / sec:.0f} {unit} ago"
    return "just now"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))


class _Row:
    """What the table shows of one record, worked out once per change of the record
    (a repaint of a thousand rows asks for these many times)."""

    __slots__ = ("cells", "sort", "haystack", "verdict")

    def __init__(self, r: SessionRecord):
        model = Path(r.model_path).name
        size = r.state_size + r.sidecar_size
        verdict = str(r.last_verdict) if r.last_verdict else ""
        saved = format_duration(r.time_saved_s) if r.time_saved_s or r.last_time_saved_s is not None else "-"
        self.cells = (r.name, model or "-", f"{r.n_tokens:,}", _size(size), None,
                      r.sidecar_status + (f" ({r.sidecar_count})" if r.sidecar_count else ""), None,
                      saved, verdict or "-")
        self.sort = (r.name.casefold(), model.casefold(), r.n_tokens, float(size), -float(r.updated_at or 0.0),
                     str(r.sidecar_status), -1.0 if r.last_restore_ms is None else float(r.last_restore_ms),
                     float(r.time_saved_s or 0.0), verdict.casefold())
        self.haystack = "  ".join((r.name, model, r.profile, verdict))
        self.verdict = verdict


class SessionsModel(QAbstractTableModel):
    """The sessions, in the catalog's order (most recently parked first).

    :meth:`set_records` changes only what changed: nothing when a refresh finds
    the same records (selection, scroll position and sort stay as they are), the
    changed rows when the same sessions are listed in the same order, and a
    reset otherwise. The view sorts and filters through a
    :class:`QSortFilterProxyModel` (``SORT_ROLE``, ``FILTER_ROLE``).
    """

    def __init__(self, parent=None):
        super().__init__(parent)
        self.records: list[SessionRecord] = []
        self._rows: list[_Row] = []
        self.icon_for: dict = {}  # sidecar status -> QIcon, set by the panel from its style
        # what the running server's own loader does with a record's sidecar (the session
        # service's answer, asked when a tooltip is shown); None without a server
        self.server_view = None

    def set_records(self, records: list[SessionRecord]) -> bool:
        """Show ``records``; False when they are what is shown already."""
        records = list(records)
        if records == self.records:
            return False
        if [r.id for r in records] == [r.id for r in self.records]:
            last = len(COLUMNS) - 1
            for i, (old, new) in enumerate(zip(self.records, records)):
                if old != new:
                    self.records[i] = new
                    self._rows[i] = _Row(new)
                    self.dataChanged.emit(self.index(i, 0), self.index(i, last))
            return True
        self.beginResetModel()
        self.records = records
        self._rows = [_Row(r) for r in records]
        self.endResetModel()
        return True

    def row_of(self, *, session_id: int | None = None, name: str | None = None,
               profile: str | None = None) -> int | None:
        """The row of a session (by id, or by name and, if given, profile); None if not listed."""
        for i, r in enumerate(self.records):
            if (r.id == session_id if session_id is not None else
                    r.name == name and (profile is None or r.profile == profile)):
                return i
        return None

    def rowCount(self, parent=QModelIndex()) -> int:  # noqa: N802
        return 0 if parent.isValid() else len(self.records)

    def columnCount(self, parent=QModelIndex()) -> int:  # noqa: N802
        return len(COLUMNS)

    def headerData(self, section, orientation, role=Qt.DisplayRole):  # noqa: N802
        if orientation == Qt.Horizontal:
            if role == _DISPLAY:
                return COLUMNS[section]
            if role == _INITIAL_SORT_ORDER:
                return FIRST_CLICK_ORDER.get(section, Qt.AscendingOrder).value  # an int, as Qt reads it
            if role == _TOOLTIP and section == COL_AGE:
                return "Time since the session was last parked (or renamed)."
            if role == _TOOLTIP and section == COL_SAVED:
                return TIME_SAVED_HELP
        return None

    def data(self, index: QModelIndex, role: int = _DISPLAY) -> Any:
        row, col = index.row(), index.column()
        if row < 0:
            return None
        if role == SORT_ROLE:
            return self._rows[row].sort[col]
        if role == _DISPLAY:
            text = self._rows[row].cells[col]
            if text is None:  # relative times: worked out when shown, so they do not go stale
                r = self.records[row]
                if col == COL_AGE:
                    return _age(r.updated_at)
                return (f"{r.last_restore_ms:,.0f} ms, {_age(r.last_restore_at)}"
                        if r.last_restore_ms is not None else "never")
            return text
        if role == FILTER_ROLE:
            return self._rows[row].haystack
        if role == _DECORATION:
            return self.icon_for.get(self.records[row].sidecar_status) if col == COL_SIDECAR else None
        if role == _FOREGROUND:
            if col != COL_VERDICT:
                return None
            verdict = self._rows[row].verdict
            return theme.verdict_colour(verdict) if verdict else None  # asked when painted: light or dark
        if role == _ALIGNMENT:
            return _RIGHT if col in (COL_TOKENS, COL_SIZE, COL_SAVED) else None
        if role == _TOOLTIP:
            r = self.records[row]
            if col == COL_SIDECAR:
                text = f"{SIDECAR_HELP.get(r.sidecar_status, '')}\n\n{r.sidecar_reason}".strip()
                view = self.server_view(r) if self.server_view is not None else None
                return f"{text}\n\n{view}" if view else text
            if col == COL_VERDICT:
                return r.last_verdict_reason or "No query judged since the last resume."
            if col == COL_SAVED:
                last = ("the last resume re-prefilled: it saved nothing" if r.last_time_saved_s == 0 else
                        f"the last resume saved {format_duration(r.last_time_saved_s)}"
                        if r.last_time_saved_s is not None else "no resume judged yet")
                return f"{last}.\n\n{TIME_SAVED_HELP}"
            if col == COL_MODEL:
                return f"{r.model_path}\nKV cache: K {r.cache_type_k}, V {r.cache_type_v}; {r.memory_kind}"
            if col == COL_NAME:
                return f"{r.state_path}\nprofile {r.profile}"
            if col == COL_AGE:
                return f"parked {_when(r.updated_at)}" + (
                    f", first parked {_when(r.created_at)}" if r.created_at and r.created_at < r.updated_at else "")
        return None


class ShownSessions(QSortFilterProxyModel):
    """The sessions as the table shows them: filtered by the filter box, sorted by the
    clicked header (``SORT_ROLE``), else in the catalog's order."""

    def __init__(self, source: SessionsModel, parent=None):
        super().__init__(parent)
        self.setSourceModel(source)
        self.setSortRole(SORT_ROLE)
        self.setFilterRole(FILTER_ROLE)
        self.setFilterKeyColumn(0)
        self.setDynamicSortFilter(True)

    def record(self, row: int) -> SessionRecord | None:
        """The session shown in view row ``row``."""
        source = self.mapToSource(self.index(row, 0))
        return self.sourceModel().records[source.row()] if source.isValid() else None

    @property
    def records(self) -> list[SessionRecord]:
        """The sessions shown, top to bottom."""
        return [self.record(i) for i in range(self.rowCount())]


def filter_pattern(text: str) -> str:
    """The filter box's text as a regular expression: every word must appear, in any order."""
    return "".join(f"(?=.*{QRegularExpression.escape(w)})" for w in text.split())


class SessionsPanel(AsksQuestions, RunsTasks, QWidget):
    sig_changed = Signal()  # the catalog changed (parked, resumed, renamed, deleted, judged)
    sig_done = Signal(str, bool, str)  # operation label, ok, message
    sig_restored = Signal(int, object)  # slot, RestoredSlot
    sig_verdict = Signal(int, str, object)  # slot, session, Verdict
    sig_service = Signal(object)  # SessionService once connected (None when gone)

    def __init__(self, parent=None, *, catalog: Catalog | None = None, store: ProfileStore | None = None,
                 confirm=None):
        super().__init__(parent)
        self.catalog = catalog or Catalog(paths.catalog_path())
        self.store = store or ProfileStore()
        self.service: SessionService | None = None
        self.controller = None
        # confirm(title, text) -> bool or awaitable bool; a test may replace the dialog.
        self.confirm = confirm or self._ask
        # ask_days() -> int or None (or awaitable): "Delete older than…"'s first question; a test may replace it.
        self.ask_days = self._ask_days
        self.question_box: QMessageBox | None = None
        self.days_dialog: QInputDialog | None = None
        self.report_dialog = None
        self._rows: list[SlotRow] = []
        self._reading_slots = False
        self._hashing = False
        self._hash_tried: set = set()
        # The slot chooser follows the live /slots while the tab is visible
        # (the Monitor's ticks feed it too, but the Monitor pauses when hidden).
        self.slots_timer = QTimer(self)
        self.slots_timer.setInterval(SLOTS_POLL_MS)
        self.slots_timer.timeout.connect(self._on_slots_timer)
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self._build()
        self.refresh()
        self._set_connected(False)

    # -- layout -----------------------------------------------------------
    def _build(self) -> None:
        self.source_model = SessionsModel(self)
        style = self.style()
        icons = {SidecarStatus.PRESENT_VALID: QStyle.SP_DialogApplyButton,
                 SidecarStatus.MISSING: QStyle.SP_MessageBoxWarning,
                 SidecarStatus.INVALID: QStyle.SP_MessageBoxCritical,
                 SidecarStatus.NOT_NEEDED: QStyle.SP_MessageBoxInformation}
        self.source_model.icon_for = {k: style.standardIcon(v) for k, v in icons.items()}
        # The table shows the sessions through a proxy that filters and sorts: ``self.model``
        # is what the table shows (its rows are the view's rows), ``self.source_model`` every
        # session listed; selected()/select() map between them.
        self.model = ShownSessions(self.source_model, self)
        self.table = QTableView()
        self.table.setModel(self.model)
        self.table.setSelectionBehavior(QAbstractItemView.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SingleSelection)
        self.table.verticalHeader().hide()
        self.table.verticalHeader().setSectionResizeMode(QHeaderView.Fixed)  # no row measures every cell
        self.table.setWordWrap(False)
        header = self.table.horizontalHeader()
        # Fit the columns to what is on screen, not to every one of a thousand rows each time they change.
        header.setSectionResizeMode(QHeaderView.ResizeToContents)
        header.setResizeContentsPrecision(0)
        header.setStretchLastSection(True)
        header.setSortIndicatorClearable(True)  # a third click goes back to "most recently parked first"
        header.setSortIndicator(-1, Qt.AscendingOrder)
        self.table.setSortingEnabled(True)  # a click on a header sorts by that column
        self.table.doubleClicked.connect(lambda _i: self._on_resume())

        self.filter = QLineEdit(placeholderText="Filter by name, model file, profile or verdict")
        self.filter.setClearButtonEnabled(True)
        self.filter.setToolTip("Shows the sessions whose name, model file, profile or last verdict contain every "
                               "word typed here (any case, any order).")
        self.filter.textChanged.connect(self._on_filter)
        self.shown_label = QLabel("")
        self.usage_label = _wrapping_label()
        self.usage_label.setText("No parked sessions.")
        self.usage_label.setToolTip("Disk space of the parked sessions: their state files and checkpoint sidecars.")
        self.delete_old_button = QPushButton("Delete older than…")
        self.delete_old_button.setToolTip("Delete the sessions last parked more than a number of days ago, with "
                                          "their files (asks for the days, then confirms with the count and size).")

        self.slot = QComboBox()
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
        self.message = _wrapping_label()
        self.message.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.hint = _wrapping_label()
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

    # -- catalog ----------------------------------------------------------
    @property
    def profile_name(self) -> str | None:
        return self.service.profile_name if self.service else None

    def refresh(self) -> None:
        """Show the catalog's sessions as they are now; the table changes only where they changed."""
        if self._closed:
            return
        selected = self.selected()
        # each sidecar is looked at again on disk: a removed or replaced one shows as such
        records = self.service.sessions() if self.service else list_sessions(self.catalog)
        self._verify_hashes_later(records)
        if not self.source_model.set_records(records):
            return
        self._show_usage()
        self._show_counts()
        if selected is not None and self.selected() is None:  # the model was reset: select it again
            self.select(selected.name, selected.profile, session_id=selected.id)

    def _show_usage(self) -> None:
        usage = disk_usage(self.catalog, records=self.source_model.records)
        self.usage_label.setText("; ".join(describe_usage(p, u) for p, u in usage.items()) or "No parked sessions.")

    def _show_counts(self) -> None:
        shown, total = self.model.rowCount(), self.source_model.rowCount()
        self.shown_label.setText(f"{shown:,} of {total:,} shown" if self.filter.text().strip() else "")

    def _on_filter(self, text: str) -> None:
        self.model.setFilterRegularExpression(QRegularExpression(filter_pattern(text),
                                                                 QRegularExpression.CaseInsensitiveOption))
        self._show_counts()

    def _verify_hashes_later(self, records) -> None:
        """PKCL v2 sidecars: hash their state files off the GUI thread, once per change."""
        from app.jobs.sidecar_check import needs_hash

        if self.service is None or self._hashing:
            return
        todo = [r for r in records if (r.id, r.state_size, r.updated_at) not in self._hash_tried and needs_hash(r)]
        if not todo:
            return
        self._hash_tried.update((r.id, r.state_size, r.updated_at) for r in todo)
        self._hashing = True

        async def run():
            try:
                await self.service.verify_sidecar_hashes(todo)
            finally:
                self._hashing = False

        self.spawn(run())

    def selected(self) -> SessionRecord | None:
        """The session of the selected row (a view row, mapped to the listed records)."""
        rows = self.table.selectionModel().selectedRows() if self.table.selectionModel() else []
        if not rows:
            return None
        return self.model.record(rows[0].row())

    def index_of(self, name: str, profile: str | None = None, *, session_id: int | None = None) -> QModelIndex:
        """The view's index (column 0) of a session's row; invalid when it is not listed or filtered out."""
        row = self.source_model.row_of(session_id=session_id, name=name, profile=profile)
        if row is None:
            return QModelIndex()
        return self.model.mapFromSource(self.source_model.index(row, 0))

    def select(self, name: str, profile: str | None = None, *, session_id: int | None = None) -> bool:
        """Select a session's row and scroll to it; False when it is not shown (e.g. filtered out)."""
        index = self.index_of(name, profile, session_id=session_id)
        if not index.isValid():
            return False
        self.table.selectRow(index.row())
        self.table.scrollTo(index)
        return True

    # -- server -----------------------------------------------------------
    def attach(self, controller) -> None:
        self.controller = controller
        controller.sig_state.connect(self._on_server_state)

    def _on_server_state(self, state: ServerState, detail: str) -> None:
        if self._closed:
            return
        if self.service is not None and self.service.restarting:
            return  # the A/B restarts the server between probes: the service goes on through it
        if state == ServerState.READY:
            self.spawn(self.connect_service())
        elif state in (ServerState.STOPPED, ServerState.CRASHED, ServerState.STOPPING):
            self._drop_service()

    def _drop_service(self) -> None:
        self.source_model.server_view = None
        if self.service is not None:
            svc, self.service = self.service, None
            self.spawn(svc.aclose())
            self.sig_service.emit(None)
        self._set_connected(False)
        self.refresh()

    async def connect_service(self) -> SessionService | None:
        """Connect the session service to the server the controller runs or watches."""
        c = self.controller
        if c is None or c.url is None:
            return None
        profile, save_dir, supervisor, stopper = None, None, None, None
        if c.owned:
            profile = c.profile
            save_dir = c.plan.slot_save_path if c.plan else None
            supervisor = c.supervisor
            stopper = c.supervisor.stop if c.supervisor else None
        elif c.attached and c.attached.leftover:
            # a server an earlier KV Valet launched: its profile says where it parks
            try:
                profile = self.store.load(c.attached.leftover.profile)
            except Exception:
                profile = None
        try:
            svc = await SessionService.connect(
                self.catalog, url=c.url, profile=profile, save_dir=save_dir,
                log_buffer=c.supervisor.log if c.owned and c.supervisor else None,
                build=c.plan.build if c.owned and c.plan else None, supervisor=supervisor, stopper=stopper)
        except ServiceError as e:
            log.warning("cannot connect to %s: %s", c.url, e)
            self._say(f"Cannot connect the Sessions tab: {e}", ok=False)
            return None
        if self._closed or self.controller is not c or c.url is None:
            await svc.aclose()
            return None
        if self.service is not None:
            await self.service.aclose()
        self.service = svc
        self.source_model.server_view = svc.on_this_server
        svc.target.queue.on_change(self._on_queue)
        svc.on_change(self._on_service_changed)
        svc.on_restored(lambda slot, entry: self.sig_restored.emit(slot, entry))
        svc.on_verdict(self._on_verdict)
        self.spawn(svc.warm_model_identity())
        await self._read_slots()
        self._set_connected(True)
        self.refresh()
        self.sig_service.emit(svc)
        if svc.recovery_messages:
            self._say("Recovered after an interruption: " + "; ".join(svc.recovery_messages), ok=True)
        self._profile = profile
        self._offer_resume_all(svc.resume_plan())
        return svc

    def _offer_resume_all(self, plan) -> None:
        """Show "Resume all (N)" for a resume plan, or resume at once where the
        preferences or the profile say so (app.settings.auto_resumes)."""
        from app.settings import auto_resumes, load_or_defaults

        if not plan:
            self.resume_all_button.hide()
            return
        profile = getattr(self, "_profile", None)
        if auto_resumes(load_or_defaults()[0].auto_resume, bool(profile and profile.resume_on_start)):
            self.spawn(self.resume_planned())
            return
        self.resume_all_button.setText(f"Resume all ({len(plan)})")
        self.resume_all_button.setToolTip("Parked before the server went away: " + ", ".join(
            f"{e.session} → slot {e.slot}" for e in plan))
        self.resume_all_button.show()

    async def after_wake(self) -> None:
        """Back from a suspend that parked the slots: nothing to do if the chats are still in
        their slots; else offer (or do) "Resume all" for the slots that lost theirs."""
        if self.service is None:
            return  # the server is gone: its next start offers the plan
        label = "Back from sleep"
        try:
            lost = await self.service.check_after_wake()
        except ServiceError as e:
            self._say(f"{label}: {e}", ok=False, label=label)
            return
        self._offer_resume_all(lost)
        if lost:
            self._say(f"{label}: {len(lost)} slot(s) lost their chat while the computer slept; they were parked "
                      "before it: " + ", ".join(f"'{e.session}' → slot {e.slot}" for e in lost), ok=False, label=label)
        else:
            self._say(f"{label}: every slot still holds its chat; nothing to resume.", ok=True, label=label)

    def _on_service_changed(self) -> None:
        if not self._closed:
            self.refresh()
            self.sig_changed.emit()

    # -- the slot chooser follows the live /slots ---------------------------
    async def _read_slots(self) -> None:
        if not self.service or self._reading_slots:
            return
        self._reading_slots = True
        try:
            rows = await self.service.slot_rows()
        except Exception as e:
            self.hint.setText(f"Slots unavailable: {e}")
            rows = []
        finally:
            self._reading_slots = False
        self.set_slot_rows(rows)

    def _on_slots_timer(self) -> None:
        if self.service is not None and self.isVisible() and not self._closed:
            self.spawn(self._read_slots())

    def showEvent(self, event) -> None:  # noqa: N802
        super().showEvent(event)
        self._on_slots_timer()

    def set_slot_rows(self, rows) -> None:
        """Show ``rows`` (SlotRows of this server, e.g. from each Monitor tick) in the chooser."""
        if self._closed:
            return
        rows = list(rows)
        if [(r.id, r.tokens_held, r.busy, r.tokens_known_from_restore) for r in rows] == \
                [(r.id, r.tokens_held, r.busy, r.tokens_known_from_restore) for r in self._rows] and self.slot.count():
            return
        self._rows = rows
        current = self.slot.currentData()
        self.slot.blockSignals(True)
        self.slot.clear()
        self.slot.addItem("default slot", None)
        for r in rows:
            if r.id is None:
                continue
            n = r.tokens_held or 0
            text = f"{n:,} tokens" + (" (restored)" if r.tokens_known_from_restore else "") if n else "empty"
            self.slot.addItem(f"slot {r.id} — {text}" + (" (busy)" if r.busy else ""), r.id)
        idx = self.slot.findData(current)
        if idx < 0:
            idx = self.slot.findData(default_slot(rows, Purpose.PARK))
        self.slot.setCurrentIndex(max(idx, 0))
        self.slot.blockSignals(False)

    def _set_connected(self, on: bool) -> None:
        if on:
            self.slots_timer.start()
        else:
            self.slots_timer.stop()
        for b in (self.park_button, self.park_all_button, self.park_stop_button, self.resume_button,
                  self.check_button, self.ab_button, self.slot, self.name):
            b.setEnabled(on)
        self.park_stop_button.setEnabled(on and bool(self.service and self.service.stopper))
        if not on:
            self.hint.setText("Start or attach to a server to park and resume. Parked sessions stay listed.")
            self.resume_all_button.hide()
            self._rows = []
            self.slot.clear()
        elif self.service and self.service.save_dir:
            self.hint.setText(f"Sessions of '{self.service.profile_name}' are parked in {self.service.save_dir}")
        else:
            self.hint.setText("Attached to a server KV Valet did not start: the first Park asks for its "
                              "--slot-save-path folder.")

    def _on_queue(self) -> None:
        labels = self.service.target.queue.labels() if self.service else []
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
        if self.service is None:
            self._say("Start or attach to a server first.", ok=False)
            return False
        if self.service.save_dir is None:
            dlg = QFileDialog(self, "The server's --slot-save-path folder")
            dlg.setFileMode(QFileDialog.Directory)
            fut = asyncio.get_running_loop().create_future()
            dlg.finished.connect(lambda r: fut.done() or fut.set_result(
                dlg.selectedFiles()[0] if r and dlg.selectedFiles() else ""))
            self.folder_dialog = dlg
            dlg.open()  # not exec(): see _ask
            folder = await fut
            dlg.deleteLater()
            self.folder_dialog = None
            if not folder or self.service is None:
                return False
            self.service.set_save_dir(folder)
            self._set_connected(True)
        return True

    # -- park --------------------------------------------------------------
    def _on_park(self) -> None:
        self.spawn(self.park(self._chosen_slot(), self.name.text().strip() or None))

    async def park(self, slot_id: int | None, name: str | None = None):
        if not await self._ensure_save_dir():
            return None
        label = "Park" + (f" slot {slot_id}" if slot_id is not None else "")
        try:
            result = await self.service.park(slot_id, name)
        except ServiceError as e:
            self._say(f"{label}: {e}", ok=False, label=label)
            return None
        rec = result.record
        self.select(rec.name)
        text = (f"Parked slot {result.slot_id} as '{rec.name}': {rec.n_tokens:,} tokens, "
                f"{_size(rec.state_size + rec.sidecar_size)} in {rec.save_ms:,.0f} ms. "
                f"Sidecar: {result.sidecar.reason if result.sidecar else '-'}")
        if result.warnings:
            text += "\n⚠ " + "\n⚠ ".join(result.warnings)
        self._say(text, ok=True, label=label)
        await self._read_slots()
        return result

    async def park_all(self, remember: bool = False):
        """Park all; ``remember`` (before a suspend) also writes the resume plan."""
        if not await self._ensure_save_dir():
            return []
        try:
            results = await self.service.park_all(remember=remember)
        except ServiceError as e:
            self._say(f"Park all: {e}", ok=False, label="Park all")
            return []
        self._report_parks("Park all", results)
        await self._read_slots()
        return results

    async def park_all_and_stop(self):
        if self.service is None or not await self._ensure_save_dir():
            return None
        label = "Park all & stop"
        try:
            outcome = await self.service.park_all_and_stop()
        except ServiceError as e:
            self._say(f"{label}: {e}", ok=False, label=label)
            return None
        self._report_parks(label, outcome.results,
                           "" if outcome.stopped else "\nThe server keeps running: a slot could not be parked.")
        return outcome

    def _report_parks(self, label: str, results, tail: str = "") -> None:
        lines = [(f"slot {r.slot_id}: '{r.record.name}' {r.record.n_tokens:,} tokens, sidecar {r.record.sidecar_status}"
                  if r.ok else f"slot {r.slot_id}: failed: {r.error}") for r in results]
        self._say(f"{label}: " + ("; ".join(lines) if lines else "no slot holds tokens") + tail,
                  ok=all(r.ok for r in results) and not tail, label=label)

    # -- resume ------------------------------------------------------------
    def _on_resume(self) -> None:
        rec = self.selected()
        if rec is None:
            self._say("Select a session to resume.", ok=False)
            return
        self.spawn(self.resume(rec.name, self._chosen_slot()))

    async def resume(self, name: str, slot_id: int | None = None, force: bool = False):
        label = f"Resume '{name}'"
        if self.service is None:
            self._say(f"{label}: start or attach to a server first.", ok=False, label=label)
            return None
        try:
            result = await self.service.resume(name, slot_id, force=force)
        except ResumeRefused as e:
            self._say(f"{label}: cannot resume: " + "; ".join(e.reasons), ok=False, label=label)
            return None
        except ResumeNeedsConfirmation as e:
            if not await self._confirmed("Resume session", "\n\n".join(e.warnings) + "\n\nResume anyway?"):
                self._say(f"{label}: cancelled.", ok=True, label=label)
                return None
            return await self.resume(name, slot_id, force=True)
        except ResumeFailed as e:
            self._say(f"{label}: {e}", ok=False, label=label)
            return None
        text = (f"Resumed '{result.record.name}' into slot {result.slot_id}: {result.n_restored:,} tokens in "
                f"{result.restore_ms:,.0f} ms. The verdict comes with the next query on that slot.")
        if result.warnings:
            text += "\n⚠ " + "\n⚠ ".join(result.warnings)
        self._say(text, ok=True, label=label)
        await self._read_slots()
        return result

    async def resume_planned(self):
        if self.service is None:
            return []
        outcomes = await self.service.resume_all()
        if all(o.ok for o in outcomes):
            self.resume_all_button.hide()
        self._say("Resume all: " + "; ".join(
            f"{o.entry.session} → slot {o.entry.slot}: " + ("ok" if o.ok else o.error) for o in outcomes),
            ok=all(o.ok for o in outcomes), label="Resume all")
        await self._read_slots()
        return outcomes

    def _on_verdict(self, slot_id: int, session: str | None, verdict: Verdict) -> None:
        self.sig_verdict.emit(slot_id, session or "", verdict)
        self._say(f"Slot {slot_id} ('{session}'): {verdict.kind} — {verdict.reason}",
                  ok=verdict.kind is not VerdictKind.DISCARDED, label="verdict")

    # -- check and A/B -----------------------------------------------------
    def _on_check(self, ab: bool = False) -> None:
        rec = self.selected()
        if rec is None or self.service is None:
            self._say("Select a session to check.", ok=False)
            return
        self.spawn(self.check(rec.name, self._chosen_slot(), ab=ab))

    async def check(self, name: str, slot_id: int | None = None, *, ab: bool = False, baseline: bool = False,
                    force: bool = False):
        """'Check resume' (two probes) or the A/B with the sidecar hidden; shows the report."""
        from app.ui.check_view import CheckDialog

        what = "A/B check" if ab else "Check resume"
        label = f"{what} of '{name}'"
        if self.service is None:
            self._say(f"{label}: start or attach to a server first.", ok=False, label=label)
            return None
        rec = self.catalog.get(self.service.profile_name, name)
        n = f"{rec.n_tokens:,}" if rec else "all the"
        self._say(f"{label}: running… (a re-prefill of {n} tokens can take a while)", label=label)
        try:
            report = await (self.service.ab(name, slot_id, force=force, baseline=baseline) if ab
                            else self.service.check(name, slot_id, force=force))
        except NeedsConfirmation as e:
            if not await self._confirmed(what, "\n\n".join(e.warnings) + "\n\nGo on?"):
                self._say(f"{label}: cancelled.", ok=True, label=label)
                return None
            return await self.check(name, slot_id, ab=ab, baseline=baseline, force=True)
        except ServiceError as e:
            self._say(f"{label}: {e}", ok=False, label=label)
            return None
        verdict = report.row("with sidecar").verdict if ab else report.verdict
        self._say(f"{label} in slot {report.slot_id}: done — {verdict.kind}: {verdict.reason}", ok=True, label=label)
        rec = self.catalog.get(self.service.profile_name, name)
        self.report_dialog = CheckDialog(report, self, history=self.catalog.history(rec.id) if rec else None)
        self.report_dialog.show()
        await self._read_slots()
        return report

    def _on_history(self) -> None:
        rec = self.selected()
        if rec is None:
            return
        from PySide6.QtWidgets import QDialog

        from app.ui.check_view import HistoryChart

        dlg = QDialog(self)
        dlg.setWindowTitle(f"Resume history — {rec.name}")
        chart = HistoryChart(dlg)
        chart.set_events(self.catalog.history(rec.id))
        lay = QVBoxLayout(dlg)
        lay.addWidget(QLabel("Restore time and first-query prompt time of every resume, check and A/B run, "
                             "coloured by verdict: a regression after a server update shows here."))
        lay.addWidget(chart, 1)
        dlg.resize(720, 380)
        self.history_dialog = dlg
        dlg.show()

    # -- rename, delete, folder ---------------------------------------------
    def _on_rename(self) -> None:
        rec = self.selected()
        if rec is None:
            return
        new, ok = QInputDialog.getText(self, "Rename session", "New name:", text=rec.name)
        if ok and new.strip() and new.strip() != rec.name:
            self.rename(rec.name, new.strip(), rec.profile)

    def rename(self, old: str, new: str, profile: str | None = None) -> bool:
        from app.jobs.sessions import rename_session

        try:
            if self.service is not None:
                self.service.rename(old, new, profile)
            else:
                rename_session(self.catalog, old, new, profile)
                self._on_service_changed()
        except (CatalogError, LookupError, ValueError) as e:
            self._say(f"Rename: {e}", ok=False, label="Rename")
            return False
        self.select(new)
        return True

    def _on_delete(self) -> None:
        rec = self.selected()
        if rec is None:
            return

        async def confirm_then_delete():
            if await self._confirmed("Delete session", f"Delete '{rec.name}' ({rec.n_tokens:,} tokens) and its "
                                                       "files?"):
                self.delete(rec.name, rec.profile)

        self.spawn(confirm_then_delete())

    def delete(self, name: str, profile: str | None = None) -> bool:
        from app.jobs.sessions import delete_session

        try:
            if self.service is not None:
                removed = self.service.delete(name, profile)
            else:
                removed = delete_session(self.catalog, name, profile)
                self._on_service_changed()
        except (CatalogError, LookupError, ValueError, OSError) as e:
            self._say(f"Delete: {e}", ok=False, label="Delete")
            return False
        self._say(f"Deleted '{name}' ({len(removed)} files).", label="Delete")
        return True

    async def delete_older(self) -> list[SessionRecord] | None:
        """'Delete older than…': ask the days, confirm with the count and the space, delete.

        The sessions listed (this server's profile when connected, else all)
        last parked before the cutoff go, each as a single delete does it.
        Returns those deleted; None when the user cancelled.
        """
        self.delete_old_button.setEnabled(False)  # one clean-up at a time
        try:
            return await self._delete_older()
        finally:
            if not self._closed:
                self.delete_old_button.setEnabled(True)

    async def _delete_older(self) -> list[SessionRecord] | None:
        label = "Delete older"
        days = self.ask_days()
        if inspect.isawaitable(days):
            days = await days
        if days is None or self._closed:
            return None
        profile, now = self.profile_name, time.time()
        before = _when(cutoff(days, now))
        doomed = older_than(self.catalog, days, profile, now=now)
        if not doomed:
            self._say(f"No session was parked before {before}: nothing to delete.", label=label)
            return []
        u = usage_of(doomed)
        plural = "s" if u.sessions != 1 else ""
        if not await self._confirmed("Delete older sessions", f"Delete {u.sessions:,} session{plural} "
                                     f"({_size(u.total_bytes)}) parked before {before}?\n\nTheir state files "
                                     "and sidecars are removed from disk."
                                     + ("\n\nThe filter does not apply: this counts every session listed."
                                        if self.filter.text().strip() else "")):
            self._say(f"{label}: cancelled.", label=label)
            return None
        try:
            # off the GUI thread: unlinking a thousand multi-GB files takes a while on some filesystems
            removed = await asyncio.to_thread(delete_older_than, self.catalog, days, profile, now=now)
        except (CatalogError, OSError) as e:
            self._on_service_changed()
            self._say(f"{label}: {e}", ok=False, label=label)
            return None
        self._on_service_changed()
        freed = usage_of(removed)
        kept = len(doomed) - len(removed)
        self._say(f"Deleted {freed.sessions:,} session{'s' if freed.sessions != 1 else ''} parked before {before} "
                  f"({_size(freed.total_bytes)} freed)."
                  + (f" {kept} changed meanwhile and were kept." if kept else ""), label=label)
        return removed

    async def _ask_days(self) -> int | None:
        """The number of days for 'Delete older than…' (None: cancelled), without a nested event loop."""
        dlg = QInputDialog(self)
        dlg.setWindowTitle("Delete older sessions")
        dlg.setLabelText("Delete the sessions last parked more than this many days ago:")
        dlg.setInputMode(QInputDialog.IntInput)
        dlg.setIntRange(0, 36500)
        dlg.setIntValue(30)
        fut = asyncio.get_running_loop().create_future()
        dlg.finished.connect(lambda r: fut.done() or fut.set_result(
            dlg.intValue() if r == QDialog.Accepted else None))
        self.days_dialog = dlg
        dlg.open()  # not exec(): see _ask
        try:
            return await fut
        finally:
            self.days_dialog = None
            dlg.deleteLater()

    def _on_folder(self) -> None:
        rec = self.selected()
        folder = Path(rec.save_dir) if rec else (self.service.save_dir if self.service else None)
        if folder:
            QDesktopServices.openUrl(QUrl.fromLocalFile(str(folder)))

    # -- questions -----------------------------------------------------------

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.slots_timer.stop()
        if self.controller is not None:
            self.controller.sig_state.disconnect(self._on_server_state)
        await self.end_tasks()
        if self.service:
            await self.service.aclose()
            self.service = None
        self.catalog.close()


def _wrapping_label() -> QLabel:
    """A message label that wraps and never widens the window (long paths included)."""
    from PySide6.QtWidgets import QSizePolicy

    label = QLabel("")
    label.setWordWrap(True)
    label.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)
    label.setMinimumWidth(0)
    return label
