"""The server list's table model: one row per server (app.servers.server_list decides what it says).

Rows change in place (``dataChanged``) while the same servers are listed, so a refresh every
few seconds keeps the selection and the scroll position; a server that comes or goes resets
the model, and the panel selects the shown server again.
"""

from __future__ import annotations

from PySide6.QtCore import QAbstractTableModel, QModelIndex, Qt
from PySide6.QtGui import QFont

from app.servers.server_list import COL_NAME, COL_STATE, COLUMNS, RowCells, ServerRow, cells
from app.ui.widgets import theme

TARGET_ROLE = Qt.UserRole + 1  # the row's target id


class ServerListModel(QAbstractTableModel):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.rows: list[ServerRow] = []
        self._cells: list[RowCells] = []

    # -- Qt's model interface -------------------------------------------------------------
    def rowCount(self, parent=QModelIndex()) -> int:  # noqa: N802
        return 0 if parent.isValid() else len(self.rows)

    def columnCount(self, parent=QModelIndex()) -> int:  # noqa: N802
        return 0 if parent.isValid() else len(COLUMNS)

    def headerData(self, section, orientation, role=Qt.DisplayRole):  # noqa: N802
        if orientation == Qt.Horizontal and role == Qt.DisplayRole and 0 <= section < len(COLUMNS):
            return COLUMNS[section]
        return None

    def data(self, index, role=Qt.DisplayRole):
        if not index.isValid() or not 0 <= index.row() < len(self.rows):
            return None
        c, col = self._cells[index.row()], index.column()
        if role == Qt.DisplayRole:
            return ("● " if col == COL_STATE else "") + c.text[col]
        if role == Qt.ToolTipRole:
            return c.tips[col] or None
        if role == Qt.ForegroundRole and col == COL_STATE:
            return theme.colour(c.state_role)  # asked at paint time: light or dark as the system is
        if role == Qt.FontRole and col == COL_NAME:
            font = QFont()
            font.setBold(True)
            return font
        if role == TARGET_ROLE:
            return self.rows[index.row()].target_id
        return None

    # -- rows in ----------------------------------------------------------------------------
    def set_rows(self, rows: list[ServerRow]) -> bool:
        """Show ``rows``; True when the model was reset (servers came or went)."""
        ids = [r.target_id for r in rows]
        if ids == [r.target_id for r in self.rows]:
            changed = [i for i, (old, new) in enumerate(zip(self.rows, rows)) if old != new]
            self.rows, self._cells = list(rows), [cells(r) for r in rows]
            for i in changed:
                self.dataChanged.emit(self.index(i, 0), self.index(i, len(COLUMNS) - 1))
            return False
        self.beginResetModel()
        self.rows, self._cells = list(rows), [cells(r) for r in rows]
        self.endResetModel()
        return True

    def row_of(self, target_id: str | None) -> int | None:
        return next((i for i, r in enumerate(self.rows) if r.target_id == target_id), None)

    def text(self, row: int, col: int) -> str:
        """A cell's text as listed (without the state's dot): for tests and the accessibility name."""
        return self._cells[row].text[col]
