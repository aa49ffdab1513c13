"""The conversation store: round trips, requests and slot timelines, cascades, the file itself."""

from __future__ import annotations

import sqlite3
import stat
import threading

import pytest

from app.core import conversation as model
from app.proxy.lease_journal import open_conversation_store
from app.core.conversation import Cause, Conversation, Explanation, Message, RequestRecord
from app.core.verdict import VerdictKind
from app.store.conversations import (
    SCHEMA_VERSION,
    ConversationStore,
    ConversationStoreError,
    JournalEntry,
)


@pytest.fixture
def path(tmp_path):
    return tmp_path / "data" / "conversations.sqlite3"


@pytest.fixture
def store(path):
    with open_conversation_store(path) as s:
        yield s


def full_conversation(cid="conv-1", **over) -> Conversation:
    conv = Conversation(
        id=cid,
        setup="fp-abc",
        chain=["h1", "h2", "h3"],
        messages=[Message("system", "be brief"), Message("user", "hi", name="alice"),
                  Message("assistant", "hello", reasoning="greet back"),
                  Message("tool", '{"ok": true}', name="call_1")],
        hint="client-7",
        slot=1,
        n_tokens=4321,
        parked_as=f"proxy-{cid}",
        last_used=1_700_000_100.5,
        last_verdict=VerdictKind.PARTIAL,
        requests=7,
        time_saved_s=12.25,
    )
    for k, v in over.items():
        setattr(conv, k, v)
    return conv


def record(at: float, conv: str | None = "conv-1", slot: int | None = 1, **over) -> RequestRecord:
    values = dict(at=at, conversation=conv, slot=slot, path="/v1/chat/completions", stream=True, cache_n=4000,
                  prompt_n=321, prompt_ms=88.5, predicted_n=64, expected_reuse=4300,
                  verdict=VerdictKind.PARTIAL,
                  explanation=Explanation(Cause.EARLIER_MESSAGE_EDITED, "message 3 (user) differs at character 12",
                                          first_divergent_message=3, first_divergent_token=4000),
                  restored_from="proxy-conv-1", wasted_ms=12.5)
    values.update(over)
    return RequestRecord(**values)


def test_a_conversation_round_trips_every_field(store):
    conv = full_conversation()
    store.save(conv, "gemma")
    assert store.get("conv-1") == conv
    assert store.profile_of("conv-1") == "gemma"
    assert store.get("nope") is None


def test_a_bare_conversation_round_trips(store):
    conv = Conversation(id="bare", setup="")
    store.save(conv, "gemma")
    assert store.get("bare") == conv


def test_save_replaces_and_keeps_creation_time(store):
    conv = full_conversation()
    store.save(conv, "gemma")
    created = store._read("SELECT created_at FROM conversations")[0]["created_at"]
    conv.chain.append("h4")
    conv.messages.append(Message("user", "more"))
    conv.slot = None
    conv.parked_as = None
    conv.last_verdict = None
    store.save(conv, "gemma")
    assert store.get("conv-1") == conv
    assert store._read("SELECT created_at FROM conversations")[0]["created_at"] == created


def test_list_is_most_recent_first_and_filters_by_profile(store):
    store.save(full_conversation("a", last_used=10.0), "gemma")
    store.save(full_conversation("b", last_used=30.0), "qwen")
    store.save(full_conversation("c", last_used=20.0), "gemma")
    assert [c.id for c in store.list()] == ["b", "c", "a"]
    assert [c.id for c in store.list("gemma")] == ["c", "a"]
    assert store.list("other") == []


def test_requests_round_trip_most_recent_first(store):
    store.save(full_conversation(), "gemma")
    recs = [record(100.0), record(101.0, verdict=VerdictKind.HIT, explanation=None, restored_from=None,
                                  wasted_ms=None, cache_n=None, prompt_n=None, prompt_ms=None,
                                  predicted_n=None, stream=False, slot=None),
            record(102.0, verdict=VerdictKind.MISS,
                   explanation=Explanation(Cause.SLOT_TAKEN, "conversation B used slot 1 meanwhile"))]
    for r in recs:
        store.add_request("conv-1", r)
    assert store.requests("conv-1") == list(reversed(recs))
    assert store.requests("conv-1", limit=2) == [recs[2], recs[1]]
    assert store.requests("nope") == []


def test_a_request_needs_its_conversation(store):
    with pytest.raises(ConversationStoreError, match="no conversation"):
        store.add_request("ghost", record(1.0, conv="ghost"))


def test_slot_timeline_shows_who_used_a_slot(store):
    store.save(full_conversation("a"), "gemma")
    store.save(full_conversation("b"), "gemma")
    store.save(full_conversation("q"), "qwen")  # another server's slot 1
    store.add_request("a", record(1.0, conv="a", slot=1))
    store.add_request("b", record(2.0, conv="b", slot=1))
    store.add_request("a", record(3.0, conv="a", slot=0))
    store.add_request("q", record(4.0, conv="q", slot=1))
    store.add_request("a", record(5.0, conv="a", slot=1))
    timeline = store.slot_timeline("gemma", 1)
    assert [(cid, r.at) for cid, r in timeline] == [("a", 5.0), ("b", 2.0), ("a", 1.0)]
    assert timeline[1][1] == record(2.0, conv="b", slot=1)
    assert [cid for cid, _ in store.slot_timeline("gemma", 1, limit=1)] == ["a"]


