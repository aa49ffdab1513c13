"""The session catalog: what was parked, where, from which server, and how resumes went.

One SQLite file (``app.paths.catalog_path()``), stdlib ``sqlite3`` only.

Why these choices:

* **WAL mode** so the GUI can read while a park/resume job writes, and a crash
  mid-write leaves the previous committed state intact.
* **Every write is one explicit transaction** (``BEGIN IMMEDIATE`` ... ``COMMIT``,
  ``ROLLBACK`` on any exception), so a crash or an exception never leaves half a
  record (e.g. a session without its history cleanup, or a re-park half applied).
* **``PRAGMA user_version``** holds the schema version; :func:`_migrate` brings an
  older file forward step by step and refuses a file written by a newer app
  rather than guessing at it.
* **Foreign keys on**: history rows reference their session by id. That is why a
  re-park of the same name UPDATEs the row in place (keeps the id) instead of
  delete + insert: the resume/check/A-B history stays attached to the session.
* **One connection per Catalog**, opened with ``check_same_thread=False`` and
  guarded by a ``threading.Lock``: the app calls it from the Qt thread and from
  ``asyncio.to_thread`` workers, and sqlite3 connections are not safe to use
  from two threads at once.
"""

from __future__ import annotations

import json
import sqlite3
import statistics
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple

from app.core.restore_needs import CHECKPOINTED_KINDS
from app.core.states import MemoryKind, SidecarStatus
from app.core.verdict import VerdictKind
from app.store.sqlite_file import SqliteFile

SCHEMA_VERSION = 5

#: Memory kinds whose parks say something about sidecar support. A dense model
#: keeps every KV position and never needs checkpoints, so its parks tell nothing.

EVENT_KINDS = frozenset({"resume", "check", "ab", "baseline"})

#: Prefill samples shorter than this are dominated by fixed per-request overhead.
MIN_PREFILL_TOKENS = 32
#: How many recent prefill samples per profile are kept and used for the median.
PREFILL_WINDOW = 20


class CatalogError(Exception):
    """A catalog operation that cannot be done (name conflict, unknown id, bad file)."""


@dataclass
class SessionRecord:
    """One parked slot state ("session") and everything needed to judge a resume.

    All fields have defaults so callers can build records by keyword; ``id`` is
    ``None`` until the record is stored.
    """

    id: int | None = None
    name: str = ""
    profile: str = ""  # profile name, or the server URL in attach mode
    state_file: str = ""  # file name inside the server's --slot-save-path
    save_dir: str = ""  # absolute folder holding state_file (and the sidecar)
    sidecar_file: str | None = None
    state_size: int = 0
    sidecar_size: int = 0
    n_tokens: int = 0
    save_ms: float = 0.0
    server_build: str = ""
    model_path: str = ""
    model_size: int = 0
    model_sha256: str = ""  # "" until the background hash is done
    model_quick_id: str = ""  # size + SHA-256 of the first 16 MiB (app.server.gguf_info.model_quick_id)
    cache_type_k: str = ""
    cache_type_v: str = ""
    n_ctx_slot: int = 0
    flash_attn: str = ""
    swa_full: bool = False
    memory_kind: MemoryKind = MemoryKind.DENSE
    sidecar_status: SidecarStatus = SidecarStatus.NOT_NEEDED
    sidecar_reason: str = ""
    sidecar_count: int = 0
    slot_id: int = 0  # the slot it was parked from
    created_at: float = 0.0
    updated_at: float = 0.0
    last_restore_ms: float | None = None
    last_n_restored: int | None = None
    last_restore_at: float | None = None
    last_verdict: VerdictKind | None = None
    last_verdict_reason: str | None = None
    notes: str = ""
    # Prefill time the resumes of this session avoided (tokens reused x the profile's
    # measured prefill rate), summed; a resume that re-prefilled adds 0.
    time_saved_s: float = 0.0
    last_time_saved_s: float | None = None
    # What the park wrote (app.core.park_files.ParkedFiles as JSON: each file's size and SHA-256, the
    # sidecar's checkpoint positions); "" for a park from before the catalog kept them: "not recorded".
    parked_files: str = ""
    # The stamps (device, inode, size, mtime, ctime) of each file when its bytes were last found to be
    # the parked ones (app.sessions.files_check): a file with the same stamp is not hashed again.
    files_verified: str = ""

    def __post_init__(self) -> None:
        # Stored as their text values; typed in memory (StrEnum: compares equal to the text).
        self.memory_kind = _enum(MemoryKind, self.memory_kind, MemoryKind.UNKNOWN)
        self.sidecar_status = _enum(SidecarStatus, self.sidecar_status, SidecarStatus.INVALID)
        if self.last_verdict is not None:
            self.last_verdict = _enum(VerdictKind, self.last_verdict, VerdictKind.UNKNOWN)

    @property
    def state_path(self) -> Path:
        return Path(self.save_dir) / self.state_file


