"""Long status messages wrap inside the window: the window never grows because of one (issue #17)."""

from __future__ import annotations

import pytest

from app.ui.panels import build_window
from app.ui.widgets.status_bar import MAX_LINES

pytestmark = pytest.mark.gui

WORDS = ("The server stopped unexpectedly: llama-server exited with code 1 after loading "
         "/home/user/models/a-model-file-with-a-rather-long-name-Q4_K_M.gguf; its last log lines said ")


def long_message(i: int) -> str:
    text = f"#{i} " + WORDS * 6
    assert len(text) > 600
    return text


@pytest.fixture
def window(qtbot):
    w = build_window(tabs=False)
    qtbot.addWidget(w)
    w.resize(1128, 700)
    w.show()
    qtbot.waitExposed(w)
    return w


def settle(qtbot) -> None:
    qtbot.wait(50)  # the status bar re-lays out on the posted LayoutRequest


def test_six_long_messages_leave_the_window_width_alone(window, qtbot):
    width, sb = window.width(), window.statusBar()
    for i in range(6):
        text = long_message(i)
        window.show_message(text)  # the path every status message of the app takes
        settle(qtbot)
        assert window.width() == width
        label = sb.message_label
        assert label.isVisible() and label.width() <= width
        assert label.toolTip() == text and sb.currentMessage() == text == window.last_message
        shown = label.text().split("\n")
        assert 1 < len(shown) <= MAX_LINES
        # what the label shows is the message, wrapped (and cut with "…" past MAX_LINES lines)
        flat = " ".join(shown)
        assert flat.endswith("…") and text.startswith(flat[:-1].rstrip())
        fm = label.fontMetrics()
        assert all(fm.horizontalAdvance(line) <= label.contentsRect().width() for line in shown)
    assert window.width() == width


def test_a_message_that_fits_is_shown_whole_then_the_status_comes_back(window, qtbot):
    sb = window.statusBar()
    text = "Preferences saved. " + "The data folder moves at the next start. " * 4
    window.show_message(text)
    settle(qtbot)
    assert sb.message_label.text().replace("\n", " ") == text.rstrip()
    assert not window.state_label.isVisible()  # as Qt's own message: it takes the normal widgets' place
    sb.clearMessage()
    settle(qtbot)
    assert not sb.message_label.isVisible() and sb.currentMessage() == ""
    assert window.state_label.isVisible() and "Server Stopped" in window.state_label.text()


def test_show_message_goes_through_the_wrapping_label_with_its_timeout(window, qtbot):
    """statusBar().showMessage (the profile form's "Saved profile", any other caller) is the
    same path; a timeout clears the message and brings the state back."""
    sb = window.statusBar()
    text = "Saved profile '" + "x" * 700 + "'"
    sb.showMessage(text, 100)
    settle(qtbot)
    assert sb.message_label.toolTip() == text and sb.currentMessage() == text
    assert window.width() == 1128
    qtbot.waitUntil(lambda: sb.currentMessage() == "", timeout=120_000)
    assert window.state_label.isVisible() and not sb.message_label.isVisible()
