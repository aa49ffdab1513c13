"""Background work that nobody awaits: kept alive, and its failure logged with what it was.

``asyncio.ensure_future`` alone leaves a task only the event loop weakly holds (it can
be collected mid-run) and an exception nobody reads (it vanishes, or surfaces as
"Task exception was never retrieved" long after). :func:`track` keeps the task until it
ends and logs a failure with the context it was given. Panels use
:class:`app.ui.widgets.tasks.Tasks`, which also tells the user; this is for the rest.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable

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
