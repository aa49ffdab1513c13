"""The Conversations tab's models: the conversations the proxy knows, and the requests of one.

:class:`ConversationsModel` holds one row per :class:`~app.core.conversation.Conversation`;
:meth:`ConversationsModel.set_conversations` merges a new list in by id (changed rows
repainted, new ones inserted, gone ones removed: no reset, so the selection and the
scroll position stay). :class:`ShownConversations` is the
:class:`QSortFilterProxyModel` the table shows: filtered by the filter box
(``FILTER_ROLE``, as the Sessions table's) and sorted by the
clicked header (``SORT_ROLE``: numbers as numbers).

:class:`RequestsModel` lists :class:`~app.core.conversation.RequestRecord` s in time order:
one conversation's, or one slot's timeline (every conversation's requests on that slot).
The verdict columns give their verdict in ``VERDICT_ROLE`` for the verdict delegate.
"""

from __future__ import annotations

import time
from typing import Any

from PySide6.QtCore import QAbstractTableModel, QModelIndex, QSortFilterProxyModel, Qt

from app.core.units import fmt_duration
from app.core.conversation import Conversation, RequestRecord
from app.core.verdict import MEANING, VerdictKind
from app.ui.sessions.model import _age

COLUMNS = ["Conversation", "Client id", "Last verdict", "Tokens", "Where", "Requests", "Time saved", "Last used"]
(COL_ID, COL_HINT, COL_VERDICT, COL_TOKENS, COL_WHERE, COL_REQUESTS, COL_SAVED, COL_USED) = range(len(COLUMNS))
REQUEST_COLUMNS = ["Time", "Conversation", "Slot", "Verdict", "Cached (cache_n)", "Processed (prompt_n)",
                   "Prompt ms", "Restored from", "Why"]
(RCOL_TIME, RCOL_CONV, RCOL_SLOT, RCOL_VERDICT, RCOL_CACHE, RCOL_PROMPT, RCOL_MS, RCOL_RESTORED,
 RCOL_WHY) = range(len(REQUEST_COLUMNS))
#: The order a first click on a header sorts in: biggest and most recent first.
FIRST_CLICK_ORDER = {COL_TOKENS: Qt.DescendingOrder, COL_REQUESTS: Qt.DescendingOrder,
                     COL_SAVED: Qt.DescendingOrder, COL_USED: Qt.DescendingOrder}
SORT_ROLE = int(Qt.UserRole) + 1
FILTER_ROLE = int(Qt.UserRole) + 2
VERDICT_ROLE = int(Qt.UserRole) + 3
_DISPLAY, _TOOLTIP, _ALIGNMENT = int(Qt.DisplayRole), int(Qt.ToolTipRole), int(Qt.TextAlignmentRole)
_INITIAL_SORT_ORDER = int(Qt.InitialSortOrderRole)
_RIGHT = int((Qt.AlignRight | Qt.AlignVCenter).value)
TIME_SAVED_TIP = ("Prompt processing the proxy's hits skipped: the tokens they reused, at this server's measured "
                  "prefill rate.")


def where(c: Conversation) -> str:
    """Where a conversation's tokens are now: its slot, its park, or nowhere."""
    if c.slot is not None:
        return f"slot {c.slot}"
    if c.parked_as:
        return f"parked as {c.parked_as}"
    return "gone"


def why_text(r: RequestRecord) -> str:
    """The cause and the sentence of a request that re-processed ("" when it did not say)."""
    e = r.explanation
    if e is None:
        return "first request" if r.verdict is VerdictKind.NEW else ""
    head = f"{e.cause.value} [{e.cause.client_words}]"
    return f"{head}: {e.detail}" if e.detail else head


def _clock(ts: float) -> str:
    fmt = "%H:%M:%S" if time.localtime(ts)[:3] == time.localtime()[:3] else "%Y-%m-%d %H:%M:%S"
    return time.strftime(fmt, time.localtime(ts))


