"""A remote row selected: the Monitor tab shows the host's slots and GPUs, the status bar its
server's state (issue #20), with a stand-in host (its ``kv-valet status --json`` answers as
tests/unit/test_server_list.STATUS). The real sshd version is tests/ssh/test_gui_remote.py."""

from __future__ import annotations

import asyncio

import pytest

from app.servers import remote_sessions as rv_jobs
from app.servers.server_list import RemoteServerSource
from app.servers import host_server
from app.ui.operations import Operation
from tests.conftest import signal_future
from tests.fake_server.gui_helpers import make_window
from tests.fake_server.test_gui_server_list import click_row, open_tab
from tests.unit.test_server_list import STATUS

pytestmark = pytest.mark.gui


class StandInHost:
    """A host whose kv-valet lists ``big`` (running) and ``idle`` (not), and answers each status
    call only when the test lets it (``answers``): calls that overlap would show in ``most``."""

    name = "gpu-box"

    def __init__(self):
        self.answers: asyncio.Queue = asyncio.Queue()
        self.calls, self.in_flight, self.most = 0, 0, 0
        self.closed = False

    async def servers(self):
        return [{"profile": {"name": "big", "url": "http://127.0.0.1:8080"}, "status": STATUS, "running": True},
                {"profile": {"name": "idle"}, "status": {"health": "unreachable: connection refused"},
                 "running": False}]

    async def sessions(self, profile=None):
        return []

    async def status(self, profile):
        self.calls += 1
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            if profile != "big":
                return {"health": "unreachable: connection refused"}
            return await self.answers.get()
        finally:
            self.in_flight -= 1

    async def close(self):
        self.closed = True


def test_a_remote_row_shows_its_slots_and_gpus_in_the_monitor_and_its_state_in_the_status_bar(
        qtbot, qloop, tmp_path, monkeypatch):
    monkeypatch.setattr(host_server, "MONITOR_EVERY_S", 0.01)  # asked again at once: overlap would show
    w, _profile = make_window(qtbot, tmp_path)
    host = StandInHost()
    view, monitor = w.remote_view, w.monitor_panel

    async def scenario():
        refreshed = signal_future(w.server_list.sig_refreshed, lambda: w.server_list.model.row_of("gpu-box:idle"))
        w.server_list.add_source(RemoteServerSource(host))
        await asyncio.wait_for(refreshed, 120)
        open_tab(qtbot, w, monitor)
        shown = signal_future(view.sig_monitor, lambda tid: tid == "gpu-box:big")
        click_row(qtbot, w, "gpu-box:big")
        assert "Ready on gpu-box" in w.state_label.text()  # the row's state until the host answers
        await host.answers.put(STATUS)  # the sessions listing asks for a status too: answered below
        await host.answers.put(STATUS)
        await asyncio.wait_for(shown, 120)
        assert monitor.slots_model.rowCount() == 2 and "big on gpu-box" in monitor.status_label.text()
        card = monitor.gpu_cards[0]
        assert "9.0" in card.mem_label.text() and "16.0" in card.mem_label.text(), card.mem_label.text()
        assert "8.0" in card.server_label.text(), card.server_label.text()
        assert "Ready on gpu-box" in w.state_label.text() and "Server" not in w.state_label.text()
        assert "health ok · 1 / 2 slots in use · GPU0 9.0/16.0 GiB" in w.snapshot_label.text()
        # the Sessions tab shows the host's server through its one entry point: park and resume there
        sessions = w.sessions_panel
        assert sessions.controller.sessions.host == "gpu-box" and sessions.controller.sessions.profile_name == "big"
        assert sessions.park_button.isEnabled() and sessions.resume_button.isEnabled()
        assert not sessions.check_button.isEnabled() and not sessions.ab_button.isEnabled()  # its capabilities
        assert not sessions.delete_button.isEnabled() and sessions.resume_all_button.isHidden()

        # asked again while shown, one call at a time (the next waits for the answer)
        # (the sampler may have used the listing's status, younger than MONITOR_EVERY_S, for its first snapshot:
        # then the second answer above is its next one, before this)
        again = signal_future(view.sig_monitor, lambda _tid: monitor.slots_model.rowCount() == 1)
        await host.answers.put({**STATUS, "slots": STATUS["slots"][:1]})
        await asyncio.wait_for(again, 120)
        assert monitor.slots_model.rowCount() == 1 and host.most == 1
        # one picture: the status the Monitor's sampler read is the Sessions tab's slots too (no call of its own)
        calls = host.calls
        assert [r.id for r in await sessions.controller.sessions.slot_rows()] == [0] and host.calls == calls

        # the host's other profile: not running there
        shown_idle = signal_future(view.sig_monitor, lambda tid: tid == "gpu-box:idle")
        click_row(qtbot, w, "gpu-box:idle")
        await asyncio.wait_for(shown_idle, 120)
        assert "Stopped on gpu-box" in w.state_label.text() and monitor.slots_model.rowCount() == 0

        # a profile of this machine: the polling stops, the status bar is this machine's again; the server
        # service keeps each host server's handle (its one sampler, paused; its sessions), the view shows none
        hosts = w.controller.service.hosts
        assert sorted(hosts) == ["gpu-box:big", "gpu-box:idle"] and view.sampler is hosts["gpu-box:idle"].sampler
        assert hosts["gpu-box:big"].sampler.paused and not hosts["gpu-box:idle"].sampler.paused
        w.controller.select("profile:fake")  # as a click on the profile on the left does (it is current there)
        assert view.shown is None and all(h.sampler.paused for h in hosts.values())
        assert "Server Stopped" in w.state_label.text() and "not sampling" in monitor.status_label.text().lower()
        assert w.sessions_panel.controller.sessions is None and w.sessions_panel.delete_button.isEnabled()
        calls = host.calls
        assert host.most == 1 and calls >= 4
        await w.shutdown()

    qloop.run_until_complete(asyncio.wait_for(scenario(), 240))


