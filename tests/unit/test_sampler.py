"""Sampler: ticks, pause/resume, busy interval, errors; no fixed sleeps for sync."""

from __future__ import annotations

import asyncio
import logging

import pytest

from app.core.states import Health
from app.monitor.gpu import GpuSnapshot
from app.monitor.process import HostSample
from app.monitor.sampler import Sampler
from app.monitor.slots import slot_rows
from app.monitor.snapshot import Snapshot, take_snapshot

URL = "http://fake"
TIMEOUT = 5.0


def _slots(busy: bool):
    return [{"id": 0, "n_ctx": 4096, "is_processing": busy}]


class Recorder:
    """on_snapshot callback: wakes waiters when n snapshots have arrived."""

    def __init__(self, loop_time):
        self.snaps: list[Snapshot] = []
        self.times: list[float] = []
        self._time = loop_time
        self._waiters: list[tuple[int, asyncio.Event]] = []

    def __call__(self, snap: Snapshot) -> None:
        self.snaps.append(snap)
        self.times.append(self._time())
        for n, ev in self._waiters:
            if len(self.snaps) >= n:
                ev.set()

    async def wait_for(self, n: int, timeout: float = TIMEOUT) -> None:
        ev = asyncio.Event()
        self._waiters.append((n, ev))
        if len(self.snaps) >= n:
            ev.set()
        await asyncio.wait_for(ev.wait(), timeout)


def make(busy=lambda: False, fail=None, **kw):
    async def health():
        return {"status": "ok"}

    async def slots():
        if fail is not None and fail():
            raise RuntimeError("connection reset")
        return _slots(busy())

    async def take():
        return await take_snapshot(health, slots, None, None, {}, None, URL)

    loop = asyncio.get_running_loop()
    rec = Recorder(loop.time)
    return Sampler(take, on_snapshot=rec, url=URL, **kw), rec


async def test_ticks_happen_and_stop_leaves_no_task():
    sampler, rec = make(interval=0.02)
    sampler.start()
    sampler.start()  # idempotent
    try:
        await rec.wait_for(3)
    finally:
        await sampler.stop()
    assert not sampler.is_running
    assert all(s.health is Health.OK for s in rec.snaps)
    assert sampler.last_snapshot is rec.snaps[-1]
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert others == []
    await sampler.stop()  # idempotent


async def test_pause_stops_ticks_and_resume_restarts():
    sampler, rec = make(interval=0.01)
    sampler.start()
    try:
        await rec.wait_for(2)
        sampler.pause()
        n_paused = len(rec.snaps)
        with pytest.raises(asyncio.TimeoutError):
            await rec.wait_for(n_paused + 2, timeout=0.2)
        assert sampler.paused
        sampler.resume()
        await rec.wait_for(n_paused + 2)
    finally:
        await sampler.stop()


async def test_busy_slot_shortens_interval():
    # An idle interval of an hour: any tick after the requested one comes from the busy
    # interval, so counting ticks tells which interval runs (the spacing itself is measured
    # by tests/bench/bench_sampling.py).
    state = {"busy": False}
    sampler, rec = make(busy=lambda: state["busy"], interval=3600, busy_interval=0.02)
    sampler.start()
    try:
        await rec.wait_for(1)
        assert sampler.current_interval == 3600
        state["busy"] = True
        sampler.request_tick()
        await rec.wait_for(2)
        assert rec.snaps[-1].any_busy
        assert sampler.current_interval == 0.02
        n = len(rec.snaps)
        await rec.wait_for(n + 5)  # TIMEOUT is a failure guard: the idle interval would take hours
        assert all(s.any_busy for s in rec.snaps[n - 1:])
    finally:
        await sampler.stop()


async def test_a_snapshot_asked_by_a_reader_sets_the_pace_its_subscribers_read():
    # A paused sampler (the Monitor hidden) asked for one snapshot by the Servers list: the pace
    # its subscribers read while they hear of it is that snapshot's, never the last loop tick's.
    state = {"busy": False}
    sampler, rec = make(busy=lambda: state["busy"], interval=3600, busy_interval=0.02)
    seen: list[float] = []
    sampler.on_snapshot = lambda snap: (rec(snap), seen.append(sampler.current_interval))
    sampler.start()
    try:
        await rec.wait_for(1)
        sampler.pause()
        state["busy"] = True
        snap = await sampler.sample_once()
        assert snap.any_busy and seen[-1] == 0.02 and sampler.current_interval == 0.02
        state["busy"] = False
        assert not (await sampler.sample_once()).any_busy
        assert seen[-1] == 3600 and sampler.current_interval == 3600
    finally:
        await sampler.stop()


async def test_a_decisions_read_is_the_picture_not_one_read_more():
    # A park read /slots for its decision: its rows are delivered as the newest snapshot (the Monitor,
    # the server list and the Sessions tab show them) without a tick, a fetch or a count.
    reads = []
    sampler, rec = make(fail=lambda: reads.append(1) and False)
    assert await sampler.feed_slots(slot_rows(_slots(True))) is None and rec.snaps == []  # no picture yet
    first = await sampler.refresh()
    fed = await sampler.feed_slots(slot_rows([{"id": 0, "n_ctx": 4096, "is_processing": True,
                                               "n_prompt_tokens": 4000}]))
    assert len(reads) == 1 and sampler.ticks == 0 and rec.snaps == [first, fed] and sampler.last_snapshot is fed
    assert fed.health is first.health and fed.any_busy and sampler.current_interval == sampler.busy_interval
    assert fed.slots[0].tokens_held == 4000 and fed.warnings != first.warnings  # a slot 98 % full warns


