"""Python's cyclic garbage collection at moments KV Valet chooses, not wherever an allocation crosses a
threshold.

Two owners use it:

* the window collects on the GUI thread, from a timer (:class:`app.ui.collector.MainThreadCollector`: a
  Qt object destroyed in a worker thread's collection crashes Qt);
* ``kv-valet serve --proxy`` collects when the proxy is idle, between requests (:class:`IdleCollections`):
  an automatic collection lands inside a request. Measured on ``tests/bench/bench_proxy.py``'s traffic
  (16 conversations over 4 slots, 960 turns of up to ~6,000 tokens): 31 generation-1 collections, p50
  3.9 ms and up to 15 ms, and 3 full ones of 20-33 ms, inside requests: the proxy's p99.

Both decide which generation is due the same way, by Python's own thresholds (:func:`due_generation`).
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)

#: while :class:`IdleCollections` runs, Python's own first-generation threshold: a safety net for a proxy
#: that is never idle (about 70 times the default 700 objects: megabytes of young objects at most)
BUSY_GEN0_THRESHOLD = 50_000


def due_generation(counts: tuple[int, int, int], thresholds: tuple[int, ...]) -> int | None:
    """The oldest generation a collection is due for by ``thresholds`` (``gc.get_threshold()``'s
    meaning: a generation is due once its count passed its threshold and every younger one's did);
    None: none is."""
    generation = None
    for g in range(3):
        if counts[g] > thresholds[g]:
            generation = g
        else:
            break
    return generation


class IdleCollections:
    """Collections between requests: while it runs, Python collects by itself only past
    :data:`BUSY_GEN0_THRESHOLD` young objects, and :meth:`collect_due` (called when nothing is in
    flight) runs what Python's thresholds of before :meth:`start` say is due."""

    def __init__(self, busy_gen0: int = BUSY_GEN0_THRESHOLD):
        self.busy_gen0 = busy_gen0
        self.thresholds: tuple[int, ...] = gc.get_threshold()
        self.collections = [0, 0, 0]  # per generation, made by collect_due
        self.running = False

    def start(self) -> None:
        if self.running:
            return
        self.thresholds = gc.get_threshold()
        gc.set_threshold(max(self.busy_gen0, self.thresholds[0]), *self.thresholds[1:])
        self.running = True

    def stop(self) -> None:
        """Python's thresholds as they were before :meth:`start`."""
        if self.running:
            gc.set_threshold(*self.thresholds)
            self.running = False

    def collect_due(self) -> int | None:
        """Collect the oldest generation that is due (None: none is, or not running); what it freed."""
        if not self.running:
            return None
        generation = due_generation(gc.get_count(), self.thresholds)
        if generation is None:
            return None
        self.collections[generation] += 1
        return gc.collect(generation)


def collect_between_requests(on_idle) -> IdleCollections:
    """What ``kv-valet serve --proxy`` does once its proxy is up: what the start-up made (modules, the
    stores, the server's plan) frozen out of the collector's way, so that a full collection does not walk
    it, and the collections run when the proxy is idle: ``on_idle`` registers a callback for those
    moments (``ProxyService.on_idle``). Stop it with :meth:`IdleCollections.stop`."""
    gc.collect()
    gc.freeze()
    idle = IdleCollections()
    idle.start()
    on_idle(idle.collect_due)
    return idle
