"""A fake NVML module for GpuMonitor tests: the pynvml functions GpuMonitor
uses, with pynvml's error class shape (``NVMLError(value)``, ``.value``).

Two GPUs by default: a 16 GiB Tesla P100 and a 12 GiB Titan X, each with a
per-process list holding the server pid, a child pid and an unrelated pid.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

GiB = 1024**3
MiB = 1024**2

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999
NVML_TEMPERATURE_GPU = 0
nvmlMemory_v2 = 0x02000028  # pynvml's version of the _v2 memory query

_STRINGS = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _STRINGS.get(self.value, f"NVML error {self.value}")


@dataclass
class FakeGpu:
    name: str
    bus_id: str
    uuid: str
    total: int
    used: int  # what nvidia-smi shows as used (NVML's _v2 "used")
    util: int = 0
    temp: int = 40
    power_mw: int = 30_000
    procs: list[tuple[int, int | None]] = field(default_factory=list)
    # Number of successful handle lookups before the GPU is lost (None = never).
    lost_after: int | None = None
    lookups: int = 0
    not_supported: set[str] = field(default_factory=set)
    # memory the driver keeps for itself: NVML's first memory query counts it as used, its _v2 apart
    reserved: int = 0


class FakeNvml:
    """Module-like object: ``GpuMonitor(nvml=FakeNvml(...))``."""

    NVMLError = NVMLError
    NVML_ERROR_UNINITIALIZED = NVML_ERROR_UNINITIALIZED
    NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_NO_PERMISSION = NVML_ERROR_NO_PERMISSION
    NVML_ERROR_NOT_FOUND = NVML_ERROR_NOT_FOUND
    NVML_ERROR_DRIVER_NOT_LOADED = NVML_ERROR_DRIVER_NOT_LOADED
    NVML_ERROR_LIBRARY_NOT_FOUND = NVML_ERROR_LIBRARY_NOT_FOUND
    NVML_ERROR_GPU_IS_LOST = NVML_ERROR_GPU_IS_LOST
    NVML_ERROR_UNKNOWN = NVML_ERROR_UNKNOWN
    NVML_TEMPERATURE_GPU = NVML_TEMPERATURE_GPU
    nvmlMemory_v2 = nvmlMemory_v2  # None: a pynvml older than the _v2 memory query

    def __init__(
        self,
        gpus: list[FakeGpu] | None = None,
        *,
        init_error: int | None = None,
        driver_version: str = "535.183.01",
    ) -> None:
        self.gpus = gpus if gpus is not None else []
        self.init_error = init_error
        self.driver_version = driver_version
        self.init_calls = 0
        self.shutdown_calls = 0
        self.initialised = False

    # -- lifecycle --
    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1
        self.initialised = False

    def _check(self) -> None:
        if not self.initialised:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check()
        return self.driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._check()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        self._check()
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[index]
        gpu.lookups += 1
        if gpu.lost_after is not None and gpu.lookups > gpu.lost_after:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        return gpu

    def _dev(self, handle: FakeGpu, what: str) -> FakeGpu:
        self._check()
        if handle.lost_after is not None and handle.lookups > handle.lost_after:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        if what in handle.not_supported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return handle

    def nvmlDeviceGetName(self, h: FakeGpu) -> str:
        return self._dev(h, "name").name

    def nvmlDeviceGetPciInfo(self, h: FakeGpu) -> SimpleNamespace:
        return SimpleNamespace(busId=self._dev(h, "pci").bus_id)

    def nvmlDeviceGetUUID(self, h: FakeGpu) -> str:
        return self._dev(h, "uuid").uuid

    def nvmlDeviceGetMemoryInfo(self, h: FakeGpu, version: int | None = None) -> SimpleNamespace:
        g = self._dev(h, "memory")
        if version is None:  # the first query: the driver's reserve counted as used
            return SimpleNamespace(total=g.total, used=g.used + g.reserved, free=g.total - g.used - g.reserved)
        if version != nvmlMemory_v2 or "memory_v2" in g.not_supported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(version=version, total=g.total, reserved=g.reserved, used=g.used,
                               free=g.total - g.used - g.reserved)

    def nvmlDeviceGetUtilizationRates(self, h: FakeGpu) -> SimpleNamespace:
        g = self._dev(h, "utilization")
        return SimpleNamespace(gpu=g.util, memory=0)

    def nvmlDeviceGetTemperature(self, h: FakeGpu, sensor: int) -> int:
        assert sensor == NVML_TEMPERATURE_GPU
        return self._dev(h, "temperature").temp

    def nvmlDeviceGetPowerUsage(self, h: FakeGpu) -> int:
        return self._dev(h, "power").power_mw

    def nvmlDeviceGetComputeRunningProcesses(self, h: FakeGpu) -> list[SimpleNamespace]:
        g = self._dev(h, "processes")
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in g.procs]


SERVER_PID = 4242
CHILD_PID = 4243
OTHER_PID = 999


def two_gpus(*, lost_after: int | None = None) -> FakeNvml:
    """16 GiB P100 (index 0) and 12 GiB Titan X (index 1).

    ``lost_after``: GPU 1 raises GPU_IS_LOST after that many handle lookups
    (1 = it works on the first sample and is lost on the second).
    """
    p100 = FakeGpu(
        name="Tesla P100-PCIE-16GB",
        bus_id="00000000:03:00.0",
        uuid="GPU-aaaaaaaa-0000-0000-0000-000000000000",
        total=16 * GiB,
        used=10 * GiB,
        util=87,
        temp=61,
        power_mw=143_512,
        procs=[(SERVER_PID, 6 * GiB), (CHILD_PID, 1 * GiB), (OTHER_PID, 3 * GiB)],
    )
    titan = FakeGpu(
        name="NVIDIA TITAN X (Pascal)",
        bus_id="00000000:04:00.0",
        uuid="GPU-bbbbbbbb-0000-0000-0000-000000000000",
        total=12 * GiB,
        used=4 * GiB,
        util=12,
        temp=45,
        power_mw=60_250,
        procs=[(SERVER_PID, 2 * GiB), (OTHER_PID, 512 * MiB)],
        lost_after=lost_after,
    )
    return FakeNvml([p100, titan])
