"""One lock per catalog, across processes, for the moments the catalog and a save folder
change together.

A park's commit (the old state file renamed aside, the new one renamed in, the catalog
row written) and a delete (the row removed, the files unlinked) are each several steps.
Two KV Valet processes (the window and a CLI, two CLIs) doing them at once on the same
session interleave: a re-park's row written over another process's newer file, a delete
unlinking the file another process just swapped in. The fault matrix
(tests/faults/test_two_processes.py) catches both. So each such block runs under an
exclusive ``flock`` on ``<catalog>.lock``: short (milliseconds; no server call inside),
released by the kernel when its holder dies (a SIGKILL mid-commit never leaves it held).

POSIX only (``fcntl``); elsewhere the blocks run unlocked, as before.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

from app import files
from app.store.catalog import Catalog, CatalogError

#: How long a park's commit or a delete waits for another process's block (milliseconds long).
WAIT_S = 30.0


class FilesLock:
    def __init__(self, catalog: Catalog):
        p = str(catalog.path)
        self.path = None if p == ":memory:" or fcntl is None else Path(p + ".lock")
        self._fd: int | None = None

    def acquire(self, timeout: float = WAIT_S) -> "FilesLock":
        """Wait (polling, so a worker thread can give up) until no other process holds it."""
        if self.path is None:
            return self
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise CatalogError(f"cannot lock the session catalog ({self.path}): {e.strerror or e}") from None
        try:
            try:
                files.take_flock(fd, timeout, "")
            except TimeoutError:
                raise CatalogError(f"another KV Valet process has been moving session files for "
                                   f"{timeout:.0f} s ({self.path} is locked): try again") from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the only descriptor of this lock: closing it releases the flock
            self._fd = None


@contextlib.contextmanager
def files_locked(catalog: Catalog, timeout: float = WAIT_S) -> Iterator[None]:
    lock = FilesLock(catalog).acquire(timeout)
    try:
        yield
    finally:
        lock.release()
