"""The desktop session's end parks the chats like SIGTERM does: Qt's commit-data request, and an
application quit() from outside (a session manager) while the window still runs."""

from __future__ import annotations

import asyncio

import pytest
from PySide6.QtCore import QTimer
from PySide6.QtGui import QSessionManager
from PySide6.QtWidgets import QApplication

from app import paths
from app.store.catalog import Catalog
from app.ui.app import run_until_closed
from tests.conftest import run, signal_future
from tests.fake_server.gui_helpers import make_window
from tests.fake_server.test_gui_sessions import PROMPT, complete

pytestmark = pytest.mark.gui


@pytest.fixture(autouse=True)
def as_the_app_runs(qapp):
    """run_gui keeps the application when the window closes (the tray may keep it): so here."""
    qapp.setQuitOnLastWindowClosed(False)
    yield
    qapp.setQuitOnLastWindowClosed(True)


class SessionManagerStub:
    """What commitDataRequest hands over (QSessionManager has no public constructor)."""

    def __init__(self):
        self.hints = []

    def setRestartHint(self, hint):  # noqa: N802 (Qt name)
        self.hints.append(hint)


async def started_with_a_chat(w, profile):
    connected = signal_future(w.sessions_panel.controller.service_changed, lambda s: s is not None)
    assert await w.controller.start_async(profile)
    await asyncio.wait_for(connected, 120)
    await complete(profile, PROMPT, 0)


def parked_slots() -> list[int]:
    with Catalog(paths.catalog_path()) as cat:
        return sorted(r.slot_id for r in cat.list("fake"))


def test_commit_data_parks_and_the_logouts_sigterm_does_not_cut_it_short(qtbot, qloop, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SIDECAR", "1")
    w, profile = make_window(qtbot, tmp_path)
    manager = SessionManagerStub()

    async def scenario():
        await started_with_a_chat(w, profile)
        closed = signal_future(w.sig_closed)
        w.session_ending(manager)  # app.commitDataRequest → the desktop session is ending
        w.park_and_quit()  # the SIGTERM the logout sends next: joins the park
        await asyncio.wait_for(closed, 120)

    run(qloop, scenario(), 240)
    assert manager.hints == [QSessionManager.RestartNever]
    assert parked_slots() == [0]
    assert w.controller.state == "Stopped"


def test_a_quit_from_the_session_manager_waits_for_the_park(qtbot, qloop, tmp_path, monkeypatch):
    """After the commit-data request the session manager quits the application: Qt asks the
    window to close, and it closes only once the chat is parked and the server stopped."""
    monkeypatch.setenv("FAKE_SIDECAR", "1")
    w, profile = make_window(qtbot, tmp_path)
    run(qloop, started_with_a_chat(w, profile), 120)
    w.session_ending(SessionManagerStub())
    QTimer.singleShot(0, QApplication.instance().quit)
    run_until_closed(qloop, w)
    assert parked_slots() == [0]
    assert w.controller.state == "Stopped"


def test_an_exit_from_outside_still_parks_before_the_process_goes(qtbot, qloop, tmp_path, monkeypatch):
    """exit() stops the event loop without asking the window: the chats are parked all the same."""
    monkeypatch.setenv("FAKE_SIDECAR", "1")
    w, profile = make_window(qtbot, tmp_path)
    run(qloop, started_with_a_chat(w, profile), 120)
    QTimer.singleShot(0, lambda: QApplication.exit(0))
    run_until_closed(qloop, w)
    assert parked_slots() == [0]
    assert w.controller.state == "Stopped"
