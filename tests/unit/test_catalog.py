"""The session catalog: round trips, re-park semantics, learned facts, crash safety."""

from __future__ import annotations

import dataclasses
import sqlite3
import threading

import pytest

from app.core.verdict import VerdictKind
from app.store.catalog import (
    SCHEMA_VERSION,
    Catalog,
    CatalogError,
    HistoryEvent,
    PendingVerdict,
    SessionRecord,
)


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "data" / "catalog.sqlite3"


@pytest.fixture
def cat(db_path):
    with Catalog(db_path) as c:
        yield c


def full_record(name="chat", profile="gemma", **over) -> SessionRecord:
    """A record with every field set to a non-default value."""
    rec = SessionRecord(
        name=name,
        profile=profile,
        state_file=f"{name}.bin",
        save_dir="/data/sessions/gemma",
        sidecar_file=f"{name}.bin.ckpt",
        state_size=123_456_789,
        sidecar_size=4_096,
        n_tokens=8_000,
        save_ms=412.5,
        server_build="b11434-abc",
        model_path="/models/gemma-3-270m.gguf",
        model_size=253_000_000,
        model_sha256="ab" * 32,
        cache_type_k="q8_0",
        cache_type_v="turbo3",
        n_ctx_slot=32_768,
        flash_attn="on",
        swa_full=True,
        memory_kind="sliding-window",
        sidecar_status="present",
        sidecar_reason="3 checkpoints",
        sidecar_count=3,
        slot_id=1,
        created_at=1_700_000_000.5,
        updated_at=1_700_000_001.5,
        last_restore_ms=88.25,
        last_n_restored=7_999,
        last_restore_at=1_700_000_100.0,
        last_verdict="resumed",
        last_verdict_reason="cache_n 7999, prompt_n 3",
        notes="ünïcode notes",
    )
    return dataclasses.replace(rec, **over)


def test_schema_version_and_pragmas(cat, db_path):
    assert SCHEMA_VERSION >= 1
    assert cat.schema_version == SCHEMA_VERSION
    raw = sqlite3.connect(db_path)
    try:
        assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert raw.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal"
    finally:
        raw.close()


def test_newer_schema_is_refused(db_path):
    Catalog(db_path).close()
    raw = sqlite3.connect(db_path)
    raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    raw.commit()
    raw.close()
    with pytest.raises(CatalogError, match="newer"):
        Catalog(db_path)


def test_round_trip_every_field(cat):
    rec = full_record()
    stored = cat.add_or_replace(rec)
    assert stored.id is not None
    got = cat.get("gemma", "chat")
    assert got == dataclasses.replace(rec, id=stored.id)
    assert cat.get_by_id(stored.id) == got
    assert got.swa_full is True
    assert got.state_path.as_posix() == "/data/sessions/gemma/chat.bin"
    # Optional fields survive as None too.
    bare = cat.add_or_replace(SessionRecord(name="b", profile="p", state_file="b.bin", save_dir="/x"))
    again = cat.get_by_id(bare.id)
    assert again.sidecar_file is None and again.last_verdict is None
    assert again.created_at > 0 and again.updated_at > 0
    assert cat.get("gemma", "nope") is None and cat.get_by_id(9999) is None


def test_list_newest_first_and_by_profile(cat):
    cat.add_or_replace(full_record("old", updated_at=100.0))
    cat.add_or_replace(full_record("new", updated_at=300.0))
    cat.add_or_replace(full_record("other", profile="http://host:8080", updated_at=200.0))
    assert [r.name for r in cat.list()] == ["new", "other", "old"]
    assert [r.name for r in cat.list("gemma")] == ["new", "old"]
    assert [r.name for r in cat.list("http://host:8080")] == ["other"]
    # Same name in two profiles is allowed.
    cat.add_or_replace(full_record("old", profile="http://host:8080"))
    assert len(cat.list()) == 4


