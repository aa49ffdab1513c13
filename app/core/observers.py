"""The one observer list of the services (not Qt signals): :class:`Observers`.

A service tells whoever listens that something changed (a server's state, a log line, a
verdict, a request's record) by ``emit``; a listener that raises is logged with what it was
told and who was telling, and never stops the others nor the service.
"""

from __future__ import annotations

import logging
from typing import Callable, Generic, ParamSpec

log = logging.getLogger(__name__)

P = ParamSpec("P")


class Observers(Generic[P]):
    """Listeners called in the order they were added; ``what`` names them in the log."""

    def __init__(self, what: str):
        self.what = what
        self._fns: list[Callable[P, object]] = []

    def add(self, fn: Callable[P, object]) -> Callable[P, object]:
        self._fns.append(fn)
        return fn

    def remove(self, fn: Callable[P, object]) -> None:
        """Stop telling ``fn`` (one that was never added, or removed already: nothing)."""
        try:
            self._fns.remove(fn)
        except ValueError:
            pass

    def emit(self, *args: P.args, **kwargs: P.kwargs) -> None:
        for fn in list(self._fns):  # a listener may add or remove listeners while it is told
            try:
                fn(*args, **kwargs)
            except Exception:  # report: one listener failing must not stop the others nor the service
                log.exception("%s: the observer %r failed on %r", self.what, fn, args)

    def __len__(self) -> int:
        return len(self._fns)
