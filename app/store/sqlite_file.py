"""One private SQLite file, opened the one way the app's stores need (the session catalog, the
proxy's conversations): 0600 in a 0700 folder, WAL, one connection guarded by a lock (the
window's thread and asyncio's workers), every write one explicit ``BEGIN IMMEDIATE``
transaction, the schema version in ``PRAGMA user_version`` brought forward one step per
transaction (a file from a newer app is refused, not guessed at), and a failing disk said
with the file's name instead of sqlite's bare "disk I/O error".

WAL checkpoints: SQLite runs one inside whichever commit takes the log past 1,000 pages, with its
fsyncs: milliseconds, on a request's path when the proxy commits there. An owner with idle moments
(the proxy between requests) calls :meth:`SqliteFile.defer_checkpoints` and then
:meth:`SqliteFile.checkpoint_if_due` when idle; SQLite still checkpoints by itself past
:data:`DEFERRED_CHECKPOINT_PAGES`, so a log never grows without bound."""

from __future__ import annotations

import os
import shutil
import sqlite3
import threading
import time
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Iterator


#: with checkpoints deferred, SQLite's own checkpoint comes only past this many log pages (16 MiB of 4 KiB pages)
DEFERRED_CHECKPOINT_PAGES = 4000
#: with checkpoints deferred, an idle moment checkpoints once this many commits went into the log since the last
#: (a proxy's journal entry and the conversation rows it touched: a few pages each, about SQLite's 1,000 pages)
CHECKPOINT_EVERY_COMMITS = 250


