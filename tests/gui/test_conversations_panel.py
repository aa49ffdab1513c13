"""The Conversations tab: the proxy's conversations, each request's verdict and why it re-processed.

Over a real conversation store in the test's own data folder; the live proxy is a stand-in
(on_record / list / forget / profile) emitted through a stand-in controller's ``sig_proxy``.
Assertions are on what the user sees: the cells as the views show them, top to bottom.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from PySide6.QtCore import QObject, QPoint, Qt, Signal

from app.core.units import fmt_duration
from app.core.conversation import Cause, Conversation, Explanation, RequestRecord
from app.core.verdict import VerdictKind
from app.store.conversations import ConversationStore
from app.ui.conversations.model import (COL_HINT, COL_ID, COL_REQUESTS, COL_SAVED, COL_TOKENS, COL_USED,
                                        COL_VERDICT, COL_WHERE, RCOL_CACHE, RCOL_CONV, RCOL_PROMPT, RCOL_RESTORED,
                                        RCOL_SLOT, RCOL_VERDICT, RCOL_WHY, VERDICT_ROLE)
from app.ui.conversations.panel import NO_PROXY_HINT, ConversationsPanel
from app.ui.widgets import theme
from tests.conftest import run

pytestmark = pytest.mark.gui

PROFILE = "chat"
NOW = time.time()
A, B, C = "a1b2c3d4e5f6", "b0b0b0b0b0b0", "c0ffee000001"
SYSTEM_CHANGED = Explanation(Cause.SYSTEM_PROMPT_CHANGED,
                             "message 0 (system) differs from what the slot held, at character 120",
                             first_divergent_message=0)


def conv(cid, **kw) -> Conversation:
    return Conversation(id=cid, setup="setup-1", **kw)


def rec(cid, at, slot, verdict, cache_n, prompt_n, *, why=None, restored=None) -> RequestRecord:
    return RequestRecord(at=at, conversation=cid, slot=slot, path="/v1/chat/completions", stream=True,
                         cache_n=cache_n, prompt_n=prompt_n, prompt_ms=prompt_n * 0.5, predicted_n=40,
                         expected_reuse=cache_n, verdict=verdict, explanation=why, restored_from=restored)


def open_store() -> ConversationStore:
    return ConversationStore()


@pytest.fixture
def filled():
    """A: slot 0, its last request a MISS (the system prompt changed); B: parked, it had slot 0 before A;
    C: slot 1, a PARTIAL, the biggest."""
    global NOW
    NOW = time.time()  # the ages are read moments later: "1 min ago", not what the module's import time gives
    with open_store() as s:
        s.save(conv(A, hint="alice", slot=0, n_tokens=12_000, last_used=NOW - 60,
                    last_verdict=VerdictKind.MISS, requests=3, time_saved_s=42.0), PROFILE)
        s.save(conv(B, slot=None, parked_as="proxy-b0b0", n_tokens=3_000, last_used=NOW - 3600,
                    last_verdict=VerdictKind.HIT, requests=2, time_saved_s=5.0), PROFILE)
        s.save(conv(C, hint="bob", slot=1, n_tokens=20_000, last_used=NOW - 7200,
                    last_verdict=VerdictKind.PARTIAL, requests=1), PROFILE)
        for r in (rec(B, NOW - 4000, 0, VerdictKind.NEW, 0, 2_500),
                  rec(B, NOW - 3600, 0, VerdictKind.HIT, 2_500, 30),
                  rec(A, NOW - 300, 0, VerdictKind.NEW, 0, 9_000, restored=None),
                  rec(A, NOW - 200, 0, VerdictKind.HIT, 9_000, 50),
                  rec(A, NOW - 60, 0, VerdictKind.MISS, 4, 11_800, why=SYSTEM_CHANGED, restored="proxy-a1b2"),
                  rec(C, NOW - 7200, 1, VerdictKind.PARTIAL, 800, 19_000,
                      why=Explanation(Cause.REASONING_STRIPPED, "message 2 (assistant) lost its reasoning"))):
            s.add_request(r.conversation, r)


@pytest.fixture
def panel(qtbot, qloop, filled):
    p = ConversationsPanel(confirm=lambda title, text: True)
    qtbot.addWidget(p)
    p.resize(1200, 700)
    p.show()
    qtbot.waitExposed(p)
    yield p
    run(qloop, p.aclose(), 120)


def shown(view, column: int) -> list:
    m = view.model()
    return [m.index(row, column).data() for row in range(m.rowCount())]


def cell(view, row: int, column: int, role=Qt.DisplayRole):
    return view.model().index(row, column).data(role)


def click_header(qtbot, view, column: int) -> None:
    header = view.horizontalHeader()
    x = header.sectionViewportPosition(column) + header.sectionSize(column) // 2
    qtbot.mouseClick(header.viewport(), Qt.LeftButton, pos=QPoint(x, header.height() // 2))


def click_row(qtbot, view, row: int) -> None:
    rect = view.visualRect(view.model().index(row, 0))
    qtbot.mouseClick(view.viewport(), Qt.LeftButton, pos=rect.center())


async def until(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("the panel did not get there in time")
        await asyncio.sleep(0.01)


# -- what the store holds, with no proxy running -------------------------------------------------


def test_the_table_lists_the_stored_conversations_most_recent_first(panel):
    t = panel.table
    assert panel.hint.text() == NO_PROXY_HINT
    assert shown(t, COL_ID) == [A, B, C]
    assert shown(t, COL_HINT) == ["alice", "-", "bob"]
    assert shown(t, COL_VERDICT) == ["MISS", "HIT", "PARTIAL"]
    assert shown(t, COL_TOKENS) == ["12,000", "3,000", "20,000"]
    assert shown(t, COL_WHERE) == ["slot 0", "parked as proxy-b0b0", "slot 1"]
    assert shown(t, COL_REQUESTS) == ["3", "2", "1"]
    assert shown(t, COL_SAVED) == [fmt_duration(42.0), fmt_duration(5.0), "-"]
    assert shown(t, COL_USED) == ["1 min ago", "1 h ago", "2 h ago"]
    # the verdict column is painted in the verdict's colour
    delegate = t.itemDelegateForColumn(COL_VERDICT)
    assert delegate.verdict_brush(t.model().index(0, COL_VERDICT)) == theme.colour("crit")
    assert delegate.verdict_brush(t.model().index(1, COL_VERDICT)) == theme.colour("ok")
    assert cell(t, 2, COL_VERDICT, VERDICT_ROLE) == "PARTIAL"


def test_a_click_on_a_header_sorts(qtbot, panel):
    click_header(qtbot, panel.table, COL_TOKENS)  # biggest first
    assert shown(panel.table, COL_TOKENS) == ["20,000", "12,000", "3,000"]
    click_header(qtbot, panel.table, COL_TOKENS)
    assert shown(panel.table, COL_TOKENS) == ["3,000", "12,000", "20,000"]
    click_header(qtbot, panel.table, COL_HINT)
    assert shown(panel.table, COL_HINT) == ["-", "alice", "bob"]


def test_selecting_a_conversation_shows_its_requests_and_why(qtbot, panel):
    r = panel.requests
    assert shown(r, RCOL_VERDICT) == []
    click_row(qtbot, panel.table, 0)
    assert panel.selected().id == A
    assert shown(r, RCOL_VERDICT) == ["NEW", "HIT", "MISS"]  # in time order
    assert shown(r, RCOL_SLOT) == ["0", "0", "0"]
    assert shown(r, RCOL_CACHE) == ["0", "9,000", "4"]
    assert shown(r, RCOL_PROMPT) == ["9,000", "50", "11,800"]
    assert shown(r, RCOL_RESTORED) == ["-", "-", "proxy-a1b2"]
    why = shown(r, RCOL_WHY)
    assert why[0] == "first request" and why[1] == "-"
    assert why[2] == ("the system prompt changed [system_changed]: message 0 (system) differs from what the slot held, "
                      "at character 120")
    assert "at character 120" in cell(r, 2, RCOL_WHY, Qt.ToolTipRole)
    assert r.isColumnHidden(RCOL_CONV)  # all one conversation's
    assert r.columnWidth(RCOL_WHY) >= 400
    assert f"{A}: 3 requests" in panel.requests_label.text()

    click_row(qtbot, panel.table, 2)
    assert shown(r, RCOL_VERDICT) == ["PARTIAL"]
    assert shown(r, RCOL_WHY) == ["the client sent the reply back without its reasoning [reasoning dropped by the "
                                  "client or its template]: message 2 (assistant) lost its reasoning"]


def test_the_filter_box_filters(qtbot, panel):
    qtbot.keyClicks(panel.filter, "bob")
    assert shown(panel.table, COL_ID) == [C]
    assert panel.shown_label.text() == "1 of 3 shown"
    panel.filter.clear()
    qtbot.keyClicks(panel.filter, "PARKED")
    assert shown(panel.table, COL_ID) == [B]
    panel.filter.clear()
    qtbot.keyClicks(panel.filter, "slot miss")
    assert shown(panel.table, COL_ID) == [A]
    panel.filter.clear()
    assert shown(panel.table, COL_ID) == [A, B, C]


def test_the_slot_timeline_shows_every_conversation_on_a_slot_in_time_order(qtbot, panel):
    combo = panel.timeline
    assert [combo.itemText(i) for i in range(combo.count())] == [
        "Selected conversation's requests", "Slot 0 timeline", "Slot 1 timeline"]
    combo.setCurrentIndex(combo.findData(0))
    r = panel.requests
    assert not r.isColumnHidden(RCOL_CONV)
    assert shown(r, RCOL_CONV) == [B, B, A, A, A]  # B had the slot first, then A took it
    assert shown(r, RCOL_VERDICT) == ["NEW", "HIT", "NEW", "HIT", "MISS"]
    combo.setCurrentIndex(combo.findData(1))
    assert shown(r, RCOL_CONV) == [C]
    # back to the selected conversation's requests
    click_row(qtbot, panel.table, 1)
    combo.setCurrentIndex(0)
    assert shown(r, RCOL_VERDICT) == ["NEW", "HIT"]


def test_forget_asks_then_removes_the_conversation(qtbot, qloop, panel):
    asked = []
    panel.questions.confirm = lambda title, text: asked.append(text) or False
    click_row(qtbot, panel.table, 1)
    qtbot.mouseClick(panel.forget_button, Qt.LeftButton)
    run(qloop, until(lambda: asked and not len(panel.tasks)))
    assert B in asked[0] and "proxy-b0b0" in asked[0]
    assert shown(panel.table, COL_ID) == [A, B, C]  # Cancel: nothing forgotten

    panel.questions.confirm = lambda title, text: True
    qtbot.mouseClick(panel.forget_button, Qt.LeftButton)
    run(qloop, until(lambda: shown(panel.table, COL_ID) == [A, C]))
    assert f"Forgot conversation {B}" in panel.message.text()
    with open_store() as s:
        assert s.get(B) is None and s.requests(B) == []
        assert s.get(A) is not None


# -- the live proxy ----------------------------------------------------------------------------


class FakeProxy:
    """The ProxyService the panel uses: on_record, list, forget, profile."""

    def __init__(self, store: ConversationStore):
        self.store, self.profile = store, PROFILE
        self.callbacks, self.explained_callbacks, self.forgotten = [], [], []

    def on_record(self, cb) -> None:
        self.callbacks.append(cb)

    def notice(self) -> str:
        """What the proxy says of its server's own caching (nothing: a plain server)."""
        return ""

    def on_explained(self, cb) -> None:
        """The first divergent token arrives after the answer: the panel refreshes then too."""
        self.explained_callbacks.append(cb)

    def list(self):
        return self.store.list(self.profile)

    async def forget(self, conv_id):
        self.forgotten.append(conv_id)
        return self.store.forget(conv_id)

    def judged(self, conv_: Conversation, record: RequestRecord) -> None:
        """What the proxy does after a request: store it, then tell its observers."""
        self.store.save(conv_, self.profile)
        self.store.add_request(conv_.id, record)
        for cb in list(self.callbacks):
            cb(record)


