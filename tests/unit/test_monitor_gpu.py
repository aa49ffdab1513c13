"""GpuMonitor against a fake NVML module, and the real pynvml without a GPU."""

from __future__ import annotations

import pickle
import copy

import pytest

from app.monitor.gpu import GpuHistory, GpuMonitor, GpuSample, GpuSnapshot, nvml_query
from app.core.units import NA, GiB, MiB, fmt_bytes, fmt_mib, is_na
from tests.doubles.fake_nvml import (
    CHILD_PID,
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_NO_PERMISSION,
    OTHER_PID,
    SERVER_PID,
    FakeGpu,
    FakeNvml,
    NVMLError,
    two_gpus,
)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_two_gpus_sampled_with_server_memory_attributed_to_server_and_children():
    mon = GpuMonitor(nvml=two_gpus())
    snap = mon.sample({SERVER_PID, CHILD_PID})
    assert snap.available and snap.message == "ok"
    assert snap.driver_version == "535.183.01"
    assert [g.index for g in snap.gpus] == [0, 1]
    p100, titan = snap.gpus
    assert p100.name == "Tesla P100-PCIE-16GB"
    assert p100.bus_id == "00000000:03:00.0"
    assert p100.uuid.startswith("GPU-aaaa")
    assert (p100.mem_total, p100.mem_used, p100.mem_free) == (16 * GiB, 10 * GiB, 6 * GiB)
    assert titan.mem_total == 12 * GiB
    assert p100.util_gpu_pct == 87 and p100.temperature_c == 61
    assert p100.power_w == pytest.approx(143.512)
    # server (6 GiB) + child (1 GiB); the unrelated pid's 3 GiB is not counted
    assert p100.server_mem == 7 * GiB
    assert titan.server_mem == 2 * GiB
    assert not p100.lost and not titan.lost
    assert p100.mem_used_fraction == pytest.approx(10 / 16)


def test_server_memory_unknown_without_pids_and_zero_when_not_on_gpu():
    mon = GpuMonitor(nvml=two_gpus())
    assert all(g.server_mem is None for g in mon.sample(set()).gpus)
    assert [g.server_mem for g in mon.sample({CHILD_PID}).gpus] == [1 * GiB, 0]
    assert [g.server_mem for g in mon.sample({OTHER_PID + 1}).gpus] == [0, 0]


def test_server_memory_none_when_nvml_has_no_per_process_figure():
    nvml = two_gpus()
    nvml.gpus[0].procs = [(SERVER_PID, None)]
    snap = GpuMonitor(nvml=nvml).sample({SERVER_PID})
    assert snap.gpus[0].server_mem is None


def test_gpu_lost_on_second_sample_other_gpu_still_sampled():
    nvml = two_gpus(lost_after=1)
    mon = GpuMonitor(nvml=nvml)
    first = mon.sample({SERVER_PID})
    assert not any(g.lost for g in first.gpus)

    nvml.gpus[0].used = 11 * GiB
    second = mon.sample({SERVER_PID})  # must not raise
    assert second.available
    p100, titan = second.gpus
    assert not p100.lost and p100.mem_used == 11 * GiB and p100.server_mem == 6 * GiB
    assert titan.lost
    # last known identity kept, live readings gone
    assert titan.name == "NVIDIA TITAN X (Pascal)" and titan.mem_total == 12 * GiB
    assert titan.mem_used is NA and titan.server_mem is None
    assert "GPU lost" in second.message and "#1" in second.message
    assert str(titan.mem_used) == "N/A"

    third = mon.sample({SERVER_PID})
    assert [g.lost for g in third.gpus] == [False, True]


def test_gpu_is_lost_on_a_field_query_marks_lost():
    nvml = two_gpus()
    mon = GpuMonitor(nvml=nvml)
    mon.sample(set())

    def lost_memory(h):
        raise NVMLError(nvml.NVML_ERROR_GPU_IS_LOST)

    nvml.nvmlDeviceGetMemoryInfo = lost_memory
    snap = mon.sample(set())
    assert [g.lost for g in snap.gpus] == [True, True]


