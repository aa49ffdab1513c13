"""Server process and host sampling with psutil.

:class:`ProcessMonitor` keeps one ``psutil.Process`` per pid so that
``cpu_percent()`` measures the time between two samples, and checks the
process's ``create_time`` so that a recycled pid is never taken for our
server. Totals include the children (llama-server normally has none, but a
wrapper script or an ``rpc-server`` spawned under it does):

* ``rss``      server RSS + every descendant's RSS (shared pages count twice),
* ``threads``  server threads + every descendant's threads,
* ``cpu_pct``  server + descendants, percent of one core (can exceed 100).

``sample()`` never raises: a gone, zombie or recycled process gives
``alive=False``; a field psutil may not read (AccessDenied) is None.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import psutil

__all__ = ["ProcessSample", "HostSample", "ProcessMonitor", "sample_host"]

log = logging.getLogger(__name__)

# create_time is rounded differently by psutil on some platforms.
_CREATE_TIME_TOLERANCE_S = 0.05


@dataclass(frozen=True)
class ProcessSample:
    pid: int
    alive: bool
    cpu_pct: float | None = None
    rss: int | None = None
    threads: int | None = None
    uptime_s: float | None = None
    children_pids: tuple[int, ...] = ()


@dataclass(frozen=True)
class HostSample:
    ram_total: int | None
    ram_used: int | None
    ram_available: int | None


def sample_host() -> HostSample:
    """Host RAM in bytes (never raises; None fields if psutil fails)."""
    try:
        vm = psutil.virtual_memory()
        return HostSample(int(vm.total), int(vm.used), int(vm.available))
    except Exception:
        log.exception("psutil.virtual_memory failed")
        return HostSample(None, None, None)


class ProcessMonitor:
    """Samples one server process (and its descendants) over time.

    ``create_time``: the server's start time as psutil reports it, when the
    caller recorded it at launch; otherwise it is read now, and a later
    process with the same pid but another create time is not ours.
    """

    def __init__(self, pid: int, create_time: float | None = None) -> None:
        self.pid = int(pid)
        self._proc: psutil.Process | None = None
        self._create_time: float | None = create_time
        self._gone = False
        self._children: dict[int, psutil.Process] = {}
        try:
            proc = psutil.Process(self.pid)
            ct = proc.create_time()
            if self._create_time is None:
                self._create_time = ct
            elif abs(ct - self._create_time) > _CREATE_TIME_TOLERANCE_S:
                self._gone = True  # the pid already belongs to someone else
            if not self._gone:
                self._proc = proc
                proc.cpu_percent(None)  # prime: the first call returns 0.0
        except Exception as e:  # report: a psutil.Error (no such process, access denied) means gone; others logged
            if not isinstance(e, psutil.Error):
                log.exception("process monitor: cannot open pid %d; taken as gone", self.pid)
            self._gone = True

    @property
    def create_time(self) -> float | None:
        return self._create_time

    @staticmethod
    def sample_host() -> HostSample:
        return sample_host()

    def _dead(self) -> ProcessSample:
        self._gone = True
        self._children.clear()
        return ProcessSample(pid=self.pid, alive=False)

    def _is_ours(self, proc: psutil.Process) -> bool:
        try:
            ct = psutil.Process(proc.pid).create_time()
        except Exception as e:  # report: a psutil.Error (no such process, access denied) means not ours; others logged
            if not isinstance(e, psutil.Error):
                log.exception("process monitor of pid %d: cannot read pid %d; taken as not ours", self.pid, proc.pid)
            return False
        return self._create_time is None or abs(ct - self._create_time) <= _CREATE_TIME_TOLERANCE_S

    def sample(self) -> ProcessSample:
        try:
            return self._sample()
        except Exception:
            log.exception("process sampling failed for pid %s", self.pid)
            return ProcessSample(pid=self.pid, alive=self.alive_hint())

    def alive_hint(self) -> bool:
        return not self._gone

    def _sample(self) -> ProcessSample:
        proc = self._proc
        if self._gone or proc is None:
            return ProcessSample(pid=self.pid, alive=False)
        if not self._is_ours(proc):
            return self._dead()
        try:
            with proc.oneshot():
                if proc.status() == psutil.STATUS_ZOMBIE:
                    return self._dead()
                cpu = _try(proc.cpu_percent, None)
                mem = _try(proc.memory_info)
                rss = int(mem.rss) if mem is not None else None
                threads = _try(proc.num_threads)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            return self._dead()

        children = self._sample_children(proc)
        child_pids = tuple(sorted(children))
        for c_cpu, c_rss, c_threads in children.values():
            if cpu is not None and c_cpu is not None:
                cpu += c_cpu
            if rss is not None and c_rss is not None:
                rss += c_rss
            if threads is not None and c_threads is not None:
                threads += c_threads
        uptime = max(0.0, time.time() - self._create_time) if self._create_time else None
        return ProcessSample(
            pid=self.pid,
            alive=True,
            cpu_pct=cpu,
            rss=rss,
            threads=threads,
            uptime_s=uptime,
            children_pids=child_pids,
        )

    def _sample_children(self, proc: psutil.Process) -> dict[int, tuple[Any, Any, Any]]:
        try:
            current = proc.children(recursive=True)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            return {}
        except Exception:  # why: children we may not list (access denied) are left out of the tick (debug log)
            log.debug("cannot list children of %s", self.pid, exc_info=True)
            return {}
        result: dict[int, tuple[Any, Any, Any]] = {}
        kept: dict[int, psutil.Process] = {}
        for child in current:
            # Reuse the Process we kept last tick (cpu_percent needs the same
            # object); psutil's __eq__ compares pid + create_time, so a
            # recycled child pid gets a fresh object.
            prev = self._children.get(child.pid)
            fresh = not (prev is not None and prev == child)
            if not fresh:
                child = prev
            try:
                if fresh:
                    _try(child.cpu_percent, None)  # prime; counts as ~0 this tick
                with child.oneshot():
                    if child.status() == psutil.STATUS_ZOMBIE:
                        continue
                    cpu = _try(child.cpu_percent, None)
                    mem = _try(child.memory_info)
                    threads = _try(child.num_threads)
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
            kept[child.pid] = child
            result[child.pid] = (cpu, int(mem.rss) if mem is not None else None, threads)
        self._children = kept
        return result


def _try(func: Any, *args: Any) -> Any:
    """Call a psutil getter; AccessDenied -> None, gone-process errors propagate."""
    try:
        return func(*args)
    except psutil.AccessDenied:
        return None
