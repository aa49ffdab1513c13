"""What the server list shows (app.servers.server_list): rows, cells, sources, without Qt."""

from __future__ import annotations

import dataclasses
import logging
import os
from types import SimpleNamespace

import pytest

from app.core.profile import LaunchProfile
from app.core.states import Health, ServerState
from app.servers.remote_sessions import status_line
from app.servers.server_list import (COLUMNS, THIS_MACHINE, GpuUse, LocalServerSource, ProcessUse, ServerList,
                                  ServerListSource, ServerRow, SlotUse, cells, gpu_uses, move_targets, remote_row,
                                  shown_rows, slot_use)
from app.monitor.snapshot import error_snapshot, summary
from app.monitor.sampler import Samplers
from app.servers.events import StateChanged
from app.servers.service import sampler_for
from app.monitor.gpu import GpuSample, GpuSnapshot
from app.monitor.slots import slot_rows

GiB = 2**30


def ready_row(**kw) -> ServerRow:
    base = dict(target_id="profile:chat", name="chat", state=ServerState.READY, url="http://127.0.0.1:8080",
                profile="chat", slots=SlotUse(4, 2, 1),
                gpus=(GpuUse(0, "Tesla P100", 3 * GiB, 16 * GiB, GiB), GpuUse(1, "Tesla P100", None, None, lost=True)),
                process=ProcessUse(4242, 812 * 2**20, 35.0))
    base.update(kw)
    return ServerRow(**base)


def test_a_running_server_says_its_slots_vram_per_gpu_and_process():
    c = cells(ready_row())
    assert len(c.text) == len(COLUMNS)
    assert c.text == ("chat", "Ready", "this machine", "2 / 4 in use", "GPU0 3.0/16.0 GiB · GPU1 lost",
                      "RSS 812.0 MiB · CPU 35 %")
    assert c.state_role == "ok"
    assert c.tips[3] == "1 processing now, 2 holding a chat or running a task, of 4 slots"
    assert "of which this server 1.0 GiB" in c.tips[4] and "GPU 1 (Tesla P100): lost" in c.tips[4]
    assert "pid 4242" in c.tips[5] and "http://127.0.0.1:8080" in c.tips[0]


def test_a_crashed_server_shows_its_cause_and_no_figures():
    c = cells(ready_row(state=ServerState.CRASHED, detail="GGML_ASSERT: tensor not allocated"))
    assert c.text[1:] == ("Crashed", "this machine", "–", "–", "–")
    assert c.state_role == "crit" and c.tips[1] == "GGML_ASSERT: tensor not allocated"


def test_unsampled_and_unavailable_figures_say_so():
    c = cells(ready_row(slots=None, slots_error=None, gpus=(), gpu_message="not sampled yet", process=None))
    assert c.text[3:] == ("…", "…", "–")
    c = cells(ready_row(slots=None, slots_error="HTTP 501: slots endpoint disabled", gpus=(),
                        gpu_message="no NVIDIA GPU found: NVML Shared Library Not Found"))
    assert c.text[3:5] == ("unavailable", "no GPU")
    assert c.tips[3] == "GET /slots: HTTP 501: slots endpoint disabled" and "NVML Shared Library" in c.tips[4]
    # a router has no slots of its own: the cell says what it is, the tip why
    from app.monitor.slots import SlotsUnavailable

    c = cells(ready_row(slots=None, slots_error=SlotsUnavailable.ROUTER, gpus=(), gpu_message="no NVIDIA GPU"))
    assert c.text[3] == "router" and c.tips[3] == SlotsUnavailable.ROUTER


def test_a_remote_row_names_its_host():
    c = cells(ready_row(target_id="gpu-box:big", kind="remote", host="gpu-box", process=None))
    assert c.text[2] == "gpu-box" and "reached over SSH" in c.tips[2] and c.tips[5] == "Not reported by the host"


