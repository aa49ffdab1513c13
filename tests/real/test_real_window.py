"""The window on the real server: Start reaches Ready, a crash shows its cause."""

from __future__ import annotations

import os
import signal

import pytest

from app.store.profiles import ProfileStore
from app.ui.panels import build_window
from app.ui.sessions.controller import Operation
from tests.conftest import run, signal_future

pytestmark = [pytest.mark.real_server, pytest.mark.gui]


def test_start_reaches_ready_and_a_kill_shows_its_cause(qtbot, qloop, real_profile):
    store = ProfileStore()
    store.save(real_profile)
    w = build_window(store, tabs=False)
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
    # The log panel follows the real server's log (delivered in batches: wait for the line).
    if "listening on" not in w.log_panel.shown_text():
        run(qloop, signal_future(w.log_panel.sig_lines_shown,
                                 lambda n: "listening on" in w.log_panel.shown_text()), 10)
    assert "listening on" in w.log_panel.shown_text()

    crashed = signal_future(w.controller.sig_crashed)
    os.kill(w.controller.supervisor.pid, signal.SIGKILL)
    outcome = run(qloop, crashed, 120)
    assert "signal 9" in outcome.summary()
    assert "Server Crashed" in w.state_label.text()
    assert "signal 9 (SIGKILL)" in w.url_label.text()
    assert "stopped unexpectedly" in w.profiles.errors.text()
    assert w.profiles.start_button.isEnabled()
    run(qloop, w.shutdown(), 120)


def qtbot_button():
    from PySide6.QtCore import Qt

    return Qt.LeftButton


def test_park_restart_resume_by_clicks_on_the_real_server(qtbot, qloop, real_profile):
    """The user's workflow on the stock build: park, restart, resume, and the
    next query from another client is judged DISCARDED (no checkpoint sidecar)."""
    import asyncio

    from PySide6.QtCore import Qt

    from app import paths
    from app.server.client import LlamaClient
    from app.store.catalog import Catalog
    from app.ui.monitor.panel import SlotsTableModel
    from tests.fake_server.test_gui_sessions import choose_slot, click, click_row, open_tab, slot_chooser_shows
    from tests.real.helpers import TEXT

    store = ProfileStore()
    store.save(real_profile)
    w = build_window(store)
    w.confirm_quit = False
    panel = w.sessions_panel
    panel.controller.questions.confirm = lambda title, text: True
    qtbot.addWidget(w)
    w.show()
    w.profiles.set_profiles([real_profile], select="real")
    open_tab(qtbot, w, panel)

    async def start():
        connected = signal_future(panel.controller.service_changed, lambda s: s is not None)
        qtbot.mouseClick(w.profiles.start_button, Qt.LeftButton)
        await asyncio.wait_for(connected, 120)

    async def scenario():
        await start()
        async with LlamaClient(real_profile.url) as c:
            await c.completion(TEXT, slot_id=0, n_predict=4)
        await slot_chooser_shows(panel, 0, "tokens")
        choose_slot(panel, 0)
        qtbot.keyClicks(panel.name, "real chat")
        label, ok, text = await click(qtbot, panel, panel.park_button, Operation.PARK, 120)
        assert ok and "Parked slot 0 as 'real chat'" in text and "sidecar" in text.lower()
        with Catalog(paths.catalog_path()) as cat:
            rec = cat.get("real", "real chat")
        assert rec.n_tokens > 600 and rec.state_path.is_file() and rec.sidecar_status == "missing"

        stopped = signal_future(w.controller.sig_state, lambda s, d: s == "Stopped")
        qtbot.mouseClick(w.profiles.stop_button, Qt.LeftButton)
        await asyncio.wait_for(stopped, 120)
        await start()

        click_row(qtbot, panel, "real chat")
        choose_slot(panel, 0)
        label, ok, text = await click(qtbot, panel, panel.resume_button, Operation.RESUME, 120)
        assert ok and f"into slot 0: {rec.n_tokens:,} tokens" in text and "re-prefill" in text
        restored = signal_future(w.monitor_panel.sig_snapshot, lambda snap: any(
            r.id == 0 and r.tokens_known_from_restore for r in snap.slots))
        open_tab(qtbot, w, w.monitor_panel)
        await asyncio.wait_for(restored, 120)
        m = w.monitor_panel.slots_model
        assert m.data(m.index(0, SlotsTableModel.COL_TOKENS)) == f"{rec.n_tokens:,} (restored)"

        verdict = signal_future(panel.controller.judged)
        async with LlamaClient(real_profile.url) as c:
            await c.completion(TEXT + " And then?", slot_id=0, n_predict=2)
        slot, session, v = await asyncio.wait_for(verdict, 120)
        assert (slot, session, v.kind) == (0, "real chat", "DISCARDED")
        assert v.cache_n == 0 and v.prompt_n >= rec.n_tokens
        with Catalog(paths.catalog_path()) as cat:
            assert cat.get("real", "real chat").last_verdict == "DISCARDED"
        await w.shutdown()

    run(qloop, scenario(), 240)