class FakeController(QObject):
    sig_proxy = Signal(object)


@pytest.fixture
def live(qtbot, qloop, panel):
    store = open_store()
    proxy, controller = FakeProxy(store), FakeController()
    panel.attach(controller)
    controller.sig_proxy.emit(proxy)
    yield panel, proxy, controller
    store.close()


def test_a_judged_request_updates_the_table_live(qtbot, live):
    panel, proxy, controller = live
    assert "proxy of 'chat'" in panel.hint.text() and len(proxy.callbacks) == 1
    click_row(qtbot, panel.table, 2)
    assert panel.selected().id == C
    resets = []
    panel.source_model.modelReset.connect(lambda: resets.append(1))

    proxy.judged(conv(C, hint="bob", slot=1, n_tokens=20_500, last_used=time.time(),
                      last_verdict=VerdictKind.HIT, requests=2, time_saved_s=9.5),
                 rec(C, time.time(), 1, VerdictKind.HIT, 20_000, 400))
    t = panel.table
    assert shown(t, COL_ID) == [C, A, B]  # most recently used first
    assert (cell(t, 0, COL_VERDICT), cell(t, 0, COL_TOKENS), cell(t, 0, COL_REQUESTS), cell(t, 0, COL_USED)) == \
        ("HIT", "20,500", "2", "just now")
    assert panel.selected().id == C  # the selection stays on it
    assert shown(panel.requests, RCOL_VERDICT) == ["PARTIAL", "HIT"]  # its new request is there

    # a new conversation's first request: a new row
    proxy.judged(conv("d00d00d00d00", slot=2, n_tokens=700, last_used=time.time(), last_verdict=VerdictKind.NEW,
                      requests=1), rec("d00d00d00d00", time.time(), 2, VerdictKind.NEW, 0, 700))
    assert shown(t, COL_ID)[0] == "d00d00d00d00" and shown(t, COL_WHERE)[0] == "slot 2"
    assert panel.timeline.findData(2) > 0  # its slot joins the timeline choices
    assert resets == []  # rows changed in place, no reset

    # the proxy gone: what the store holds, and its callback no longer reaches the tab
    controller.sig_proxy.emit(None)
    assert panel.hint.text() == NO_PROXY_HINT
    proxy.judged(conv(A, slot=0, n_tokens=1, last_used=time.time(), last_verdict=VerdictKind.MISS, requests=9),
                 rec(A, time.time(), 0, VerdictKind.MISS, 0, 1))
    assert cell(t, shown(t, COL_ID).index(A), COL_REQUESTS) == "3"


def test_forget_goes_through_the_proxy_when_one_runs(qtbot, qloop, live):
    panel, proxy, _controller = live
    click_row(qtbot, panel.table, 0)
    qtbot.mouseClick(panel.forget_button, Qt.LeftButton)
    run(qloop, until(lambda: shown(panel.table, COL_ID) == [B, C]))
    assert proxy.forgotten == [A]


def test_no_callback_reaches_a_closed_tab(qtbot, qloop, live):
    panel, proxy, _controller = live
    run(qloop, panel.aclose(), 120)
    proxy.judged(conv(A, slot=0, n_tokens=1, last_used=time.time(), requests=9),
                 rec(A, time.time(), 0, VerdictKind.MISS, 0, 1))  # nothing raised, nothing touched
    assert cell(panel.table, 0, COL_REQUESTS) == "3"
