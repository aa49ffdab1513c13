"""Background work that nobody awaits: kept alive, and its failure logged with what it was.

``asyncio.ensure_future`` alone leaves a task only the event loop weakly holds (it can
be collected mid-run) and an exception nobody reads (it vanishes, or surfaces as
"Task exception was never retrieved" long after). :func:`track` keeps the task until it
ends and logs a failure with the context it was given. Panels use
:class:`app.ui.widgets.tasks.Tasks` (a :class:`TaskGroup` that also tells the user); this is for the rest.
An owner that keeps its tasks (to cancel them at its close, or to wait for them) holds them in
a :class:`TaskGroup`, which starts them through :func:`track`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Awaitable, Callable, Iterator

log = logging.getLogger(__name__)

_running: set[asyncio.Future] = set()


def track(work: Awaitable, what: str) -> asyncio.Future:
    """Start ``work`` (a coroutine or future) in the background; ``what`` names it in the log."""
    task = asyncio.ensure_future(work)  # the one place: kept in _running, its failure logged below
    _running.add(task)

    def done(t: asyncio.Future) -> None:
        _running.discard(t)
        if not t.cancelled() and t.exception() is not None:
            log.error("background work failed: %s", what, exc_info=t.exception())

    task.add_done_callback(done)
    return task


class TaskGroup:
    """The background tasks one owner keeps (a supervisor, a proxy, a panel, the window's power
    handlers): started through :func:`track` (a failure logged with what it was), held until
    they end, and cancelled and awaited when the owner closes. ``on_failure``: also told of a
    failure (a panel says it to the user). The one task set of the app, beside :func:`track`."""

    def __init__(self, owner: str, on_failure: Callable[[BaseException], None] | None = None):
        self.owner = owner
        self._on_failure = on_failure
        self._tasks: set[asyncio.Future] = set()

    def start(self, work: Awaitable, what: str) -> asyncio.Future:
        """Start ``work`` in the background, held here; ``what`` names it in the log."""
        task = track(work, f"{self.owner}: {what}")
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Future) -> None:
        self._tasks.discard(task)
        if self._on_failure is not None and not task.cancelled() and task.exception() is not None:
            self._on_failure(task.exception())  # logged with its context by track already

    @contextlib.contextmanager
    def holding(self, task: asyncio.Future) -> Iterator[None]:
        """Hold a task that someone else started (a request's handler) while the block runs:
        :meth:`cancel_all` cancels it too."""
        self._tasks.add(task)
        try:
            yield
        finally:
            self._tasks.discard(task)

    async def wait(self) -> None:
        """Until every task held, and every one they start meanwhile, has ended (failures: logged)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def cancel_all(self) -> None:
        """Cancel every task held and wait until they have stopped (the owner's close)."""
        running = [t for t in self._tasks if t is not asyncio.current_task()]  # never wait on itself
        for t in running:
            t.cancel()
        if running:
            await asyncio.wait(running)

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Future]:
        return iter(list(self._tasks))


def stop_if_cancelled() -> None:
    """Raise CancelledError when the running task has been asked to stop. A looping task calls it each
    round: Python 3.11's ``asyncio.wait_for`` can swallow a cancel that lands just as its awaited call
    completes (gh-86296), and a loop that goes on after that never ends (a shutdown that cancels it
    once then waits for it forever)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def say_progress(callback, text: str, what: str) -> None:
    """Tell ``callback`` (None: nobody listens) how long work goes; a broken progress display is
    logged with ``what`` is running, and never breaks that work."""
    if callback is None:
        return
    try:
        callback(text)
    except Exception:  # report: a broken progress display must not break the work it describes
        log.exception("%s: the progress callback failed on %r", what, text)

