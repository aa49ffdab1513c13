"""The Monitor tab's slot table against the real llama-server and Gemma 3 270M."""

from __future__ import annotations

import asyncio

import pytest

from app.core.states import Health
from app.core.profile import LaunchProfile
from app.server.client import LlamaClient
from app.servers.service import ServerService
from app.ui.servers.controller import ServerController
from app.ui.monitor.panel import MonitorPanel, SlotsTableModel
from tests.conftest import signal_future
from tests.conftest import free_port

pytestmark = [pytest.mark.real_server, pytest.mark.gui]
C = SlotsTableModel


def run(loop, aw, timeout=120):
    return loop.run_until_complete(asyncio.wait_for(aw, timeout))


def test_slot_table_follows_a_real_completion(real_binary, real_model, tmp_path, qloop, qtbot):
    profile = LaunchProfile(name="real-monitor", model=real_model, server_binary=real_binary, port=free_port(),
                            ctx_size=2048, parallel=2, slot_save_path=str(tmp_path / "slots") + "/")
    controller = ServerController(service=ServerService(connect_sessions=False))  # its sampler is the service's
    panel = MonitorPanel(interval=0.5, busy_interval=0.05)
    qtbot.addWidget(panel)
    panel.attach(controller)
    panel.show()
    seen = []
    panel.sig_snapshot.connect(seen.append)
    try:
        first = signal_future(panel.sig_snapshot, lambda s: s.health is Health.OK and len(s.slots) == 2)
        assert run(qloop, controller.start_async(profile)) is True
        snap = run(qloop, first)
        sup = controller.supervisor
        assert snap.process is not None and snap.process.pid == sup.pid and snap.process.alive
        assert [r.n_ctx for r in snap.slots] == [1024, 1024]  # -c 2048 split across 2 slots
        m = panel.slots_model
        assert [m.index(r, C.COL_STATE).data() for r in range(2)] == ["idle", "idle"]
        assert m.index(0, C.COL_NCTX).data() == "1,024"

        async def complete():
            async with LlamaClient(controller.url) as client:
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
        sampling = panel.sampler is not None
        run(qloop, controller.stop_async())
        if sampling:
            run(qloop, stopped)
        run(qloop, panel.aclose())
        run(qloop, controller.aclose())
    assert not controller.supervisor or not controller.supervisor.running
    assert panel.sampler is None and controller.service.samplers.samplers == {}
    assert any(s.any_busy for s in seen)
