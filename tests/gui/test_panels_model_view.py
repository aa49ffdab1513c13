"""The Sessions and Monitor tables on Qt's model/view: a table model behind a sort/filter
proxy, sorted by a click on a header, filtered by the filter box, with delegates painting
the verdict colour and the slot fill bar.

Assertions are on the rows as the view shows them (top to bottom), as a user sees them.
"""

from __future__ import annotations

import time

import pytest
from PySide6.QtCore import QAbstractTableModel, QPoint, QSortFilterProxyModel, Qt
from PySide6.QtGui import QPalette
from PySide6.QtWidgets import QStyleOptionViewItem

from app import paths
from app.monitor.slots import SlotRow
from app.store.catalog import Catalog
from app.store.profiles import ProfileStore
from app.ui.widgets import theme
from app.ui.widgets.delegates import FillBarDelegate, VerdictDelegate
from app.ui.monitor.panel import MonitorPanel, SlotsTableModel
from app.ui.panels import sessions_panel
from app.ui.sessions.model import COL_NAME, COL_TOKENS, COL_VERDICT, SessionsModel
from tests.conftest import run
from tests.unit.test_sessions_scale import park_many

pytestmark = pytest.mark.gui

C = SlotsTableModel


@pytest.fixture
def sessions(qtbot, qloop):
    """A Sessions tab with no server over 8 sessions (chat 000 parked last, 600 + 37 * i tokens)."""
    with Catalog(paths.catalog_path()) as cat:
        park_many(cat, 8, now=time.time())
    p = sessions_panel(catalog=Catalog(paths.catalog_path()), store=ProfileStore())
    qtbot.addWidget(p)
    p.resize(1100, 600)
    p.show()
    qtbot.waitExposed(p)
    yield p
    run(qloop, p.aclose(), 120)


@pytest.fixture
def monitor(qtbot):
    p = MonitorPanel()
    qtbot.addWidget(p)
    p.resize(1100, 800)
    p.show()
    qtbot.waitExposed(p)
    return p


def shown(view, column: int) -> list:
    """One column's texts, top to bottom, as the view shows them."""
    m = view.model()
    return [m.index(row, column).data() for row in range(m.rowCount())]


