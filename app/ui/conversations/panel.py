"""Conversations: what the conversation proxy knows of each chat, and why a request re-processed.

A face of the proxy (:class:`app.proxy.service.ProxyService`) and of its store
(:class:`app.store.conversations.ConversationStore`): the upper table lists the
conversations (:mod:`app.ui.conversations.model`, filtered by the filter box and sorted by
a click on a header); the lower one the requests of the selected conversation, or a slot's
timeline (every conversation's requests on that slot, in time order), each with its
verdict and, when it re-processed, why. With a proxy running the tables follow its judged
requests live; without one they show what the store holds.
"""

from __future__ import annotations

import asyncio
import logging
import weakref

from PySide6.QtCore import QRegularExpression, Qt
from PySide6.QtWidgets import (QAbstractItemView, QComboBox, QHBoxLayout, QHeaderView, QLabel, QLineEdit,
                               QPushButton, QSplitter, QTableView, QVBoxLayout, QWidget)

from app.core.conversation import Conversation, RequestRecord
from app.store.conversations import ConversationStore
from app.ui.widgets import theme
from app.ui.conversations.model import (COL_USED, COL_VERDICT, RCOL_CONV, RCOL_TIME, RCOL_VERDICT, RCOL_WHY,
                                        VERDICT_ROLE, ConversationsModel, RequestsModel, ShownConversations,
                                        ShownRequests)
from app.ui.widgets.delegates import VerdictDelegate
from app.ui.widgets.questions import Questions
from app.ui.sessions.model import filter_pattern
from app.ui.widgets.tasks import Tasks
from app.ui.widgets.common import set_text, wrapping_label

log = logging.getLogger(__name__)

NO_PROXY_HINT = ("Start a profile with the conversation proxy on (profile: Conversation proxy; or kv-valet serve "
                 "PROFILE --proxy) to see conversations here.")
REQUESTS_SHOWN = 200  # the last requests of a conversation the lower table lists
TIMELINE_SHOWN = 100  # the last requests of a slot's timeline
WHY_WIDTH = 480  # the "why" column's width: a sentence fits, the tooltip has the rest


def _table(model) -> QTableView:
    t = QTableView()
    t.setModel(model)
    t.setSelectionBehavior(QAbstractItemView.SelectRows)
    t.setSelectionMode(QAbstractItemView.SingleSelection)
    t.verticalHeader().hide()
    t.verticalHeader().setSectionResizeMode(QHeaderView.Fixed)
    t.setWordWrap(False)
    header = t.horizontalHeader()
    header.setSectionResizeMode(QHeaderView.ResizeToContents)
    header.setResizeContentsPrecision(0)
    header.setSortIndicatorClearable(True)
    t.setSortingEnabled(True)
    return t


def on_explained(panel, proxy) -> None:
    """A request's explanation was refined (its first divergent token): the lower table shows it."""
    if panel is not None and not panel._closed and panel.proxy is proxy:
        panel._show_requests()


