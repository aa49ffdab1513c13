"""The Sessions tab with many sessions: filter box, sorting by header, "Delete older than…".

Driven as a user drives it: typing in the filter box, clicking headers, rows
and buttons, answering the dialogs by clicking their buttons. Assertions are
on what the table and the labels show and on what is left on disk.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from PySide6.QtCore import QPoint, Qt
from PySide6.QtWidgets import QDialogButtonBox, QMessageBox, QSpinBox

from app import paths
from app.core.profile import LaunchProfile
from app.store.catalog import Catalog
from app.store.profiles import ProfileStore
from app.ui.panels import build_window
from app.ui.panels import sessions_panel
from app.ui.sessions.model import COL_TOKENS, COL_VERDICT
from app.ui.sessions.panel import SessionsPanel
from app.ui.sessions.controller import Operation
from tests.conftest import run, signal_future
from tests.fake_server.test_gui_sessions import click, open_tab, started
from tests.fake_server.test_supervisor_fake import FAKE, free_port
from tests.unit.test_sessions_scale import PROFILES, park_many

pytestmark = pytest.mark.gui


@pytest.fixture
def panel(qtbot, qloop):
    """A Sessions tab with no server, over 30 sessions of three profiles parked 0..29 days ago."""
    with Catalog(paths.catalog_path()) as cat:
        park_many(cat, 30, now=time.time())
    p = sessions_panel(catalog=Catalog(paths.catalog_path()), store=ProfileStore())
    qtbot.addWidget(p)
    p.resize(1100, 700)
    p.show()
    qtbot.waitExposed(p)
    yield p
    run(qloop, p.aclose(), 120)


def shown(panel, column: int = 0) -> list[str]:
    """The texts of one column, top to bottom, as the table shows them."""
    m = panel.table.model()
    return [m.data(m.index(row, column)) for row in range(m.rowCount())]


def click_header(qtbot, panel, column: int) -> None:
    header = panel.table.horizontalHeader()
    x = header.sectionViewportPosition(column) + header.sectionSize(column) // 2
    qtbot.mouseClick(header.viewport(), Qt.LeftButton, pos=QPoint(x, header.height() // 2))


def click_row(qtbot, panel, name: str) -> None:
    index = panel.list.index_of(name)
    assert index.isValid(), f"{name} is not shown"
    panel.table.scrollTo(index)
    rect = panel.table.visualRect(index)
    qtbot.mouseClick(panel.table.viewport(), Qt.LeftButton, pos=rect.center())
    assert panel.selected().name == name


def files_of(name: str) -> list[Path]:
    i = int(name.split()[-1])
    folder = paths.sessions_dir(PROFILES[i % len(PROFILES)])
    return [folder / f"s{i:03d}.bin", folder / f"s{i:03d}.bin.ckpt"]


async def until(condition, timeout: float = 120.0):
    """Wait (on the event loop) until ``condition()`` is truthy; its value."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not (value := condition()):
        if loop.time() > end:
            raise AssertionError("timed out waiting for the condition")
        await asyncio.sleep(0.01)
    return value


def test_typing_in_the_filter_box_narrows_the_table(panel, qtbot):
    assert len(shown(panel)) == 30
    assert panel.usage_label.text().count("profile ") == 3 and "profile qwen: 10 sessions" in panel.usage_label.text()
    qtbot.keyClicks(panel.filter, "QWEN")  # a profile, any case
    assert sorted(shown(panel)) == [f"chat {i:03d}" for i in range(1, 30, 3)]
    assert panel.shown_label.text() == "10 of 30 shown"
    qtbot.keyClicks(panel.filter, " hit")  # and a verdict
    assert sorted(shown(panel)) == ["chat 004", "chat 016", "chat 028"]
    assert shown(panel, COL_VERDICT) == ["HIT"] * 3 and panel.shown_label.text() == "3 of 30 shown"
    qtbot.keyClick(panel.filter, Qt.Key_A, Qt.ControlModifier)
    qtbot.keyClicks(panel.filter, "01 chat")  # words of a name, in any order
    assert shown(panel) == [f"chat {i:03d}" for i in [1, *range(10, 20)]]
    qtbot.keyClick(panel.filter, Qt.Key_A, Qt.ControlModifier)
    qtbot.keyClick(panel.filter, Qt.Key_Backspace)
    assert len(shown(panel)) == 30 and panel.shown_label.text() == ""


def test_clicking_a_header_sorts_numerically_and_actions_follow_the_row(panel, qtbot, qloop):
    assert shown(panel)[:3] == ["chat 000", "chat 001", "chat 002"]  # most recently parked first
    click_header(qtbot, panel, COL_TOKENS)  # first click: the biggest first
    tokens = [int(t.replace(",", "")) for t in shown(panel, COL_TOKENS)]
    assert tokens == sorted(tokens, reverse=True) and tokens[0] == 600 + 37 * 29  # 1,673 before 983: numbers
    assert shown(panel)[0] == "chat 029"
    click_header(qtbot, panel, COL_TOKENS)
    tokens = [int(t.replace(",", "")) for t in shown(panel, COL_TOKENS)]
    assert tokens == sorted(tokens)

    async def scenario():
        # the view's row 1 is "chat 001" only by chance of the order: pick one the sort moved
        click_row(qtbot, panel, "chat 027")
        panel.controller.questions.confirm = lambda title, text: "'chat 027'" in text  # the user answers "Yes" to deleting chat 027
        label, ok, text = await click(qtbot, panel, panel.delete_button, Operation.DELETE)
        assert ok and text.startswith("Deleted 'chat 027'")
        assert not any(p.exists() for p in files_of("chat 027"))
        assert all(p.exists() for p in files_of("chat 026")[:1] + files_of("chat 028")[:1])
        assert "chat 027" not in shown(panel) and len(shown(panel)) == 29
        tokens = [int(t.replace(",", "")) for t in shown(panel, COL_TOKENS)]
        assert tokens == sorted(tokens)  # still sorted after the refresh
        # a double-click acts on the row clicked, too
        index = panel.list.index_of("chat 013")
        rect = panel.table.visualRect(index)
        done = signal_future(panel.controller.said, lambda op, ok, text: op is Operation.RESUME)
        # a double-click is a click and then a second press: QTest's mouseDClick sends the second part only
        qtbot.mouseClick(panel.table.viewport(), Qt.LeftButton, pos=rect.center())
        qtbot.mouseDClick(panel.table.viewport(), Qt.LeftButton, pos=rect.center())
        label, ok, text = await asyncio.wait_for(done, 120)
        assert label is Operation.RESUME and "start or attach to a server first" in text

    run(qloop, scenario(), 240)