def click_header(qtbot, view, column: int) -> None:
    header = view.horizontalHeader()
    x = header.sectionViewportPosition(column) + header.sectionSize(column) // 2
    qtbot.mouseClick(header.viewport(), Qt.LeftButton, pos=QPoint(x, header.height() // 2))


def tokens(texts) -> list[int]:
    return [int(t.split()[0].replace(",", "")) for t in texts]


# -- the Sessions table ---------------------------------------------------------------------


def test_the_sessions_table_is_a_proxy_over_a_table_model(sessions):
    proxy = sessions.table.model()
    assert isinstance(proxy, QSortFilterProxyModel) and proxy is sessions.model
    assert isinstance(proxy.sourceModel(), QAbstractTableModel) and isinstance(proxy.sourceModel(), SessionsModel)
    assert proxy.sourceModel() is sessions.source_model
    assert sessions.table.isSortingEnabled()


def test_clicking_a_header_sorts_the_rows_the_user_sees(sessions, qtbot):
    assert shown(sessions.table, COL_NAME) == [f"chat {i:03d}" for i in range(8)]  # most recently parked first
    click_header(qtbot, sessions.table, COL_TOKENS)  # a first click: the biggest first
    assert tokens(shown(sessions.table, COL_TOKENS)) == [600 + 37 * i for i in reversed(range(8))]
    assert shown(sessions.table, COL_NAME)[0] == "chat 007"
    click_header(qtbot, sessions.table, COL_TOKENS)
    assert tokens(shown(sessions.table, COL_TOKENS)) == [600 + 37 * i for i in range(8)]
    sessions.table.sortByColumn(COL_NAME, Qt.DescendingOrder)
    assert shown(sessions.table, COL_NAME) == [f"chat {i:03d}" for i in reversed(range(8))]
    # the selection follows the session, not the row number
    assert sessions.select("chat 002") and sessions.selected().name == "chat 002"
    sessions.table.sortByColumn(COL_NAME, Qt.AscendingOrder)
    assert sessions.selected().name == "chat 002"


def test_typing_in_the_filter_box_filters_the_rows(sessions, qtbot):
    qtbot.keyClicks(sessions.filter, "partial")  # a verdict, any case
    assert shown(sessions.table, COL_NAME) == ["chat 001", "chat 005"]
    assert shown(sessions.table, COL_VERDICT) == ["PARTIAL", "PARTIAL"]
    assert sessions.shown_label.text() == "2 of 8 shown"
    assert sessions.source_model.rowCount() == 8  # the model keeps every session: the proxy filters
    qtbot.keyClick(sessions.filter, Qt.Key_A, Qt.ControlModifier)
    qtbot.keyClick(sessions.filter, Qt.Key_Backspace)
    assert len(shown(sessions.table, COL_NAME)) == 8 and sessions.shown_label.text() == ""


def test_the_verdict_column_is_painted_by_its_delegate(sessions):
    delegate = sessions.table.itemDelegateForColumn(COL_VERDICT)
    assert isinstance(delegate, VerdictDelegate)
    assert not isinstance(sessions.table.itemDelegateForColumn(COL_NAME), VerdictDelegate)
    m = sessions.table.model()
    for row, verdict in enumerate(("HIT", "PARTIAL", "DISCARDED")):
        option = QStyleOptionViewItem()
        delegate.initStyleOption(option, m.index(row, COL_VERDICT))
        assert option.text == verdict
        assert option.palette.color(QPalette.Text) == theme.verdict_colour(verdict)
    option = QStyleOptionViewItem()
    delegate.initStyleOption(option, m.index(3, COL_VERDICT))  # no verdict yet: the table's own colour
    assert option.text == "-" and option.palette.color(QPalette.Text) == sessions.table.palette().color(QPalette.Text)
    # and the table paints through it: the verdict's text is drawn in the verdict's colour
    image = sessions.table.viewport().grab().toImage()
    for row, verdict in enumerate(("HIT", "PARTIAL", "DISCARDED")):
        want, rect = theme.verdict_colour(verdict), sessions.table.visualRect(m.index(row, COL_VERDICT))
        assert min(abs(c.red() - want.red()) + abs(c.green() - want.green()) + abs(c.blue() - want.blue())
                   for c in (image.pixelColor(x, y) for x in range(rect.left(), rect.right())
                             for y in range(rect.top(), rect.bottom()))) < 60, verdict


# -- the Monitor's slot table ---------------------------------------------------------------


def slot(i: int, held: int | None, busy: bool = False) -> SlotRow:
    return SlotRow(id=i, n_ctx=4096, busy=busy, tokens_held=held, tokens_known_from_restore=False,
                   n_prompt_tokens=held, n_cached=0, n_processed=held, n_decoded=0, id_task=i, session=None)


def test_the_slot_table_is_a_proxy_over_a_table_model_and_sorts_by_header(monitor, qtbot):
    view = monitor.slots_view
    assert isinstance(view.model(), QSortFilterProxyModel)
    assert isinstance(view.model().sourceModel(), SlotsTableModel) and view.model().sourceModel() is monitor.slots_model
    monitor.slots_model.set_rows([slot(0, 300), slot(1, None), slot(2, 4000, busy=True), slot(3, 1200)])
    assert shown(view, C.COL_SLOT) == ["0", "1", "2", "3"]  # the server's order until a header is clicked
    click_header(qtbot, view, C.COL_TOKENS)
    assert shown(view, C.COL_SLOT) == ["1", "0", "3", "2"]  # numbers as numbers ("-" first), not as text
    click_header(qtbot, view, C.COL_TOKENS)
    assert shown(view, C.COL_SLOT) == ["2", "3", "0", "1"]
    view.sortByColumn(C.COL_FILL, Qt.AscendingOrder)
    assert shown(view, C.COL_FILL) == ["-", "7%", "29%", "98%"]
    view.sortByColumn(C.COL_STATE, Qt.DescendingOrder)
    assert shown(view, C.COL_STATE)[0] == "processing"
    # a tick with new figures keeps the order the user chose
    monitor.slots_model.set_rows([slot(0, 300), slot(1, None), slot(2, 10), slot(3, 1200)])
    view.sortByColumn(C.COL_TOKENS, Qt.DescendingOrder)
    assert shown(view, C.COL_SLOT) == ["3", "0", "2", "1"]


def test_the_fill_column_is_painted_by_the_fill_bar_delegate(monitor):
    view = monitor.slots_view
    assert isinstance(view.itemDelegateForColumn(C.COL_FILL), FillBarDelegate)
    assert not isinstance(view.itemDelegateForColumn(C.COL_TOKENS), FillBarDelegate)
    monitor.slots_model.set_rows([slot(0, 4096), slot(1, 100)])
    assert not view.grab().isNull()  # painted through the delegate (a full slot and a low one)