def test_replace_keeps_id_created_at_and_history(cat):
    first = cat.add_or_replace(full_record(created_at=10.0, updated_at=10.0))
    cat.add_event(HistoryEvent(session_id=first.id, kind="resume", at=20.0, restore_ms=5.0))
    second = cat.add_or_replace(
        full_record(n_tokens=9_000, created_at=30.0, updated_at=30.0, sidecar_file=None)
    )
    assert second.id == first.id
    assert second.created_at == 10.0  # first park time kept
    assert second.updated_at == 30.0
    assert second.n_tokens == 9_000 and second.sidecar_file is None
    assert len(cat.list()) == 1
    assert [e.restore_ms for e in cat.history(first.id)] == [5.0]


def test_a_repark_keeps_what_the_session_earned(cat):
    """A continued session parked again under its own name (quit, park all & stop) keeps its time-saved
    ledger, its last restore and verdict, and the user's notes: the new park brings none of them."""
    fresh = {"last_restore_ms": None, "last_n_restored": None, "last_restore_at": None, "last_verdict": None,
             "last_verdict_reason": None, "notes": "", "time_saved_s": 0.0, "last_time_saved_s": None}
    first = cat.add_or_replace(full_record(**{**fresh, "notes": "the long design chat"}))
    cat.update_restore(first.id, 12.5, 1_000, at=15.0)
    cat.update_verdict(first.id, "HIT", "reused 990 of 1,000 tokens")
    cat.record_time_saved(first.id, 10.2)
    cat.add_event(HistoryEvent(session_id=first.id, kind="resume", at=20.0, restore_ms=5.0))
    before = cat.get_by_id(first.id)
    again = cat.add_or_replace(full_record(n_tokens=9_000, **fresh))  # what a park writes
    assert again.id == first.id and again.n_tokens == 9_000
    assert (again.last_verdict, again.last_verdict_reason) == ("HIT", "reused 990 of 1,000 tokens")
    assert again.time_saved_s == before.time_saved_s == 10.2 and again.last_time_saved_s == 10.2
    assert (again.last_restore_at, again.last_n_restored) == (before.last_restore_at, before.last_n_restored)
    assert again.notes == "the long design chat" and cat.total_time_saved("gemma") == 10.2
    assert [e.kind for e in cat.history(first.id)] == ["resume"]
    # a row that carries its own (a move adopting the source's row) still sets them
    moved = cat.add_or_replace(full_record(n_tokens=9_100, last_verdict="PARTIAL", time_saved_s=3.0, notes="moved"))
    assert (moved.last_verdict, moved.time_saved_s, moved.notes) == ("PARTIAL", 3.0, "moved")


def test_rename_and_conflicts(cat):
    a = cat.add_or_replace(full_record("a"))
    cat.add_or_replace(full_record("b"))
    with pytest.raises(CatalogError) as err:
        cat.rename("gemma", "a", "b")
    assert str(err.value) == "a session named 'b' already exists in profile 'gemma'"
    with pytest.raises(CatalogError, match="no session named 'zzz'"):
        cat.rename("gemma", "zzz", "c")
    renamed = cat.rename("gemma", "a", "c")
    assert renamed.id == a.id and renamed.name == "c"
    assert cat.get("gemma", "a") is None
    assert cat.get("gemma", "c").id == a.id
    # A name used in another profile is no conflict.
    cat.add_or_replace(full_record("d", profile="other"))
    assert cat.rename("gemma", "c", "d").name == "d"


def test_delete_removes_history(cat, db_path):
    rec = cat.add_or_replace(full_record())
    keep = cat.add_or_replace(full_record("keep"))
    cat.add_event(HistoryEvent(session_id=rec.id, kind="check"))
    cat.add_event(HistoryEvent(session_id=keep.id, kind="check"))
    assert cat.delete("gemma", "chat") is True
    assert cat.delete("gemma", "chat") is False
    assert cat.get("gemma", "chat") is None
    assert cat.history(rec.id) == []
    assert len(cat.history(keep.id)) == 1
    raw = sqlite3.connect(db_path)
    try:
        assert raw.execute("SELECT COUNT(*) FROM history").fetchone()[0] == 1
    finally:
        raw.close()


