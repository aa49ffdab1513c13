"""Everyday habits: keyboard shortcuts press the same buttons; the window comes back as it was left."""

from __future__ import annotations

import asyncio

import pytest
from PySide6.QtCore import Qt

from app.store.profiles import ProfileStore
from app.ui.main_window import MainWindow
from app.ui.panels import build_window
from app.ui.sessions.controller import Operation
from tests.conftest import run, signal_future
from tests.fake_server.gui_helpers import make_window
from tests.fake_server.test_gui_sessions import PROMPT, choose_slot, complete

pytestmark = pytest.mark.gui


def test_shortcuts_start_park_and_stop(qtbot, qloop, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SIDECAR", "1")
    w, profile = make_window(qtbot, tmp_path)
    qtbot.waitExposed(w)

    async def scenario():
        connected = signal_future(w.sessions_panel.controller.service_changed, lambda s: s is not None)
        qtbot.keyClick(w, Qt.Key_F5)  # Start
        await asyncio.wait_for(connected, 120)
        await complete(profile, PROMPT, 0)
        choose_slot(w.sessions_panel, 0)
        done = signal_future(w.sessions_panel.controller.said, lambda op, ok, text: op is Operation.PARK)
        qtbot.keyClick(w, Qt.Key_P, Qt.ControlModifier)  # Park the chosen slot
        label, ok, text = await asyncio.wait_for(done, 120)
        assert ok and "Parked slot 0" in text
        assert w.tabs.currentWidget() is w.sessions_panel  # shown where the result is
        stopped = signal_future(w.controller.sig_state, lambda s, d: s == "Stopped")
        qtbot.keyClick(w, Qt.Key_F5, Qt.ShiftModifier)  # Stop
        await asyncio.wait_for(stopped, 120)
        await w.shutdown()

    run(qloop, scenario(), 240)


def test_the_window_comes_back_with_its_size_and_splitter(qtbot, qloop, monkeypatch):
    """Closing saves the geometry and the splitter; the next window applies them. (Qt fits a
    restored geometry to the screen, and the offscreen test screen is smaller than the window's
    minimum, so what is compared is what was saved and what the next window was given.)"""
    w = build_window(ProfileStore(), tabs=False)
    qtbot.addWidget(w)
    w.show()
    qtbot.waitExposed(w)
    w.close()  # no server: the window closes, saving its layout
    geometry, splitter = w.saveGeometry(), w.splitter.saveState()
    given = {}
    monkeypatch.setattr(MainWindow, "restoreGeometry", lambda self, g: given.setdefault("geometry", g))
    monkeypatch.setattr(type(w.splitter), "restoreState", lambda self, st: given.setdefault("splitter", st))
    again = build_window(ProfileStore(), tabs=False)
    qtbot.addWidget(again)
    assert given == {"geometry": geometry, "splitter": splitter}
