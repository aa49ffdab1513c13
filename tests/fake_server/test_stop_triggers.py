"""Every way a server gets stopped ends in the server service's one park-then-stop, with the one
timeout of the preferences: the quit dialog, SIGTERM/SIGHUP, the desktop session's end (and a quit
from outside), logind's shutdown and sleep, the Park all & stop button, `kv-valet serve`'s Ctrl-C,
the systemd unit's stop, and `kv-valet park --all --and-stop`.

A spy wraps ServerService.park_then_stop: a trigger that parks or stops by another path leaves
it uncalled and its test fails. Each test also checks what the user gets: the chat parked (and
the server stopped, or kept before a sleep)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from PySide6.QtCore import QTimer, Qt
from PySide6.QtWidgets import QApplication

from app import paths, settings
from app.core.lifecycle import StopTrigger
from app.core.states import PowerEvent, ServerState
from app.servers.service import ServerService
from app.store.catalog import Catalog
from app.ui.app import run_until_closed
from app.ui.sessions.controller import Operation
from tests.conftest import run, signal_future
from tests.fake_server.gui_helpers import make_window
from tests.fake_server.test_gui_sessions import PROMPT, complete

pytestmark = pytest.mark.gui

TIMEOUT_S = 77.0  # the preferences' park timeout: every trigger must run under it


@pytest.fixture
def calls(monkeypatch):
    """Each park-then-stop: (trigger, the timeout it ran under)."""
    monkeypatch.setenv("FAKE_SIDECAR", "1")
    settings.update(park_timeout_s=TIMEOUT_S)
    seen: list[tuple[StopTrigger, float]] = []
    original = ServerService.park_then_stop

    async def spy(self, target_id, trigger, **kw):
        seen.append((trigger, self.park_timeout_s))
        return await original(self, target_id, trigger, **kw)

    monkeypatch.setattr(ServerService, "park_then_stop", spy)
    return seen


@pytest.fixture(autouse=True)
def as_the_app_runs(qapp):
    qapp.setQuitOnLastWindowClosed(False)
    yield
    qapp.setQuitOnLastWindowClosed(True)


def parked() -> list[int]:
    with Catalog(paths.catalog_path()) as cat:
        return sorted(r.slot_id for r in cat.list("fake"))


async def _started(w, profile) -> None:
    connected = signal_future(w.sessions_panel.controller.service_changed, lambda s: s is not None)
    assert await w.controller.start_async(profile)
    await asyncio.wait_for(connected, 120)
    await complete(profile, PROMPT, 0)


def _quit_dialog(w, qtbot):
    w.confirm_quit = True
    w.close()
    assert w.quit_box is not None
    qtbot.mouseClick(w.quit_park_button, Qt.LeftButton)


def _sigterm(w, qtbot):
    w.park_and_quit()


def _session_end(w, qtbot):
    class Manager:
        def setRestartHint(self, hint):  # noqa: N802 (Qt's name)
            pass

    w.session_ending(Manager())


WINDOW_TRIGGERS = [(_quit_dialog, StopTrigger.QUIT), (_sigterm, StopTrigger.SIGNAL),
                   (_session_end, StopTrigger.SESSION_END)]


@pytest.mark.parametrize("act,trigger", WINDOW_TRIGGERS, ids=[t for _a, t in WINDOW_TRIGGERS])
def test_a_window_quit_parks_then_stops_through_the_one_call(act, trigger, calls, qtbot, qloop, tmp_path):
    w, profile = make_window(qtbot, tmp_path)
    run(qloop, _started(w, profile), 240)
    closed = signal_future(w.sig_closed)
    act(w, qtbot)
    run(qloop, closed, 120)
    assert calls == [(trigger, TIMEOUT_S)]
    assert parked() == [0] and w.controller.state == ServerState.STOPPED


def test_a_quit_from_outside_the_window_goes_the_same_way(calls, qtbot, qloop, tmp_path):
    w, profile = make_window(qtbot, tmp_path)
    run(qloop, _started(w, profile), 240)
    QTimer.singleShot(0, lambda: QApplication.exit(0))  # the loop stops under the window
    run_until_closed(qloop, w)
    assert calls == [(StopTrigger.SESSION_END, TIMEOUT_S)]
    assert parked() == [0]


@pytest.mark.parametrize("event,trigger,stops", [(PowerEvent.SHUTDOWN, StopTrigger.SHUTDOWN, True),
                                                  (PowerEvent.SLEEP, StopTrigger.SLEEP, False)])
def test_logind_parks_through_the_one_call(event, trigger, stops, calls, qtbot, qloop, tmp_path):
    w, profile = make_window(qtbot, tmp_path)
    run(qloop, _started(w, profile), 240)
    released = signal_future(w.controller.sig_notice)  # the service says it is parking
    w.shutdown_guard.sig_prepare.emit(event, True)
    run(qloop, released, 120)
    run(qloop, asyncio.gather(*w.prepare_tasks), 120)
    assert calls == [(trigger, TIMEOUT_S)]
    assert parked() == [0]
    assert (w.controller.state == ServerState.STOPPED) is stops  # before a sleep the server stays
    run(qloop, w.shutdown(), 120)


def test_the_park_all_and_stop_button_goes_through_the_one_call(calls, qtbot, qloop, tmp_path):
    from tests.fake_server.test_gui_sessions import click

    w, profile = make_window(qtbot, tmp_path)
    run(qloop, _started(w, profile), 240)
    panel = w.sessions_panel
    w.tabs.setCurrentWidget(panel)
    _label, ok, text = run(qloop, click(qtbot, panel, panel.park_stop_button, Operation.PARK_ALL_AND_STOP), 120)
    assert ok, text
    assert calls == [(StopTrigger.USER, TIMEOUT_S)]
    assert parked() == [0] and w.controller.state == ServerState.STOPPED
    run(qloop, w.shutdown(), 120)


# -- the command line ----------------------------------------------------------------------------

@pytest.mark.parametrize("under_systemd,trigger", [(False, StopTrigger.SERVE), (True, StopTrigger.UNIT_STOP)])
async def test_serve_parks_then_stops_through_the_one_call(under_systemd, trigger, calls, tmp_path, monkeypatch):
    """`kv-valet serve`: Ctrl-C (or systemd's SIGTERM when the unit stops) parks first."""
    from argparse import Namespace

    from app.cli.serve import cmd_serve
    from tests.fake_server.profiles import fake_profile

    if under_systemd:
        monkeypatch.setenv("INVOCATION_ID", "0123456789abcdef")  # systemd sets it for a unit's processes
    else:
        monkeypatch.delenv("INVOCATION_ID", raising=False)
    profile = fake_profile(tmp_path)
    ready = asyncio.Event()
    launch = ServerService.launch

    async def launched(self, p):
        handle = await launch(self, p)
        await self.sessions(handle.id)
        ready.set()
        return handle

    monkeypatch.setattr(ServerService, "launch", launched)
    serve = asyncio.ensure_future(cmd_serve(Namespace(profile="fake", quiet=True, park_timeout=None,
                                                      no_park=False)))
    await asyncio.wait({serve, asyncio.ensure_future(ready.wait())}, return_when=asyncio.FIRST_COMPLETED)
    assert not serve.done(), serve.result()
    await complete(profile, PROMPT, 0)
    os.kill(os.getpid(), signal.SIGINT if not under_systemd else signal.SIGTERM)
    assert await serve == 0
    assert calls == [(trigger, TIMEOUT_S)]
    assert parked() == [0]


async def test_park_all_and_stop_on_the_command_line_goes_through_the_one_call(calls, tmp_path):
    """`kv-valet park PROFILE --all --and-stop` on a server KV Valet launched (its pid record)."""
    from app.cli import build_parser
    from app.cli.sessions import cmd_park
    from app.server.launcher import make_supervisor, plan_launch
    from tests.fake_server.profiles import fake_profile

    profile = fake_profile(tmp_path)
    sup = make_supervisor(await asyncio.to_thread(plan_launch, profile))
    await sup.start()
    try:
        await complete(profile, PROMPT, 0)
        args = build_parser().parse_args(["park", "fake", "--all", "--and-stop"])
        with Catalog(paths.catalog_path()) as cat:
            assert await cmd_park(args, cat) == 0
        await sup.wait_state(ServerState.STOPPED, ServerState.CRASHED, timeout=120)
    finally:
        await sup.aclose()
    assert calls == [(StopTrigger.USER, TIMEOUT_S)]
    assert parked() == [0]