async def test_exception_in_fetch_becomes_an_error_value():
    sampler, rec = make(fail=lambda: True, interval=0.01)
    sampler.start()
    try:
        await rec.wait_for(1)
    finally:
        await sampler.stop()
    s = rec.snaps[0]
    assert s.slots == () and "connection reset" in s.slots_error


async def test_exception_in_tick_produces_error_snapshot(caplog):
    calls = 0

    async def take():
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("snapshot machinery broke")
        return Snapshot(0.0, URL, "ok", (), None, GpuSnapshot(False, "x"), None,
                        HostSample(None, None, None), None)

    rec = Recorder(asyncio.get_running_loop().time)
    sampler = Sampler(take, on_snapshot=rec, interval=0.01, url=URL)
    with caplog.at_level(logging.ERROR, logger="app.monitor.sampler"):
        sampler.start()
        try:
            await rec.wait_for(2)
        finally:
            await sampler.stop()
    err = rec.snaps[0]
    assert err.error and "snapshot machinery broke" in err.error
    assert err.health is Health.ERROR and err.health_text.startswith("error:") and err.url == URL
    assert rec.snaps[1].error is None
    assert "sampler tick failed" in caplog.text


async def test_callback_exception_does_not_stop_the_loop(caplog):
    sampler, rec = make(interval=0.01)
    seen = asyncio.Event()
    count = 0

    def bad(snap):
        nonlocal count
        count += 1
        if count >= 3:
            seen.set()
        raise ValueError("ui bug")

    sampler.on_snapshot = bad
    sampler.start()
    try:
        await asyncio.wait_for(seen.wait(), TIMEOUT)
    finally:
        await sampler.stop()
    assert "on_snapshot callback failed" in caplog.text


async def test_slow_tick_skips_missed_deadlines_and_never_overlaps():
    active = 0
    max_active = 0
    done = asyncio.Event()
    ticks = 0

    async def take():
        nonlocal active, max_active, ticks
        active += 1
        max_active = max(max_active, active)
        try:
            # one slow tick: 5 intervals long, measured by a timer-driven
            # wait on an event that is never set
            if ticks == 0:
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.Event().wait(), 0.1)
            ticks += 1
            if ticks >= 3:
                done.set()
            return Snapshot(0.0, URL, "ok", (), None, GpuSnapshot(False, "x"), None,
                            HostSample(None, None, None), None)
        finally:
            active -= 1

    sampler = Sampler(take, interval=0.02)
    sampler.start()
    try:
        await asyncio.wait_for(done.wait(), TIMEOUT)
    finally:
        await sampler.stop()
    assert max_active == 1
    assert sampler.skipped_ticks >= 3


async def test_stop_cancels_a_tick_in_flight():
    started = asyncio.Event()

    async def take():
        started.set()
        await asyncio.Event().wait()  # hangs until cancelled

    sampler = Sampler(take, interval=0.01)
    sampler.start()
    await asyncio.wait_for(started.wait(), TIMEOUT)
    await asyncio.wait_for(sampler.stop(), TIMEOUT)
    assert not sampler.is_running
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert others == []


async def test_tick_timeout_gives_error_snapshot():
    async def take():
        await asyncio.Event().wait()

    rec = Recorder(asyncio.get_running_loop().time)
    sampler = Sampler(take, on_snapshot=rec, interval=0.01, tick_timeout=0.05, url=URL)
    sampler.start()
    try:
        await rec.wait_for(1)
    finally:
        await sampler.stop()
    assert "timed out" in rec.snaps[0].error


async def test_a_cancel_that_wait_for_swallows_still_ends_the_loop(monkeypatch):
    """gh-86296: Python 3.11's wait_for can swallow a cancel that lands as its awaited call completes.
    A shutdown cancels each task once and waits for it: the loop must end all the same (a test run hung
    in asyncio.run's teardown on a sampler that went on ticking)."""
    import app.monitor.sampler as sampler_module

    real_wait_for = asyncio.wait_for

    async def swallowing(aw, timeout):
        try:
            return await real_wait_for(aw, timeout)
        except asyncio.CancelledError:
            return None  # the race, made certain

    class OnlyHere:  # the sampler module's asyncio, with the racy wait_for; every other module's is untouched
        wait_for = staticmethod(swallowing)

        def __getattr__(self, name):
            return getattr(asyncio, name)

    monkeypatch.setattr(sampler_module, "asyncio", OnlyHere())
    sampler, rec = make(interval=0.02)
    sampler.start()
    await rec.wait_for(2)
    task = sampler._task
    ticks = len(rec.snaps)
    task.cancel()  # once, as asyncio.run's teardown does
    done, _ = await asyncio.wait({task}, timeout=TIMEOUT)
    assert task in done and task.cancelled()
    assert len(rec.snaps) <= ticks + 1
