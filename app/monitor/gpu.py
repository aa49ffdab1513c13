"""NVIDIA GPU sampling through NVML (pynvml), modelled on nvitop's ``api``.

One call to :meth:`GpuMonitor.sample` gives one immutable :class:`GpuSnapshot`.
Nothing here raises to the caller: every NVML call goes through
:func:`nvml_query`, which turns an NVML error into ``NA`` (prints as "N/A"),
and a machine with no driver/library gives ``available=False`` with a
"no NVIDIA GPU found: <reason>" message.

A GPU that stops answering after having worked (Xid, driver reset,
``NVML_ERROR_GPU_IS_LOST``) is reported as ``lost=True`` with the last known
name/bus id/total memory, while the other GPUs keep being sampled.

``GpuMonitor.sample`` blocks (NVML calls take ~1 ms each, longer on a sick
GPU): call it from a worker thread (``asyncio.to_thread``), as
``app.monitor.snapshot.take_snapshot`` does.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

from app.core.units import NA, NaType, is_na

__all__ = [
    "GpuSample",
    "GpuSnapshot",
    "GpuMonitor",
    "GpuHistory",
    "nvml_query",
    "NO_GPU_PREFIX",
    "NVML_ERROR_PREFIX",
]

log = logging.getLogger(__name__)

NO_GPU_PREFIX = "no NVIDIA GPU found"
NVML_ERROR_PREFIX = "NVML error"

# pynvml's values, used when an injected module lacks the constant.
_GPU_IS_LOST = 15
_LIBRARY_NOT_FOUND = 12
_DRIVER_NOT_LOADED = 9


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one tick. Memory in bytes; ``NA`` where NVML gave nothing."""

    index: int
    name: str | NaType
    bus_id: str | NaType
    uuid: str | NaType
    mem_total: int | NaType
    mem_used: int | NaType
    mem_free: int | NaType
    util_gpu_pct: int | NaType
    temperature_c: int | NaType
    power_w: float | NaType
    # Bytes used on this GPU by the server pid and its children; None if
    # unknown (no pids given, process list not readable, or NVML reports no
    # per-process figure, e.g. inside some containers).
    server_mem: int | None
    # The GPU disappeared mid-run (GPU_IS_LOST, handle failing after having
    # worked, or no longer counted): show as lost, not as a crash.
    lost: bool = False

    @property
    def mem_used_fraction(self) -> float | None:
        if is_na(self.mem_used) or is_na(self.mem_total) or not self.mem_total:
            return None
        return float(self.mem_used) / float(self.mem_total)


@dataclass(frozen=True)
class GpuSnapshot:
    available: bool
    message: str
    gpus: tuple[GpuSample, ...] = ()
    driver_version: str | None = None


def _error_value(exc: BaseException) -> Any:
    return getattr(exc, "value", None)


