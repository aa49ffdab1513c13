"""Work kept off a proxied request's path (issue #38): garbage collections and SQLite's WAL checkpoints
run when the proxy is idle (app.core.gc_moments, app.store.sqlite_file); the proxy calling them only when
nothing is in flight is tested in tests/fake_server/test_proxy_http.py."""

from __future__ import annotations

import gc

import pytest

from app.core.gc_moments import BUSY_GEN0_THRESHOLD, IdleCollections, due_generation
from app.store.sqlite_file import SqliteFile


@pytest.mark.parametrize("counts, due", [((0, 0, 0), None), ((700, 10, 10), None), ((701, 0, 0), 0),
                                         ((701, 11, 0), 1), ((701, 11, 11), 2), ((0, 11, 11), None),
                                         ((701, 3, 11), 0)])
def test_the_generation_due_is_pythons_own_rule(counts, due):
    assert due_generation(counts, (700, 10, 10)) == due


@pytest.fixture
def thresholds():
    before = gc.get_threshold()
    yield before
    gc.set_threshold(*before)


def test_idle_collections_raise_pythons_threshold_and_collect_by_the_old_one(thresholds):
    idle = IdleCollections()
    assert idle.collect_due() is None  # not started: it collects nothing
    gc.set_threshold(700, 10, 10)
    idle.start()
    assert gc.get_threshold() == (BUSY_GEN0_THRESHOLD, 10, 10)  # Python's own collection: a safety net only
    gc.collect()
    assert idle.collect_due() is None  # nothing due
    keep = [[] for _ in range(1500)]  # young container objects: past the old threshold of 700
    assert gc.get_count()[0] > 700
    assert idle.collect_due() is not None and idle.collections == [1, 0, 0]
    assert gc.get_count()[0] < 700
    idle.stop()
    assert gc.get_threshold() == (700, 10, 10) and idle.collect_due() is None
    del keep


class _Blobs(SqliteFile):
    NAME = "the test file"
    SCHEMA_VERSION = 1
    MIGRATIONS = {0: "CREATE TABLE blobs (b BLOB)"}

    def add(self, n_bytes: int) -> None:
        with self._tx() as conn:
            conn.execute("INSERT INTO blobs (b) VALUES (?)", (b"\x5a" * n_bytes,))


def test_a_deferred_checkpoint_waits_for_the_idle_moment_and_then_runs(tmp_path):
    """In WAL mode the main file only grows when a checkpoint copies the log into it: SQLite's own
    checkpoint after 1,000 pages (4 MiB) grows it inside the commit; deferred, only checkpoint_if_due does."""
    with _Blobs(tmp_path / "own.sqlite3") as own:
        size = own.path.stat().st_size
        own.add(6 << 20)
        assert own.path.stat().st_size > size + (5 << 20)  # SQLite checkpointed inside the commit
    with _Blobs(tmp_path / "deferred.sqlite3") as f:
        f.defer_checkpoints()
        size = f.path.stat().st_size
        f.add(6 << 20)
        assert f.path.stat().st_size == size  # the commit ran no checkpoint
        assert f.commits == 1 and not f.checkpoint_if_due(every_commits=2)  # not due yet
        f.add(1024)
        assert f.checkpoint_if_due(every_commits=2) and f.commits == 0
        assert f.path.stat().st_size > size + (5 << 20)
        assert f._conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 4000  # SQLite's own past 16 MiB


def test_without_deferral_there_is_nothing_to_do_at_an_idle_moment(tmp_path):
    with _Blobs(tmp_path / "f.sqlite3") as f:
        for _ in range(3):
            f.add(10)
        assert f.commits == 3 and not f.checkpoint_if_due(every_commits=1)


def test_serve_freezes_the_start_up_and_collects_at_the_proxys_idle_moments(thresholds):
    """What ``kv-valet serve --proxy`` (and tests/bench/bench_proxy.py, on its path) does once the proxy is up."""
    from app.core.gc_moments import collect_between_requests

    registered = []
    idle = collect_between_requests(registered.append)
    try:
        assert gc.get_freeze_count() > 0 and gc.get_threshold()[0] == max(BUSY_GEN0_THRESHOLD, thresholds[0])
        assert registered == [idle.collect_due]
    finally:
        idle.stop()
        gc.unfreeze()
    assert gc.get_threshold() == thresholds


def test_a_prefill_sample_is_written_without_an_fsync_and_the_catalog_stays_full(tmp_path):
    """A prefill sample is written on the event loop for every prompt the server reports: no fsync there,
    while every other write of the catalog still waits for the disk (synchronous FULL)."""
    from app.store.catalog import Catalog

    with Catalog(tmp_path / "catalog.sqlite3") as cat:
        seen = []
        cat._conn.set_trace_callback(seen.append)
        cat.record_prefill("p", 4096, 1500.0)
        cat._conn.set_trace_callback(None)
        assert seen[0] == "PRAGMA synchronous = NORMAL" and seen[-1] == "PRAGMA synchronous = FULL"
        assert cat._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL again
        assert cat.prefill_rate("p") is not None