def test_delete_older_than_asks_the_days_confirms_then_deletes(panel, qtbot, qloop):
    async def scenario():
        before_text = panel.usage_label.text()
        qtbot.mouseClick(panel.delete_old_button, Qt.LeftButton)
        dlg = await until(lambda: panel.housekeeping.days_dialog)
        assert dlg.isVisible() and not panel.delete_old_button.isEnabled()  # one clean-up at a time
        spin = dlg.findChild(QSpinBox)
        qtbot.keyClick(spin, Qt.Key_A, Qt.ControlModifier)
        qtbot.keyClicks(spin, "19")
        qtbot.mouseClick(dlg.findChild(QDialogButtonBox).button(QDialogButtonBox.Ok), Qt.LeftButton)

        box = await until(lambda: panel.controller.questions.box)
        with Catalog(paths.catalog_path()) as cat:
            old = [r for r in cat.list() if r.updated_at < time.time() - 19 * 86400]
        assert sorted(r.name for r in old) == [f"chat {i:03d}" for i in range(19, 30)]
        expected_size = sum(r.state_size + r.sidecar_size for r in old) / 1024
        assert box.text().startswith(f"Delete 11 sessions ({expected_size:.1f} KiB) parked before ")
        done = signal_future(panel.controller.said, lambda op, ok, text: op is Operation.DELETE_OLDER)
        qtbot.mouseClick(box.button(QMessageBox.Yes), Qt.LeftButton)
        label, ok, text = await asyncio.wait_for(done, 120)

        assert ok and text.startswith("Deleted 11 sessions parked before ") and "KiB freed" in text
        assert sorted(shown(panel)) == [f"chat {i:03d}" for i in range(19)]
        for r in old:
            assert not any(p.exists() for p in files_of(r.name))
        assert all(files_of(f"chat {i:03d}")[0].exists() for i in range(19))
        with Catalog(paths.catalog_path()) as cat:
            assert len(cat.list()) == 19
        assert panel.usage_label.text() != before_text and "profile llama: 6 sessions" in panel.usage_label.text()
        assert panel.delete_old_button.isEnabled()

    run(qloop, scenario(), 240)


def test_delete_older_than_cancelled_deletes_nothing(panel, qtbot, qloop):
    asked = []
    panel.housekeeping.ask_days = lambda: 5  # the user answers 5 days...
    panel.controller.questions.confirm = lambda title, text: asked.append(text) or False  # ...then "Cancel"

    async def scenario():
        label, ok, text = await click(qtbot, panel, panel.delete_old_button, Operation.DELETE_OLDER)
        assert text == "Delete older: cancelled."
        assert asked and asked[0].startswith("Delete 25 sessions (")
        assert len(shown(panel)) == 30 and all(files_of(f"chat {i:03d}")[0].exists() for i in range(30))
        panel.housekeeping.ask_days = lambda: 365
        label, ok, text = await click(qtbot, panel, panel.delete_old_button, Operation.DELETE_OLDER)
        assert "nothing to delete" in text and len(asked) == 1  # nothing to confirm

    run(qloop, scenario(), 240)


def test_connected_delete_older_than_keeps_other_profiles(qtbot, qloop, tmp_path, monkeypatch):
    """With a server, the tab lists its profile's sessions, and only those are cleaned up."""
    monkeypatch.setenv("FAKE_SIDECAR", "1")
    with Catalog(paths.catalog_path()) as cat:
        park_many(cat, 12, now=time.time(), profiles=("fake", "other"))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    profile = LaunchProfile(name="fake", model=str(model), server_binary=FAKE, port=free_port(), ctx_size=4096,
                            parallel=2)
    store = ProfileStore()
    store.save(profile)
    w = build_window(store)
    w.confirm_quit = False
    panel: SessionsPanel = w.sessions_panel
    panel.housekeeping.ask_days = lambda: 3
    panel.controller.questions.confirm = lambda title, text: True
    qtbot.addWidget(w)
    w.show()
    open_tab(qtbot, w, panel)

    async def scenario():
        assert len(shown(panel)) == 12  # no server yet: every profile
        await started(w, panel, profile)
        await until(lambda: len(shown(panel)) == 6)
        assert panel.usage_label.text().startswith("profile fake: 6 sessions")
        label, ok, text = await click(qtbot, panel, panel.delete_old_button, Operation.DELETE_OLDER)
        assert ok and text.startswith("Deleted 4 sessions")  # "fake" has sessions 0, 2, ..., 10 days old
        assert sorted(shown(panel)) == ["chat 000", "chat 002"]
        with Catalog(paths.catalog_path()) as cat:
            assert len(cat.list("other")) == 6 and len(cat.list("fake")) == 2
        await w.shutdown()

    run(qloop, scenario(), 240)