def _decode(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    return v


def nvml_query(
    func: Callable[..., Any],
    *args: Any,
    default: Any = NA,
    on_error: Callable[[BaseException], None] | None = None,
) -> Any:
    """Call ``func(*args)``; on any error return ``default`` (nvitop's nvmlQuery).

    ``on_error`` sees the exception (used to notice ``GPU_IS_LOST``). Bytes
    results are decoded (older pynvml returned bytes for names and ids).
    """
    try:
        return _decode(func(*args))
    except Exception as exc:  # NVMLError, missing function, ctypes errors...
        if on_error is not None:
            try:
                on_error(exc)
            except Exception:  # pragma: no cover - defensive
                log.exception("nvml_query on_error failed")
        return default


def _memory_info(nvml: Any, handle: Any, q: Callable[..., Any]) -> Any:
    """The memory figures as ``nvidia-smi`` shows them. NVML's first memory query counts the memory the
    driver reserves for itself as used (on an H200 with driver 580: 2,166 MiB used where nvidia-smi says
    1,551; tests/bench/nvml_compare.py); its ``_v2`` (drivers since 510) says that part apart, as
    ``reserved``. The first query only where ``_v2`` is missing (an older driver or pynvml)."""
    v2 = getattr(nvml, "nvmlMemory_v2", None)
    if v2 is not None:
        mem = nvml_query(nvml.nvmlDeviceGetMemoryInfo, handle, v2, default=None)  # unsupported: the first query
        if mem is not None:
            return mem
    return q(nvml.nvmlDeviceGetMemoryInfo, default=None)


class GpuMonitor:
    """Samples every NVIDIA GPU through an NVML module.

    ``nvml`` is the ``pynvml`` module by default (imported lazily on first
    use); tests inject a fake module object with the same functions. NVML is
    initialised once, lazily; a failed init is retried at most once per
    ``retry_interval_s`` (60 s), so a GPU-less machine costs nothing per tick.
    """

    def __init__(
        self,
        nvml: Any = None,
        *,
        retry_interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._nvml = nvml
        self._retry_interval_s = retry_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._initialised = False
        self._last_init_attempt: float | None = None
        self._init_message = f"{NO_GPU_PREFIX}: NVML not initialised yet"
        self._driver_version: str | None = None
        # Last good sample per index, to show a lost GPU with what we knew.
        self._known: dict[int, GpuSample] = {}

    # -- lifecycle ---------------------------------------------------------

    @property
    def initialised(self) -> bool:
        return self._initialised

    def _const(self, name: str, fallback: int) -> int:
        return getattr(self._nvml, name, fallback)

    def _ensure_init(self) -> bool:
        if self._initialised:
            return True
        now = self._clock()
        if (
            self._last_init_attempt is not None
            and now - self._last_init_attempt < self._retry_interval_s
        ):
            return False
        self._last_init_attempt = now
        if self._nvml is None:
            try:
                import pynvml  # nvidia-ml-py

                self._nvml = pynvml
            except Exception as exc:  # report: the reason is the snapshot's message, shown where the GPUs would be
                self._init_message = (
                    f"{NO_GPU_PREFIX}: the pynvml module (nvidia-ml-py) cannot be imported ({exc})"
                )
                return False
        try:
            self._nvml.nvmlInit()
        except Exception as exc:  # report: the reason is the snapshot's message (shown), and logged at info below
            value = _error_value(exc)
            if value in (
                self._const("NVML_ERROR_LIBRARY_NOT_FOUND", _LIBRARY_NOT_FOUND),
                self._const("NVML_ERROR_DRIVER_NOT_LOADED", _DRIVER_NOT_LOADED),
            ) or isinstance(exc, OSError):
                self._init_message = f"{NO_GPU_PREFIX}: {exc}"
            else:
                self._init_message = f"{NVML_ERROR_PREFIX}: nvmlInit failed: {exc}"
            log.info("GPU monitoring unavailable: %s", self._init_message)
            return False
        self._initialised = True
        self._driver_version = nvml_query(self._nvml.nvmlSystemGetDriverVersion, default=None)
        return True

    def close(self) -> None:
        """Shut NVML down (idempotent, never raises)."""
        with self._lock:
            if self._initialised:
                nvml_query(self._nvml.nvmlShutdown, default=None)
            self._initialised = False

    # -- sampling ----------------------------------------------------------

    def sample(self, pids: Iterable[int] = ()) -> GpuSnapshot:
        """One snapshot of every GPU. ``pids``: the server pid and its children."""
        try:
            with self._lock:
                return self._sample(frozenset(pids or ()))
        except Exception as exc:  # never raise to the caller
            log.exception("GPU sampling failed")
            return GpuSnapshot(False, f"{NVML_ERROR_PREFIX}: {exc}", self._lost_known(()), None)

    def _sample(self, pids: frozenset[int]) -> GpuSnapshot:
        if not self._ensure_init():
            return GpuSnapshot(False, self._init_message, (), None)
        nvml = self._nvml
        count_errors: list[BaseException] = []
        count = nvml_query(nvml.nvmlDeviceGetCount, default=None, on_error=count_errors.append)
        if count is None:
            # The driver went away under us (reset, unload): show what we knew
            # as lost and try a fresh init later (throttled).
            msg = f"{NVML_ERROR_PREFIX}: cannot count GPUs: {count_errors[0] if count_errors else 'unknown'}"
            nvml_query(nvml.nvmlShutdown, default=None)
            self._initialised = False
            self._last_init_attempt = self._clock()
            self._init_message = msg
            return GpuSnapshot(False, msg, self._lost_known(()), self._driver_version)
        if count == 0:
            return GpuSnapshot(False, f"{NO_GPU_PREFIX}: NVML reports 0 devices", (), self._driver_version)

        samples = [self._sample_one(i, pids) for i in range(count)]
        samples.extend(self._lost_known(range(count)))
        samples.sort(key=lambda s: s.index)
        lost = [s for s in samples if s.lost]
        message = "ok" if not lost else "GPU lost: " + ", ".join(
            f"#{s.index} {s.name}" for s in lost
        )
        return GpuSnapshot(True, message, tuple(samples), self._driver_version)

    def _lost_known(self, present: Iterable[int]) -> list[GpuSample]:
        present = set(present)
        return [self._as_lost(s) for i, s in sorted(self._known.items()) if i not in present]

    @staticmethod
    def _as_lost(s: GpuSample) -> GpuSample:
        return replace(
            s,
            mem_used=NA,
            mem_free=NA,
            util_gpu_pct=NA,
            temperature_c=NA,
            power_w=NA,
            server_mem=None,
            lost=True,
        )

    def _is_lost_error(self, exc: BaseException) -> bool:
        return _error_value(exc) == self._const("NVML_ERROR_GPU_IS_LOST", _GPU_IS_LOST) or (
            type(exc).__name__ == "NVMLError_GpuIsLost"
        )

    def _sample_one(self, index: int, pids: frozenset[int]) -> GpuSample:
        nvml = self._nvml
        errors: list[BaseException] = []
        handle = nvml_query(nvml.nvmlDeviceGetHandleByIndex, index, default=None, on_error=errors.append)
        known = self._known.get(index)
        if handle is None:
            lost = known is not None or any(self._is_lost_error(e) for e in errors)
            if known is not None:
                return self._as_lost(known)
            return GpuSample(index, NA, NA, NA, NA, NA, NA, NA, NA, NA, None, lost)

        def q(func: Callable[..., Any], *args: Any, default: Any = NA) -> Any:
            return nvml_query(func, handle, *args, default=default, on_error=errors.append)

        name = q(nvml.nvmlDeviceGetName)
        pci = q(nvml.nvmlDeviceGetPciInfo, default=None)
        bus_id = NA if pci is None else _decode(getattr(pci, "busId", NA))
        uuid = q(nvml.nvmlDeviceGetUUID)
        mem = _memory_info(nvml, handle, q)
        util = q(nvml.nvmlDeviceGetUtilizationRates, default=None)
        temp = q(nvml.nvmlDeviceGetTemperature, self._const("NVML_TEMPERATURE_GPU", 0))
        power_mw = q(nvml.nvmlDeviceGetPowerUsage)
        procs = q(nvml.nvmlDeviceGetComputeRunningProcesses, default=None)

        lost = any(self._is_lost_error(e) for e in errors)
        if lost and known is not None:
            return self._as_lost(known)

        sample = GpuSample(
            index=index,
            name=name,
            bus_id=bus_id,
            uuid=uuid,
            mem_total=_int_or_na(getattr(mem, "total", NA)),
            mem_used=_int_or_na(getattr(mem, "used", NA)),
            mem_free=_int_or_na(getattr(mem, "free", NA)),
            util_gpu_pct=_int_or_na(getattr(util, "gpu", NA)),
            temperature_c=_int_or_na(temp),
            power_w=NA if is_na(power_mw) else float(power_mw) / 1000.0,
            server_mem=_server_mem(procs, pids),
            lost=lost,
        )
        if not lost:
            self._known[index] = sample
        return sample


def _int_or_na(v: Any) -> int | NaType:
    if is_na(v):
        return NA
    try:
        return int(v)
    except (TypeError, ValueError):
        return NA


def _server_mem(procs: Any, pids: frozenset[int]) -> int | None:
    """Bytes used by ``pids`` in NVML's per-process list; None if unknown.

    None when no pids are given, the list could not be read, or a matching
    entry has no figure (``usedGpuMemory`` None: NVML_VALUE_NOT_AVAILABLE, seen
    under WDDM and in some containers). A server in another pid namespace
    (container) shows as 0: NVML reports host pids.
    """
    if not pids or procs is None:
        return None
    total = 0
    try:
        for p in procs:
            if getattr(p, "pid", None) in pids:
                used = getattr(p, "usedGpuMemory", None)
                if used is None:
                    return None
                total += int(used)
    except Exception:  # why: a malformed NVML process entry makes the sum unknown (None), shown as unknown
        return None
    return total


@dataclass(frozen=True)
class HistoryPoint:
    t: float
    mem_used: int | None
    util: int | None


class GpuHistory:
    """Ring buffer of ``(t, mem_used, util)`` per GPU index (pure Python).

    Keeps the last ``window_s`` seconds (10 min) at most one point per
    ``interval_s`` (1 Hz): points that arrive faster (the sampler ticks at
    4 Hz while a slot is busy) are dropped, so the ring always spans the
    whole window. A lost or N/A reading is stored as None (a gap in the chart).
    """

    def __init__(self, window_s: float = 600.0, interval_s: float = 1.0) -> None:
        if window_s <= 0 or interval_s <= 0:
            raise ValueError("window_s and interval_s must be positive")
        self.window_s = float(window_s)
        self.interval_s = float(interval_s)
        self.maxlen = max(1, int(round(window_s / interval_s)))
        self._series: dict[int, collections.deque[HistoryPoint]] = {}

    def add(self, snapshot: GpuSnapshot, t: float | None = None) -> None:
        t = time.time() if t is None else float(t)
        for g in snapshot.gpus:
            dq = self._series.get(g.index)
            if dq is None:
                dq = self._series[g.index] = collections.deque(maxlen=self.maxlen)
            # 10 % slack: 1 Hz ticks jitter by a few ms either way.
            if dq and t - dq[-1].t < self.interval_s * 0.9:
                continue
            mem = None if (g.lost or is_na(g.mem_used)) else int(g.mem_used)
            util = None if (g.lost or is_na(g.util_gpu_pct)) else int(g.util_gpu_pct)
            dq.append(HistoryPoint(t, mem, util))
        self._prune(t)

    def _prune(self, now: float) -> None:
        horizon = now - self.window_s
        for dq in self._series.values():
            while dq and dq[0].t < horizon:
                dq.popleft()

    def indices(self) -> list[int]:
        return sorted(self._series)

    def series(self, index: int) -> list[tuple[float, int | None, int | None]]:
        return [(p.t, p.mem_used, p.util) for p in self._series.get(index, ())]

    def __len__(self) -> int:
        return sum(len(d) for d in self._series.values())

    def clear(self) -> None:
        self._series.clear()
