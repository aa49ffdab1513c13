"""Coroutines a panel starts from a click: kept, and their failures said, never lost.

A task nobody holds can be garbage-collected mid-run, and an exception nobody
reads vanishes. A panel or a dialog holds a :class:`Tasks` (composition, not a
mixin): it starts work with :meth:`Tasks.spawn`, cancels what is left in its
``aclose`` (:meth:`Tasks.end`), and is told of a failure through the
``on_failure`` callable it gave (its message line says it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from app.core.background import track

log = logging.getLogger(__name__)


class Tasks:
    """The running tasks of one owner (``owner`` names it in the log)."""

    def __init__(self, owner: str, on_failure: Callable[[BaseException], None]):
        self.owner = owner
        self.on_failure = on_failure
        self._running: set[asyncio.Task] = set()

    def __len__(self) -> int:
        return len(self._running)

    def spawn(self, coro, what: str = "") -> asyncio.Task:
        """Start ``coro``: the app's one way (:func:`app.core.background.track` logs a failure with
        ``what``); kept to cancel at the owner's close; a failure goes to ``on_failure``."""
        task = track(coro, what or f"{self.owner}: {getattr(coro, '__qualname__', coro)}")
        self._running.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._running.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.on_failure(task.exception())  # logged with its context by track

    async def end(self) -> None:
        """Cancel what is still running and wait until it has stopped (the owner's ``aclose``)."""
        for t in list(self._running):
            t.cancel()
        for t in list(self._running):
            try:
                await t
            except BaseException:  # why: cancelled, or failed and already logged (and said) by _done
                pass