def test_update_restore_and_verdict(cat):
    rec = cat.add_or_replace(full_record(last_restore_ms=None, last_verdict=None))
    cat.update_restore(rec.id, 12.5, 4_000, 1234.0)
    cat.update_verdict(rec.id, VerdictKind.DISCARDED, "cache_n 0: SWA without checkpoints")
    got = cat.get_by_id(rec.id)
    assert (got.last_restore_ms, got.last_n_restored, got.last_restore_at) == (12.5, 4_000, 1234.0)
    assert got.last_verdict is VerdictKind.DISCARDED
    assert got.last_verdict_reason == "cache_n 0: SWA without checkpoints"
    with pytest.raises(CatalogError):
        cat.update_verdict(9999, VerdictKind.HIT, "y")


def test_a_restore_is_noted_in_one_commit(cat):
    """A restore's record (its last restore, its verdict back to UNKNOWN, the resume event, the note for
    whoever judges its first query) is one commit: it sits on the path of a request the proxy restored for.
    Nothing of it lands for an unknown session, or when a part of it fails."""
    rec = cat.add_or_replace(full_record(last_verdict="resumed"))
    older, _ = cat.add_pending_verdict(PendingVerdict(session_id=rec.id, profile="p", slot_id=2, n_restored=10))
    commits = cat.commits
    noted = cat.note_restore(HistoryEvent(session_id=rec.id, kind="resume", at=1234.0, restore_ms=12.5,
                                          details={"slot": 2}), 4_000, "no query on this slot since the restore yet",
                             pending=PendingVerdict(session_id=rec.id, profile="p", slot_id=2, n_restored=4_000),
                             durable=False)
    assert cat.commits == commits + 1
    got = cat.get_by_id(rec.id)
    assert (got.last_restore_ms, got.last_n_restored, got.last_restore_at) == (12.5, 4_000, 1234.0)
    assert got.last_verdict is VerdictKind.UNKNOWN
    assert got.last_verdict_reason == "no query on this slot since the restore yet"
    ev = noted.event
    assert cat.history(rec.id) == [ev] and ev.details == {"slot": 2} and ev.id is not None
    assert cat.pending_verdicts("p", 2) == [noted.pending] and noted.pending.n_restored == 4_000
    assert noted.replaced == [older]  # the older note on the same slot went in the same commit
    with pytest.raises(CatalogError):
        cat.note_restore(HistoryEvent(session_id=9999, kind="resume", at=1.0), 1, "x")
    with pytest.raises(CatalogError):  # a bad event rolls the session's update back too
        cat.note_restore(HistoryEvent(session_id=rec.id, kind="bogus", at=2.0, restore_ms=1.0), 1, "x")
    with pytest.raises(CatalogError):  # so does a pending note for no session
        cat.note_restore(HistoryEvent(session_id=rec.id, kind="resume", at=3.0, restore_ms=2.0), 1, "x",
                         pending=PendingVerdict(session_id=9999, profile="p", slot_id=3))
    assert cat.get_by_id(rec.id).last_restore_ms == 12.5 and len(cat.history(rec.id)) == 1
    assert cat.pending_verdicts("p") == [noted.pending]