def set_wal(conn: sqlite3.Connection, timeout: float = 10.0) -> None:
    """``PRAGMA journal_mode = WAL``, retried while another process holds the file: on a new
    file two processes starting at once (the window and a CLI) collide here, and sqlite
    answers this pragma "database is locked" at once, without its busy timeout."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as e:
            if getattr(e, "sqlite_errorname", "") != "SQLITE_BUSY" or time.monotonic() > deadline:
                raise
            time.sleep(0.02)  # a lock retry, as sqlite's own busy handler does


def free_bytes(folder: Path) -> int:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return 1 << 62


class SqliteFile:
    """Subclasses say what they are and how their schema grows."""

    NAME = "the file"  # in errors: "cannot open the session catalog PATH: …"
    SHORT_NAME = "the file"  # "the catalog was written by a newer KV Valet"
    ERROR: type[Exception] = RuntimeError
    SCHEMA_VERSION = 0
    MIGRATIONS: dict[int, str] = {}  # MIGRATIONS[n] takes a file at version n to version n + 1
    #: NORMAL (WAL): a commit can be lost to a power cut, never the file; FULL: a commit is on disk when it returns
    SYNCHRONOUS = "NORMAL"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if str(path) != ":memory:":
            from app import files as fileio

            fileio.private_dir(self.path.parent)  # 0700, the file 0600 (its -wal and -shm follow)
            fileio.touch_private(self.path)
        self._lock = threading.Lock()
        self.commits = 0  # since the last checkpoint this connection made (counted while deferred)
        self._writes = 0  # every commit this connection made (see ``changes``)
        self._deferred = False
        # isolation_level=None: BEGIN/COMMIT are issued here, so transactions are exactly what the code says
        try:
            self._conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=10.0)
        except sqlite3.Error as e:
            raise self._storage_error("open", e) from e
        self._conn.row_factory = sqlite3.Row
        try:
            set_wal(self._conn)
            self._conn.execute(f"PRAGMA synchronous = {self.SYNCHRONOUS}")
            self._conn.execute("PRAGMA foreign_keys = ON")
            self._migrate()
        except sqlite3.DatabaseError as e:  # a folder, not a database, unreadable: say which file
            self._conn.close()
            raise self._storage_error("open", e) from e
        except BaseException:
            self._conn.close()
            raise

    # -- checkpoints
    def defer_checkpoints(self, limit_pages: int = DEFERRED_CHECKPOINT_PAGES) -> None:
        """Leave the WAL checkpoints to :meth:`checkpoint_if_due` (SQLite's own only past ``limit_pages``)."""
        with self._lock:
            self._conn.execute(f"PRAGMA wal_autocheckpoint = {int(limit_pages)}")
            self._deferred = True

    def checkpoint_if_due(self, every_commits: int | None = None) -> bool:
        """A passive checkpoint (it waits for no reader or writer) when checkpoints are deferred and
        ``every_commits`` (default :data:`CHECKPOINT_EVERY_COMMITS`) commits went into the log since the
        last; whether one ran."""
        due = CHECKPOINT_EVERY_COMMITS if every_commits is None else every_commits
        if not self._deferred or self.commits < due:
            return False
        with self._lock:
            try:
                self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            except sqlite3.OperationalError as e:
                if (err := self._storage_error("checkpoint", e)) is None:
                    raise
                raise err from e
            self.commits = 0
        return True

    # -- lifecycle
    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def schema_version(self) -> int:
        with self._lock:
            return self._conn.execute("PRAGMA user_version").fetchone()[0]

    # -- plumbing
    def _migrate(self) -> None:
        """Bring the file to SCHEMA_VERSION, one step per transaction: each step and its
        ``user_version`` bump commit together, so an interrupted migration restarts cleanly."""
        conn = self._conn
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > self.SCHEMA_VERSION:
            raise self.ERROR(f"{self.SHORT_NAME} was written by a newer KV Valet (schema {version}, "
                             f"this version knows {self.SCHEMA_VERSION}); refusing to touch it")
        while version < self.SCHEMA_VERSION:
            conn.execute("BEGIN IMMEDIATE")
            try:
                # Read again under the write lock: another process opening the same file at the same
                # time (the window and a CLI on a fresh install) may have done this step meanwhile.
                version = conn.execute("PRAGMA user_version").fetchone()[0]
                if version < self.SCHEMA_VERSION:
                    for statement in self.MIGRATIONS[version].split(";"):
                        if statement.strip():
                            conn.execute(statement)
                    conn.execute(f"PRAGMA user_version = {version + 1}")
                    version += 1
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

    def _storage_error(self, what: str, e: sqlite3.Error) -> Exception | None:
        """The disk or the file failed (not the SQL): an error naming the file, which every front
        end shows as it is. None for an SQL mistake (SQLITE_ERROR): re-raise that one."""
        path = self.path
        if getattr(e, "sqlite_errorname", "") == "SQLITE_ERROR" and what != "open":
            return None
        if path.is_dir():
            why = "it is a folder, not a file"
        elif not os.access(path.parent, os.W_OK):  # sqlite needs the folder too (the WAL and -shm files)
            why = f"{e} (its folder {path.parent} is read-only)"
        elif free_bytes(path.parent) < 1024 * 1024:  # sqlite says "disk I/O error" when the -shm cannot grow
            why = f"{e} (its disk is full: {free_bytes(path.parent):,} bytes free)"
        else:
            why = str(e)
        return self.ERROR(f"cannot {what} {self.NAME} {path}: {why}")

    @contextmanager
    def _tx(self, durable: bool = True) -> Iterator[Any]:
        """Lock + one write transaction; rolled back on any exception.

        ``durable=False``: committed without waiting for the disk even where the file is FULL (a measurement
        a power cut may lose, written on the event loop for every request: no fsync there); a later durable
        commit makes it durable too.

        A write the disk refuses (full, read-only, I/O error) raises the store's error naming the
        file, not sqlite's bare "database or disk is full". After such an error sqlite may or may
        not have rolled the transaction back itself (SQLITE_FULL, SQLITE_IOERR, SQLITE_BUSY:
        https://sqlite.org/lang_transaction.html), and COMMIT can fail too: roll back only what is
        still open, so the error raised is the real one and this long-lived connection (the
        window's) writes again once the disk has room.
        """
        relaxed = not durable and self.SYNCHRONOUS != "NORMAL"
        with self._lock:
            conn = self._conn
            done = False
            try:
                if relaxed:
                    conn.execute("PRAGMA synchronous = NORMAL")  # outside a transaction, as SQLite requires
                conn.execute("BEGIN IMMEDIATE")
                try:
                    yield conn
                    conn.execute("COMMIT")
                    self.commits += 1
                    self._writes += 1
                    done = True
                except BaseException:
                    if conn.in_transaction:
                        with suppress(sqlite3.Error):
                            conn.execute("ROLLBACK")
                    raise
            except sqlite3.OperationalError as e:
                if (err := self._storage_error("write", e)) is None:
                    raise
                raise err from e
            finally:
                if relaxed:
                    try:
                        conn.execute(f"PRAGMA synchronous = {self.SYNCHRONOUS}")
                    except sqlite3.Error:
                        if done:  # else the write's own error is the one raised
                            raise

    def changes(self) -> tuple[int, int]:
        """A value that differs once anything was committed to the file since it was last taken, by this
        connection or another (SQLite's ``data_version``): what a cached read checks, in microseconds."""
        with self._lock:
            return self._writes, self._conn.execute("PRAGMA data_version").fetchone()[0]

    def _read(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            try:
                return self._conn.execute(sql, args).fetchall()
            except sqlite3.OperationalError as e:
                if (err := self._storage_error("read", e)) is None:
                    raise
                raise err from e