def test_gpu_dropped_from_count_is_shown_lost():
    nvml = two_gpus()
    mon = GpuMonitor(nvml=nvml)
    mon.sample(set())
    titan = nvml.gpus.pop()
    snap = mon.sample(set())
    assert len(snap.gpus) == 2
    assert snap.gpus[1].lost and snap.gpus[1].name == titan.name


def test_unsupported_fields_print_na_and_do_not_raise():
    nvml = two_gpus()
    nvml.gpus[1].not_supported = {"power", "temperature", "utilization", "processes"}
    snap = GpuMonitor(nvml=nvml).sample({SERVER_PID})
    titan = snap.gpus[1]
    assert not titan.lost
    assert titan.power_w is NA and titan.temperature_c is NA and titan.util_gpu_pct is NA
    assert titan.server_mem is None
    assert f"{titan.power_w:>8.1f}" == "     N/A"
    assert str(titan.temperature_c) == "N/A"


def test_init_failure_no_driver_and_retry_throttled_to_once_a_minute():
    clock = Clock()
    nvml = FakeNvml(init_error=NVML_ERROR_DRIVER_NOT_LOADED)
    mon = GpuMonitor(nvml=nvml, clock=clock)
    snap = mon.sample({1})
    assert not snap.available and snap.gpus == ()
    assert snap.message == "no NVIDIA GPU found: Driver Not Loaded"
    clock.t += 30
    assert not mon.sample(set()).available
    assert nvml.init_calls == 1  # not retried within the minute
    clock.t += 31
    nvml.init_error = None
    nvml.gpus = two_gpus().gpus
    snap = mon.sample(set())
    assert nvml.init_calls == 2
    assert snap.available and len(snap.gpus) == 2
    mon.sample(set())
    assert nvml.init_calls == 2  # init once


def test_init_library_not_found_and_other_errors():
    snap = GpuMonitor(nvml=FakeNvml(init_error=NVML_ERROR_LIBRARY_NOT_FOUND)).sample(set())
    assert snap.message.startswith("no NVIDIA GPU found")
    snap = GpuMonitor(nvml=FakeNvml(init_error=NVML_ERROR_NO_PERMISSION)).sample(set())
    assert not snap.available and snap.message.startswith("NVML error:")


def test_zero_gpus_is_no_gpu_state():
    snap = GpuMonitor(nvml=FakeNvml([])).sample(set())
    assert not snap.available and snap.message.startswith("no NVIDIA GPU found")


def test_any_exception_is_contained():
    class Broken:
        def __getattr__(self, name):
            raise RuntimeError("boom " + name)

    snap = GpuMonitor(nvml=Broken()).sample({1})
    assert isinstance(snap, GpuSnapshot) and not snap.available


def test_driver_gone_on_count_then_reinit_throttled():
    clock = Clock()
    nvml = two_gpus()
    mon = GpuMonitor(nvml=nvml, clock=clock)
    assert mon.sample(set()).available

    def count_fails():
        raise NVMLError(nvml.NVML_ERROR_UNKNOWN)

    real_count = nvml.nvmlDeviceGetCount
    nvml.nvmlDeviceGetCount = count_fails
    snap = mon.sample(set())
    assert not snap.available and snap.message.startswith("NVML error")
    assert [g.lost for g in snap.gpus] == [True, True]
    nvml.nvmlDeviceGetCount = real_count
    assert not mon.sample(set()).available  # throttled
    clock.t += 61
    assert mon.sample(set()).available


def test_close_is_idempotent():
    nvml = two_gpus()
    mon = GpuMonitor(nvml=nvml)
    mon.close()
    mon.sample(set())
    mon.close()
    mon.close()
    assert nvml.shutdown_calls == 1


def test_nvml_query_returns_default_on_error():
    def fails():
        raise NVMLError(3)

    seen = []
    assert nvml_query(fails) is NA
    assert nvml_query(fails, default=None, on_error=seen.append) is None
    assert isinstance(seen[0], NVMLError)
    assert nvml_query(lambda a, b: a + b, 1, 2) == 3
    assert nvml_query(lambda: b"Tesla") == "Tesla"