def test_history_round_trip_oldest_first(cat):
    rec = cat.add_or_replace(full_record())
    ev = HistoryEvent(
        session_id=rec.id,
        kind="ab",
        at=50.0,
        server_build="b1",
        restore_ms=1.5,
        prompt_ms=720_100.0,
        prompt_n=30_000,
        cache_n=0,
        ttft_ms=720_200.0,
        verdict="sidecar needed",
        reason="without sidecar the prefill ran",
        details={"with": {"prompt_ms": 1000.0}, "without": {"prompt_ms": 720100.0}},
    )
    stored = cat.add_event(ev)
    cat.add_event(HistoryEvent(session_id=rec.id, kind="baseline", at=10.0))
    cat.add_event(HistoryEvent(session_id=rec.id, kind="resume", at=99.0))
    hist = cat.history(rec.id)
    assert [e.kind for e in hist] == ["baseline", "ab", "resume"]
    assert hist[1] == dataclasses.replace(ev, id=stored.id)
    with pytest.raises(CatalogError):
        cat.add_event(HistoryEvent(session_id=rec.id, kind="bogus"))
    with pytest.raises(CatalogError):
        cat.add_event(HistoryEvent(session_id=9999, kind="check"))


def test_build_persistence_logic(cat):
    assert cat.build_persists_checkpoints("b1") is None
    # Dense parks tell nothing.
    cat.record_sidecar_observation("b1", False, "dense")
    cat.record_sidecar_observation("b1", False, "dense")
    assert cat.build_persists_checkpoints("b1") is None
    # An SWA park with checkpoints and no sidecar: the build does not persist them.
    cat.record_sidecar_observation("b1", False, "sliding-window")
    assert cat.build_persists_checkpoints("b1") is False
    # Once one sidecar is written, it does (forever).
    cat.record_sidecar_observation("b1", True, "recurrent-hybrid")
    cat.record_sidecar_observation("b1", False, "sliding-window")
    assert cat.build_persists_checkpoints("b1") is True
    # Builds are independent.
    assert cat.build_persists_checkpoints("b2") is None


def test_the_prefill_rate_is_read_again_once_any_connection_wrote(cat, db_path, monkeypatch):
    """It is asked on a proxied request's path: kept while the file is unchanged, read again after a
    sample this connection or another process wrote."""
    cat.record_prefill("p", 1000, 1000.0)
    assert cat.prefill_rate("p") == 1000.0
    reads = []
    real = cat._read
    monkeypatch.setattr(cat, "_read", lambda sql, args=(): reads.append(sql) or real(sql, args))
    assert cat.prefill_rate("p") == 1000.0 and reads == []  # nothing written since
    with Catalog(db_path) as other:  # another process's connection
        other.record_prefill("p", 3000, 1000.0)
    assert cat.prefill_rate("p") == 2000.0 and len(reads) == 1
    cat.record_prefill("p", 4000, 1000.0)
    assert cat.prefill_rate("p") == 3000.0 and len(reads) == 2
    assert cat.prefill_rate("q") is None


def test_prefill_rate_ignores_noise_and_uses_median(cat):
    assert cat.prefill_rate("p") is None
    cat.record_prefill("p", 10, 1.0)  # too few tokens
    cat.record_prefill("p", 1000, 0.0)  # no time
    cat.record_prefill("p", 1000, -5.0)
    assert cat.prefill_rate("p") is None
    cat.record_prefill("p", 1000, 1000.0)  # 1000 t/s
    cat.record_prefill("p", 2000, 1000.0)  # 2000 t/s
    cat.record_prefill("p", 1000, 100_000.0)  # 10 t/s outlier
    assert cat.prefill_rate("p") == pytest.approx(1000.0)
    assert cat.prefill_rate("other") is None
    # Only the last 20 samples count.
    for _ in range(20):
        cat.record_prefill("p", 5000, 1000.0)
    assert cat.prefill_rate("p") == pytest.approx(5000.0)


