"""Coroutines a panel starts from a click: kept, and their failures said, never lost.

A task nobody holds can be garbage-collected mid-run, and an exception nobody
reads vanishes. A panel mixes :class:`RunsTasks` in, starts work with
:meth:`spawn`, cancels what is left in its ``aclose`` (:meth:`end_tasks`), and
says a failure with ``_task_failed``.
"""

from __future__ import annotations

import asyncio
import logging

from app.core.background import track

log = logging.getLogger(__name__)


class RunsTasks:
    _tasks: set

    def spawn(self, coro, what: str = "") -> asyncio.Task:
        """Start ``coro``: the app's one way (:func:`app.core.background.track` logs a failure with
        ``what``); the panel keeps it to cancel at its close and says a failure to the user."""
        task = track(coro, what or f"{type(self).__name__}: {getattr(coro, '__qualname__', coro)}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._task_failed(task.exception())  # logged with its context by track

    async def end_tasks(self) -> None:
        """Cancel what is still running and wait until it has stopped (a panel's ``aclose``)."""
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            try:
                await t
            except BaseException:  # why: cancelled, or failed and already logged (and said) by _task_done
                pass

    def _task_failed(self, exc: BaseException) -> None:
        """Say it to the user (the panel's message line)."""
