"""Python's cyclic garbage collection, on the GUI thread only.

A collection runs in whichever thread happens to allocate when a generation's
threshold is crossed: in KV Valet that is as often the log reader's thread or an
``asyncio.to_thread`` worker as the GUI thread. A Qt object caught in a reference
cycle is then destroyed in that thread: its timers are stopped and its socket
notifiers unregistered from another thread than theirs, which Qt does not allow,
and the GUI thread's event dispatcher can be left holding a freed object: the next
``processEvents`` crashes. (The test suite crashed so, in pytest-qt's
``processEvents`` between two tests that ran worker threads, in two of three full
runs before this existed; this is the cause we found for it, not one we caught
in the act.)

The well-known remedy for PySide/PyQt programs: turn automatic collection off and
collect from a timer on the GUI thread, with the same thresholds
(:data:`app.ui.app.GC_THRESHOLDS`) deciding which generation is due
(:func:`app.core.gc_moments.due_generation`).
"""

from __future__ import annotations

import gc
import logging

from PySide6.QtCore import QObject, QTimer

from app.core.gc_moments import due_generation

log = logging.getLogger(__name__)

#: how often the GUI thread checks whether a collection is due (ms)
CHECK_INTERVAL_MS = 500


class MainThreadCollector(QObject):
    """While it runs, every cyclic garbage collection happens on the thread that made it."""

    def __init__(self, interval_ms: int = CHECK_INTERVAL_MS, parent: QObject | None = None):
        super().__init__(parent)
        self.thresholds = gc.get_threshold()
        self.collections = [0, 0, 0]  # per generation, made here
        self._was_enabled = gc.isenabled()
        self._timer = QTimer(self)
        self._timer.setObjectName("gc")
        self._timer.setInterval(interval_ms)
        self._timer.timeout.connect(self.check)

    def start(self) -> None:
        gc.disable()
        self._timer.start()

    def stop(self) -> None:
        """Automatic collection as it was before :meth:`start`."""
        self._timer.stop()
        if self._was_enabled:
            gc.enable()

    def check(self) -> int | None:
        """Collect the oldest generation that is due (None: none is); what it freed."""
        generation = due_generation(gc.get_count(), self.thresholds)
        if generation is None:
            return None
        self.collections[generation] += 1
        return gc.collect(generation)