def _enum(kind, value, fallback):
    """``value`` as a member of ``kind``; a text this app version does not know is ``fallback``."""
    if isinstance(value, kind):
        return value
    try:
        return kind(value)
    except ValueError:
        return fallback


@dataclass
class HistoryEvent:
    """One resume, check, A/B run or baseline measurement of a session."""

    id: int | None = None
    session_id: int | None = None
    kind: str = "resume"  # "resume" / "check" / "ab" / "baseline"
    at: float = 0.0
    server_build: str = ""
    restore_ms: float | None = None
    prompt_ms: float | None = None
    prompt_n: int | None = None
    cache_n: int | None = None
    ttft_ms: float | None = None
    verdict: str | None = None
    reason: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class PendingVerdict:
    """A restore whose first query nobody has judged yet. ``kv-valet resume`` ends long
    before that query comes, so it leaves this note; whichever process watches the
    server's log judges the query and removes the note (app.sessions.wiring)."""

    id: int | None = None
    session_id: int = 0  # the session's id: a rename while it waits keeps it
    profile: str = ""  # the server's profile name (its URL in attach mode)
    server_url: str = ""
    slot_id: int = 0
    n_restored: int = 0
    sidecar_status: str = ""
    sidecar_count: int | None = None
    ctx_checkpoints: int | None = None
    build_persists: bool | None = None
    created_at: float = 0.0  # when the restore was done (time.time())


class RestoreNoted(NamedTuple):
    """What :meth:`Catalog.note_restore` wrote: the resume event, the pending verdict (None: none asked),
    and the older notes on the same slot it replaced."""

    event: HistoryEvent
    pending: PendingVerdict | None
    replaced: list[PendingVerdict]


_SESSION_COLS = [f.name for f in fields(SessionRecord) if f.name != "id"]
#: the columns a re-park of the same session keeps unless it brings its own (Catalog.add_or_replace)
_EARNED_COLS = ("time_saved_s", "last_time_saved_s", "last_restore_ms", "last_n_restored", "last_restore_at",
                "last_verdict", "last_verdict_reason", "notes")
_PENDING_VERDICT_COLS = [f.name for f in fields(PendingVerdict) if f.name != "id"]
_EVENT_COLS = [f.name for f in fields(HistoryEvent) if f.name != "id"]


# --------------------------------------------------------------------------- schema

