"""Shutdown and sleep, as logind announces them: the window parks the chats, then lets go.

A private D-Bus bus (dbus-daemon, started here) carries a fake logind
(tests/doubles/fake_logind.py); the window holds its delay lock while the real
server runs. PrepareForShutdown(true) must end with the filled slot parked, the
server stopped and the lock released; the time from the signal to the release
is printed (the app's share of the shutdown delay). PrepareForSleep(true) parks
and keeps the server; on the wake a slot that lost its chat is offered back.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
from PySide6.QtCore import Qt

from app import paths
from app.server.client import LlamaClient
from app.store.catalog import Catalog
from app.store.profiles import ProfileStore
from app.ui.main_window import MainWindow
from app.ui.panels import build_window
from app.ui.sessions.controller import Operation
from tests.conftest import run, signal_future
from tests.real.helpers import TEXT

pytestmark = [pytest.mark.real_server, pytest.mark.gui]

FAKE_LOGIND = Path(__file__).resolve().parents[1] / "doubles" / "fake_logind.py"


class Lines:
    """A child's stdout, line by line, waited on with a timeout (a reader thread, no sleeps)."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc) -> None:
        for line in proc.stdout:
            with self.cond:
                self.lines.append(line.strip())
                self.cond.notify_all()

    def wait(self, prefix: str, timeout: float = 120.0, count: int = 1) -> str:
        """The ``count``-th line starting with ``prefix``, once there is one."""
        def found():
            return [l for l in self.lines if l.startswith(prefix)]

        with self.cond:
            ok = self.cond.wait_for(lambda: len(found()) >= count, timeout)
            assert ok, f"no {count}. line starting with {prefix!r} in {self.lines}"
            return found()[count - 1]


@pytest.fixture
def private_bus():
    if shutil.which("dbus-daemon") is None:
        pytest.skip("dbus-daemon (Debian package dbus-daemon) is not installed")
    daemon = subprocess.Popen(["dbus-daemon", "--session", "--nofork", "--print-address=1"],
                              stdout=subprocess.PIPE, text=True)
    address = daemon.stdout.readline().strip()
    logind = subprocess.Popen([sys.executable, str(FAKE_LOGIND), address], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, QT_QPA_PLATFORM="offscreen"))
    lines = Lines(logind)
    try:
        lines.wait("READY")
        yield address, lines
    finally:
        for p in (logind, daemon):
            p.terminate()
            p.wait(10)


def window_on_the_bus(qtbot, profile, address: str, monkeypatch) -> MainWindow:
    """The window as the app wires it, its shutdown guard on the private bus, the profile selected."""
    monkeypatch.setenv("KV_VALET_LOGIND_BUS", address)
    store = ProfileStore()
    store.save(profile)
    w = build_window(store)
    w.confirm_quit = False
    qtbot.addWidget(w)
    w.show()
    w.profiles.set_profiles([profile], select=profile.name)
    return w


def test_prepare_for_shutdown_parks_the_filled_slot_then_releases_the_lock(qtbot, qloop, real_profile,
                                                                        private_bus, monkeypatch, capsys):
    from PySide6.QtDBus import QDBusConnection, QDBusMessage

    address, logind = private_bus
    w = window_on_the_bus(qtbot, real_profile, address, monkeypatch)
    assert w.shutdown_guard.connected

    async def scenario():
        connected = signal_future(w.sessions_panel.controller.service_changed, lambda s: s is not None)
        qtbot.mouseClick(w.profiles.start_button, Qt.LeftButton)
        await asyncio.wait_for(connected, 120)
        assert await asyncio.to_thread(logind.wait, "INHIBIT") == "INHIBIT shutdown:sleep delay KV Valet"
        assert w.shutdown_guard.held
        server_pid = w.controller.supervisor.pid
        async with LlamaClient(real_profile.url) as c:  # two filled slots
            await c.completion(TEXT, slot_id=0, n_predict=2)
            await c.completion("A second conversation, about trains. " + TEXT, slot_id=1, n_predict=2)

        stopped = signal_future(w.controller.sig_state, lambda s, d: s == "Stopped")
        bus = QDBusConnection.connectToBus(address, "test-caller")
        emit = QDBusMessage.createMethodCall("org.freedesktop.login1", "/org/freedesktop/login1",
                                             "org.freedesktop.login1.Manager", "Emit")
        emit.setArguments(["PrepareForShutdown", True])
        bus.call(emit)
        await asyncio.wait_for(stopped, 120)
        released = await asyncio.to_thread(logind.wait, "RELEASED", 120)
        QDBusConnection.disconnectFromBus("test-caller")
        await w.shutdown()
        return server_pid, float(released.split()[1])

    server_pid, seconds = run(qloop, scenario(), 240)
    assert not psutil.pid_exists(server_pid) or psutil.Process(server_pid).status() == psutil.STATUS_ZOMBIE
    assert not w.shutdown_guard.held
    # the window's shutdown let go of D-Bus: its signals and its private connection to the bus
    assert not w.shutdown_guard.connected
    assert not QDBusConnection(f"kv-valet-logind {address}").isConnected()
    with Catalog(paths.catalog_path()) as cat:
        recs = sorted(cat.list("real"), key=lambda r: r.slot_id)
    assert [r.slot_id for r in recs] == [0, 1] and all(r.n_tokens > 600 and r.state_path.is_file() for r in recs)
    with capsys.disabled():  # the app's share of the shutdown delay, beside the server's own save times
        print(f"\nfrom PrepareForShutdown(true) to the lock's release: {seconds * 1000:,.0f} ms; the server's "
              f"own saves: {', '.join(f'slot {r.slot_id} {r.save_ms:,.1f} ms' for r in recs)}")


