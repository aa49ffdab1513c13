"""Coroutines a panel starts from a click: kept, and their failures said, never lost.

A task nobody holds can be garbage-collected mid-run, and an exception nobody
reads vanishes. A panel mixes :class:`RunsTasks` in, starts work with
:meth:`spawn`, cancels what is left in its ``aclose`` (:meth:`end_tasks`), and
says a failure with ``_task_failed``. Its tasks are held in the app's one task set,
:class:`app.core.background.TaskGroup`.
"""

from __future__ import annotations

import asyncio
import logging

from app.core.background import TaskGroup

log = logging.getLogger(__name__)


class RunsTasks:
    @property
    def _tasks(self) -> TaskGroup:
        """The panel's tasks (made at the first use: a panel's ``__init__`` needs nothing for it)."""
        group = self.__dict__.get("_task_group")
        if group is None:
            group = self.__dict__["_task_group"] = TaskGroup(type(self).__name__, on_failure=self._task_failed)
        return group

    def spawn(self, coro, what: str = "") -> asyncio.Future:
        """Start ``coro``: the app's one way (:func:`app.core.background.track` logs a failure with
        ``what``); the panel keeps it to cancel at its close and says a failure to the user."""
        return self._tasks.start(coro, what or str(getattr(coro, "__qualname__", coro)))

    async def end_tasks(self) -> None:
        """Cancel what is still running and wait until it has stopped (a panel's ``aclose``)."""
        await self._tasks.cancel_all()

    def _task_failed(self, exc: BaseException) -> None:
        """Say it to the user (the panel's message line)."""
