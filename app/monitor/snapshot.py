"""One immutable snapshot per tick: health, slots, GPUs, server process, host.

:func:`take_snapshot` gathers everything for one tick. HTTP fetches run on
the event loop; the blocking NVML and psutil calls run together in one
``asyncio.to_thread`` call so the loop (and the Qt window under qasync) never
blocks. Every failure becomes a value in the snapshot (``health``,
``slots_error``, ``gpu.message``), never an exception.

:func:`format_snapshot` renders the fixed-width tables of
``kv-valet status URL``; :func:`snapshot_to_dict` the one JSON object of
``kv-valet status URL --json``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from app.core.states import Health, health_text
from app.monitor.gpu import GpuMonitor, GpuSnapshot
from app.monitor.process import HostSample, ProcessMonitor, ProcessSample, sample_host
from app.monitor.slots import LastTask, RestoredSlot, SlotRow, held_count, slot_rows, slots_state_from_error
from app.core.units import NA, fmt_bytes, is_na, fmt_uptime
from app.monitor.warnings import MonitorWarning, compute_warnings

__all__ = [
    "Snapshot",
    "take_snapshot",
    "error_snapshot",
    "health_from_result",
    "health_from_error",
    "format_snapshot",
    "snapshot_to_dict",
    "summary",
]

log = logging.getLogger(__name__)

DEFAULT_FETCH_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Snapshot:
    taken_at: float  # epoch seconds
    url: str
    health: Health
    slots: tuple[SlotRow, ...]
    slots_error: str | None
    gpu: GpuSnapshot
    process: ProcessSample | None
    host: HostSample
    cache_ram_mib: int | None
    warnings: tuple[MonitorWarning, ...] = ()
    # Set only when the tick itself failed (see error_snapshot); the fields
    # above then hold "not sampled" placeholders.
    error: str | None = None
    health_detail: str = ""  # why, for UNREACHABLE and ERROR ("connection refused")

    @property
    def any_busy(self) -> bool:
        return any(r.busy for r in self.slots)

    @property
    def health_text(self) -> str:
        """"ok", "loading", "unreachable: <reason>", "error: <reason>" (as shown and in --json)."""
        return health_text(self.health, self.health_detail)


# -- health -------------------------------------------------------------------


def _status_of(x: Any) -> int | None:
    for attr in ("status", "status_code"):
        v = getattr(x, attr, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


HealthReading = tuple[Health, str]  # the health and why (empty for OK and LOADING)
OK: HealthReading = (Health.OK, "")
LOADING: HealthReading = (Health.LOADING, "")


def _unreachable(why: str) -> HealthReading:
    return Health.UNREACHABLE, why


def health_from_error(exc: BaseException) -> HealthReading:
    status = _status_of(exc)
    message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    if status == 503 or "loading" in str(message).lower():
        return LOADING
    if status is not None:
        return _unreachable(f"HTTP {status}: {message}")
    if isinstance(exc, asyncio.TimeoutError):
        return _unreachable("timed out")
    name = type(exc).__name__
    return _unreachable(str(message) if name in str(message) else f"{name}: {message}")


def health_from_result(result: Any) -> HealthReading:
    """Normalise what ``fetch_health`` returned: (Health.OK, ""), (Health.LOADING, "") or why not."""
    if result is None or result is True:
        return OK
    if result is False:
        return _unreachable("health check failed")
    if isinstance(result, Health):
        return result, ""
    if isinstance(result, str):
        if "loading" in result.strip().lower():
            return LOADING
        return Health.parse(result)
    if isinstance(result, Mapping):
        err = result.get("error")
        if isinstance(err, Mapping):
            if err.get("code") == 503 or "loading" in str(err.get("message", "")).lower():
                return LOADING
            return _unreachable(str(err.get("message", err)))
        status = result.get("status")
        if status is not None:
            return health_from_result(str(status))
        return OK
    ok = getattr(result, "ok", None)
    if isinstance(ok, bool):  # the client's Health: status 0 means no HTTP answer at all
        if ok:
            return OK
        if getattr(result, "loading", False):
            return LOADING
        status, message = _status_of(result), getattr(result, "message", "") or ""
        if not status:
            return _unreachable(message or "no answer")
        return _unreachable(f"HTTP {status}" + (f": {message}" if message else ""))
    status = _status_of(result)
    if status is not None:
        if 200 <= status < 300:
            return OK
        if status == 503:
            return LOADING
        return _unreachable(f"HTTP {status}")
    v = getattr(result, "value", None) or getattr(result, "name", None)
    if isinstance(v, str):
        return health_from_result(v)
    return _unreachable(str(result))


# -- taking a snapshot --------------------------------------------------------


def _local_sample(
    gpu: GpuMonitor | None, proc: ProcessMonitor | None
) -> tuple[ProcessSample | None, GpuSnapshot, HostSample]:
    """All blocking calls of one tick, run in one worker thread."""
    ps: ProcessSample | None = None
    if proc is not None:
        try:
            ps = proc.sample()
        except Exception as exc:  # ProcessMonitor never raises; be sure
            log.exception("process sample failed")
            ps = ProcessSample(pid=getattr(proc, "pid", -1), alive=False)
            del exc
    pids: set[int] = set()
    if ps is not None and ps.alive:
        pids = {ps.pid, *ps.children_pids}
    if gpu is None:
        gs = GpuSnapshot(False, "GPU monitoring off", (), None)
    else:
        try:
            gs = gpu.sample(pids)
        except Exception as exc:
            log.exception("GPU sample failed")
            gs = GpuSnapshot(False, f"NVML error: {exc}", (), None)
    return ps, gs, sample_host()


async def take_snapshot(
    fetch_health: Callable[[], Awaitable[Any]],
    fetch_slots: Callable[[], Awaitable[Any]],
    gpu: GpuMonitor | None,
    proc: ProcessMonitor | None,
    restored: Mapping[int, RestoredSlot] | None,
    cache_ram_mib: int | None,
    url: str,
    *,
    timeout_s: float = DEFAULT_FETCH_TIMEOUT_S,
    last_tasks: Mapping[int, LastTask] | None = None,
) -> Snapshot:
    """Gather one :class:`Snapshot`; never raises (except CancelledError).

    ``fetch_slots`` returns the parsed ``GET /slots`` list or raises (an HTTP
    error with ``.status``/``.message``, read with getattr). Each fetch is
    bounded by ``timeout_s`` on top of the client's own timeout.
    """
    taken_at = time.time()

    async def health() -> HealthReading:
        try:
            return health_from_result(await asyncio.wait_for(fetch_health(), timeout_s))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # report: the error is the health shown for this tick (health_from_error)
            return health_from_error(exc)

    async def slots() -> tuple[tuple[SlotRow, ...], str | None]:
        try:
            data = await asyncio.wait_for(fetch_slots(), timeout_s)
        except asyncio.CancelledError:
            raise
        except asyncio.TimeoutError:
            return (), slots_state_from_error(f"timed out after {timeout_s:g} s")
        except Exception as exc:  # report: the error is the slots' state shown for this tick
            return (), slots_state_from_error(exc)
        if not isinstance(data, (list, tuple)):
            if isinstance(data, Mapping) and "error" in data:
                return (), slots_state_from_error(data)
            return (), slots_state_from_error(f"unexpected response: {type(data).__name__}")
        try:
            return tuple(slot_rows(data, restored or {}, last_tasks or {})), None
        except Exception as exc:  # slot_rows is defensive; be sure
            log.exception("slot_rows failed")
            return (), slots_state_from_error(exc)

    async def local() -> tuple[ProcessSample | None, GpuSnapshot, HostSample]:
        try:
            return await asyncio.to_thread(_local_sample, gpu, proc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("local sampling failed")
            return None, GpuSnapshot(False, f"NVML error: {exc}", (), None), HostSample(None, None, None)

    (h, why), (rows, slots_error), (ps, gs, host) = await asyncio.gather(health(), slots(), local())
    snap = Snapshot(
        taken_at=taken_at,
        url=url,
        health=h,
        health_detail=why,
        slots=rows,
        slots_error=slots_error,
        gpu=gs,
        process=ps,
        host=host,
        cache_ram_mib=cache_ram_mib,
    )
    return _warned(snap)


def _warned(snap: Snapshot) -> Snapshot:
    """``snap`` with the warnings its figures call for."""
    try:
        warnings = tuple(compute_warnings(snap))
    except Exception:
        log.exception("compute_warnings failed")
        warnings = ()
    return dataclasses.replace(snap, warnings=warnings)


def with_slots(snap: Snapshot, rows, taken_at: float | None = None) -> Snapshot:
    """``snap`` with the slots of a ``/slots`` read made elsewhere (a park's, a resume's: one read,
    one picture), its warnings worked out again; the rest (health, GPUs, process) as ``snap`` had it."""
    return _warned(dataclasses.replace(snap, slots=tuple(rows), slots_error=None,
                                       taken_at=time.time() if taken_at is None else taken_at))


def summary(s: Snapshot) -> str:
    """One short line of a snapshot for the status bar: health, slots in use, VRAM per GPU."""
    parts = [s.health_text if s.health is not Health.OK else "health ok"]
    if s.slots:
        parts.append(f"{held_count(s.slots)} / {len(s.slots)} slots in use")
    for g in s.gpu.gpus:
        if g.lost:
            parts.append(f"GPU{g.index} lost")
        elif not is_na(g.mem_used) and not is_na(g.mem_total) and g.mem_total:
            parts.append(f"GPU{g.index} {g.mem_used / 2**30:.1f}/{g.mem_total / 2**30:.1f} GiB")
    return " · ".join(parts)


def error_snapshot(url: str, exc: BaseException | str, cache_ram_mib: int | None = None) -> Snapshot:
    """A snapshot for a tick that failed as a whole (the error is kept, not lost)."""
    text = exc if isinstance(exc, str) else (f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
    return Snapshot(
        taken_at=time.time(),
        url=url,
        health=Health.ERROR,
        health_detail=text,
        slots=(),
        slots_error=f"not sampled: {text}",
        gpu=GpuSnapshot(False, f"not sampled: {text}", (), None),
        process=None,
        host=HostSample(None, None, None),
        cache_ram_mib=cache_ram_mib,
        warnings=(MonitorWarning("critical", f"sampling failed: {text}"),),
        error=text,
    )


# -- output -------------------------------------------------------------------


def _jsonable(v: Any) -> Any:
    if v is NA:
        return None
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _jsonable(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return str(v)


def snapshot_to_dict(s: Snapshot) -> dict[str, Any]:
    """One JSON-serialisable object (``NA`` -> null, tuples -> lists); ``health`` as its text
    ("unreachable: why", what every kv-valet's ``status --json`` has said: Health.parse reads it)."""
    d = _jsonable(s)
    d["health"] = s.health_text
    d.pop("health_detail", None)
    return d


def _cell(v: Any) -> str:
    if is_na(v):
        return "-" if v is None else "N/A"
    return str(v)


def _table(headers: list[str], rows: list[list[Any]], right: set[int] | None = None) -> list[str]:
    right = right or set()
    cells = [[_cell(c) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in cells:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))

    def line(values: list[str]) -> str:
        parts = [v.rjust(widths[i]) if i in right else v.ljust(widths[i]) for i, v in enumerate(values)]
        return "  ".join(parts).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out.extend(line(r) for r in cells)
    return out


def _uptime(s: float | None) -> str:
    return fmt_uptime(s)


def format_snapshot(s: Snapshot) -> str:
    """Readable fixed-width tables: Slots, GPUs, Server process, Host, Warnings."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s.taken_at))
    lines = [f"KV Valet status of {s.url} at {when}", f"health: {s.health_text}"]
    if s.error:
        lines.append(f"error: {s.error}")

    lines += ["", "Slots"]
    if s.slots_error:
        lines.append(f"  {s.slots_error}")
    elif not s.slots:
        lines.append("  (no slots)")
    else:
        rows = []
        for r in s.slots:
            held = "-" if r.tokens_held is None else f"{r.tokens_held:,}" + (" (restored)" if r.tokens_known_from_restore else "")
            fill = "-" if r.fill_fraction is None else f"{r.fill_fraction:.0%}"
            rows.append([
                r.id,
                "busy" if r.busy else "idle",
                held,
                "-" if r.n_ctx is None else f"{r.n_ctx:,}",
                fill,
                r.id_task,
                r.n_cached,
                r.n_processed,
                r.n_decoded,
                r.session,
            ])
        lines += ["  " + x for x in _table(
            ["slot", "state", "tokens", "n_ctx", "fill", "task", "cached", "processed", "decoded", "session"],
            rows,
            right={0, 2, 3, 4, 5, 6, 7, 8},
        )]

    lines += ["", "GPUs"]
    g = s.gpu
    if not g.available and not g.gpus:
        lines.append(f"  {g.message}")
    else:
        if g.driver_version:
            lines.append(f"  driver {g.driver_version}")
        if g.message and g.message != "ok":
            lines.append(f"  {g.message}")
        rows = []
        for x in g.gpus:
            frac = x.mem_used_fraction
            rows.append([
                x.index,
                x.name,
                x.bus_id,
                "LOST" if x.lost else "ok",
                fmt_bytes(x.mem_used),
                fmt_bytes(x.mem_total),
                "N/A" if frac is None else f"{frac:.0%}",
                "N/A" if is_na(x.util_gpu_pct) else f"{x.util_gpu_pct} %",
                "N/A" if is_na(x.temperature_c) else f"{x.temperature_c} C",
                "N/A" if is_na(x.power_w) else f"{x.power_w:.0f} W",
                "-" if x.server_mem is None else fmt_bytes(x.server_mem),
            ])
        lines += ["  " + t for t in _table(
            ["gpu", "name", "bus id", "state", "used", "total", "mem", "util", "temp", "power", "server"],
            rows,
            right={0, 4, 5, 6, 7, 8, 9, 10},
        )]

    lines += ["", "Server process"]
    p = s.process
    if p is None:
        lines.append("  (no server process known)")
    elif not p.alive:
        lines.append(f"  pid {p.pid}: not running")
    else:
        cpu = "-" if p.cpu_pct is None else f"{p.cpu_pct:.1f} %"
        lines += ["  " + t for t in _table(
            ["pid", "cpu", "rss", "threads", "uptime", "children"],
            [[p.pid, cpu, fmt_bytes(p.rss), p.threads, _uptime(p.uptime_s),
              ",".join(map(str, p.children_pids)) or "-"]],
            right={0, 1, 2, 3, 4},
        )]
        lines.append("  (rss, threads and cpu include the children)")

    lines += ["", "Host"]
    h = s.host
    budget = s.cache_ram_mib
    budget_txt = "-" if budget is None else ("unlimited" if budget < 0 else ("disabled" if budget == 0 else fmt_bytes(budget * 1024 * 1024)))
    lines += ["  " + t for t in _table(
        ["ram total", "ram used", "ram available", "--cache-ram"],
        [[fmt_bytes(h.ram_total), fmt_bytes(h.ram_used), fmt_bytes(h.ram_available), budget_txt]],
        right={0, 1, 2, 3},
    )]

    lines += ["", "Warnings"]
    if not s.warnings:
        lines.append("  none")
    for w in s.warnings:
        lines.append(f"  [{w.level}] {w.text}")
    return "\n".join(lines) + "\n"