def test_stopped_servers_leave_the_list_unless_shown_crashed_ones_stay():
    rows = [ready_row(target_id="profile:a", state=ServerState.STOPPED),
            ready_row(target_id="profile:b", state=ServerState.CRASHED),
            ready_row(target_id="profile:c")]
    assert [r.target_id for r in shown_rows(rows)] == ["profile:b", "profile:c"]
    assert [r.target_id for r in shown_rows(rows, "profile:a")] == ["profile:a", "profile:b", "profile:c"]


def test_a_session_moves_to_another_server_that_runs_from_a_profile():
    rows = [ready_row(target_id="profile:a", profile="a"), ready_row(target_id="url:http://x:1", profile=None),
            ready_row(target_id="box:b", kind="remote", host="box", profile="b")]
    assert [r.target_id for r in move_targets(rows, "profile:a")] == ["box:b"]


def test_slot_use_counts_busy_and_held_slots():
    data = [{"id": 0, "n_ctx": 2048, "is_processing": True, "n_prompt_tokens": 12},
            {"id": 1, "n_ctx": 2048, "is_processing": False, "n_prompt_tokens": 300},
            {"id": 2, "n_ctx": 2048, "is_processing": False},
            {"id": 3, "n_ctx": 2048, "is_processing": True}]  # busy, its tokens not known yet: held
    rows = slot_rows(data, {}, {})
    assert slot_use(rows) == SlotUse(4, 3, 2)
    # one "held" rule (app.monitor.slots.is_held): a host's ``status --json`` rows, its status line and
    # the status bar's summary count the same slots
    status = {"health": "ok", "slots": [dataclasses.asdict(r) for r in rows]}
    assert remote_row("box", {"profile": {"name": "b"}, "status": status}).slots == SlotUse(4, 3, 2)
    assert "3 / 4 slots in use" in status_line("box", "b", status)
    assert "3 / 4 slots in use" in summary(dataclasses.replace(error_snapshot("u", "x"), health=Health.OK,
                                                              slots=tuple(rows)))


def test_gpu_uses_keep_each_card_and_this_servers_share():
    g = GpuSample(0, "RTX 4090", "0000:01:00.0", "GPU-1", 24 * GiB, 20 * GiB, 4 * GiB, 99, 70, 300.0, 18 * GiB)
    uses, message = gpu_uses(GpuSnapshot(True, "", (g,), "550.1"))
    assert uses == (GpuUse(0, "RTX 4090", 20 * GiB, 24 * GiB, 18 * GiB),) and message == ""
    assert gpu_uses(GpuSnapshot(False, "no NVIDIA GPU found: no driver", (), None)) == \
        ((), "no NVIDIA GPU found: no driver")


# -- this machine's source, over a stand-in server service ------------------------------------


class FakeClient:
    def __init__(self, answer):
        self.answer = answer

    async def slots(self):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    async def health(self):
        return "ok"


class FakeGpu:
    def __init__(self):
        self.asked: list[set[int]] = []
        self.closed = False

    def sample(self, pids):
        self.asked.append(set(pids))
        g = GpuSample(0, "P100", "b", "u", 16 * GiB, 2 * GiB, 14 * GiB, 0, 40, 30.0, GiB if pids else None)
        return GpuSnapshot(True, "", (g,), "1")

    def close(self):
        self.closed = True


class FakeService:
    """What the local source needs of a server service: its servers, their events, their samplers."""

    def __init__(self, gpu=None):
        self.servers: dict = {}
        self.cbs = []
        self.samplers = Samplers(gpu=gpu or FakeGpu(), gpu_factory=lambda: pytest.fail("a second NVML handle"))

    def on_event(self, cb):
        self.cbs.append(cb)

    def emit(self, ev):
        for cb in self.cbs:
            cb(ev)


