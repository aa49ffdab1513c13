"""One slot operation per server at a time, queued and visible (as Anki does).

Saves and restores of 100K-token states take minutes; a second click queues
behind the first instead of racing it on the same server.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from app.core.observers import Observers


@dataclass
class Operation:
    id: int
    label: str
    started_at: float | None = None
    future: asyncio.Future = field(default=None, repr=False)  # type: ignore[assignment]


class OperationQueue:
    def __init__(self) -> None:
        self._lock: asyncio.Lock | None = None
        self._ids = itertools.count(1)
        self.pending: list[Operation] = []  # waiting, in order
        self.current: Operation | None = None
        self._listeners: Observers[[]] = Observers("the operation queue changed")

    def on_change(self, cb: Callable[[], None]) -> None:
        self._listeners.add(cb)

    def _changed(self) -> None:
        self._listeners.emit()

    def labels(self) -> list[str]:
        return ([f"▶ {self.current.label}"] if self.current else []) + [op.label for op in self.pending]

    async def run(self, label: str, fn: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``fn`` when every earlier operation has finished."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        op = Operation(next(self._ids), label)
        self.pending.append(op)
        self._changed()
        try:
            async with self._lock:
                self.pending.remove(op)
                self.current = op
                op.started_at = asyncio.get_running_loop().time()
                self._changed()
                return await fn()
        finally:
            if op in self.pending:
                self.pending.remove(op)
            if self.current is op:
                self.current = None
            self._changed()