_SCHEMA_V1 = """
CREATE TABLE sessions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    profile TEXT NOT NULL,
    state_file TEXT NOT NULL,
    save_dir TEXT NOT NULL,
    sidecar_file TEXT,
    state_size INTEGER NOT NULL DEFAULT 0,
    sidecar_size INTEGER NOT NULL DEFAULT 0,
    n_tokens INTEGER NOT NULL DEFAULT 0,
    save_ms REAL NOT NULL DEFAULT 0,
    server_build TEXT NOT NULL DEFAULT '',
    model_path TEXT NOT NULL DEFAULT '',
    model_size INTEGER NOT NULL DEFAULT 0,
    model_sha256 TEXT NOT NULL DEFAULT '',
    cache_type_k TEXT NOT NULL DEFAULT '',
    cache_type_v TEXT NOT NULL DEFAULT '',
    n_ctx_slot INTEGER NOT NULL DEFAULT 0,
    flash_attn TEXT NOT NULL DEFAULT '',
    swa_full INTEGER NOT NULL DEFAULT 0,
    memory_kind TEXT NOT NULL DEFAULT 'dense',
    sidecar_status TEXT NOT NULL DEFAULT 'not needed',
    sidecar_reason TEXT NOT NULL DEFAULT '',
    sidecar_count INTEGER NOT NULL DEFAULT 0,
    slot_id INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    last_restore_ms REAL,
    last_n_restored INTEGER,
    last_restore_at REAL,
    last_verdict TEXT,
    last_verdict_reason TEXT,
    notes TEXT NOT NULL DEFAULT '',
    UNIQUE (profile, name)
);
CREATE TABLE history (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id INTEGER NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    kind TEXT NOT NULL,
    at REAL NOT NULL,
    server_build TEXT NOT NULL DEFAULT '',
    restore_ms REAL,
    prompt_ms REAL,
    prompt_n INTEGER,
    cache_n INTEGER,
    ttft_ms REAL,
    verdict TEXT,
    reason TEXT,
    details TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX history_session ON history(session_id, at);
CREATE TABLE builds (
    build TEXT PRIMARY KEY,
    checkpointed_parks INTEGER NOT NULL DEFAULT 0,
    sidecars_written INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE prefill_samples (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    profile TEXT NOT NULL,
    n_tokens INTEGER NOT NULL,
    ms REAL NOT NULL,
    at REAL NOT NULL
);
CREATE INDEX prefill_profile ON prefill_samples(profile, id);
CREATE TABLE pending (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,
    payload TEXT NOT NULL,
    created_at REAL NOT NULL
);
"""

_SCHEMA_V2 = """
ALTER TABLE sessions ADD COLUMN model_quick_id TEXT NOT NULL DEFAULT '';
CREATE INDEX sessions_profile ON sessions(profile, updated_at)
"""

_SCHEMA_V3 = """
ALTER TABLE sessions ADD COLUMN time_saved_s REAL NOT NULL DEFAULT 0;
ALTER TABLE sessions ADD COLUMN last_time_saved_s REAL
"""

# A restore waiting for the verdict of its slot's next query (app.sessions.wiring): keyed by the
# session's id, so a rename while it waits keeps it; gone with its session.
_SCHEMA_V4 = """
CREATE TABLE pending_verdicts (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id INTEGER NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    profile TEXT NOT NULL,
    server_url TEXT NOT NULL DEFAULT '',
    slot_id INTEGER NOT NULL,
    n_restored INTEGER NOT NULL,
    sidecar_status TEXT NOT NULL DEFAULT '',
    sidecar_count INTEGER,
    ctx_checkpoints INTEGER,
    build_persists INTEGER,
    created_at REAL NOT NULL
);
CREATE INDEX pending_verdicts_slot ON pending_verdicts(profile, slot_id, created_at)
"""

# What each park wrote, and when its files were last found to be those (app.core.park_files): an
# older row keeps "" in both, "not recorded", never refused.
_SCHEMA_V5 = """
ALTER TABLE sessions ADD COLUMN parked_files TEXT NOT NULL DEFAULT '';
ALTER TABLE sessions ADD COLUMN files_verified TEXT NOT NULL DEFAULT ''
"""

#: _MIGRATIONS[n] takes a file at version n to version n + 1.
_MIGRATIONS: dict[int, str] = {0: _SCHEMA_V1, 1: _SCHEMA_V2, 2: _SCHEMA_V3, 3: _SCHEMA_V4, 4: _SCHEMA_V5}


# --------------------------------------------------------------------------- catalog


