"""The tray menu presses the window's own buttons; closing can leave KV Valet in the tray."""

from __future__ import annotations

import asyncio

import pytest
from PySide6.QtWidgets import QSystemTrayIcon

from app import paths
from app.store.catalog import Catalog
from app.ui.sessions.controller import Operation
from tests.conftest import run, signal_future
from tests.fake_server.gui_helpers import make_window
from tests.fake_server.test_gui_sessions import PROMPT, complete

pytestmark = pytest.mark.gui


def test_tray_park_all_keep_in_tray_and_quit(qtbot, qloop, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SIDECAR", "1")
    w, profile = make_window(qtbot, tmp_path)
    tray = w.tray

    async def scenario():
        connected = signal_future(w.sessions_panel.controller.service_changed, lambda s: s is not None)
        assert await w.controller.start_async(profile)
        await asyncio.wait_for(connected, 120)
        assert tray.state_action.text() == "Server Ready" and tray.park_all_action.isEnabled()
        await complete(profile, PROMPT, 0)

        # the desktop has a tray (the offscreen test platform has none): closing hides the window
        monkeypatch.setattr(QSystemTrayIcon, "isSystemTrayAvailable", staticmethod(lambda: True))
        w.tray_action.trigger()  # Session > Keep running in the tray when closed
        assert w.keep_in_tray and "keep_in_tray = true" in paths.settings_path().read_text()  # a preference
        w.close()
        assert not w.isVisible() and w.controller.state == "Ready"

        # Park all from the tray while the window is hidden: done in the background, told in a notification
        done = signal_future(w.sessions_panel.controller.said, lambda op, ok, text: op is Operation.PARK_ALL)
        tray.park_all_action.trigger()
        label, ok, text = await asyncio.wait_for(done, 120)
        assert ok and tray.notifications[-1][0] == "KV Valet: Park all"
        with Catalog(paths.catalog_path()) as cat:
            assert [r.slot_id for r in cat.list("fake")] == [0]

        tray.open_action.trigger()
        assert w.isVisible()
        closed = signal_future(w.sig_closed)
        tray.quit_action.trigger()  # Quit from the tray really quits (and stops the server)
        await asyncio.wait_for(closed, 120)
        assert w.controller.state == "Stopped"

    from PySide6.QtWidgets import QApplication

    QApplication.instance().setQuitOnLastWindowClosed(False)  # as run_gui sets it
    try:
        run(qloop, scenario(), 240)
    finally:
        QApplication.instance().setQuitOnLastWindowClosed(True)