def test_pending_journal(cat):
    assert cat.list_pending() == []
    a = cat.add_pending("park", {"state": "/x/a.bin", "tmp": "/x/a.bin.part"})
    b = cat.add_pending("ab-sidecar-aside", {"from": "/x/a.bin.ckpt", "to": "/x/a.bin.ckpt.aside"})
    items = cat.list_pending()
    assert [(i, k) for i, k, _, _ in items] == [(a, "park"), (b, "ab-sidecar-aside")]
    assert items[1][2] == {"from": "/x/a.bin.ckpt", "to": "/x/a.bin.ckpt.aside"}
    assert items[0][3] > 0
    cat.remove_pending(a)
    assert [i for i, *_ in cat.list_pending()] == [b]


def test_reopen_keeps_everything(db_path):
    with Catalog(db_path) as c:
        rec = c.add_or_replace(full_record())
        c.add_event(HistoryEvent(session_id=rec.id, kind="resume", details={"k": [1, 2]}))
        c.record_sidecar_observation("b1", True, "sliding-window")
        c.record_prefill("gemma", 512, 256.0)
        pid = c.add_pending("park", {"name": "chat"})
    with Catalog(db_path) as c:  # "app restart"
        assert c.get("gemma", "chat") == rec
        assert c.history(rec.id)[0].details == {"k": [1, 2]}
        assert c.build_persists_checkpoints("b1") is True
        assert c.prefill_rate("gemma") == pytest.approx(2000.0)
        assert c.list_pending()[0][:3] == (pid, "park", {"name": "chat"})
        assert c.schema_version == SCHEMA_VERSION


class _FailingConn:
    """Wraps the sqlite connection; raises when a statement matching ``trigger`` runs."""

    def __init__(self, conn, trigger):
        self._conn, self._trigger = conn, trigger

    def execute(self, sql, *args):
        if self._trigger in sql:
            raise RuntimeError("simulated crash mid-transaction")
        return self._conn.execute(sql, *args)

    def __getattr__(self, name):
        return getattr(self._conn, name)


def test_failure_mid_delete_leaves_no_half_record(cat, monkeypatch):
    rec = cat.add_or_replace(full_record())
    cat.add_event(HistoryEvent(session_id=rec.id, kind="check"))
    # History is deleted first, then the session row fails: all must roll back.
    monkeypatch.setattr(cat, "_conn", _FailingConn(cat._conn, "DELETE FROM sessions"))
    with pytest.raises(RuntimeError):
        cat.delete("gemma", "chat")
    monkeypatch.undo()
    assert cat.get("gemma", "chat") == rec
    assert len(cat.history(rec.id)) == 1
    # The connection is usable afterwards (no transaction left open).
    assert cat.delete("gemma", "chat") is True


def test_failure_mid_add_leaves_no_row(cat, db_path, monkeypatch):
    # The INSERT succeeds, then reading it back inside the transaction fails.
    def boom(row):
        raise RuntimeError("simulated crash after insert")

    monkeypatch.setattr(Catalog, "_to_record", staticmethod(boom))
    with pytest.raises(RuntimeError):
        cat.add_or_replace(full_record())
    monkeypatch.undo()
    assert cat.list() == []
    # A replace interrupted the same way leaves the old row untouched.
    old = cat.add_or_replace(full_record(n_tokens=1))
    monkeypatch.setattr(Catalog, "_to_record", staticmethod(boom))
    with pytest.raises(RuntimeError):
        cat.add_or_replace(full_record(n_tokens=2))
    monkeypatch.undo()
    assert cat.get("gemma", "chat").n_tokens == 1 == old.n_tokens
    # And another connection never saw a half-written record.
    raw = sqlite3.connect(db_path)
    try:
        assert raw.execute("SELECT n_tokens FROM sessions").fetchall() == [(1,)]
    finally:
        raw.close()


def test_threads_share_one_catalog(cat):
    rec = cat.add_or_replace(full_record())
    errors = []

    def worker(n):
        try:
            for i in range(20):
                cat.add_event(HistoryEvent(session_id=rec.id, kind="resume", at=float(n * 100 + i + 1)))
                cat.list()
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(cat.history(rec.id)) == 80