def test_forget_cascades_to_its_requests(store):
    store.save(full_conversation("a"), "gemma")
    store.save(full_conversation("b"), "gemma")
    store.add_request("a", record(1.0, conv="a"))
    store.add_request("b", record(2.0, conv="b"))
    gone = store.forget("a")
    assert gone == full_conversation("a")
    assert store.get("a") is None and store.requests("a") == []
    assert store._read("SELECT COUNT(*) AS n FROM requests WHERE conversation_id = 'a'")[0]["n"] == 0
    assert len(store.requests("b")) == 1
    assert store.forget("a") is None


def test_journal_writes_lease_fields_with_the_entry(store):
    conv = full_conversation("a")
    store.save(conv, "gemma")
    conv.slot, conv.parked_as, conv.n_tokens = None, "proxy-a", 99
    conv.messages = []  # a lease change does not rewrite the messages
    store.journal(JournalEntry("gemma", "saved", slot=1, conversation="a", park="proxy-a", n_tokens=99,
                               state="idle-clean"), conversations=[conv])
    stored = store.get("a")
    assert (stored.slot, stored.parked_as, stored.n_tokens) == (None, "proxy-a", 99)
    assert stored.messages == full_conversation("a").messages
    new = Conversation(id="n", setup="s", slot=0)  # not stored yet: stored whole
    store.journal(JournalEntry("gemma", "acquired", slot=0, conversation="n", state="busy"), conversations=[new])
    assert store.get("n") == new and store.profile_of("n") == "gemma"
    [e1, e2] = store.journal_entries("gemma")
    assert (e1.event, e1.slot, e1.park, e1.state, e2.event) == ("saved", 1, "proxy-a", "idle-clean", "acquired")
    assert store.journal_entries("other") == [] and store.journal_entries("gemma", after_id=e1.id) == [e2]
    assert [p.conversation for p in store.parks("gemma")] == ["a"]
    assert store.in_slots("gemma") == ["n"]
    store.rewrite_journal("gemma", [JournalEntry("gemma", "recovered")])
    assert [e.event for e in store.journal_entries("gemma")] == ["recovered"]


def test_a_failed_journal_write_leaves_nothing(store):
    conv = full_conversation("a")
    store.save(conv, "gemma")
    conv.slot = 0
    bad = JournalEntry("gemma", None)  # event NOT NULL: the insert fails after the update
    with pytest.raises(sqlite3.IntegrityError):
        store.journal(bad, conversations=[conv])
    assert store.get("a").slot == 1 and store.journal_entries("gemma") == []


def test_the_file_is_private_wal_and_versioned(path, store):
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert store.schema_version == SCHEMA_VERSION == 2
    assert store._read("PRAGMA journal_mode")[0][0] == "wal"
    assert store._read("PRAGMA foreign_keys")[0][0] == 1


def test_a_newer_file_is_refused(path):
    with open_conversation_store(path):
        pass
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(ConversationStoreError, match="newer KV Valet"):
        open_conversation_store(path)


def test_default_path_is_in_the_data_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("KV_VALET_DATA_DIR", str(tmp_path / "d"))
    with ConversationStore(values=model) as s:
        assert s.path == tmp_path / "d" / "conversations.sqlite3"
        assert s.path.exists()


def test_threads_share_one_store(store):
    store.save(full_conversation("a"), "gemma")
    errors = []

    def work(k: int) -> None:
        try:
            for i in range(20):
                store.add_request("a", record(k * 100 + i, conv="a"))
                store.requests("a", limit=5)
        except Exception as e:  # report: collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(store.requests("a")) == 80


def test_every_verdict_word_stored_reads_back_as_itself_and_an_unknown_one_as_unknown(store, path):
    """The proxy's words (HIT, PARTIAL, MISS, NEW) were stored before the one judge; DISCARDED and
    UNKNOWN since: all read back, and a word a later version might write reads as UNKNOWN."""
    store.save(full_conversation(last_verdict=VerdictKind.DISCARDED), "gemma")
    for i, kind in enumerate(VerdictKind):
        store.add_request("conv-1", record(float(i), verdict=kind))
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE requests SET verdict = 'SOMETHING NEW' WHERE at = 0.0")
    assert store.get("conv-1").last_verdict is VerdictKind.DISCARDED
    read = {r.at: r.verdict for r in store.requests("conv-1")}
    assert [read[float(i)] for i in range(len(VerdictKind))] == [VerdictKind.UNKNOWN, *list(VerdictKind)[1:]]
