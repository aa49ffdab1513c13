"""take_snapshot / format_snapshot / snapshot_to_dict / compute_warnings."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from pathlib import Path

import pytest

from app.core.states import Health, ServerState, health_text
from app.monitor.gpu import GpuMonitor, GpuSample, GpuSnapshot
from app.monitor.process import HostSample, ProcessMonitor
from app.monitor.slots import RestoredSlot, SlotRow, SlotsUnavailable
from app.monitor.snapshot import (
    Snapshot,
    error_snapshot,
    format_snapshot,
    health_from_result,
    snapshot_to_dict,
    take_snapshot,
)
from app.monitor.units import GiB, MiB
from app.monitor.warnings import CRITICAL, WARNING, compute_warnings
from tests.doubles.fake_nvml import FakeNvml, two_gpus

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llama-server-b11434"
RESPONSES = json.loads((FIXTURES / "responses.json").read_text())
URL = "http://127.0.0.1:18080"


class HttpError(Exception):
    def __init__(self, status, message):
        super().__init__(message)
        self.status = status
        self.message = message


async def ok_health():
    return RESPONSES["health"]["body"]


async def restored_slots():
    return RESPONSES["slots_after_restore"]["body"]


async def test_take_snapshot_collects_everything():
    proc = ProcessMonitor(os.getpid())
    snap = await take_snapshot(
        ok_health, restored_slots, GpuMonitor(nvml=two_gpus()), proc,
        {0: RestoredSlot(336, "fixture.bin")}, 8192, URL,
    )
    assert isinstance(snap, Snapshot) and snap.url == URL
    assert snap.health is Health.OK and snap.slots_error is None
    assert snap.slots[0].tokens_held == 336 and snap.slots[0].tokens_known_from_restore
    assert snap.gpu.available and len(snap.gpu.gpus) == 2
    assert snap.process.alive and snap.process.pid == os.getpid()
    # our pid is not in the fake's process list
    assert [g.server_mem for g in snap.gpu.gpus] == [0, 0]
    assert snap.host.ram_total > 0
    assert snap.cache_ram_mib == 8192
    assert not snap.any_busy


async def test_blocking_calls_run_off_the_loop_thread():
    loop_thread = threading.get_ident()
    seen = []
    nvml = two_gpus()
    real = nvml.nvmlDeviceGetCount

    def count():
        seen.append(threading.get_ident())
        return real()

    nvml.nvmlDeviceGetCount = count
    await take_snapshot(ok_health, restored_slots, GpuMonitor(nvml=nvml), None, {}, None, URL)
    assert seen and all(t != loop_thread for t in seen)


async def test_failures_become_values():
    async def loading():
        raise HttpError(503, "Loading model")

    async def no_slots():
        raise HttpError(501, "This server does not support slots endpoint. Start it with `--slots`")

    snap = await take_snapshot(loading, no_slots, GpuMonitor(nvml=FakeNvml(init_error=9)), None, None, None, URL)
    assert snap.health is Health.LOADING
    assert snap.slots == () and snap.slots_error == SlotsUnavailable.NO_SLOTS
    assert not snap.gpu.available and snap.gpu.message.startswith("no NVIDIA GPU found")
    assert snap.process is None

    async def refused():
        raise ConnectionRefusedError("[Errno 111] Connection refused")

    snap = await take_snapshot(refused, refused, None, None, None, None, URL)
    assert snap.health is Health.UNREACHABLE and "Connection refused" in snap.health_detail
    assert snap.health_text.startswith("unreachable: ") and snapshot_to_dict(snap)["health"] == snap.health_text
    assert snap.slots_error.startswith("GET /slots failed: ")


async def test_hung_fetch_is_bounded_by_timeout():
    never = asyncio.Event()

    async def hang():
        await never.wait()

    snap = await take_snapshot(hang, hang, None, None, None, None, URL, timeout_s=0.05)
    assert (snap.health, snap.health_detail) == (Health.UNREACHABLE, "timed out")
    assert "timed out" in snap.slots_error


def test_health_normalisation():
    assert health_from_result({"status": "ok"}) == (Health.OK, "")
    assert health_from_result("ok") == (Health.OK, "")
    assert health_from_result({"error": {"code": 503, "message": "Loading model"}}) == (Health.LOADING, "")
    assert health_from_result(None) == (Health.OK, "")


def test_health_reads_the_wire_text_of_any_kv_valet():
    assert Health.parse("ok") == (Health.OK, "") and Health.parse("loading") == (Health.LOADING, "")
    assert Health.parse("unreachable: connection refused") == (Health.UNREACHABLE, "connection refused")
    assert Health.parse(None) == (Health.NOT_RUNNING, "") and Health.parse("error: x") == (Health.ERROR, "x")
    assert Health.parse("gone away") == (Health.UNREACHABLE, "gone away")
    assert health_text(Health.UNREACHABLE, "x") == "unreachable: x" and health_text(Health.OK) == "ok"
    assert Health.OK.state() is ServerState.READY and Health.UNREACHABLE.state() is ServerState.STOPPED


def _gpu(i, total, used, lost=False):
    return GpuSample(i, f"gpu{i}", "bus", "uuid", total, used, total - used, 50, 60, 100.0, 1 * GiB, lost)


def _row(i, held, n_ctx=4096, busy=False):
    return SlotRow(i, n_ctx, busy, held, False, held, None, None, 0, 1, None)


def _snapshot(**kw):
    base = dict(
        taken_at=1_700_000_000.0, url=URL, health=Health.OK, slots=(), slots_error=None,
        gpu=GpuSnapshot(True, "ok", (), "535"), process=None,
        host=HostSample(64 * GiB, 10 * GiB, 54 * GiB), cache_ram_mib=None,
    )
    base.update(kw)
    return Snapshot(**base)


def test_warnings():
    s = _snapshot(
        gpu=GpuSnapshot(True, "ok", (_gpu(0, 16 * GiB, int(15.5 * GiB)), _gpu(1, 12 * GiB, 6 * GiB),
                                    _gpu(2, 12 * GiB, 1, lost=True)), "535"),
        slots=(_row(0, 3700), _row(1, 3600), _row(2, 4096), _row(3, None)),
    )
    w = compute_warnings(s)
    texts = [x.text for x in w]
    assert any("GPU 0" in t and "97%" in t for t in texts)
    assert not any("GPU 1" in t for t in texts)
    assert any(x.level == CRITICAL and "GPU 2" in x.text and "lost" in x.text for x in w)
    assert any("slot 0" in t for t in texts)  # 3700 >= 90 % of 4096
    assert not any("slot 1 " in t for t in texts)  # 3600 < 3686.4
    assert any(x.level == CRITICAL and "slot 2" in x.text for x in w)


@pytest.mark.parametrize(
    "budget, available, warned",
    [(8192, 4 * GiB, True), (8192, 9 * GiB, False), (-1, 100 * MiB, False), (0, 100 * MiB, False),
     (None, 100 * MiB, False)],
)
def test_cache_ram_warning(budget, available, warned):
    s = _snapshot(cache_ram_mib=budget, host=HostSample(64 * GiB, 60 * GiB, available))
    w = [x for x in compute_warnings(s) if "--cache-ram" in x.text]
    assert bool(w) == warned
    if warned:
        assert w[0].level == WARNING


async def test_format_and_dict():
    snap = await take_snapshot(
        ok_health, restored_slots, GpuMonitor(nvml=two_gpus(lost_after=0)), ProcessMonitor(os.getpid()),
        {0: RestoredSlot(336, "fixture.bin")}, 8192, URL,
    )
    text = format_snapshot(snap)
    for heading in ("Slots", "GPUs", "Server process", "Host", "Warnings"):
        assert f"\n{heading}\n" in text
    assert "336 (restored)" in text and "fixture.bin" in text
    assert "Tesla P100-PCIE-16GB" in text and "LOST" in text and "N/A" in text

    d = snapshot_to_dict(snap)
    again = json.loads(json.dumps(d))
    assert again["health"] == "ok"
    assert again["slots"][0]["tokens_known_from_restore"] is True
    assert again["gpu"]["gpus"][1]["lost"] is True
    assert again["gpu"]["gpus"][1]["mem_used"] is None  # NA -> null
    assert again["warnings"][0]["level"] == "critical"

    no_gpu = _snapshot(gpu=GpuSnapshot(False, "no NVIDIA GPU found: Driver Not Loaded"),
                       slots_error=SlotsUnavailable.NO_SLOTS)
    text = format_snapshot(no_gpu)
    assert "no NVIDIA GPU found: Driver Not Loaded" in text and "--no-slots" in text
    json.dumps(snapshot_to_dict(error_snapshot(URL, RuntimeError("x"))))
