"""The Sessions tab's list: the table of parked sessions, its filter box and counts.

A :class:`~app.ui.sessions.panel.SessionsPanel` mixes :class:`SessionsTable`
in. ``source_model`` (:class:`~app.ui.sessions.model.SessionsModel`) lists
every session; ``model`` (:class:`~app.ui.sessions.model.ShownSessions`, a
:class:`QSortFilterProxyModel`) is what ``table`` shows: filtered by the filter
box, sorted by a click on a header. :meth:`selected`, :meth:`index_of` and
:meth:`select` map between the two.
"""

from __future__ import annotations

from PySide6.QtCore import QModelIndex, QRegularExpression, Qt
from PySide6.QtWidgets import QAbstractItemView, QHeaderView, QLabel, QLineEdit, QStyle, QTableView

from app.core.states import SidecarStatus
from app.sessions.records import describe_usage, disk_usage, list_sessions
from app.store.catalog import SessionRecord
from app.ui.widgets.delegates import VerdictDelegate
from app.ui.sessions.model import COL_VERDICT, VERDICT_ROLE, SessionsModel, ShownSessions, filter_pattern
from app.ui.widgets.common import wrapping_label


class SessionsTable:
    """The table of sessions, its filter box, its counts and the selection (a mixin of the panel)."""

    def _build_table(self) -> None:
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
        self.table.setItemDelegateForColumn(COL_VERDICT, VerdictDelegate(self.table, VERDICT_ROLE))
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
        self.usage_label = wrapping_label()
        self.usage_label.setText("No parked sessions.")
        self.usage_label.setToolTip("Disk space of the parked sessions: their state files and checkpoint sidecars.")

    def refresh(self) -> None:
        """Show the catalog's sessions as they are now; the table changes only where they changed."""
        if self._closed:
            return
        selected = self.selected()
        # each sidecar is looked at again on disk: a removed or replaced one shows as such
        records = self.sessions.sessions() if self.sessions else list_sessions(self.catalog)
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
        from app.sessions.sidecar_check import needs_hash

        if self.sessions is None or not self.sessions.capabilities.local_files or self._hashing:
            return
        todo = [r for r in records if (r.id, r.state_size, r.updated_at) not in self._hash_tried and needs_hash(r)]
        if not todo:
            return
        self._hash_tried.update((r.id, r.state_size, r.updated_at) for r in todo)
        self._hashing = True

        async def run():
            try:
                await self.sessions.verify_sidecar_hashes(todo)
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