class Catalog(SqliteFile):
    """The SQLite catalog of parked sessions, their history and learned facts."""

    # a park says "parked" once its row is on disk: a power cut after that keeps it (tests/faults/test_power_cut.py;
    # the cost per park: tests/bench/bench_durable_park.py)
    SYNCHRONOUS = "FULL"
    NAME = "the session catalog"
    SHORT_NAME = "the catalog"
    ERROR = CatalogError
    SCHEMA_VERSION = SCHEMA_VERSION
    MIGRATIONS = _MIGRATIONS

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self._rates: dict[str, tuple[tuple[int, int], float | None]] = {}  # prefill_rate's, with ``changes()``

    @staticmethod
    def _to_record(row: sqlite3.Row) -> SessionRecord:
        data = dict(row)
        data["swa_full"] = bool(data["swa_full"])
        return SessionRecord(**data)

    @staticmethod
    def _to_event(row: sqlite3.Row) -> HistoryEvent:
        data = dict(row)
        data["details"] = json.loads(data["details"] or "{}")
        return HistoryEvent(**data)

    # -- sessions

    def add_or_replace(self, rec: SessionRecord) -> SessionRecord:
        """Store a park. A re-park of the same (profile, name) replaces the row in
        place, keeping its id (and so its history) and its original created_at.

        Returns the stored record (a new object with ``id`` and timestamps set).
        """
        now = time.time()
        values = {c: getattr(rec, c) for c in _SESSION_COLS}
        for c in ("memory_kind", "sidecar_status", "last_verdict"):
            if values[c] is not None:
                values[c] = str(values[c])
        values["swa_full"] = int(bool(rec.swa_full))
        values["updated_at"] = rec.updated_at or now
        with self._tx() as conn:
            row = conn.execute(
                "SELECT id, created_at FROM sessions WHERE profile = ? AND name = ?",
                (rec.profile, rec.name),
            ).fetchone()
            if row is None:
                values["created_at"] = rec.created_at or now
                cols = ", ".join(values)
                marks = ", ".join("?" for _ in values)
                cur = conn.execute(
                    f"INSERT INTO sessions ({cols}) VALUES ({marks})", tuple(values.values())
                )
                sid = cur.lastrowid
            else:
                sid = row["id"]
                values["created_at"] = row["created_at"]
                # What the session earned stays with it: its time-saved ledger (only the verdicts add to
                # it), its last restore and verdict until the next one, and the user's notes. A park that
                # carries its own (a move's adopted row) still sets them.
                for c in _EARNED_COLS:
                    if values[c] in (None, "", 0, 0.0):
                        del values[c]
                sets = ", ".join(f"{c} = ?" for c in values)
                conn.execute(
                    f"UPDATE sessions SET {sets} WHERE id = ?", (*values.values(), sid)
                )
            stored = conn.execute("SELECT * FROM sessions WHERE id = ?", (sid,)).fetchone()
            return self._to_record(stored)

    def get(self, profile: str, name: str) -> SessionRecord | None:
        rows = self._read(
            "SELECT * FROM sessions WHERE profile = ? AND name = ?", (profile, name)
        )
        return self._to_record(rows[0]) if rows else None

    def get_by_id(self, session_id: int) -> SessionRecord | None:
        rows = self._read("SELECT * FROM sessions WHERE id = ?", (session_id,))
        return self._to_record(rows[0]) if rows else None

    def list(self, profile: str | None = None) -> list[SessionRecord]:
        """Sessions, most recently parked first (all profiles when profile is None)."""
        order = " ORDER BY updated_at DESC, id DESC"
        if profile is None:
            rows = self._read("SELECT * FROM sessions" + order)
        else:
            rows = self._read("SELECT * FROM sessions WHERE profile = ?" + order, (profile,))
        return [self._to_record(r) for r in rows]

    def sessions_of_build(self, build: str, limit: int = 5) -> list[SessionRecord]:
        """The newest sessions parked by ``build`` with a sidecar file (what its parks wrote)."""
        rows = self._read("SELECT * FROM sessions WHERE server_build = ? AND COALESCE(sidecar_file, '') != '' "
                          "ORDER BY updated_at DESC, id DESC LIMIT ?", (build, limit))
        return [self._to_record(r) for r in rows]

    def rename(self, profile: str, old: str, new: str) -> SessionRecord:
        """Rename a session (the catalog name only; the state file keeps its name)."""
        with self._tx() as conn:
            row = conn.execute(
                "SELECT id FROM sessions WHERE profile = ? AND name = ?", (profile, old)
            ).fetchone()
            if row is None:
                raise CatalogError(f"no session named '{old}' in profile '{profile}'")
            if new != old:
                clash = conn.execute(
                    "SELECT 1 FROM sessions WHERE profile = ? AND name = ?", (profile, new)
                ).fetchone()
                if clash:
                    raise CatalogError(
                        f"a session named '{new}' already exists in profile '{profile}'"
                    )
                conn.execute(
                    "UPDATE sessions SET name = ?, updated_at = ? WHERE id = ?",
                    (new, time.time(), row["id"]),
                )
            return self._to_record(
                conn.execute("SELECT * FROM sessions WHERE id = ?", (row["id"],)).fetchone()
            )

    def delete(self, profile: str, name: str) -> bool:
        """Remove a session and its history. Returns False if there was none.

        Deleting the files on disk is the caller's job (do it after this commits).
        """
        with self._tx() as conn:
            row = conn.execute(
                "SELECT id FROM sessions WHERE profile = ? AND name = ?", (profile, name)
            ).fetchone()
            if row is None:
                return False
            # Explicit, though ON DELETE CASCADE would do it too: the intent is visible
            # and it holds even if a connection ever ran without foreign_keys.
            conn.execute("DELETE FROM history WHERE session_id = ?", (row["id"],))
            conn.execute("DELETE FROM sessions WHERE id = ?", (row["id"],))
            return True

    def update_restore(
        self, session_id: int, restore_ms: float, n_restored: int, at: float
    ) -> None:
        self._update(
            session_id,
            last_restore_ms=restore_ms,
            last_n_restored=n_restored,
            last_restore_at=at,
        )

    def update_verdict(self, session_id: int, verdict: VerdictKind | str, reason: str) -> None:
        self._update(session_id, last_verdict=str(VerdictKind(verdict)), last_verdict_reason=reason)

    def record_time_saved(self, session_id: int, seconds: float) -> None:
        """One resume's avoided prefill time (0 for a resume that re-prefilled)."""
        with self._tx() as conn:
            cur = conn.execute("UPDATE sessions SET time_saved_s = time_saved_s + ?, last_time_saved_s = ? "
                               "WHERE id = ?", (max(0.0, seconds), max(0.0, seconds), session_id))
            if cur.rowcount == 0:
                raise CatalogError(f"no session with id {session_id}")

    def total_time_saved(self, profile: str | None = None) -> float:
        sql = "SELECT COALESCE(SUM(time_saved_s), 0) AS t FROM sessions"
        rows = self._read(sql + " WHERE profile = ?", (profile,)) if profile else self._read(sql)
        return float(rows[0]["t"])

    def fill_model_sha256(self, quick_id: str, size: int, sha256: str) -> int:
        """The background hash of a model is done: record it in every session parked
        from that model (same quick id and size) that did not have it. Returns how many."""
        with self._tx() as conn:
            cur = conn.execute("UPDATE sessions SET model_sha256 = ? WHERE model_quick_id = ? AND model_size = ? "
                               "AND model_sha256 = ''", (sha256, quick_id, size))
            return cur.rowcount

    def update_sidecar(self, session_id: int, *, status: SidecarStatus, reason: str, count: int, size: int,
                       file: str | None) -> None:
        """The sidecar as it is on disk now (removed, replaced or checked again)."""
        self._update(session_id, sidecar_status=str(status), sidecar_reason=reason, sidecar_count=count,
                     sidecar_size=size, sidecar_file=file)

    def set_files_verified(self, session_id: int, stamps: str, *, parked_files: str | None = None) -> bool:
        """The files of a session were found to be the parked ones with these ``stamps`` (JSON text).
        ``parked_files``: only when the row still records these (a re-park meanwhile wrote others:
        nothing is written, False)."""
        with self._tx() as conn:
            if parked_files is None:
                cur = conn.execute("UPDATE sessions SET files_verified = ? WHERE id = ?", (stamps, session_id))
            else:
                cur = conn.execute("UPDATE sessions SET files_verified = ? WHERE id = ? AND parked_files = ?",
                                   (stamps, session_id, parked_files))
            return cur.rowcount > 0

    def _update(self, session_id: int, **values: Any) -> None:
        sets = ", ".join(f"{c} = ?" for c in values)
        with self._tx() as conn:
            cur = conn.execute(
                f"UPDATE sessions SET {sets} WHERE id = ?", (*values.values(), session_id)
            )
            if cur.rowcount == 0:
                raise CatalogError(f"no session with id {session_id}")

    # -- restores waiting for their verdict (app.sessions.wiring)

    @staticmethod
    def _to_pending_verdict(row: sqlite3.Row) -> PendingVerdict:
        data = dict(row)
        if data["build_persists"] is not None:
            data["build_persists"] = bool(data["build_persists"])
        return PendingVerdict(**data)

    def add_pending_verdict(self, p: PendingVerdict) -> tuple[PendingVerdict, list[PendingVerdict]]:
        """Note a restore waiting for its verdict. An older note on the same slot of the
        same server (profile or URL) goes in the same transaction (a newer restore
        replaced it): it is returned second, so the caller can say so."""
        with self._tx() as conn:
            return self._insert_pending(conn, p)

    def _insert_pending(self, conn: sqlite3.Connection, p: PendingVerdict) -> tuple[PendingVerdict,
                                                                                   list[PendingVerdict]]:
        values = {c: getattr(p, c) for c in _PENDING_VERDICT_COLS}
        values["created_at"] = p.created_at or time.time()
        if p.build_persists is not None:
            values["build_persists"] = int(bool(p.build_persists))
        values["sidecar_status"] = str(p.sidecar_status or "")
        same = "(profile = ? OR server_url = ?) AND slot_id = ?"
        key = (p.profile, p.server_url or p.profile, p.slot_id)
        older = [self._to_pending_verdict(r) for r in conn.execute(
            f"SELECT * FROM pending_verdicts WHERE {same}", key)]
        conn.execute(f"DELETE FROM pending_verdicts WHERE {same}", key)
        try:
            cur = conn.execute(f"INSERT INTO pending_verdicts ({', '.join(values)}) "
                               f"VALUES ({', '.join('?' for _ in values)})", tuple(values.values()))
        except sqlite3.IntegrityError as exc:
            raise CatalogError(f"no session with id {p.session_id}") from exc
        row = conn.execute("SELECT * FROM pending_verdicts WHERE id = ?", (cur.lastrowid,)).fetchone()
        return self._to_pending_verdict(row), older

    def pending_verdicts(self, profile: str, slot_id: int | None = None, *,
                         server_url: str | None = None) -> list[PendingVerdict]:
        """The restores of ``profile`` (or, given, of the server at ``server_url``: a resume
        that named the server by its URL), one slot or all, still waiting for a verdict,
        newest first."""
        sql = "SELECT * FROM pending_verdicts WHERE (profile = ? OR server_url = ?)"
        args: tuple = (profile, server_url or profile)
        if slot_id is not None:
            sql, args = sql + " AND slot_id = ?", (*args, slot_id)
        return [self._to_pending_verdict(r) for r in self._read(sql + " ORDER BY created_at DESC, id DESC", args)]

    def drop_pending_verdict(self, pending_id: int) -> bool:
        """Forget a waiting restore; False when it was gone already."""
        with self._tx() as conn:
            return conn.execute("DELETE FROM pending_verdicts WHERE id = ?", (pending_id,)).rowcount > 0

    def settle_pending_verdict(self, pending_id: int, verdict: VerdictKind | str, reason: str,
                               time_saved_s: float | None) -> bool:
        """The verdict of a waiting restore, in one transaction: the note goes, the session
        gets the verdict and (when known) the time the resume saved. False, and nothing
        written, when the note was gone: another watcher judged it first, or it was dropped."""
        with self._tx() as conn:
            row = conn.execute("SELECT session_id FROM pending_verdicts WHERE id = ?", (pending_id,)).fetchone()
            if row is None:
                return False
            conn.execute("DELETE FROM pending_verdicts WHERE id = ?", (pending_id,))
            conn.execute("UPDATE sessions SET last_verdict = ?, last_verdict_reason = ? WHERE id = ?",
                         (str(VerdictKind(verdict)), reason, row["session_id"]))
            if time_saved_s is not None:
                saved = max(0.0, time_saved_s)
                conn.execute("UPDATE sessions SET time_saved_s = time_saved_s + ?, last_time_saved_s = ? "
                             "WHERE id = ?", (saved, saved, row["session_id"]))
            return True

    # -- history

    def add_event(self, ev: HistoryEvent) -> HistoryEvent:
        """Append a resume/check/A-B/baseline event; returns it with id (and at) set."""
        with self._tx() as conn:
            return self._insert_event(conn, ev)

    def note_restore(self, ev: HistoryEvent, n_restored: int, verdict_reason: str, *,
                     pending: PendingVerdict | None = None, durable: bool = True) -> RestoreNoted:
        """A restore, in one commit (it sits on the path of a request the proxy restored for): the
        session's last restore (``ev.restore_ms``, ``n_restored``, ``ev.at``), its verdict UNKNOWN until
        the next query is judged (``verdict_reason``), the resume event ``ev``, and ``pending``, the note
        for whoever judges that query (:meth:`add_pending_verdict`). ``durable`` False: not waiting for the
        disk (the proxy's restores, one per returning turn: a power cut may lose the note, never a park)."""
        with self._tx(durable=durable) as conn:
            cur = conn.execute(
                "UPDATE sessions SET last_restore_ms = ?, last_n_restored = ?, last_restore_at = ?, "
                "last_verdict = ?, last_verdict_reason = ? WHERE id = ?",
                (ev.restore_ms, n_restored, ev.at, str(VerdictKind.UNKNOWN), verdict_reason, ev.session_id))
            if cur.rowcount == 0:
                raise CatalogError(f"no session with id {ev.session_id}")
            event = self._insert_event(conn, ev)
            note, replaced = self._insert_pending(conn, pending) if pending is not None else (None, [])
            return RestoreNoted(event, note, replaced)

    def _insert_event(self, conn: sqlite3.Connection, ev: HistoryEvent) -> HistoryEvent:
        if ev.kind not in EVENT_KINDS:
            raise CatalogError(f"unknown history event kind '{ev.kind}'")
        values = {c: getattr(ev, c) for c in _EVENT_COLS}
        values["at"] = ev.at or time.time()
        values["details"] = json.dumps(ev.details or {})
        cols = ", ".join(values)
        marks = ", ".join("?" for _ in values)
        try:
            cur = conn.execute(f"INSERT INTO history ({cols}) VALUES ({marks})", tuple(values.values()))
        except sqlite3.IntegrityError as exc:
            raise CatalogError(f"no session with id {ev.session_id}") from exc
        row = conn.execute("SELECT * FROM history WHERE id = ?", (cur.lastrowid,)).fetchone()
        return self._to_event(row)

    def history(self, session_id: int) -> list[HistoryEvent]:
        """Events of a session, oldest first."""
        rows = self._read(
            "SELECT * FROM history WHERE session_id = ? ORDER BY at, id", (session_id,)
        )
        return [self._to_event(r) for r in rows]

    # -- per-build checkpoint persistence

    def record_sidecar_observation(
        self, build: str, wrote_sidecar: bool, memory_kind: str
    ) -> None:
        """Note whether a park on ``build`` wrote a checkpoint sidecar.

        Only SWA/hybrid parks count: a dense model holds no checkpoints, so a dense
        park without a sidecar says nothing about the build. The caller should only
        report SWA/hybrid parks of slots that actually held checkpoints.
        """
        if memory_kind not in CHECKPOINTED_KINDS:
            return
        with self._tx() as conn:
            conn.execute(
                "INSERT INTO builds (build, checkpointed_parks, sidecars_written) "
                "VALUES (?, 1, ?) ON CONFLICT(build) DO UPDATE SET "
                "checkpointed_parks = checkpointed_parks + 1, "
                "sidecars_written = sidecars_written + excluded.sidecars_written",
                (build, int(bool(wrote_sidecar))),
            )

    def build_persists_checkpoints(self, build: str) -> bool | None:
        """True if the build ever wrote a sidecar; False if it parked at least one
        SWA/hybrid slot and never wrote one; None if it was never observed."""
        rows = self._read(
            "SELECT checkpointed_parks, sidecars_written FROM builds WHERE build = ?",
            (build,),
        )
        if not rows or rows[0]["checkpointed_parks"] == 0:
            return None
        return rows[0]["sidecars_written"] > 0

    # -- per-profile prefill rate

    def record_prefill(self, profile: str, n_tokens: int, ms: float) -> None:
        """Keep a prefill measurement (prompt_n, prompt_ms) for the profile.

        Samples under MIN_PREFILL_TOKENS tokens or with ms <= 0 are dropped: they
        are dominated by per-request overhead and timer noise. Only the last
        PREFILL_WINDOW samples per profile are kept. Not durable at once (no fsync: it is written on the
        event loop for every prompt the server reports, a proxied request's path); the next durable write
        makes it so.
        """
        if n_tokens < MIN_PREFILL_TOKENS or ms <= 0:
            return
        with self._tx(durable=False) as conn:
            conn.execute(
                "INSERT INTO prefill_samples (profile, n_tokens, ms, at) VALUES (?, ?, ?, ?)",
                (profile, int(n_tokens), float(ms), time.time()),
            )
            conn.execute(
                "DELETE FROM prefill_samples WHERE profile = ? AND id NOT IN ("
                "SELECT id FROM prefill_samples WHERE profile = ? ORDER BY id DESC LIMIT ?)",
                (profile, profile, PREFILL_WINDOW),
            )

    def prefill_rate(self, profile: str) -> float | None:
        """Tokens/s: the **median** of the per-sample rates of the last 20 samples.

        Median rather than a mean because one prefill slowed by a competing job (or
        sped up by a partial cache hit) should not move the estimate. None until a
        sample exists.
        """
        changes = self.changes()  # read again only when the file changed (it is asked on a request's path)
        kept = self._rates.get(profile)
        if kept is not None and kept[0] == changes:
            return kept[1]
        rows = self._read(
            "SELECT n_tokens, ms FROM prefill_samples WHERE profile = ? "
            "ORDER BY id DESC LIMIT ?",
            (profile, PREFILL_WINDOW),
        )
        rate = statistics.median(r["n_tokens"] * 1000.0 / r["ms"] for r in rows) if rows else None
        self._rates[profile] = (changes, rate)
        return rate

    # -- pending-operations journal

    def add_pending(self, kind: str, payload: dict[str, Any]) -> int:
        """Journal an operation before touching files (park, A/B moving a sidecar
        aside), so a crash can be undone or finished at the next start."""
        with self._tx() as conn:
            cur = conn.execute(
                "INSERT INTO pending (kind, payload, created_at) VALUES (?, ?, ?)",
                (kind, json.dumps(payload), time.time()),
            )
            return int(cur.lastrowid)

    def list_pending(self) -> list[tuple[int, str, dict[str, Any], float]]:
        """Open journal entries, oldest first: (id, kind, payload, created_at)."""
        rows = self._read("SELECT * FROM pending ORDER BY id")
        return [(r["id"], r["kind"], json.loads(r["payload"]), r["created_at"]) for r in rows]

    def remove_pending(self, pending_id: int) -> None:
        with self._tx() as conn:
            conn.execute("DELETE FROM pending WHERE id = ?", (pending_id,))
