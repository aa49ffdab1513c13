"""The Cache health tab's RPC workers line and findings (app.ui.monitor.health_panel over app.monitor.rpc)."""

from __future__ import annotations

import asyncio
import socket
import types

import pytest
from PySide6.QtCore import QObject, Signal

from app.core.profile import LaunchProfile
from app.monitor.rpc import RULE_UNREACHABLE
from app.ui.monitor.health_panel import HealthPanel
from tests.conftest import run

pytestmark = pytest.mark.gui


class Controller(QObject):
    """The part of ServerController the panel reads."""

    sig_plan = Signal(object)
    sig_crashed = Signal(object)
    sig_state = Signal(object, str)
    sig_selected = Signal(str)

    def __init__(self, profile, supervisor):
        super().__init__()
        self.profile, self.supervisor, self.attached = profile, supervisor, None
        self.target_id = f"profile:{profile.name}"


class Supervisor:
    def __init__(self):
        self.pid = None
        self.lines = []

    def on_line(self, cb):
        self.lines.append(cb)


def test_an_unreachable_worker_shows_in_the_line_and_the_table(qtbot, qloop):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # released: nothing listens there
    sup = Supervisor()
    controller = Controller(LaunchProfile(name="p", model="m.gguf", parallel=1, rpc=f"127.0.0.1:{port}"), sup)
    panel = HealthPanel()
    qtbot.addWidget(panel)
    panel.attach(controller)
    panel.show()
    controller.sig_plan.emit(types.SimpleNamespace())
    assert panel.rpc is not None and panel.rpc_label.isVisible()
    run(qloop, asyncio.wait_for(panel.rpc.wait_for(lambda w: w.rounds >= 1), 120))
    assert f"127.0.0.1:{port}: unreachable (connection refused" in panel.rpc_label.text()
    [f] = panel.health.findings
    assert f.rule_id == RULE_UNREACHABLE and panel.table.rowCount() == 1
    # the profile change is a button; starting the worker is done on its machine: said, not a button
    assert [b.text() for b in panel.remedy_buttons] == [f"Apply: Remove 127.0.0.1:{port} from --rpc"]
    assert f"To do: Start rpc-server on 127.0.0.1 with -p {port}" in panel.detail.text()
    run(qloop, panel.rpc.check())  # the next round: the same trouble is not listed twice
    assert panel.table.rowCount() == 1
    run(qloop, panel.aclose())
    assert not panel.rpc.is_running


def test_without_rpc_there_is_no_watcher(qtbot, qloop):
    controller = Controller(LaunchProfile(name="p", model="m.gguf"), Supervisor())
    panel = HealthPanel()
    qtbot.addWidget(panel)
    panel.attach(controller)
    controller.sig_plan.emit(types.SimpleNamespace())
    assert panel.rpc is None and not panel.rpc_label.isVisible()
    run(qloop, panel.aclose())
