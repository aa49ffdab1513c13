"""The Sessions tab's list: the table of parked sessions, its filter box, counts and details line.

A :class:`SessionsTable` is a widget of its own: the
:class:`~app.ui.sessions.panel.SessionsPanel` places it and gives it the records to show
(:meth:`show_records`). ``source_model`` (:class:`~app.ui.sessions.model.SessionsModel`)
lists every session; ``model`` (:class:`~app.ui.sessions.model.ShownSessions`, a
:class:`QSortFilterProxyModel`) is what ``view`` shows: filtered by the filter box, sorted by
a click on a header. :meth:`selected`, :meth:`index_of` and :meth:`select` map between the two.

The table fits the tab without a horizontal scroll bar: the name takes the room the short
columns leave (elided when long), and ``details`` under it shows what no column does
(:func:`~app.ui.sessions.model.session_facts`) for the selected session.
"""

from __future__ import annotations

from PySide6.QtCore import QModelIndex, QRegularExpression, Qt, Signal
from PySide6.QtWidgets import (QAbstractItemView, QHBoxLayout, QHeaderView, QLabel, QLineEdit, QStyle, QTableView,
                               QVBoxLayout, QWidget)

from app.core.states import SidecarStatus
from app.core.verdict import TIME_SAVED_HELP
from app.store.catalog import SessionRecord
from app.ui.sessions.model import (COL_NAME, COL_VERDICT, VERDICT_ROLE, SessionsModel, ShownSessions, filter_pattern,
                                   session_facts)
from app.ui.widgets.common import wrapping_label
from app.ui.widgets.delegates import VerdictDelegate


NO_DETAILS = "Select a session to see its model file, size on disk and time saved."


class SessionsTable(QWidget):
    """The filter box, the table of sessions, the selected session's details and the disk usage under it."""
    activated = Signal()  # a row double-clicked (the panel resumes it)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.source_model = SessionsModel(self)
        style = self.style()
        icons = {SidecarStatus.PRESENT_VALID: QStyle.SP_DialogApplyButton,
                 SidecarStatus.MISSING: QStyle.SP_MessageBoxWarning,
                 SidecarStatus.INVALID: QStyle.SP_MessageBoxCritical,
                 SidecarStatus.NOT_NEEDED: QStyle.SP_MessageBoxInformation}
        self.source_model.icon_for = {k: style.standardIcon(v) for k, v in icons.items()}
        self.model = ShownSessions(self.source_model, self)
        self.view = view = QTableView()
        view.setModel(self.model)
        view.setItemDelegateForColumn(COL_VERDICT, VerdictDelegate(view, VERDICT_ROLE))
        view.setSelectionBehavior(QAbstractItemView.SelectRows)
        view.setSelectionMode(QAbstractItemView.SingleSelection)
        view.verticalHeader().hide()
        view.verticalHeader().setSectionResizeMode(QHeaderView.Fixed)  # no row measures every cell
        view.setWordWrap(False)
        header = view.horizontalHeader()
        # Fit the short columns to what is on screen, not to every one of a thousand rows each time they
        # change; the name takes the rest of the width, elided when long, so the table never scrolls sideways.
        header.setSectionResizeMode(QHeaderView.ResizeToContents)
        header.setSectionResizeMode(COL_NAME, QHeaderView.Stretch)
        header.setResizeContentsPrecision(0)
        header.setStretchLastSection(False)
        header.setSortIndicatorClearable(True)  # a third click goes back to "most recently parked first"
        header.setSortIndicator(-1, Qt.AscendingOrder)
        view.setSortingEnabled(True)  # a click on a header sorts by that column
        view.doubleClicked.connect(lambda _i: self.activated.emit())

        self.filter = QLineEdit(placeholderText="Filter by name, model file, profile or verdict")
        self.filter.setClearButtonEnabled(True)
        self.filter.setToolTip("Shows the sessions whose name, model file, profile or last verdict contain every "
                               "word typed here (any case, any order).")
        self.filter.textChanged.connect(self._on_filter)
        self.shown_label = QLabel("")
        self.details = wrapping_label()  # what no column shows, of the selected session
        self.details.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.details.setText(NO_DETAILS)
        # a fact a line, room for the three kept: the table does not jump when a row is selected
        self.details.setMinimumHeight(3 * self.details.fontMetrics().lineSpacing())
        self.details.setAlignment(Qt.AlignLeft | Qt.AlignTop)
        self.usage_label = wrapping_label()
        self.usage_label.setText("No parked sessions.")
        self.usage_label.setToolTip("Disk space of the parked sessions: their state files and checkpoint sidecars.")

        filter_row = QHBoxLayout()
        filter_row.addWidget(self.filter, 1)
        filter_row.addWidget(self.shown_label)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addLayout(filter_row)
        lay.addWidget(view, 1)
        lay.addWidget(self.details)
        lay.addWidget(self.usage_label)
        view.selectionModel().selectionChanged.connect(self.show_details)
        self.model.dataChanged.connect(self.show_details)  # the selected session's record changed
        self.model.modelReset.connect(self.show_details)

    def show_details(self, *_args) -> None:
        """The selected session's facts that no column shows, in the line under the table."""
        rec = self.selected()
        self.details.setText("\n".join(session_facts(rec)) if rec is not None else NO_DETAILS)
        self.details.setToolTip("\n".join(session_facts(rec, full=True)) + f"\n\n{TIME_SAVED_HELP}"
                                if rec is not None else "")

    def show_records(self, records, usage: str) -> bool:
        """Show ``records`` (the table changes only where they changed) and the disk usage line;
        False when nothing changed. The selection stays on the same session."""
        selected = self.selected()
        if not self.source_model.set_records(records):
            return False
        self.usage_label.setText(usage)
        self.show_counts()
        if selected is not None and self.selected() is None:  # the model was reset: select it again
            self.select(selected.name, selected.profile, session_id=selected.id)
        return True

    def show_counts(self) -> None:
        shown, total = self.model.rowCount(), self.source_model.rowCount()
        self.shown_label.setText(f"{shown:,} of {total:,} shown" if self.filter.text().strip() else "")

    def _on_filter(self, text: str) -> None:
        self.model.setFilterRegularExpression(QRegularExpression(filter_pattern(text),
                                                                 QRegularExpression.CaseInsensitiveOption))
        self.show_counts()

    def filtered(self) -> bool:
        return bool(self.filter.text().strip())

    def selected(self) -> SessionRecord | None:
        """The session of the selected row (a view row, mapped to the listed records)."""
        rows = self.view.selectionModel().selectedRows() if self.view.selectionModel() else []
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
        self.view.selectRow(index.row())
        self.view.scrollTo(index)
        return True