def _num(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


class _ConvRow:
    """What the table shows of one conversation, worked out once per change."""

    __slots__ = ("cells", "sort", "haystack", "verdict")

    def __init__(self, c: Conversation):
        verdict = c.last_verdict.value if c.last_verdict else ""
        place = where(c)
        self.cells = (c.id, c.hint or "-", verdict or "-", f"{c.n_tokens:,}", place, f"{c.requests:,}",
                      fmt_duration(c.time_saved_s) if c.time_saved_s else "-", None)
        self.sort = (c.id, (c.hint or "").casefold(), verdict, c.n_tokens, place.casefold(), c.requests,
                     float(c.time_saved_s), float(c.last_used or 0.0))
        self.haystack = "  ".join((c.id, c.hint or "", verdict, place))
        self.verdict = verdict


class ConversationsModel(QAbstractTableModel):
    """The conversations, one row each; merged in by id so a live update never resets the table."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.conversations: list[Conversation] = []
        self._rows: list[_ConvRow] = []

    def set_conversations(self, conversations: list[Conversation]) -> bool:
        """Show ``conversations``: the changed rows repainted, the gone removed, the new inserted
        at the top. False when nothing changed."""
        new = {c.id: c for c in conversations}
        changed = False
        for i in range(len(self.conversations) - 1, -1, -1):
            if self.conversations[i].id not in new:
                self.beginRemoveRows(QModelIndex(), i, i)
                del self.conversations[i], self._rows[i]
                self.endRemoveRows()
                changed = True
        last = len(COLUMNS) - 1
        for i, old in enumerate(self.conversations):
            c = new[old.id]
            if c != old:
                self.conversations[i], self._rows[i] = c, _ConvRow(c)
                self.dataChanged.emit(self.index(i, 0), self.index(i, last))
                changed = True
        listed = {c.id for c in self.conversations}
        added = [c for c in conversations if c.id not in listed]
        if added:
            self.beginInsertRows(QModelIndex(), 0, len(added) - 1)
            self.conversations[0:0] = added
            self._rows[0:0] = [_ConvRow(c) for c in added]
            self.endInsertRows()
            changed = True
        return changed

    def row_of(self, conv_id: str) -> int | None:
        return next((i for i, c in enumerate(self.conversations) if c.id == conv_id), None)

    def rowCount(self, parent=QModelIndex()) -> int:  # noqa: N802
        return 0 if parent.isValid() else len(self.conversations)

    def columnCount(self, parent=QModelIndex()) -> int:  # noqa: N802
        return len(COLUMNS)

    def headerData(self, section, orientation, role=Qt.DisplayRole):  # noqa: N802
        if orientation == Qt.Horizontal:
            if role == _DISPLAY:
                return COLUMNS[section]
            if role == _INITIAL_SORT_ORDER:
                return FIRST_CLICK_ORDER.get(section, Qt.AscendingOrder).value
            if role == _TOOLTIP:
                return {COL_HINT: "The client's own id for the conversation (X-Session-Id, or the body's "
                                  "\"user\"), when it sends one.",
                        COL_WHERE: "Where its tokens are now: in a slot, parked on disk, or gone (re-processed "
                                   "on its next request).",
                        COL_SAVED: TIME_SAVED_TIP}.get(section)
        return None

    def data(self, index: QModelIndex, role: int = _DISPLAY) -> Any:
        row, col = index.row(), index.column()
        if row < 0:
            return None
        if role == SORT_ROLE:
            return self._rows[row].sort[col]
        if role == _DISPLAY:
            text = self._rows[row].cells[col]
            return _age(self.conversations[row].last_used) if text is None else text
        if role == FILTER_ROLE:
            return self._rows[row].haystack
        if role == VERDICT_ROLE:
            return self._rows[row].verdict if col == COL_VERDICT else None
        if role == _ALIGNMENT:
            return _RIGHT if col in (COL_TOKENS, COL_REQUESTS, COL_SAVED) else None
        if role == _TOOLTIP:
            c = self.conversations[row]
            if col == COL_VERDICT:
                return MEANING[c.last_verdict] if c.last_verdict else "No request judged yet."
            if col == COL_USED and c.last_used:
                return f"last request {_clock(c.last_used)}"
            if col == COL_WHERE and c.parked_as:
                return f"parked as the session '{c.parked_as}' (Sessions tab)"
        return None


class ShownConversations(QSortFilterProxyModel):
    """The conversations as the table shows them: filtered by the filter box, sorted by a header."""

    def __init__(self, source: ConversationsModel, parent=None):
        super().__init__(parent)
        self.setSourceModel(source)
        self.setSortRole(SORT_ROLE)
        self.setFilterRole(FILTER_ROLE)
        self.setFilterKeyColumn(0)
        self.setDynamicSortFilter(True)

    def conversation(self, row: int) -> Conversation | None:
        source = self.mapToSource(self.index(row, 0))
        return self.sourceModel().conversations[source.row()] if source.isValid() else None


class RequestsModel(QAbstractTableModel):
    """Requests in time order (oldest first): one conversation's, or one slot's timeline."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.records: list[RequestRecord] = []

    def set_records(self, records: list[RequestRecord]) -> None:
        records = sorted(records, key=lambda r: r.at)
        if records == self.records:
            return
        self.beginResetModel()
        self.records = records
        self.endResetModel()

    def add(self, record: RequestRecord) -> None:
        """One more request (the live proxy's), at its place in time."""
        i = len(self.records)
        while i > 0 and self.records[i - 1].at > record.at:
            i -= 1
        self.beginInsertRows(QModelIndex(), i, i)
        self.records.insert(i, record)
        self.endInsertRows()

    def rowCount(self, parent=QModelIndex()) -> int:  # noqa: N802
        return 0 if parent.isValid() else len(self.records)

    def columnCount(self, parent=QModelIndex()) -> int:  # noqa: N802
        return len(REQUEST_COLUMNS)

    def headerData(self, section, orientation, role=Qt.DisplayRole):  # noqa: N802
        if orientation == Qt.Horizontal:
            if role == _DISPLAY:
                return REQUEST_COLUMNS[section]
            if role == _TOOLTIP:
                return {RCOL_CACHE: "Tokens the server reused from the slot (its cache_n).",
                        RCOL_PROMPT: "Tokens the server processed anew (its prompt_n).",
                        RCOL_RESTORED: "The parked session restored into the slot before this request.",
                        RCOL_WHY: "Why it re-processed more than it had to (hover for the whole text)."}.get(section)
        return None

    def _cell(self, r: RequestRecord, col: int) -> str:
        if col == RCOL_TIME:
            return _clock(r.at)
        if col == RCOL_CONV:
            return r.conversation or "-"
        if col == RCOL_SLOT:
            return "-" if r.slot is None else str(r.slot)
        if col == RCOL_VERDICT:
            return r.verdict.value
        if col == RCOL_CACHE:
            return _num(r.cache_n)
        if col == RCOL_PROMPT:
            return _num(r.prompt_n)
        if col == RCOL_MS:
            return "-" if r.prompt_ms is None else f"{r.prompt_ms:,.0f}"
        if col == RCOL_RESTORED:
            return r.restored_from or "-"
        return why_text(r) or "-"

    def _sort_key(self, r: RequestRecord, col: int):
        return {RCOL_TIME: r.at, RCOL_SLOT: -1 if r.slot is None else r.slot, RCOL_CACHE: r.cache_n or 0,
                RCOL_PROMPT: r.prompt_n or 0, RCOL_MS: r.prompt_ms or 0.0}.get(col) \
            if col in (RCOL_TIME, RCOL_SLOT, RCOL_CACHE, RCOL_PROMPT, RCOL_MS) else self._cell(r, col).casefold()

    def data(self, index: QModelIndex, role: int = _DISPLAY) -> Any:
        row, col = index.row(), index.column()
        if row < 0:
            return None
        r = self.records[row]
        if role == _DISPLAY:
            return self._cell(r, col)
        if role == SORT_ROLE:
            return self._sort_key(r, col)
        if role == VERDICT_ROLE:
            return r.verdict.value if col == RCOL_VERDICT else None
        if role == _ALIGNMENT:
            return _RIGHT if col in (RCOL_SLOT, RCOL_CACHE, RCOL_PROMPT, RCOL_MS) else None
        if role == _TOOLTIP:
            if col == RCOL_WHY:
                text = why_text(r)
                if r.wasted_ms:
                    text += f"\n\nIt cost about {fmt_duration(r.wasted_ms / 1000.0)} of prompt processing."
                if r.expected_reuse:
                    text += f"\nThe slot held {r.expected_reuse:,} tokens it could have reused."
                e = r.explanation
                if e is not None and e.first_divergent_token is not None:
                    text += (f"\nFirst divergent token: {e.first_divergent_token:,} (the slot held "
                             f"{e.held_token or ''!r}, the request had {e.sent_token or ''!r}).")
                return text.strip() or None
            if col == RCOL_VERDICT:
                return MEANING.get(r.verdict)
            if col == RCOL_TIME:
                return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(r.at))}  {r.path}" + (
                    " (streamed)" if r.stream else "")
        return None


class ShownRequests(QSortFilterProxyModel):
    def __init__(self, source: RequestsModel, parent=None):
        super().__init__(parent)
        self.setSourceModel(source)
        self.setSortRole(SORT_ROLE)
        self.setDynamicSortFilter(True)
