"""Periodic snapshots on the asyncio loop (Qt-free; qasync runs it in the UI).

Ticks are scheduled against a deadline, ``next = anchor + k * interval``: a
slow tick makes the sampler skip the ticks it missed instead of running them
back to back, and a tick never overlaps the previous one (one task runs them
in sequence). The interval is ``interval`` (1 s), or ``busy_interval``
(0.25 s) while any slot of the last snapshot is busy. ``pause()`` stops ticks
(the window calls it when hidden or minimised); ``resume()`` ticks at once.

Every exception inside a tick is logged and delivered as an error snapshot
(:func:`app.monitor.snapshot.error_snapshot`), never lost silently.

:class:`Samplers` holds the one sampler of each server and the one NVML handle
(:class:`app.monitor.gpu.GpuMonitor`) they all share (issue #27): the Monitor tab,
the server list and the status bar read the snapshots of the same sampler. A
sampler nobody watches closely stays paused; a reader that needs a figure of it
now asks :meth:`Sampler.sample_once` (one tick, never two at once).

**One slot picture per server**: a ``/slots`` read made for a decision (a park, a resume) is
not made again for the picture: :meth:`Sampler.feed_slots` delivers its rows as the newest
snapshot to the same subscribers; the Sessions tab shows the slots of that picture too.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

from app.core.background import TaskGroup, stop_if_cancelled
from app.monitor.gpu import GpuMonitor
from app.monitor.snapshot import Snapshot, error_snapshot, with_slots

__all__ = ["Sampler", "Samplers"]

log = logging.getLogger(__name__)

SnapshotFn = Callable[[], Awaitable[Snapshot]]
OnSnapshot = Callable[[Snapshot], Any]


class Sampler:
    """Runs ``take()`` (a zero-argument coroutine function, e.g. a lambda around
    :func:`take_snapshot` that reads the current restored counts) on ticks.

    ``on_snapshot`` is called with every snapshot, on the loop thread; it may be
    a plain function or a coroutine function. Its exceptions are logged.
    """

    def __init__(
        self,
        take: SnapshotFn,
        *,
        on_snapshot: OnSnapshot | None = None,
        interval: float = 1.0,
        busy_interval: float = 0.25,
        tick_timeout: float = 30.0,
        url: str = "",
        cache_ram_mib: int | None = None,
    ) -> None:
        if interval <= 0 or busy_interval <= 0:
            raise ValueError("intervals must be positive")
        self._take = take
        self.on_snapshot = on_snapshot
        self.interval = float(interval)
        self.busy_interval = float(busy_interval)
        self.tick_timeout = float(tick_timeout)
        self.url = url
        self.cache_ram_mib = cache_ram_mib
        self._task: asyncio.Task[None] | None = None
        self._running = asyncio.Event()  # set = not paused
        self._running.set()
        self._wake = asyncio.Event()
        self._busy = False
        self._ticking: asyncio.Lock | None = None  # one tick at a time: the loop's, or sample_once's
        self.last_snapshot: Snapshot | None = None
        self.ticks = 0
        self.skipped_ticks = 0

    # -- control -----------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    @property
    def current_interval(self) -> float:
        return self.busy_interval if self._busy else self.interval

    def start(self) -> None:
        """Start ticking (idempotent). Must be called with a running loop."""
        if self.is_running:
            return
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kv-valet-sampler")
        self._task.add_done_callback(self._on_task_done)

    async def stop(self) -> None:
        """Cancel the loop and wait for it; idempotent, leaves no task behind."""
        task, self._task = self._task, None
        if task is None:
            return
        # Python 3.11's asyncio.wait_for can swallow a cancel that lands just as the
        # awaited call completes (gh-86296): the loop then runs on. Cancel again until
        # the task is really done.
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=0.5)
        try:
            await task
        except asyncio.CancelledError:
            # Our own cancel; re-raise only if *we* are being cancelled.
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
        except Exception:
            log.exception("sampler task ended with an error")

    async def run(self) -> None:
        """Tick until cancelled, then stop: for a caller whose own task owns the sampler's life."""
        self.start()
        try:
            await asyncio.wait({self._task})
        finally:
            await self.stop()

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        if not self._running.is_set():
            self._running.set()
            self._wake.set()

    def request_tick(self) -> None:
        """Tick now (e.g. right after a park/resume) instead of at the deadline."""
        self._wake.set()

    @staticmethod
    def _on_task_done(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("sampler loop died", exc_info=task.exception())

    # -- loop --------------------------------------------------------------

    async def sample_once(self) -> Snapshot:
        """One snapshot now, delivered as a tick's (a paused sampler asked by a reader; not counted
        in ``ticks``); while the loop ticks, its last snapshot."""
        if self.is_running and not self.paused and self.last_snapshot is not None:
            return self.last_snapshot
        return await self.refresh()

    async def refresh(self) -> Snapshot:
        """One tick now, delivered (not counted), whether the loop ticks or not: the picture after a
        change the app made to the slots (a restore) without waiting for the next tick."""
        snap = await self._tick()
        await self._deliver(snap, counted=False)
        return snap

    async def feed_slots(self, rows) -> Snapshot | None:
        """The rows of a ``/slots`` read made for a decision (a park's, a resume's) as the server's newest
        picture: the last snapshot with those slots (:func:`app.monitor.snapshot.with_slots`), delivered
        as a tick's (not counted), so that one read serves the decision and everyone who shows the slots.
        None, and nothing delivered, before the first snapshot or after a tick that failed as a whole
        (no picture to put them in: the next tick makes one)."""
        last = self.last_snapshot
        if last is None or last.error:
            return None
        snap = with_slots(last, rows)
        await self._deliver(snap, counted=False)
        return snap

    async def _tick(self) -> Snapshot:
        if self._ticking is None:
            self._ticking = asyncio.Lock()
        async with self._ticking:
            return await self._tick_alone()

    async def _tick_alone(self) -> Snapshot:
        try:
            snap = await asyncio.wait_for(self._take(), self.tick_timeout)
            if not isinstance(snap, Snapshot):
                raise TypeError(f"take() returned {type(snap).__name__}, not Snapshot")
        except asyncio.CancelledError:
            raise
        except asyncio.TimeoutError:
            log.warning("sampler tick timed out after %.1f s", self.tick_timeout)
            snap = error_snapshot(self.url, f"tick timed out after {self.tick_timeout:g} s", self.cache_ram_mib)
        except Exception as exc:
            log.exception("sampler tick failed")
            snap = error_snapshot(self.url, exc, self.cache_ram_mib)
        return snap

    async def _deliver(self, snap: Snapshot, counted: bool = True) -> None:
        # The pace the newest snapshot sets (the loop's or one asked by a reader) is known before its
        # subscribers hear of it: they may read it.
        self._busy = bool(getattr(snap, "any_busy", False))
        self.last_snapshot = snap
        self.ticks += counted
        cb = self.on_snapshot
        if cb is None:
            return
        try:
            result = cb(snap)
            if inspect.isawaitable(result):
                await result
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("on_snapshot callback failed")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        anchor: float | None = None
        k = 0
        cur_interval = None
        while True:
            stop_if_cancelled()  # a cancel wait_for swallowed below still ends the loop
            if not self._running.is_set():
                await self._running.wait()
                anchor = None  # resumed: re-anchor on this tick
            self._wake.clear()
            tick_start = loop.time()
            snap = await self._tick()
            await self._deliver(snap)

            interval = self.current_interval
            if anchor is None or interval != cur_interval:
                anchor, k, cur_interval = tick_start, 0, interval
            now = loop.time()
            # The next deadline after now; ticks missed while this one ran are
            # skipped, not piled up.
            due = max(k + 1, math.floor((now - anchor) / interval) + 1)
            self.skipped_ticks += due - (k + 1)
            k = due
            delay = anchor + k * interval - now
            if delay > 0 and not self._wake.is_set():
                try:
                    await asyncio.wait_for(self._wake.wait(), delay)
                    anchor = None  # woken early: re-anchor
                except asyncio.TimeoutError:
                    pass
            elif self._wake.is_set():
                anchor = None


TakeFor = Callable[[GpuMonitor], SnapshotFn]
OnPublished = Callable[[str, Snapshot], Any]


class Samplers:
    """The one :class:`Sampler` of each server (by key: its target id) and the one
    :class:`GpuMonitor` (NVML handle) of this machine they share. Every snapshot of every
    sampler is published to the subscribers with its key. Qt-free; on the event loop."""

    def __init__(self, *, gpu: GpuMonitor | None = None, interval: float = 1.0, busy_interval: float = 0.25,
                 gpu_factory: Callable[[], GpuMonitor] | None = None) -> None:
        self._gpu = gpu
        self._own_gpu = gpu is None
        self._gpu_factory = gpu_factory
        self.interval, self.busy_interval = float(interval), float(busy_interval)
        self.samplers: dict[str, Sampler] = {}
        self._idents: dict[str, tuple] = {}
        self._subs: list[OnPublished] = []
        self._stopping = TaskGroup("the samplers")  # samplers of servers gone, stopping (awaited by aclose)

    @property
    def gpu(self) -> GpuMonitor:
        """This machine's one NVML handle, opened at the first sample that needs it."""
        if self._gpu is None:
            self._gpu = (self._gpu_factory or GpuMonitor)()
        return self._gpu

    @gpu.setter
    def gpu(self, gpu: GpuMonitor) -> None:
        """Use ``gpu`` (the caller's to close) from the next tick on."""
        self._gpu, self._own_gpu = gpu, False

    def ensure(self, key: str, ident: tuple, take_for: TakeFor, *, url: str = "",
               cache_ram_mib: int | None = None) -> Sampler:
        """The sampler of ``key``; made (paused: see :meth:`Sampler.resume`) when there is none, or
        when the server behind the key is another now (``ident``: its URL and pid)."""
        s = self.samplers.get(key)
        if s is not None and self._idents.get(key) == ident and s.is_running:
            return s
        if s is not None:
            self.stop_soon(key)  # another server answers there now
        s = Sampler(lambda: take_for(self.gpu)(), on_snapshot=lambda snap, key=key: self._publish(key, snap),
                    interval=self.interval, busy_interval=self.busy_interval, url=url, cache_ram_mib=cache_ram_mib)
        s.pause()
        s.start()
        self.samplers[key], self._idents[key] = s, ident
        return s

    def get(self, key: str | None) -> Sampler | None:
        return self.samplers.get(key) if key is not None else None

    def last(self, key: str | None) -> Snapshot | None:
        s = self.get(key)
        return s.last_snapshot if s is not None else None

    def subscribe(self, cb: OnPublished) -> None:
        self._subs.append(cb)

    def unsubscribe(self, cb: OnPublished) -> None:
        self._subs = [c for c in self._subs if c != cb]

    async def _publish(self, key: str, snap: Snapshot) -> None:
        for cb in list(self._subs):
            try:
                result = cb(key, snap)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception("snapshot subscriber failed")

    def set_rates(self, interval: float, busy_interval: float) -> None:
        """The rates of every sampler, from its next tick."""
        self.interval, self.busy_interval = float(interval), float(busy_interval)
        for s in self.samplers.values():
            s.interval, s.busy_interval = self.interval, self.busy_interval

    def _forget(self, key: str) -> Sampler | None:
        self._idents.pop(key, None)
        return self.samplers.pop(key, None)

    async def stop(self, key: str) -> None:
        """The server behind ``key`` is gone: its sampler stops (idempotent)."""
        s = self._forget(key)
        if s is not None:
            await s.stop()

    def stop_soon(self, key: str) -> None:
        """:meth:`stop` from a callback: gone from :attr:`samplers` now, stopped in the background."""
        s = self._forget(key)
        if s is not None:
            self._stopping.start(s.stop(), f"stopping the sampler of {key}")

    async def aclose(self) -> None:
        for key in list(self.samplers):
            await self.stop(key)
        await self._stopping.wait()
        if self._gpu is not None and self._own_gpu:
            gpu, self._gpu = self._gpu, None
            await asyncio.to_thread(gpu.close)