def test_park_all_and_quit_from_the_quit_dialog(qtbot, qloop, real_profile):
    """Quit asks: "Park all & quit" parks the filled slot, stops the server, closes the window; with
    "Resume them at once" in the preferences the next start puts the chat back unasked."""
    import asyncio

    import psutil
    from PySide6.QtCore import Qt

    from app import paths
    from app.sessions.resume_plan import load_resume_plan
    from app.server.client import LlamaClient
    from app.store.catalog import Catalog
    from tests.real.helpers import TEXT

    from PySide6.QtWidgets import QApplication

    store = ProfileStore()
    store.save(real_profile)
    w = build_window(store)
    qtbot.addWidget(w)
    w.show()
    w.profiles.set_profiles([real_profile], select="real")
    QApplication.instance().setQuitOnLastWindowClosed(False)  # the test's loop outlives the window

    async def scenario():
        connected = signal_future(w.sessions_panel.controller.service_changed, lambda s: s is not None)
        qtbot.mouseClick(w.profiles.start_button, Qt.LeftButton)
        await asyncio.wait_for(connected, 120)
        server_pid = w.controller.supervisor.pid
        async with LlamaClient(real_profile.url) as c:
            await c.completion(TEXT, slot_id=0, n_predict=2)
        closed = signal_future(w.sig_closed)
        w.close()  # the window's close button
        assert w.quit_box is not None and w.quit_box.isVisible()
        qtbot.mouseClick(w.quit_park_button, Qt.LeftButton)
        await asyncio.wait_for(closed, 120)
        return server_pid

    try:
        server_pid = run(qloop, scenario(), 240)
    finally:
        QApplication.instance().setQuitOnLastWindowClosed(True)
    assert not psutil.pid_exists(server_pid) or psutil.Process(server_pid).status() == psutil.STATUS_ZOMBIE
    with Catalog(paths.catalog_path()) as cat:
        [rec] = cat.list("real")
    assert rec.slot_id == 0 and rec.n_tokens > 600 and rec.state_path.is_file()
    assert [(e.slot, e.session) for e in load_resume_plan("real")] == [(0, rec.name)]

    # The next start, with Preferences → "Resume them at once": the chat goes back unasked.
    from tests.fake_server.test_gui_preferences import open_preferences

    w2 = build_window(store)
    w2.confirm_quit = False
    qtbot.addWidget(w2)
    w2.show()
    w2.profiles.set_profiles([real_profile], select="real")
    dlg = open_preferences(qtbot, w2)
    dlg.auto_resume.setFocus()
    qtbot.keyClick(dlg.auto_resume, Qt.Key_Down)
    qtbot.mouseClick(dlg.save_button, Qt.LeftButton)
    panel = w2.sessions_panel

    async def next_start():
        resumed = signal_future(panel.controller.said, lambda op, ok, text: op is Operation.RESUME_ALL)
        qtbot.mouseClick(w2.profiles.start_button, Qt.LeftButton)
        label, ok, text = await asyncio.wait_for(resumed, 120)
        assert ok and f"{rec.name} → slot 0: ok" in text, text
        rows = {r.id: r for r in await panel.controller.service.slot_rows()}
        await w2.shutdown()
        return rows[0].tokens_held

    assert run(qloop, next_start(), 180) == rec.n_tokens
    assert load_resume_plan("real") == [] and not panel.resume_all_button.isVisibleTo(panel)
