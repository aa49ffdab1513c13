"""The window as a new user first sees it (issue #27): it keeps the size it was given whatever it
says, the profile form fits its column, and nothing opens on top of the first-run guide."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QEvent, Qt
from PySide6.QtWidgets import QApplication, QMessageBox, QScrollArea

from app.store.profiles import ProfileStore
from app.ui.panels import build_window

pytestmark = pytest.mark.gui

DEFAULT_WIDTH = 1280  # the width MainWindow gives itself


@pytest.fixture
def window(qtbot, qloop):
    w = build_window(ProfileStore())
    w.confirm_quit = False
    qtbot.addWidget(w)
    w.show()
    qtbot.waitExposed(w)
    yield w
    from tests.conftest import run

    run(qloop, w.shutdown(), 120)


def laid_out() -> None:
    """Deliver the layout requests a new text posted (what the next paint would do)."""
    QApplication.sendPostedEvents(None, QEvent.LayoutRequest)
    QApplication.processEvents()


def test_a_2000_character_message_leaves_the_window_its_width(window):
    assert window.width() == DEFAULT_WIDTH
    # every part of the window fits the width it starts with: none can push it wider
    assert window.minimumSizeHint().width() <= DEFAULT_WIDTH
    text = "The server stopped unexpectedly: " + ("/home/user/models/a-rather-long-model-file-name.gguf " * 40)
    text = text[:2000]
    assert len(text) == 2000
    window.show_message(text)  # the status bar (every window message goes this way)
    window.sessions_panel.say(text, ok=False)  # the Sessions tab's message line
    window.tabs.setCurrentWidget(window.sessions_panel)
    laid_out()
    assert window.width() == DEFAULT_WIDTH
    assert window.statusBar().currentMessage() == text
    assert window.sessions_panel.message.text() == text and window.sessions_panel.message.width() < DEFAULT_WIDTH


def test_the_sessions_tab_keeps_its_buttons_inside_the_window(window, qtbot):
    """A user resizes the window to its narrowest: every Sessions button is still on screen."""
    panel = window.sessions_panel
    window.tabs.setCurrentWidget(panel)
    window.resize(window.minimumSizeHint().width(), window.height())
    laid_out()
    right = window.mapToGlobal(window.rect().topRight()).x()
    for b in (panel.park_stop_button, panel.history_button, panel.folder_button, window.server_list.hosts_button):
        assert b.isVisible() and b.mapToGlobal(b.rect().topRight()).x() <= right, b.text()


def test_the_profile_form_fits_without_a_horizontal_scroll_bar(window):
    form = window.profiles
    scroll = form.findChild(QScrollArea)
    laid_out()
    assert not scroll.horizontalScrollBar().isVisible()
    assert scroll.widget().width() <= scroll.viewport().width()
    # the server binary's status, wrapped in the column: all of it is inside what the user sees
    status = form.w["server_binary"].status
    assert status.isVisible() and status.text()
    assert status.mapTo(scroll.viewport(), status.rect().topRight()).x() <= scroll.viewport().width()


def test_the_built_server_question_waits_until_the_first_run_guide_is_closed(window, qtbot, monkeypatch):
    import app.ui.dialogs.build as build
    from app.ui.dialogs.first_run import greet

    # a checkpoint-persisting server is already built (kv-valet build-server), the default model needs it
    monkeypatch.setattr(build, "default_switch_wanted", lambda store, answer: not answer)
    greet(window, fresh_install=True)
    guide = window.first_run
    assert guide.isVisible()
    QApplication.processEvents()
    assert getattr(window, "built_server_question", None) is None  # not over the guide
    qtbot.mouseClick(guide.skip_button, Qt.LeftButton)
    assert not guide.isVisible()
    box = window.built_server_question
    assert box is not None and box.isVisible() and "built a checkpoint-persisting" in box.text()
    qtbot.mouseClick(box.button(QMessageBox.No), Qt.LeftButton)
    assert window.built_server_question is None


def test_without_the_guide_the_built_server_question_comes_at_once(window, qtbot, monkeypatch):
    import app.ui.dialogs.build as build
    from app.ui.dialogs.first_run import greet

    monkeypatch.setattr(build, "default_switch_wanted", lambda store, answer: not answer)
    greet(window, fresh_install=False)
    assert getattr(window, "first_run", None) is None
    qtbot.waitUntil(lambda: getattr(window, "built_server_question", None) is not None, timeout=120_000)
    qtbot.mouseClick(window.built_server_question.button(QMessageBox.No), Qt.LeftButton)
