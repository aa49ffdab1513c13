"""The fault matrix's freezer (tests/faults/freeze.py driven by helpers.Freezer) when the operation
it waits for finishes first: the test then drops the watch and tries again. On the CI machine
(2026-12-02) that path raised "read() called while another coroutine is already waiting for
incoming data": the cancelled wait for the hit still held the watcher's stdout when stop() read it.
No server here: a ``sleep`` stands in for the process to freeze."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from pathlib import Path

from tests.faults.helpers import Freezer


def _state(pid: int) -> str:
    """The one-letter state of /proc/PID/stat (T: stopped)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


async def _child_event(pid: int, event: int) -> int:
    """The child ``pid``'s next change (30 s at most) among ``event`` (``os.WSTOPPED``,
    ``os.WCONTINUED``) and its end, as ``os.CLD_*``: a stop or a continue takes effect when the
    child next runs, not when the signal is sent. ``WNOWAIT`` leaves the child to its parent's own
    wait; its end (the test's cleanup kills it) ends the wait in any case."""
    result = await asyncio.wait_for(asyncio.to_thread(os.waitid, os.P_PID, pid, event | os.WEXITED | os.WNOWAIT), 120)
    return result.si_code


@contextlib.contextmanager
def _sleeper():
    proc = subprocess.Popen(["sleep", "600"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_watch_dropped_before_any_event_stops_cleanly(tmp_path):
    async def go():
        with _sleeper() as sleeper:
            freezer = await Freezer.watch(tmp_path, r"chat\.bin", "create", sleeper.pid)
            hit = freezer.hit_task()
            await asyncio.sleep(0)  # one turn of the loop: the hit task now waits on the watcher's stdout (the CI failure)
            await freezer.stop(frozen_pid=sleeper.pid)
            assert hit.cancelled() and freezer.done()
            assert _state(sleeper.pid) != "T"

    asyncio.run(go())


def test_a_freeze_the_test_drops_lets_the_process_go_on(tmp_path):
    """The watcher froze the process after all (the hit came with the operation's own end): stop()
    lets it go, or the next try would wait on a stopped server."""
    async def go():
        with _sleeper() as sleeper:
            freezer = await Freezer.watch(tmp_path, r"chat\.bin", "create", sleeper.pid)
            hit = freezer.hit_task()
            (tmp_path / "chat.bin").write_bytes(b"x")
            assert (await hit)["name"] == "chat.bin"
            assert await _child_event(sleeper.pid, os.WSTOPPED) == os.CLD_STOPPED  # frozen
            await freezer.stop(frozen_pid=sleeper.pid)
            assert await _child_event(sleeper.pid, os.WCONTINUED) == os.CLD_CONTINUED  # and let go

    asyncio.run(go())
