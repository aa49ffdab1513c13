"""Garbage with Qt objects in it is collected on the GUI thread only (app.ui.collector)."""

from __future__ import annotations

import gc
import threading
import weakref

from PySide6.QtCore import QObject

from app.ui.collector import MainThreadCollector


def churn() -> None:
    """A worker thread's allocations: enough to cross generation 0's threshold many times over."""
    kept = [[] for _ in range(100_000)]  # containers kept alive: each allocation counts towards a collection
    del kept


def cycle() -> weakref.ref:
    obj = QObject()
    obj.me = obj  # a reference cycle only the cyclic collector frees
    return weakref.ref(obj)


def test_a_worker_thread_never_frees_a_qt_object_while_the_collector_runs(qtbot):
    was_enabled = gc.isenabled()  # (the suite's own collector runs for every Qt test: tests/conftest.py)
    collector = MainThreadCollector(interval_ms=20)
    collector.thresholds = (0, 10**9, 10**9)  # generation 0 is due at every check
    collector.start()
    try:
        assert not gc.isenabled()
        ref = cycle()
        worker = threading.Thread(target=churn)
        worker.start()
        worker.join()
        assert ref() is not None  # the worker's allocations did not collect it
        qtbot.waitUntil(lambda: ref() is None)  # the collector's timer on this thread did
        assert collector.collections[0] >= 1
    finally:
        collector.stop()
    assert gc.isenabled() is was_enabled


def test_without_it_the_worker_thread_is_the_one_that_frees_it():
    """What the collector prevents: automatic collection runs in whichever thread allocates. (Automatic
    collection turned on here: the suite turns it off for a test that uses no Qt once Qt is loaded,
    tests/conftest.py, for this very reason.)"""
    was_enabled = gc.isenabled()
    gc.enable()
    try:
        freed_in: list[str] = []
        ref = cycle()
        weakref.finalize(ref(), lambda: freed_in.append(threading.current_thread().name))
        worker = threading.Thread(target=churn, name="worker")
        worker.start()
        worker.join()
        assert freed_in == ["worker"]
    finally:
        if not was_enabled:
            gc.disable()


def test_a_due_generation_is_collected_and_none_when_none_is():
    collector = MainThreadCollector()
    collector.thresholds = (10**9, 10**9, 10**9)
    assert collector.check() is None and collector.collections == [0, 0, 0]
    collector.thresholds = (-1, -1, 10**9)
    assert collector.check() is not None and collector.collections == [0, 1, 0]