def test_prepare_for_sleep_parks_and_the_wake_offers_back_only_what_was_lost(qtbot, qloop, real_profile,
                                                                             private_bus, monkeypatch):
    from PySide6.QtDBus import QDBusConnection, QDBusMessage

    from app.sessions.resume_plan import load_resume_plan

    address, logind = private_bus
    w = window_on_the_bus(qtbot, real_profile, address, monkeypatch)
    panel = w.sessions_panel
    bus = QDBusConnection.connectToBus(address, "test-caller-sleep")

    def announce(start: bool) -> None:
        emit = QDBusMessage.createMethodCall("org.freedesktop.login1", "/org/freedesktop/login1",
                                             "org.freedesktop.login1.Manager", "Emit")
        emit.setArguments(["PrepareForSleep", start])
        bus.call(emit)

    async def woke():
        done = signal_future(panel.controller.said, lambda op, ok, text: op is Operation.WAKE)
        announce(False)
        return await asyncio.wait_for(done, 120)

    async def scenario():
        connected = signal_future(panel.controller.service_changed, lambda s: s is not None)
        qtbot.mouseClick(w.profiles.start_button, Qt.LeftButton)
        await asyncio.wait_for(connected, 120)
        await asyncio.to_thread(logind.wait, "INHIBIT")
        async with LlamaClient(real_profile.url) as c:  # two filled slots
            await c.completion(TEXT, slot_id=0, n_predict=2)
            await c.completion("A second conversation, about trains. " + TEXT, slot_id=1, n_predict=2)

        # a suspend: both parked, the plan written, the lock released; the server keeps running
        announce(True)
        await asyncio.to_thread(logind.wait, "RELEASED", 120)
        assert w.controller.state == "Ready" and not w.shutdown_guard.held
        assert sorted(e.slot for e in load_resume_plan("real")) == [0, 1]
        # the wake, with the chats still in their slots: nothing to resume, the plan goes
        label, ok, text = await woke()
        assert ok and "nothing to resume" in text, text
        assert load_resume_plan("real") == [] and not panel.resume_all_button.isVisibleTo(panel)
        await asyncio.to_thread(logind.wait, "INHIBIT", 120, 2)  # held again for the next time

        # a second suspend, during which slot 1 loses its chat (a GPU reset, another client's erase)
        announce(True)
        await asyncio.to_thread(logind.wait, "RELEASED", 120, 2)
        async with LlamaClient(real_profile.url) as c:
            await c.erase_slot(1)
        label, ok, text = await woke()
        assert not ok and "slot 1" in text and "slot 0" not in text, text
        assert [e.slot for e in load_resume_plan("real")] == [1]
        assert panel.resume_all_button.isVisibleTo(panel) and panel.resume_all_button.text() == "Resume all (1)"
        done = signal_future(panel.controller.said, lambda op, ok, text: op is Operation.RESUME_ALL)
        qtbot.mouseClick(panel.resume_all_button, Qt.LeftButton)
        label, ok, text = await asyncio.wait_for(done, 120)
        assert ok and "→ slot 1: ok" in text, text
        rows = {r.id: r for r in await panel.controller.service.slot_rows()}
        assert rows[1].tokens_held and rows[1].tokens_held > 600
        await w.shutdown()

    try:
        run(qloop, scenario(), 240)
    finally:
        QDBusConnection.disconnectFromBus("test-caller-sleep")