def test_the_status_bar_words_of_a_remote_server():
    from app.core.states import ServerState

    assert rv_jobs.state_text(rv_jobs.remote_state(STATUS, ServerState.STOPPED), "gpu-box") == "Ready on gpu-box"
    assert rv_jobs.state_text(rv_jobs.remote_state({"health": "unreachable: x"}, ServerState.READY),
                              "gpu-box") == "Stopped on gpu-box"
    assert rv_jobs.remote_state(None, ServerState.READY) is ServerState.READY  # not answered yet: the row's


class ParkingHost(StandInHost):
    """A stand-in host whose kv-valet also parks and resumes (``run_cli``: what its ``--json`` says)."""

    def __init__(self):
        super().__init__()
        self.listed = [{"name": "chat", "profile": "big", "state_file": "chat.bin", "save_dir": "/srv/kv",
                        "n_tokens": 900}]
        self.commands = []

    async def status(self, profile):
        return STATUS

    async def sessions(self, profile=None):
        return list(self.listed)

    async def run_cli(self, argv, *, timeout=60, ok_exits=(0,)):
        self.commands.append(list(argv))
        if argv[0] == "park":
            self.listed.insert(0, {"name": "again", "profile": "big", "n_tokens": 1234})
            return {"ok": True, "profile": "big", "sessions": [
                {"ok": True, "session": "again", "slot": 0, "tokens": 1234, "state_size": 2**20, "save_ms": 5.0,
                 "profile": "big", "warnings": []}]}
        return {"ok": True, "session": argv[2], "profile": "big", "slot": 1, "tokens": 900, "restore_ms": 7.0,
                "warnings": []}


def test_park_and_resume_on_a_remote_row_go_through_the_tabs_one_code_path(qtbot, qloop, tmp_path):
    from PySide6.QtCore import Qt

    w, _profile = make_window(qtbot, tmp_path)
    host = ParkingHost()
    sessions = w.sessions_panel

    async def scenario():
        refreshed = signal_future(w.server_list.sig_refreshed, lambda: w.server_list.model.row_of("gpu-box:big") is not None)
        w.server_list.add_source(RemoteServerSource(host))
        await asyncio.wait_for(refreshed, 120)
        open_tab(qtbot, w, sessions)
        loaded = signal_future(w.remote_view.sig_loaded, lambda tid, _s: tid == "gpu-box:big")
        slots = signal_future(sessions.controller.slots_changed, lambda rows: [r.id for r in rows] == [0, 1])
        click_row(qtbot, w, "gpu-box:big")
        await asyncio.wait_for(loaded, 120)
        assert [r.name for r in sessions.source_model.records] == ["chat"]  # listed; its status may follow
        await asyncio.wait_for(slots, 120)  # the host's status: its slots in the chooser
        assert "'big' on gpu-box: Ready" in sessions.hint.text()

        sessions.slot.setCurrentIndex(sessions.slot.findData(0))
        sessions.name.setText("again")
        parked = signal_future(sessions.controller.said, lambda op, ok, text: op is Operation.PARK)
        qtbot.mouseClick(sessions.park_button, Qt.LeftButton)
        _op, ok, text = await asyncio.wait_for(parked, 120)
        assert ok and text.startswith("Parked slot 0 as 'again': 1,234 tokens"), text
        assert host.commands[-1] == ["park", "big", "--json", "--slot", "0", "--name", "again"]
        assert [r.name for r in sessions.source_model.records] == ["again", "chat"]  # listed again

        assert sessions.select("chat")
        resumed = signal_future(sessions.controller.said, lambda op, ok, text: op is Operation.RESUME)
        qtbot.mouseClick(sessions.resume_button, Qt.LeftButton)
        _op, ok, text = await asyncio.wait_for(resumed, 120)
        assert ok and text.startswith("Resumed 'chat' into slot 1: 900 tokens"), text
        assert host.commands[-1][:4] == ["resume", "big", "chat", "--json"]
        await w.shutdown()

    qloop.run_until_complete(asyncio.wait_for(scenario(), 240))