def handle(name, state, *, pid=None, slots=(), owned=True):
    profile = LaunchProfile(name=name, model="/m.gguf") if owned else None
    spec = SimpleNamespace(name=name if owned else "http://127.0.0.1:9")
    return SimpleNamespace(state=state, profile=profile, url=f"http://127.0.0.1/{name}", spec=spec, pid=pid,
                           supervisor=object() if owned else None, client=FakeClient(list(slots)), sessions=None)


async def test_the_local_source_lists_every_server_with_its_figures_and_follows_states():
    gpu = FakeGpu()
    svc = FakeService(gpu)
    svc.servers["profile:a"] = handle("a", ServerState.READY, pid=os.getpid(),
                                      slots=[{"id": 0, "n_ctx": 512, "n_prompt_tokens": 40}, {"id": 1, "n_ctx": 512}])
    svc.servers["url:http://127.0.0.1:9"] = handle("b", ServerState.READY, owned=False)
    svc.servers["url:http://127.0.0.1:9"].client = FakeClient(RuntimeError("HTTP 501: slots endpoint disabled"))
    svc.servers["profile:c"] = handle("c", ServerState.STOPPED)
    src = LocalServerSource(svc)
    assert isinstance(src, ServerListSource)
    changes = []
    src.on_change(lambda: changes.append(1))
    await src.refresh()
    a, b, c = src.rows()
    assert (a.kind, a.profile, a.host, a.slots) == ("profile", "a", THIS_MACHINE, SlotUse(2, 1, 0))
    assert a.process is not None and a.process.pid == os.getpid() and a.process.rss > 0
    assert a.gpus == (GpuUse(0, "P100", 2 * GiB, 16 * GiB, GiB),)
    assert (b.kind, b.name, b.profile, b.slots) == ("attached", "http://127.0.0.1:9", None, None)
    assert "HTTP 501: slots endpoint disabled" in b.slots_error
    assert b.process is None and set() in gpu.asked  # no pid of its own: the cards, no share
    assert c.slots is None and c.process is None  # a stopped server is not sampled

    svc.servers["profile:a"].state = ServerState.CRASHED
    svc.emit(StateChanged("profile:a", ServerState.CRASHED, "killed by signal 9"))
    assert changes == [1]
    a = src.rows()[0]
    assert (a.state, a.detail, a.slots, a.gpus) == (ServerState.CRASHED, "killed by signal 9", None, ())
    await src.aclose()
    await svc.samplers.aclose()
    assert not gpu.closed  # a monitor given to the samplers is the giver's to close


async def test_one_sampler_and_one_nvml_handle_per_server_whoever_reads_it():
    """The list, the Monitor and the status bar read the same sampler of a server: refreshing the
    list again, or the Monitor following a server, makes no other sampler and no other NVML handle."""
    from tests.doubles.fake_nvml import two_gpus

    from app.monitor.gpu import GpuMonitor

    handles = []

    def nvml_handle():
        handles.append(GpuMonitor(nvml=two_gpus()))
        return handles[-1]

    svc = FakeService()
    svc.samplers = Samplers(gpu_factory=nvml_handle)
    svc.servers["profile:a"] = handle("a", ServerState.READY, pid=os.getpid(), slots=[{"id": 0, "n_ctx": 512}])
    svc.servers["profile:b"] = handle("b", ServerState.LOADING, slots=[])
    src = LocalServerSource(svc)
    for _ in range(3):
        await src.refresh()
    monitor = sampler_for(svc.samplers, "profile:a", svc.servers["profile:a"])  # what the Monitor tab follows
    published = []
    svc.samplers.subscribe(lambda key, snap: published.append(key))
    monitor.resume()
    await src.refresh()
    assert sorted(svc.samplers.samplers) == ["profile:a", "profile:b"] and svc.samplers.get("profile:a") is monitor
    assert len(handles) == 1 and handles[0]._nvml.init_calls == 1  # one NVML handle, initialised once
    assert src.rows()[0].gpus and src.rows()[0].slots == SlotUse(1, 0, 0)
    assert published  # every reader's snapshot is the sampler's, published to every subscriber
    svc.servers["profile:b"].state = ServerState.STOPPED
    await svc.samplers.stop("profile:b")
    await src.refresh()
    assert sorted(svc.samplers.samplers) == ["profile:a"]
    await svc.samplers.aclose()
    assert not monitor.is_running


