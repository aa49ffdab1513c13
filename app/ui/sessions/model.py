"""The Sessions table's model: one row per parked session, and the proxy the view shows.

:class:`SessionsModel` holds the catalog's records (most recently parked first)
and what each row shows; :class:`ShownSessions` is the
:class:`QSortFilterProxyModel` the table shows: filtered by the filter box
(:func:`filter_pattern` over ``FILTER_ROLE``) and sorted by the clicked header
(``SORT_ROLE``: numbers as numbers). The verdict column is painted in the
verdict's colour by :class:`app.ui.widgets.delegates.VerdictDelegate` (``VERDICT_ROLE``).

The columns are what a user weighs when choosing what to resume, the verdict next to the
name; the rest of a session (its model file, size on disk, time saved, files) is in
:func:`session_facts`, which the row's tooltip and the details line under the table show.
With a model file and a size column the table needed a horizontal scroll to reach the
Verdict in a 1,280-px window (issue #37).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from PySide6.QtCore import QAbstractTableModel, QModelIndex, QRegularExpression, QSortFilterProxyModel, Qt

from app.core.units import fmt_duration
from app.store.catalog import SessionRecord

SIDECAR_HELP = {
    "present": "A checkpoint sidecar was saved with this session: a resume after a restart can roll back a few "
               "tokens instead of re-reading the whole chat.",
    "missing": "No checkpoint sidecar: on this sliding-window/hybrid model the first query after a restart will "
               "re-prefill the whole session. A server build that writes sidecars (turboquant PR #206) fixes it.",
    "invalid": "The sidecar is damaged or does not belong to this state file, so it will not help the resume.",
    "not needed": "A dense model keeps every position: resumes need no checkpoint.",
    "present, unverified": "A companion checkpoint file is there, in a format KV Valet cannot check.",
}
COLUMNS = ["Name", "Verdict", "Tokens", "Age", "Sidecar", "Last restore"]
COL_NAME, COL_VERDICT, COL_TOKENS, COL_AGE, COL_SIDECAR, COL_RESTORE = range(len(COLUMNS))
#: The order a first click on a header sorts in: biggest, oldest and most recent restore first.
FIRST_CLICK_ORDER = {COL_TOKENS: Qt.DescendingOrder, COL_AGE: Qt.DescendingOrder, COL_RESTORE: Qt.DescendingOrder}
#: The header's tooltip on the name: where the columns that are not in the table went.
NAME_HELP = ("The session's name. Its model file, size on disk and time saved are in the line under the table "
             "(the selected session) and in the tooltip of its name.")
SORT_ROLE = int(Qt.UserRole) + 1  # numbers for numeric columns, case-folded text for the others
FILTER_ROLE = int(Qt.UserRole) + 2  # column 0: name, model file, profile and verdict, for the filter box
VERDICT_ROLE = int(Qt.UserRole) + 3  # the verdict column's verdict, coloured by app.ui.widgets.delegates.VerdictDelegate
# Plain ints: looking up and comparing a PySide6 enum costs microseconds, and a sort or a
# repaint of a thousand rows calls data() tens of thousands of times.
_DISPLAY, _DECORATION, _TOOLTIP = int(Qt.DisplayRole), int(Qt.DecorationRole), int(Qt.ToolTipRole)
_ALIGNMENT = int(Qt.TextAlignmentRole)
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
    from app.core.units import fmt_bytes  # the app's one size formatter: the CLI writes the same

    return fmt_bytes(n)


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))


def session_facts(r: SessionRecord, *, full: bool = False) -> list[str]:
    """What the table's columns leave out of a session, one fact a line: its model file (the
    whole path when ``full``), its size on disk and the prefill time its resumes saved; with
    ``full`` also its state file and profile. The details line under the table shows the
    selected session's; the tooltip of a row's name shows them ``full``."""
    model = r.model_path if full else Path(r.model_path).name
    cache = f"K {r.cache_type_k or '?'}, V {r.cache_type_v or '?'}; {r.memory_kind}"
    size = (f"{_size(r.state_size + r.sidecar_size)} (state file {_size(r.state_size)}, "
            f"sidecar {_size(r.sidecar_size)})")
    saved = fmt_duration(r.time_saved_s) if r.time_saved_s or r.last_time_saved_s is not None else "-"
    last = ("the last resume re-prefilled: it saved nothing" if r.last_time_saved_s == 0 else
            f"the last resume saved {fmt_duration(r.last_time_saved_s)}"
            if r.last_time_saved_s is not None else "no resume judged yet")
    facts = [f"Model: {model or '-'} (KV cache {cache})", f"Size: {size}", f"Time saved: {saved} ({last})"]
    return facts + [f"State file: {r.state_path}, profile {r.profile}"] if full else facts


class _Row:
    """What the table shows of one record, worked out once per change of the record
    (a repaint of a thousand rows asks for these many times)."""

    __slots__ = ("cells", "sort", "haystack", "verdict")

    def __init__(self, r: SessionRecord):
        verdict = str(r.last_verdict) if r.last_verdict else ""
        self.cells = (r.name, verdict or "-", f"{r.n_tokens:,}", None,
                      r.sidecar_status + (f" ({r.sidecar_count})" if r.sidecar_count else ""), None)
        self.sort = (r.name.casefold(), verdict.casefold(), r.n_tokens, -float(r.updated_at or 0.0),
                     str(r.sidecar_status), -1.0 if r.last_restore_ms is None else float(r.last_restore_ms))
        self.haystack = "  ".join((r.name, Path(r.model_path).name, r.profile, verdict))
        self.verdict = verdict


class SessionsModel(QAbstractTableModel):
    """The sessions, in the catalog's order (most recently parked first).

    :meth:`set_records` changes only what changed: nothing when a refresh finds
    the same records (selection, scroll position and sort stay as they are), the
    changed rows when the same sessions are listed in the same order, and a
    reset otherwise. The view sorts and filters through a
    :class:`QSortFilterProxyModel` (``SORT_ROLE``, ``FILTER_ROLE``); the verdict column's
    colour is its delegate's (``VERDICT_ROLE``).
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
            if role == _TOOLTIP and section == COL_NAME:
                return NAME_HELP
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
        if role == VERDICT_ROLE:  # painted in its colour by the verdict column's delegate (light or dark)
            return self._rows[row].verdict if col == COL_VERDICT else None
        if role == _ALIGNMENT:
            return _RIGHT if col == COL_TOKENS else None
        if role == _TOOLTIP:
            r = self.records[row]
            if col == COL_SIDECAR:
                text = f"{SIDECAR_HELP.get(r.sidecar_status, '')}\n\n{r.sidecar_reason}".strip()
                view = self.server_view(r) if self.server_view is not None else None
                return f"{text}\n\n{view}" if view else text
            if col == COL_VERDICT:
                return r.last_verdict_reason or "No query judged since the last resume."
            if col in (COL_NAME, COL_TOKENS, COL_RESTORE):  # the facts no column shows
                return "\n".join([r.name, *session_facts(r, full=True)])
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
