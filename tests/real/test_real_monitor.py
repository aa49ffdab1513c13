"""The Monitor tab's slot table against the real llama-server and Gemma 3 270M."""

from __future__ import annotations

import asyncio

import pytest

from app.core.states import Health
from app.core.profile import LaunchProfile
from app.server.client import LlamaClient
from app.server.launcher import make_supervisor, plan_launch
from app.ui.monitor.panel import MonitorPanel, SlotsTableModel
from tests.conftest import signal_future
from tests.conftest import free_port

pytestmark = [pytest.mark.real_server, pytest.mark.gui]
C = SlotsTableModel


def run(loop, aw, timeout=120):
    return loop.run_until_complete(asyncio.wait_for(aw, timeout))


def make_controller(plan, sup):
    """The part of ServerController the panel reads, around a bare Supervisor."""
    from PySide6.QtCore import QObject, Signal

    class Controller(QObject):
        sig_state = Signal(str, str)

        @property
        def pid(self):
            return sup.pid

    c = Controller()
    c.plan, c.supervisor, c.url = plan, sup, plan.url
    c.client = sup._client  # the server's one client, as the server service shares it
    sup.on_state(lambda state, outcome: c.sig_state.emit(state.value, ""))
    return c


def test_slot_table_follows_a_real_completion(real_binary, real_model, tmp_path, qloop, qtbot):
    profile = LaunchProfile(name="real-monitor", model=real_model, server_binary=real_binary, port=free_port(),
                            ctx_size=2048, parallel=2, slot_save_path=str(tmp_path / "slots") + "/")
    plan = plan_launch(profile)
    sup = make_supervisor(plan)
    controller = make_controller(plan, sup)
    panel = MonitorPanel(interval=0.5, busy_interval=0.05)
    qtbot.addWidget(panel)
    panel.attach(controller)
    panel.show()
    seen = []
    panel.sig_snapshot.connect(seen.append)
    try:
        first = signal_future(panel.sig_snapshot, lambda s: s.health is Health.OK and len(s.slots) == 2)
        run(qloop, sup.start())
        snap = run(qloop, first)
        assert snap.process is not None and snap.process.pid == sup.pid and snap.process.alive
        assert [r.n_ctx for r in snap.slots] == [1024, 1024]  # -c 2048 split across 2 slots
        m = panel.slots_model
        assert [m.index(r, C.COL_STATE).data() for r in range(2)] == ["idle", "idle"]
        assert m.index(0, C.COL_NCTX).data() == "1,024"

        async def complete():
            async with LlamaClient(plan.url) as client:
                return await client.completion("Write a long story about a lighthouse keeper and the sea.",
                                               slot_id=1, n_predict=100, extra={"ignore_eos": True})

        busy = signal_future(panel.sig_snapshot, lambda s: any(r.busy for r in s.slots))
        task = asyncio.ensure_future(complete())
        snap = run(qloop, busy)
        assert [r.id for r in snap.slots if r.busy] == [1]
        assert m.index(1, C.COL_STATE).data() == "processing"
        result = run(qloop, task)
        assert result["tokens_predicted"] == 100

        # idle, with the process figures of that tick (a tick whose psutil read lost a race on a
        # loaded machine shows "-" for them, and the next one has them again)
        idle = signal_future(panel.sig_snapshot, lambda s: not s.any_busy and s.slots[1].tokens_held
                             and s.process is not None and s.process.rss is not None)
        snap = run(qloop, idle)
        row = snap.slots[1]
        assert row.tokens_held >= result["tokens_evaluated"] > 0
        assert row.id_task is not None and not row.tokens_known_from_restore
        assert m.index(1, C.COL_STATE).data() == "idle"
        assert m.index(1, C.COL_TOKENS).data() == f"{row.tokens_held:,}"
        assert m.index(1, C.COL_TASK).data() == str(row.id_task)
        assert m.index(0, C.COL_TOKENS).data() == "-"  # slot 0 ran nothing
        assert panel.host_labels["server_rss"].text() != "-"
        assert not any("Traceback" in t for t in panel.warning_texts())
    finally:
        stopped = signal_future(panel.sig_sampling, lambda on: on is False)
        run(qloop, sup.aclose())
        if panel.sampler is not None:
            run(qloop, stopped, timeout=10)
        run(qloop, panel.aclose())
    assert not sup.running and panel.sampler is None
    assert any(s.any_busy for s in seen)