def test_real_pynvml_gives_this_machine_s_gpu_state():
    import pynvml  # nvidia-ml-py, a dependency of the app

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        count = 0
    else:  # pragma: no cover - only on a machine with a GPU
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    mon = GpuMonitor()
    snap = mon.sample(set())
    if count:  # a machine with an NVIDIA GPU: the real library's view of it, not a skip
        assert snap.available is True and len(snap.gpus) == count
        assert snap.driver_version
    else:
        assert snap.available is False
        assert snap.message.startswith("no NVIDIA GPU found")
        assert snap.gpus == ()
    mon.close()


def test_na_value():
    assert not NA and is_na(NA) and is_na(None) and not is_na(0)
    assert str(NA) == "N/A" and repr(NA) == "NA"
    assert f"{NA:>6}" == "   N/A" and f"{NA:.1f}" == "N/A" and f"{NA:<5d}|" == "N/A  |"
    assert copy.deepcopy(NA) is NA and pickle.loads(pickle.dumps(NA)) is NA


def test_units():
    assert fmt_bytes(None) == "N/A" and fmt_bytes(NA) == "N/A"
    assert fmt_bytes(512) == "512 B"
    assert fmt_bytes(1536) == "1.5 KiB"
    assert fmt_bytes(16 * GiB) == "16.0 GiB"
    assert fmt_mib(16280 * MiB) == "16,280 MiB"
    assert fmt_mib(NA) == "N/A"


def _snap(used0, util0, lost1=False):
    def g(i, used, util, lost=False):
        return GpuSample(i, "g", "b", "u", 16 * GiB, used, 0, util, 50, 10.0, None, lost)

    return GpuSnapshot(True, "ok", (g(0, used0, util0), g(1, 1, 1, lost1)), "d")


def test_history_ring_buffer_window_and_rate():
    h = GpuHistory(window_s=10, interval_s=1)
    assert h.maxlen == 10
    for i in range(40):  # 4 Hz for 10 s: kept at 1 Hz
        h.add(_snap(i, i), t=100 + i * 0.25)
    s = h.series(0)
    assert len(s) == 10
    assert [p[0] for p in s] == [float(100 + i) for i in range(10)]
    assert [p[1] for p in s] == [i * 4 for i in range(10)]
    h.add(_snap(5, 5, lost1=True), t=200)
    assert h.series(1)[-1][1:] == (None, None)  # lost = gap
    assert len(h.series(0)) == 1  # everything older than 10 s pruned
    assert h.indices() == [0, 1]
    h.clear()
    assert len(h) == 0


def test_used_memory_is_what_nvidia_smi_shows_without_the_drivers_reserve():
    """Measured on an H200 (driver 580, tests/bench/nvml_compare.py): NVML's first memory query said 2,166 MiB
    used where nvidia-smi said 1,551; the _v2 query says the driver's reserve apart."""
    gpu = FakeGpu("NVIDIA H200", "00000000:00:06.0", "GPU-1", total=143_771 * MiB, used=1_551 * MiB,
                  reserved=615 * MiB)
    [g] = GpuMonitor(nvml=FakeNvml([gpu])).sample().gpus
    assert (g.mem_used, g.mem_total, g.mem_free) == (1_551 * MiB, 143_771 * MiB, (143_771 - 1_551 - 615) * MiB)


@pytest.mark.parametrize("old", ["driver", "pynvml"])
def test_without_the_v2_memory_query_the_first_ones_figures_are_shown(old):
    gpu = FakeGpu("Tesla P100-PCIE-16GB", "00000000:04:00.0", "GPU-2", total=16_384 * MiB, used=1_000 * MiB,
                  reserved=300 * MiB, not_supported={"memory_v2"} if old == "driver" else set())
    nvml = FakeNvml([gpu])
    if old == "pynvml":
        nvml.nvmlMemory_v2 = None
    [g] = GpuMonitor(nvml=nvml).sample().gpus
    assert g.mem_used == 1_300 * MiB and g.mem_total == 16_384 * MiB
