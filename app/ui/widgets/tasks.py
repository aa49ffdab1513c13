"""Coroutines a panel starts from a click: kept, and their failures said, never lost.

A task nobody holds can be garbage-collected mid-run, and an exception nobody
reads vanishes. A panel or a dialog holds a :class:`Tasks` (composition, not a
mixin): it starts work with :meth:`Tasks.spawn`, cancels what is left in its
``aclose`` (:meth:`Tasks.end`), and is told of a failure through the
``on_failure`` callable it gave (its message line says it). :class:`Tasks` is the
app's one task set, :class:`app.core.background.TaskGroup`, under the names a
panel uses.
"""

from __future__ import annotations

import asyncio

from app.core.background import TaskGroup


class Tasks(TaskGroup):
    """The running tasks of one panel or dialog (``owner`` names it in the log)."""

    def spawn(self, coro, what: str = "") -> asyncio.Future:
        """Start ``coro``: the app's one way (:func:`app.core.background.track` logs a failure with
        ``what``); kept to cancel at the owner's close; a failure goes to ``on_failure``."""
        return self.start(coro, what or str(getattr(coro, "__qualname__", coro)))

    async def end(self) -> None:
        """Cancel what is still running and wait until it has stopped (the owner's ``aclose``)."""
        await self.cancel_all()
