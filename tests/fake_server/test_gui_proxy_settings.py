"""Server > Preferences… reaches a running conversation proxy: the park budget and the idle-slot saving
typed and saved in the dialog apply to the proxy in front of the server at once, without a restart (the
park ahead too)."""

from __future__ import annotations

import asyncio

import pytest
from PySide6.QtCore import Qt

from tests.conftest import run
from tests.fake_server.gui_helpers import make_window
from tests.fake_server.test_gui_preferences import open_preferences, saved_file, type_into

pytestmark = pytest.mark.gui


def test_preferences_saved_reach_the_running_proxy(qtbot, qloop, tmp_path):
    w, profile = make_window(qtbot, tmp_path, proxy=True)

    async def scenario():
        assert await w.controller.start_async(profile)
        handle = next(h for h in w.controller.service.servers.values() if h.profile and h.profile.name == "fake")
        proxy = handle.proxy
        assert proxy is not None and proxy.http is not None  # the profile's port is the proxy's
        assert proxy.disk_budget_bytes == 50 * 1024 ** 3 and proxy.save_before_idle_clear  # the defaults
        assert proxy.park_ahead

        dlg = open_preferences(qtbot, w)
        type_into(qtbot, dlg.proxy_budget, "3")
        qtbot.mouseClick(dlg.proxy_save_first, Qt.LeftButton)  # untick "Save idle slots before …"
        assert dlg.proxy_warm.isChecked()  # the warm start is on by default
        qtbot.mouseClick(dlg.proxy_warm, Qt.LeftButton)  # untick "Restore the conversations used last …"
        assert dlg.proxy_park_ahead.isChecked()
        qtbot.mouseClick(dlg.proxy_park_ahead, Qt.LeftButton)  # untick "Park the next conversation to leave …"
        qtbot.mouseClick(dlg.save_button, Qt.LeftButton)
        qtbot.waitUntil(lambda: not dlg.isVisible(), timeout=120_000)

        assert saved_file() == {"proxy_disk_budget_gib": 3, "proxy_save_before_idle_clear": False,
                                "proxy_warm_start": False, "proxy_park_ahead": False}
        # (the next proxy start restores nothing ahead)
        # applied to the running proxy: its leases enforce the new budget at the next save, its watch no
        # longer saves idle slots before a task
        assert proxy.disk_budget_bytes == 3 * 1024 ** 3
        assert proxy.leases.disk_budget_bytes == 3 * 1024 ** 3
        assert not proxy.save_before_idle_clear and not proxy.watch.save_before_clear
        assert not proxy.park_ahead  # its next idle moment parks nothing ahead
        await asyncio.wait_for(w.shutdown(), 120)

    run(qloop, scenario(), 240)
