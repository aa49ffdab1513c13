"""The proxy's conversations: what each one holds, its judged requests, and the slot lease journal.

Its own SQLite file (``<data>/conversations.sqlite3``), stdlib ``sqlite3`` only, built the way
the session catalog is (app.store.catalog): WAL, one connection guarded by a lock (the window's
thread and asyncio's), every write one explicit ``BEGIN IMMEDIATE`` transaction, the schema
version in ``PRAGMA user_version`` (a file from a newer app is refused, not guessed at), and the
file 0600 in a 0700 folder (conversations are prompts).

The value types (Conversation, RequestRecord, …) live in ``app.core.conversation`` (below this
layer); a test may hand another module of the same shape in (``values=``). Verdicts are stored
as their words (:class:`app.core.verdict.VerdictKind`: HIT, PARTIAL, DISCARDED, MISS, NEW,
UNKNOWN); every word stored before reads back as itself, a word this version does not know as
UNKNOWN.

The lease journal (table ``lease_journal``) is written by app.proxy.leases before every backend
call that depends on a slot's state ("slot 1: saving conv X", then "saved"), in the same
transaction as the conversations the change touches, so a crash leaves a record to recover from.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Protocol

from app.core.verdict import VerdictKind
from app.store.sqlite_file import SqliteFile

SCHEMA_VERSION = 2

FILE_NAME = "conversations.sqlite3"


class ConversationStoreError(Exception):
    """A conversation store operation that cannot be done (a newer file, a full disk, an unknown id)."""


class ProxyValues(Protocol):
    """What the store needs of ``app.core.conversation``: the module itself satisfies it."""

    Conversation: Any
    Message: Any
    RequestRecord: Any
    Explanation: Any
    Cause: Any


@dataclass(frozen=True)
class JournalEntry:
    """One line of the slot lease journal.

    ``state`` is the slot's state after the event (the value of app.proxy.lease_table.SlotState),
    ``conversation`` the conversation it concerns (the slot's holder for a slot event), ``park``
    the parked session's name for a save/restore/deletion.
    """

    profile: str
    event: str
    slot: int | None = None
    conversation: str | None = None
    park: str | None = None
    n_tokens: int | None = None
    state: str | None = None
    detail: str = ""
    at: float = 0.0
    id: int | None = None


@dataclass(frozen=True)
class ParkInfo:
    """A parked conversation, without its messages (what a disk budget needs)."""

    conversation: str
    parked_as: str
    last_used: float
    slot: int | None


# --------------------------------------------------------------------------- schema

_SCHEMA_V1 = """
CREATE TABLE conversations (
    id TEXT PRIMARY KEY,
    setup TEXT NOT NULL DEFAULT '',
    profile TEXT NOT NULL DEFAULT '',
    chain TEXT NOT NULL DEFAULT '[]',
    messages TEXT NOT NULL DEFAULT '[]',
    hint TEXT,
    slot INTEGER,
    n_tokens INTEGER NOT NULL DEFAULT 0,
    parked_as TEXT,
    last_used REAL NOT NULL DEFAULT 0,
    last_verdict TEXT,
    requests INTEGER NOT NULL DEFAULT 0,
    time_saved_s REAL NOT NULL DEFAULT 0,
    created_at REAL NOT NULL
);
CREATE INDEX conversations_profile ON conversations(profile, last_used);
CREATE TABLE requests (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    at REAL NOT NULL,
    slot INTEGER,
    path TEXT NOT NULL DEFAULT '',
    stream INTEGER NOT NULL DEFAULT 0,
    cache_n INTEGER,
    prompt_n INTEGER,
    prompt_ms REAL,
    predicted_n INTEGER,
    expected_reuse INTEGER NOT NULL DEFAULT 0,
    verdict TEXT NOT NULL,
    cause TEXT,
    detail TEXT,
    first_divergent_message INTEGER,
    first_divergent_token INTEGER,
    restored_from TEXT,
    wasted_ms REAL
);
CREATE INDEX requests_conversation ON requests(conversation_id, at);
CREATE INDEX requests_slot ON requests(slot, at);
CREATE TABLE lease_journal (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    profile TEXT NOT NULL,
    at REAL NOT NULL,
    event TEXT NOT NULL,
    slot INTEGER,
    conversation_id TEXT,
    park TEXT,
    n_tokens INTEGER,
    state TEXT,
    detail TEXT NOT NULL DEFAULT ''
);
CREATE INDEX lease_journal_profile ON lease_journal(profile, id)
"""

# v2: the token texts at a request's first divergent token (the slot's, the request's)
_V2 = """
ALTER TABLE requests ADD COLUMN held_token TEXT;
ALTER TABLE requests ADD COLUMN sent_token TEXT
"""

#: _MIGRATIONS[n] takes a file at version n to version n + 1.
_MIGRATIONS: dict[int, str] = {0: _SCHEMA_V1, 1: _V2}


def _enum(kind: Any, text: str | None, fallback: Any) -> Any:
    """``text`` as a member of ``kind``, by name first (stable), then by value; else ``fallback``."""
    if text is None:
        return None
    member = getattr(kind, "__members__", {}).get(text)
    if member is not None:
        return member
    try:
        return kind(text)
    except ValueError:
        return fallback


@dataclass(frozen=True)
class _Explained:
    """A request record with only its explanation (what :meth:`ConversationStore.set_explanation` writes)."""

    explanation: Any
    at: float = 0.0
    slot: int | None = None
    path: str = ""
    stream: bool = False
    cache_n: int | None = None
    prompt_n: int | None = None
    prompt_ms: float | None = None
    predicted_n: int | None = None
    expected_reuse: int = 0
    verdict: str = ""
    restored_from: str | None = None
    wasted_ms: float | None = None


class ConversationStore(SqliteFile):
    """The proxy's conversations, their requests and the slot lease journal (one SQLite file)."""

    NAME = "the conversation store"
    SHORT_NAME = "the conversation store"
    ERROR = ConversationStoreError
    SCHEMA_VERSION = SCHEMA_VERSION
    MIGRATIONS = _MIGRATIONS

    def __init__(self, path: str | Path | None = None, *, values: ProxyValues | None = None) -> None:
        from app import paths

        if values is None:
            from app.core import conversation as values  # the value types, below the store
        self._v = values
        super().__init__(path if path is not None else paths.data_dir() / FILE_NAME)

    # -- conversions

    def _conv_values(self, conv: Any, profile: str, created_at: float) -> dict[str, Any]:
        return {
            "id": conv.id,
            "setup": conv.setup,
            "profile": profile,
            "chain": json.dumps(list(conv.chain)),
            "messages": json.dumps([{"role": m.role, "content": m.content, "reasoning": m.reasoning,
                                     "name": m.name} for m in conv.messages]),
            "hint": conv.hint,
            "slot": conv.slot,
            "n_tokens": int(conv.n_tokens),
            "parked_as": conv.parked_as,
            "last_used": float(conv.last_used),
            "last_verdict": None if conv.last_verdict is None else str(conv.last_verdict),
            "requests": int(conv.requests),
            "time_saved_s": float(conv.time_saved_s),
            "created_at": created_at,
        }

    def _to_conversation(self, row: sqlite3.Row) -> Any:
        v = self._v
        messages = [v.Message(role=m.get("role", ""), content=m.get("content", ""),
                              reasoning=m.get("reasoning", ""), name=m.get("name", ""))
                    for m in json.loads(row["messages"] or "[]")]
        return v.Conversation(
            id=row["id"], setup=row["setup"], chain=list(json.loads(row["chain"] or "[]")), messages=messages,
            hint=row["hint"], slot=row["slot"], n_tokens=row["n_tokens"], parked_as=row["parked_as"],
            last_used=row["last_used"],
            last_verdict=_enum(VerdictKind, row["last_verdict"], None),
            requests=row["requests"], time_saved_s=row["time_saved_s"])

    def _request_values(self, conv_id: str, rec: Any) -> dict[str, Any]:
        ex = rec.explanation
        return {
            "conversation_id": conv_id, "at": float(rec.at), "slot": rec.slot, "path": rec.path,
            "stream": int(bool(rec.stream)), "cache_n": rec.cache_n, "prompt_n": rec.prompt_n,
            "prompt_ms": rec.prompt_ms, "predicted_n": rec.predicted_n, "expected_reuse": int(rec.expected_reuse),
            "verdict": str(rec.verdict),
            "cause": None if ex is None else ex.cause.name,
            "detail": None if ex is None else ex.detail,
            "first_divergent_message": None if ex is None else ex.first_divergent_message,
            "first_divergent_token": None if ex is None else ex.first_divergent_token,
            "held_token": None if ex is None else ex.held_token,
            "sent_token": None if ex is None else ex.sent_token,
            "restored_from": rec.restored_from, "wasted_ms": rec.wasted_ms,
        }

    def _to_request(self, row: sqlite3.Row) -> Any:
        v = self._v
        explanation = None
        if row["cause"] is not None:
            explanation = v.Explanation(
                cause=_enum(v.Cause, row["cause"], v.Cause.UNKNOWN), detail=row["detail"] or "",
                first_divergent_message=row["first_divergent_message"],
                first_divergent_token=row["first_divergent_token"], held_token=row["held_token"],
                sent_token=row["sent_token"])
        return v.RequestRecord(
            at=row["at"], conversation=row["conversation_id"], slot=row["slot"], path=row["path"],
            stream=bool(row["stream"]), cache_n=row["cache_n"], prompt_n=row["prompt_n"],
            prompt_ms=row["prompt_ms"], predicted_n=row["predicted_n"], expected_reuse=row["expected_reuse"],
            verdict=_enum(VerdictKind, row["verdict"], VerdictKind.UNKNOWN), explanation=explanation,
            restored_from=row["restored_from"], wasted_ms=row["wasted_ms"])

    def _upsert(self, conn: sqlite3.Connection, conv: Any, profile: str) -> None:
        values = self._conv_values(conv, profile, time.time())
        cols = ", ".join(values)
        marks = ", ".join("?" for _ in values)
        # created_at is kept from the first save: the update leaves it out
        sets = ", ".join(f"{c} = excluded.{c}" for c in values if c not in ("id", "created_at"))
        conn.execute(f"INSERT INTO conversations ({cols}) VALUES ({marks}) ON CONFLICT(id) DO UPDATE SET {sets}",
                     tuple(values.values()))

    def _update_lease_fields(self, conn: sqlite3.Connection, conv: Any, profile: str) -> None:
        """What the leases change (slot, tokens, park, last use): a conversation not stored yet is stored
        whole; a stored one keeps its messages as they were written (a lease change does not rewrite them)."""
        cur = conn.execute("UPDATE conversations SET slot = ?, n_tokens = ?, parked_as = ?, last_used = ? "
                           "WHERE id = ?", (conv.slot, int(conv.n_tokens), conv.parked_as, float(conv.last_used),
                                            conv.id))
        if cur.rowcount == 0:
            self._upsert(conn, conv, profile)

    # -- conversations

    def save(self, conv: Any, profile: str) -> None:
        """Store ``conv`` (insert, or replace every field of the stored one but its creation time)."""
        with self._tx() as conn:
            self._upsert(conn, conv, profile)

    def get(self, conv_id: str) -> Any | None:
        rows = self._read("SELECT * FROM conversations WHERE id = ?", (conv_id,))
        return self._to_conversation(rows[0]) if rows else None

    def profile_of(self, conv_id: str) -> str | None:
        rows = self._read("SELECT profile FROM conversations WHERE id = ?", (conv_id,))
        return rows[0]["profile"] if rows else None

    def list(self, profile: str | None = None) -> list[Any]:
        """Conversations, most recently used first (all profiles when ``profile`` is None)."""
        order = " ORDER BY last_used DESC, created_at DESC, id"
        if profile is None:
            rows = self._read("SELECT * FROM conversations" + order)
        else:
            rows = self._read("SELECT * FROM conversations WHERE profile = ?" + order, (profile,))
        return [self._to_conversation(r) for r in rows]

    def forget(self, conv_id: str) -> Any | None:
        """Delete a conversation and its requests (ON DELETE CASCADE); the one it was, or None.
        Its park (a file in the server's --slot-save-path) is the caller's to delete."""
        with self._tx() as conn:
            row = conn.execute("SELECT * FROM conversations WHERE id = ?", (conv_id,)).fetchone()
            if row is None:
                return None
            conn.execute("DELETE FROM conversations WHERE id = ?", (conv_id,))
        return self._to_conversation(row)

    def parks(self, profile: str) -> list[ParkInfo]:
        """The parked conversations of ``profile``, least recently used first (no messages read)."""
        rows = self._read("SELECT id, parked_as, last_used, slot FROM conversations "
                          "WHERE profile = ? AND parked_as IS NOT NULL ORDER BY last_used, id", (profile,))
        return [ParkInfo(r["id"], r["parked_as"], r["last_used"], r["slot"]) for r in rows]

    def in_slots(self, profile: str) -> list[str]:
        """Ids of the conversations of ``profile`` stored as holding a slot."""
        rows = self._read("SELECT id FROM conversations WHERE profile = ? AND slot IS NOT NULL ORDER BY id",
                          (profile,))
        return [r["id"] for r in rows]

    # -- requests

    def add_request(self, conv_id: str, rec: Any) -> int:
        """Store one judged request of a stored conversation; its row id."""
        values = self._request_values(conv_id, rec)
        with self._tx() as conn:
            if conn.execute("SELECT 1 FROM conversations WHERE id = ?", (conv_id,)).fetchone() is None:
                raise ConversationStoreError(f"no conversation {conv_id!r}: save it before its requests")
            cur = conn.execute(f"INSERT INTO requests ({', '.join(values)}) VALUES "
                               f"({', '.join('?' for _ in values)})", tuple(values.values()))
            return cur.lastrowid

    def set_explanation(self, request_id: int, explanation: Any) -> bool:
        """Replace the explanation of the stored request ``request_id`` (the first divergent token found
        after the request was recorded); False when the request is gone (its conversation forgotten)."""
        values = self._request_values("", _Explained(explanation))
        cols = ("cause", "detail", "first_divergent_message", "first_divergent_token", "held_token", "sent_token")
        with self._tx() as conn:
            cur = conn.execute(f"UPDATE requests SET {', '.join(f'{c} = ?' for c in cols)} WHERE id = ?",
                               (*(values[c] for c in cols), int(request_id)))
            return cur.rowcount > 0

    def requests(self, conv_id: str, limit: int | None = None) -> list[Any]:
        """A conversation's requests, most recent first (the ``limit`` most recent)."""
        sql = "SELECT * FROM requests WHERE conversation_id = ? ORDER BY at DESC, id DESC"
        args: tuple = (conv_id,)
        if limit is not None:
            sql += " LIMIT ?"
            args += (int(limit),)
        return [self._to_request(r) for r in self._read(sql, args)]

    def slot_timeline(self, profile: str, slot: int, limit: int = 50) -> list[tuple[str, Any]]:
        """(conversation id, request) of the requests that ran in ``slot`` of ``profile``'s server,
        most recent first: who used the slot, in turn."""
        rows = self._read(
            "SELECT r.* FROM requests r JOIN conversations c ON c.id = r.conversation_id "
            "WHERE c.profile = ? AND r.slot = ? ORDER BY r.at DESC, r.id DESC LIMIT ?", (profile, slot, int(limit)))
        return [(r["conversation_id"], self._to_request(r)) for r in rows]

    # -- the lease journal

    @staticmethod
    def _insert_entry(conn: sqlite3.Connection, e: JournalEntry) -> int:
        cur = conn.execute(
            "INSERT INTO lease_journal (profile, at, event, slot, conversation_id, park, n_tokens, state, detail) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (e.profile, e.at or time.time(), e.event, e.slot, e.conversation, e.park, e.n_tokens, e.state, e.detail))
        return cur.lastrowid

    def journal(self, entry: JournalEntry, *, conversations: Iterable[Any] = ()) -> int:
        """Write one journal entry and, in the same transaction, the lease fields (slot, n_tokens,
        parked_as, last_used) of the ``conversations`` it changed; the entry's id."""
        return self.append_journal([(entry, conversations)])[-1]

    def append_journal(self, items: Iterable[tuple[JournalEntry, Iterable[Any]]]) -> list[int]:
        """Write journal entries in their order, each with the lease fields of the conversations it changed,
        in one transaction; their ids."""
        ids = []
        with self._tx() as conn:
            for entry, conversations in items:
                for conv in conversations:
                    self._update_lease_fields(conn, conv, entry.profile)
                ids.append(self._insert_entry(conn, entry))
        return ids

    def journal_entries(self, profile: str, after_id: int = 0) -> list[JournalEntry]:
        """The journal of ``profile``, oldest first."""
        rows = self._read("SELECT * FROM lease_journal WHERE profile = ? AND id > ? ORDER BY id", (profile, after_id))
        return [JournalEntry(profile=r["profile"], event=r["event"], slot=r["slot"], conversation=r["conversation_id"],
                             park=r["park"], n_tokens=r["n_tokens"], state=r["state"], detail=r["detail"],
                             at=r["at"], id=r["id"]) for r in rows]

    def journal_size(self, profile: str) -> int:
        return self._read("SELECT COUNT(*) AS n FROM lease_journal WHERE profile = ?", (profile,))[0]["n"]

    def rewrite_journal(self, profile: str, entries: Iterable[JournalEntry], *,
                        conversations: Iterable[Any] = ()) -> None:
        """Replace ``profile``'s journal by ``entries`` (a snapshot of the slots: what a replay of the
        old journal would give), with the lease fields of ``conversations``, in one transaction."""
        with self._tx() as conn:
            conn.execute("DELETE FROM lease_journal WHERE profile = ?", (profile,))
            for conv in conversations:
                self._update_lease_fields(conn, conv, profile)
            for e in entries:
                self._insert_entry(conn, e)