class ConversationsPanel(QWidget):
    def __init__(self, parent=None, *, store: ConversationStore | None = None, confirm=None):
        super().__init__(parent)
        self._owns_store = store is None
        self.store = store if store is not None else ConversationStore()
        self.proxy = None
        self._proxy_profile: str | None = None  # the bound proxy's profile (its server may go before it does)
        self.controller = None
        # confirm(title, text) -> bool or awaitable bool; a test may replace the dialog.
        # a test may answer in place of the box: questions.confirm(title, text) -> bool
        self.questions = Questions(self, confirm)
        self.tasks = Tasks("ConversationsPanel", self._task_failed)
        self._closed = False
        self._slots_seen: set[int] = set()
        self._build()
        self._show_hint()
        self.refresh()

    # -- layout -------------------------------------------------------------------------------
    def _build(self) -> None:
        self.hint = wrapping_label()
        theme.tint(self.hint, "color: {muted};")
        self.filter = QLineEdit(placeholderText="Filter by conversation id, client id, verdict or where")
        self.filter.setClearButtonEnabled(True)
        self.filter.setToolTip("Shows the conversations whose id, client id, last verdict or place contain every "
                               "word typed here (any case, any order).")
        self.filter.textChanged.connect(self._on_filter)
        self.shown_label = QLabel("")

        self.source_model = ConversationsModel(self)
        self.model = ShownConversations(self.source_model, self)
        self.table = _table(self.model)
        self.table.setItemDelegateForColumn(COL_VERDICT, VerdictDelegate(self.table, VERDICT_ROLE))
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.horizontalHeader().setSortIndicator(COL_USED, Qt.DescendingOrder)  # most recent first
        self.table.selectionModel().selectionChanged.connect(lambda *_: self._on_selected())

        self.requests_model = RequestsModel(self)
        self.requests_shown = ShownRequests(self.requests_model, self)
        self.requests = _table(self.requests_shown)
        self.requests.setItemDelegateForColumn(RCOL_VERDICT, VerdictDelegate(self.requests, VERDICT_ROLE))
        header = self.requests.horizontalHeader()
        header.setSectionResizeMode(RCOL_WHY, QHeaderView.Interactive)
        header.resizeSection(RCOL_WHY, WHY_WIDTH)
        header.setStretchLastSection(True)
        header.setSortIndicator(RCOL_TIME, Qt.AscendingOrder)
        self.requests.doubleClicked.connect(self._on_request_double_clicked)

        self.timeline = QComboBox()
        self.timeline.setToolTip("The requests of the selected conversation, or a slot's timeline: every "
                                 "conversation's requests on that slot, in time order (who took the slot from whom).")
        self.timeline.addItem("Selected conversation's requests", None)
        self.timeline.currentIndexChanged.connect(lambda _i: self._show_requests())
        self.forget_button = QPushButton("Forget")
        self.forget_button.setToolTip("Forget the selected conversation: its next request starts a new one. "
                                      "With the proxy running, its park is deleted too.")
        self.forget_button.setEnabled(False)
        self.forget_button.clicked.connect(lambda: self.tasks.spawn(self.forget_selected(), "forgetting a conversation"))
        self.requests_label = QLabel("")
        self.message = wrapping_label()
        self.message.setTextInteractionFlags(Qt.TextSelectableByMouse)

        filter_row = QHBoxLayout()
        filter_row.addWidget(self.filter, 1)
        filter_row.addWidget(self.shown_label)
        lower_row = QHBoxLayout()
        lower_row.addWidget(QLabel("Show"))
        lower_row.addWidget(self.timeline)
        lower_row.addWidget(self.requests_label, 1)
        lower_row.addWidget(self.forget_button)
        lower = QWidget()
        lower_lay = QVBoxLayout(lower)
        lower_lay.setContentsMargins(0, 0, 0, 0)
        lower_lay.addLayout(lower_row)
        lower_lay.addWidget(self.requests, 1)
        split = QSplitter(Qt.Vertical)
        split.addWidget(self.table)
        split.addWidget(lower)
        split.setStretchFactor(0, 1)
        split.setStretchFactor(1, 1)
        lay = QVBoxLayout(self)
        lay.addWidget(self.hint)
        lay.addLayout(filter_row)
        lay.addWidget(split, 1)
        lay.addWidget(self.message)

    def _show_hint(self) -> None:
        if self.proxy is None:
            set_text(self.hint, NO_PROXY_HINT)
        else:
            set_text(self.hint, f"Conversations through the proxy of '{self._proxy_profile}', live. Select one to "
                                "see its requests and why any re-processed."
                     + (f" {self.proxy.notice()}" if self.proxy.notice() else ""))

    # -- the conversations ------------------------------------------------------------------------
    def _conversations(self) -> list[Conversation]:
        if self.proxy is None:
            return self.store.list()  # every profile's
        try:
            return self.proxy.list()
        except RuntimeError:  # its server is gone, its None is on the way: what the store holds of it
            return self.store.list(self._proxy_profile)

    def refresh(self) -> None:
        """Show the conversations as they are now (rows change only where they changed), and the requests."""
        if self._closed:
            return
        self.source_model.set_conversations(self._conversations())
        self._note_slots(c.slot for c in self.source_model.conversations)
        self._show_counts()
        self._show_requests()

    def _show_counts(self) -> None:
        shown, total = self.model.rowCount(), self.source_model.rowCount()
        set_text(self.shown_label, f"{shown:,} of {total:,} shown" if self.filter.text().strip() else "")

    def _on_filter(self, text: str) -> None:
        self.model.setFilterRegularExpression(QRegularExpression(filter_pattern(text),
                                                                 QRegularExpression.CaseInsensitiveOption))
        self._show_counts()

    def selected(self) -> Conversation | None:
        rows = self.table.selectionModel().selectedRows()
        return self.model.conversation(rows[0].row()) if rows else None

    def select(self, conv_id: str) -> bool:
        """Select a conversation's row; False when it is not shown (e.g. filtered out)."""
        row = self.source_model.row_of(conv_id)
        if row is None:
            return False
        index = self.model.mapFromSource(self.source_model.index(row, 0))
        if not index.isValid():
            return False
        self.table.selectRow(index.row())
        self.table.scrollTo(index)
        return True

    def _on_selected(self) -> None:
        if self._closed:
            return
        self.forget_button.setEnabled(self.selected() is not None)
        if self.timeline.currentData() is None:
            self._show_requests()

    # -- the requests: of the selected conversation, or a slot's timeline ---------------------------
    def _note_slots(self, slots) -> None:
        new = {s for s in slots if s is not None} - self._slots_seen
        if not new:
            return
        self._slots_seen |= new
        chosen = self.timeline.currentData()
        self.timeline.blockSignals(True)
        while self.timeline.count() > 1:
            self.timeline.removeItem(1)
        for s in sorted(self._slots_seen):
            self.timeline.addItem(f"Slot {s} timeline", s)
        if chosen is not None:
            self.timeline.setCurrentIndex(self.timeline.findData(chosen))
        self.timeline.blockSignals(False)

    def show_timeline(self, slot: int | None) -> None:
        """Show slot ``slot``'s timeline in the lower table (None: the selected conversation's requests)."""
        self._note_slots([slot])
        self.timeline.setCurrentIndex(max(0, self.timeline.findData(slot)) if slot is not None else 0)

    def _timeline_profile(self) -> str | None:
        if self.proxy is not None:
            return self._proxy_profile
        conv = self.selected() or next(iter(self.source_model.conversations), None)
        return self.store.profile_of(conv.id) if conv is not None else None

    def _show_requests(self) -> None:
        if self._closed:
            return
        slot = self.timeline.currentData()
        self.requests.setColumnHidden(RCOL_CONV, slot is None)
        if slot is None:
            conv = self.selected()
            records = self.store.requests(conv.id, limit=REQUESTS_SHOWN) if conv is not None else []
            label = (f"{conv.id}: {len(records):,} request{'s' if len(records) != 1 else ''}"
                     + (f" (the last {REQUESTS_SHOWN})" if len(records) >= REQUESTS_SHOWN else "")
                     if conv is not None else "Select a conversation to see its requests.")
        else:
            profile = self._timeline_profile()
            records = [rec for _conv_id, rec in self.store.slot_timeline(profile, slot, limit=TIMELINE_SHOWN)] \
                if profile is not None else []
            label = f"every conversation's requests on slot {slot}, in time order"
        self.requests_model.set_records(records)
        self._note_slots(r.slot for r in records)
        set_text(self.requests_label, label)
        self.requests.scrollToBottom()

    def _on_request_double_clicked(self, index) -> None:
        """A request of a slot's timeline: show its conversation."""
        rec = self.requests_model.records[self.requests_shown.mapToSource(index).row()]
        if self.timeline.currentData() is not None and rec.conversation and self.select(rec.conversation):
            self.show_timeline(None)

    # -- the proxy ---------------------------------------------------------------------------------
    def attach(self, controller) -> None:
        """Follow the proxy in front of the server the controller shows."""
        self.controller = controller
        controller.sig_proxy.connect(self._on_proxy)

    def _on_proxy(self, proxy) -> None:
        if not self._closed:
            self.bind_proxy(proxy)

    def bind_proxy(self, proxy) -> None:
        """Show ``proxy``'s conversations, live (None: what the store holds)."""
        if self._closed or proxy is self.proxy:
            return
        self.proxy = proxy
        self._proxy_profile = proxy.profile if proxy is not None else None
        if proxy is not None:
            me = weakref.ref(self)  # the proxy holds its observers: it must not keep a closed tab alive

            def on_record(rec: RequestRecord, proxy=proxy) -> None:
                panel = me()
                if panel is not None and not panel._closed and panel.proxy is proxy:
                    panel._on_record(rec)

            proxy.on_record(on_record)
            proxy.on_explained(lambda rec, proxy=proxy: on_explained(me(), proxy))
        self._show_hint()
        self.refresh()

    def _on_record(self, rec: RequestRecord) -> None:
        """A request the proxy just judged: its conversation's row changes in place, its request is added."""
        self.source_model.set_conversations(self._conversations())
        self._note_slots([rec.slot])
        self._show_counts()
        slot = self.timeline.currentData()
        conv = self.selected()
        if (slot is None and conv is not None and rec.conversation == conv.id) or \
                (slot is not None and rec.slot == slot):
            self.requests_model.add(rec)
            self.requests.scrollToBottom()

    # -- forget ------------------------------------------------------------------------------------
    async def forget_selected(self) -> bool:
        conv = self.selected()
        if conv is None:
            return False
        park = ""
        if conv.parked_as:
            park = f" Its park '{conv.parked_as}' is deleted too."
        if not await self.questions.confirmed("Forget conversation",
                                     f"Forget conversation {conv.id} ({conv.requests:,} requests)? Its next "
                                     f"request starts a new conversation.{park}"):
            return False
        if self._closed:
            return False
        if self.proxy is not None:
            await self.proxy.forget(conv.id)
        else:
            from app.proxy.front import forget_stored

            await asyncio.to_thread(forget_stored, conv.id, self.store)
        self._say(f"Forgot conversation {conv.id}.")
        self.refresh()
        return True

    def _task_failed(self, exc: BaseException) -> None:
        self._say(f"Failed: {exc}", ok=False)

    def _say(self, text: str, ok: bool = True) -> None:
        if self._closed:
            return
        theme.tint(self.message, "" if ok else "color: {crit};")
        self.message.setText(text)

    # -- life --------------------------------------------------------------------------------------
    def showEvent(self, event) -> None:  # noqa: N802
        super().showEvent(event)
        if self.proxy is None:
            self.refresh()  # another process (kv-valet serve --proxy) may have written to the store

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.controller is not None:
            self.controller.sig_proxy.disconnect(self._on_proxy)
        await self.tasks.end()
        self.proxy = None  # the server service stops it with its server
        if self._owns_store:
            self.store.close()
