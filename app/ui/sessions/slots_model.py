"""The Monitor's slot table: one row per llama-server slot, from the live ``/slots``.

:class:`SlotsTableModel` holds the rows (fed whole lists of :class:`SlotRow`
each tick); :class:`ShownSlots` is what the view shows: sorted by the clicked
header (numbers as numbers, ``SORT_ROLE``), else in the server's order. The
Fill column is painted by :class:`app.ui.widgets.delegates.FillBarDelegate` from
``FILL_ROLE`` (the delegate's, taken from there: the widgets import nothing of the Sessions tab).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from PySide6.QtCore import QAbstractTableModel, QModelIndex, QObject, QSortFilterProxyModel, Qt
from PySide6.QtGui import QBrush, QFont

from app.monitor.slots import SlotRow
from app.ui.widgets.delegates import FILL_ROLE
from app.ui.widgets.theme import colour

__all__ = ["SlotsTableModel", "ShownSlots", "RESTORED_TOOLTIP", "ROW_ROLE", "SORT_ROLE"]

RESTORED_TOOLTIP = ("After a restore /slots does not show the restored tokens; this is the count KV Valet knows "
                    "from the restore.")
ROW_ROLE = Qt.UserRole + 2  # the SlotRow itself
SORT_ROLE = Qt.UserRole + 3  # numbers for the numeric columns, case-folded text for the others


def _num(v: Any) -> str:
    return "-" if v is None else f"{v:,}"


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
        if role == SORT_ROLE:
            return self._sort_key(r, col)
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

    def _sort_key(self, r: SlotRow, col: int) -> Any:
        """What a click on the header sorts by: numbers (-1 for none) or case-folded text."""
        if col == self.COL_STATE:
            return "processing" if r.busy else "idle"
        if col == self.COL_SESSION:
            return (r.session or "").casefold()
        value = {self.COL_SLOT: r.id, self.COL_NCTX: r.n_ctx, self.COL_TOKENS: r.tokens_held,
                 self.COL_FILL: r.fill_fraction, self.COL_CACHED: r.n_cached, self.COL_PROCESSED: r.n_processed,
                 self.COL_DECODED: r.n_decoded, self.COL_TASK: r.id_task}.get(col)
        return -1.0 if value is None else float(value)

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


class ShownSlots(QSortFilterProxyModel):
    """The slots as the view shows them: sorted by the clicked header (``SORT_ROLE``),
    else in the server's order."""

    def __init__(self, source: SlotsTableModel, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.setSourceModel(source)
        self.setSortRole(SORT_ROLE)
        self.setDynamicSortFilter(True)

    @property
    def rows(self) -> list[SlotRow]:
        """The slots shown, top to bottom."""
        return [self.index(i, 0).data(ROW_ROLE) for i in range(self.rowCount())]
