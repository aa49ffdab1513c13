"""The window on the real server: Start reaches Ready, a crash shows its cause."""

from __future__ import annotations

import os
import signal

import pytest

from app.store.profiles import ProfileStore
from app.ui.main_window import MainWindow
from tests.conftest import run, signal_future

pytestmark = [pytest.mark.real_server, pytest.mark.gui]


def test_start_reaches_ready_and_a_kill_shows_its_cause(qtbot, qloop, real_profile):
    store = ProfileStore()
    store.save(real_profile)
    w = MainWindow(store)
    w.confirm_quit = False
    qtbot.addWidget(w)
    w.profiles.set_profiles([real_profile], select="real")
    seen = []
    w.controller.sig_state.connect(lambda s, d: seen.append(s))

    ready = signal_future(w.controller.sig_state, lambda s, d: s == "Ready")
    qtbot.mouseClick(w.profiles.start_button, qtbot_button())
    state, detail = run(qloop, ready, 120)
    assert detail == real_profile.url
    assert seen[0] == "Starting" and "Ready" in seen
    assert "Server Ready" in w.state_label.text() and real_profile.url in w.url_label.text()
    assert not w.profiles.start_button.isEnabled() and w.profiles.stop_button.isEnabled()
    # The log panel follows the real server's log.
    if w.log_panel.lines_shown == 0:
        run(qloop, signal_future(w.log_panel.sig_lines_shown, lambda n: n > 0), 10)
    assert "listening on" in w.log_panel.shown_text()

    crashed = signal_future(w.controller.sig_crashed)
    os.kill(w.controller.supervisor.pid, signal.SIGKILL)
    outcome = run(qloop, crashed, 30)
    assert "signal 9" in outcome.summary()
    assert "Server Crashed" in w.state_label.text()
    assert "signal 9 (SIGKILL)" in w.url_label.text()
    assert "stopped unexpectedly" in w.profiles.errors.text()
    assert w.profiles.start_button.isEnabled()
    run(qloop, w.shutdown(), 30)


def qtbot_button():
    from PySide6.QtCore import Qt

    return Qt.LeftButton
