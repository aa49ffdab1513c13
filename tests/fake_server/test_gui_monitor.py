"""The Monitor tab following a real ServerController that runs the fake llama-server."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from app.core.states import Health
from app.core.profile import LaunchProfile
from app.monitor.gpu import GpuMonitor
from app.monitor.slots import RestoredSlot
from app.server.client import LlamaClient
from app.ui.monitor.panel import MonitorPanel, SlotsTableModel
from tests.conftest import run, signal_future
from tests.doubles.fake_nvml import two_gpus
from tests.conftest import free_port

pytestmark = pytest.mark.gui

FAKE = os.path.join(os.path.dirname(__file__), "fake_llama_server.py")
C = SlotsTableModel


@pytest.fixture
def profile(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 64)
    return LaunchProfile(name="fake-monitor", model=str(model), server_binary=FAKE, port=free_port(),
                         ctx_size=2048, parallel=2, cache_ram=1024)


def _window(qloop, tabs: bool):
    from app.ui.panels import build_window

    # Not qtbot.addWidget: pytest-qt would close the window before this
    # teardown, and closing with a live server starts the quit path.
    w = build_window(tabs=tabs)
    w.confirm_quit = False
    try:
        yield w
    finally:
        run(qloop, w.shutdown())  # stops the panel's sampler and the server, always
        assert not w.controller.supervisor or not w.controller.supervisor.running
        w.close()
        w.deleteLater()


@pytest.fixture
def window(qloop, qapp):
    """The window without its server tabs: a test adds the Monitor it builds."""
    yield from _window(qloop, tabs=False)


@pytest.fixture
def wired_window(qloop, qapp):
    """The window as the app builds it (app.ui.panels.build_window)."""
    yield from _window(qloop, tabs=True)


def cells(model, row):
    return [model.index(row, c).data() for c in range(model.columnCount())]


def test_wiring_adds_a_monitor_tab_that_follows_the_controller(wired_window, qloop, profile):
    window = wired_window
    panels = [p for p in window.extra_panels if isinstance(p, MonitorPanel)]
    assert len(panels) == 1
    panel = panels[0]
    assert window.tabs.tabText(window.tabs.indexOf(panel)) == "Monitor"
    panel.interval = 0.2
    window.tabs.setCurrentWidget(panel)
    window.show()

    first = signal_future(panel.sig_snapshot, lambda s: s.health is Health.OK)
    assert run(qloop, window.controller.start_async(profile)) is True
    snap = run(qloop, first)
    assert snap.url == window.controller.url
    assert snap.process is not None and snap.process.pid == window.controller.supervisor.pid
    assert snap.cache_ram_mib == 1024 and panel.host_labels["cache_ram"].text() == "1.0 GiB"
    assert [r.id for r in snap.slots] == [0, 1]
    assert panel.slots_model.rowCount() == 2
    # Whatever this machine has, the GPU section says something clear.
    assert panel.gpu_cards or panel.gpu_message_label.text()

    stopped = signal_future(panel.sig_sampling, lambda on: on is False)
    run(qloop, window.controller.stop_async())
    run(qloop, stopped)
    assert panel.sampler is None and "stopped" in panel.status_label.text().lower()


def test_slot_busy_then_idle_and_paused_while_hidden(window, qloop, profile, monkeypatch):
    # slot 1 stays busy until the Monitor has shown it (SIGUSR2 ends the delay): no timed window
    monkeypatch.setenv("FAKE_COMPLETION_DELAY", "600")
    window.controller.service.samplers.gpu = GpuMonitor(nvml=two_gpus())  # the window's one NVML handle
    panel = MonitorPanel(interval=0.2, busy_interval=0.05)
    panel.attach(window.controller)
    window.add_panel(panel, "Monitor")
    window.tabs.setCurrentWidget(panel)
    window.show()

    sampling = signal_future(panel.sig_sampling, lambda on: on is True)
    idle = signal_future(panel.sig_snapshot, lambda s: s.health is Health.OK and len(s.slots) == 2)
    assert run(qloop, window.controller.start_async(profile)) is True
    run(qloop, sampling)
    snap = run(qloop, idle)
    m = panel.slots_model
    assert [cells(m, r)[C.COL_STATE] for r in range(2)] == ["idle", "idle"]
    assert cells(m, 0)[C.COL_NCTX] == f"{snap.slots[0].n_ctx:,}"
    assert sorted(panel.gpu_cards) == [0, 1]
    assert panel.gpu_cards[0].server_label.text() == "used by the server 0 B"  # the fake's pids are not ours

    async def complete():
        async with LlamaClient(window.controller.url) as client:
            return await client.completion("The quick brown fox " * 20, slot_id=1, n_predict=16)

    shown = []  # what the user sees, and the pace, as the busy snapshot arrives (a later tick may follow)

    def busy_shown(s):
        if any(r.busy for r in s.slots):
            shown.append(([cells(m, r)[C.COL_STATE] for r in range(2)], panel.sampler.current_interval))
            return True
        return False

    busy = signal_future(panel.sig_snapshot, busy_shown)
    done_task = asyncio.ensure_future(complete())
    snap = run(qloop, busy)
    assert [r.id for r in snap.slots if r.busy] == [1]
    states, pace = shown[0]
    assert states == ["idle", "processing"]
    assert pace == 0.05  # faster while a slot is busy
    os.kill(window.controller.supervisor.pid, signal.SIGUSR2)
    result = run(qloop, done_task)

    after = signal_future(panel.sig_snapshot, lambda s: not s.any_busy and s.slots[1].tokens_held)
    snap = run(qloop, after)
    row = snap.slots[1]
    assert row.tokens_held >= result["tokens_evaluated"] > 0
    c1 = cells(m, 1)
    assert c1[C.COL_STATE] == "idle"
    assert c1[C.COL_TOKENS] == f"{row.tokens_held:,}"
    assert c1[C.COL_DECODED] == str(row.n_decoded)
    assert c1[C.COL_TASK] == str(row.id_task) and row.id_task is not None

    # Another tab in front: the panel is hidden and the sampler pauses.
    sampler = panel.sampler
    window.tabs.setCurrentIndex(0)
    assert not panel.isVisible()
    assert sampler.paused and panel.paused
    ticks = sampler.ticks
    run(qloop, asyncio.sleep(0.6))  # three intervals: no tick may happen
    assert sampler.ticks == ticks
    resumed = signal_future(panel.sig_snapshot)
    window.tabs.setCurrentWidget(panel)
    assert not sampler.paused
    run(qloop, resumed)
    assert sampler.ticks > ticks

    # Minimised window: paused too; restored: ticking again.
    window.showMinimized()
    qloop.run_until_complete(asyncio.sleep(0))
    assert sampler.paused
    window.showNormal()
    qloop.run_until_complete(asyncio.sleep(0))
    assert not sampler.paused

    # A resume records what it restored in the session service; the next tick shows it.
    svc = run(qloop, window.controller.service.sessions(window.controller.target_id))
    svc.target.restored[0] = RestoredSlot(123, "chat-a")
    marked = signal_future(panel.sig_snapshot, lambda s: s.slots[0].tokens_known_from_restore)
    panel.request_tick()
    run(qloop, marked)
    assert cells(m, 0)[C.COL_TOKENS] == "123 (restored)" and cells(m, 0)[C.COL_SESSION] == "chat-a"

    stopped = signal_future(panel.sig_sampling, lambda on: on is False)
    run(qloop, window.controller.stop_async())
    run(qloop, stopped)
    assert panel.sampler is None and not sampler.is_running


def test_no_slots_server_shows_the_reason(window, qloop, profile):
    window.controller.service.samplers.gpu = GpuMonitor(nvml=two_gpus())
    panel = MonitorPanel(interval=0.2)
    panel.attach(window.controller)
    window.add_panel(panel, "Monitor")
    window.tabs.setCurrentWidget(panel)
    window.show()
    got = signal_future(panel.sig_snapshot, lambda s: s.health is Health.OK)
    assert run(qloop, window.controller.start_async(profile.replace(slots_endpoint=False))) is True
    assert "--no-slots" in window.controller.plan.argv
    snap = run(qloop, got)
    assert snap.slots_error and "--no-slots" in snap.slots_error
    assert panel.slots_error_label.text() == snap.slots_error and not panel.slots_error_label.isHidden()


def test_one_sampler_and_one_nvml_handle_per_server_for_every_tab_and_the_status_bar(wired_window, qloop, profile,
                                                                                      monkeypatch):
    """The Monitor tab, the server list and the status bar read the same sampler of a server:
    counted, one sampler and one NVML handle, whether the Monitor is seen or not."""
    from app.servers.server_list import SlotUse

    window = wired_window
    made = []
    init = GpuMonitor.__init__

    def counted(self, *a, **kw):
        made.append(self)
        init(self, *a, **kw)

    monkeypatch.setattr(GpuMonitor, "__init__", counted)
    panel = window.monitor_panel
    panel.interval = 0.2
    window.tabs.setCurrentWidget(panel)
    window.show()
    first = signal_future(panel.sig_snapshot, lambda s: s.health is Health.OK)
    assert run(qloop, window.controller.start_async(profile)) is True
    run(qloop, first)
    service, tid = window.controller.service, window.controller.target_id
    run(qloop, window.server_list.refresh())
    window.tabs.setCurrentIndex(0)  # the Monitor hidden: its sampler pauses, the list asks it for one tick
    assert panel.sampler.paused
    run(qloop, window.server_list.refresh())  # after a tick of the loop under way (one tick at a time)
    ticks = panel.sampler.ticks
    run(qloop, window.server_list.refresh())
    run(qloop, window.server_list.refresh())
    assert list(service.samplers.samplers) == [tid] and panel.sampler is service.samplers.get(tid)
    assert panel.sampler.ticks == ticks  # the list's ticks are asked, not the loop's
    assert len(made) == 1  # one NVML handle for the Monitor and the list
    assert window.server_list.servers.row(tid).slots == SlotUse(2, 0, 0)
    assert window.snapshot_label.text().endswith("health ok · 0 / 2 slots in use</span>"), window.snapshot_label.text()
    assert window.snapshot_label.snapshot is service.samplers.last(tid)

    stopped = signal_future(panel.sig_sampling, lambda on: on is False)
    run(qloop, window.controller.stop_async())
    run(qloop, stopped)
    assert service.samplers.samplers == {} and window.snapshot_label.text() == ""