class BrokenSource:
    name = "broken-host"

    def rows(self):
        return [ready_row(target_id="broken-host:x", kind="remote", host="broken-host")]

    async def refresh(self):
        raise ConnectionError("ssh: connection refused")

    def on_change(self, cb):
        pass

    async def aclose(self):
        pass


async def test_the_list_keeps_this_machine_first_and_survives_a_failing_host(caplog):
    svc = FakeService()
    svc.servers["profile:a"] = handle("a", ServerState.READY, slots=[{"id": 0, "n_ctx": 512}])
    servers = ServerList([LocalServerSource(svc)])
    servers.add(BrokenSource())
    with pytest.raises(ValueError):
        servers.add(BrokenSource())
    with caplog.at_level(logging.WARNING):
        await servers.refresh()
    assert [r.target_id for r in servers.rows()] == ["profile:a", "broken-host:x"]
    assert servers.row("profile:a").slots == SlotUse(1, 0, 0)
    assert "refreshing broken-host failed: ssh: connection refused" in caplog.text
    await servers.remove("broken-host")
    assert [r.target_id for r in servers.rows()] == ["profile:a"]
    await servers.aclose()


# -- a remote host's source, over a stand-in host (the SSH host itself: tests/ssh) -------------------


class FakeHost:
    name = "gpu-box"

    def __init__(self, answer):
        self.answer = answer
        self.closed = False

    async def servers(self):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    async def close(self):
        self.closed = True


STATUS = {"url": "http://127.0.0.1:8080", "health": "ok", "slots_error": None,
          "slots": [{"id": 0, "busy": True, "tokens_held": 900}, {"id": 1, "busy": False, "tokens_held": None}],
          "gpu": {"available": True, "message": "", "gpus": [{"index": 0, "name": "Tesla P100", "mem_used": 9 * GiB,
                                                             "mem_total": 16 * GiB, "server_mem": 8 * GiB,
                                                             "lost": False}]},
          "process": {"pid": 77, "alive": True, "cpu_pct": 98.5, "rss": 2 * GiB}}


async def test_a_remote_hosts_servers_are_rows_like_local_ones():
    from app.servers.server_list import RemoteServerSource

    host = FakeHost([{"profile": {"name": "big", "url": "http://127.0.0.1:8080"}, "status": STATUS, "running": True},
                     {"profile": {"name": "idle"}, "status": {"health": "unreachable: connection refused"},
                      "running": False}])
    src = RemoteServerSource(host)
    assert isinstance(src, ServerListSource) and src.rows() == []
    await src.refresh()
    big, idle = src.rows()
    assert (big.target_id, big.kind, big.host, big.profile, big.state) == ("gpu-box:big", "remote", "gpu-box", "big",
                                                                           ServerState.READY)
    assert cells(big).text[2:] == ("gpu-box", "1 / 2 in use", "GPU0 9.0/16.0 GiB", "RSS 2.0 GiB · CPU 98 %")
    assert (idle.state, idle.detail, idle.slots) == (ServerState.STOPPED, "unreachable: connection refused", None)
    assert [r.target_id for r in shown_rows(src.rows())] == ["gpu-box:big", "gpu-box:idle"]  # a host's profiles

    host.answer = ConnectionError("ssh: connection reset")
    await src.refresh()  # never raises: the rows keep their figures and say why
    assert src.rows()[0].slots == SlotUse(2, 1, 1) and "does not answer: ssh: connection reset" in src.rows()[0].detail
    await src.aclose()
    assert host.closed
