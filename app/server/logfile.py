"""The server's full log on disk, one rotating file per profile.

The window keeps only the newest lines in memory (a ring buffer), and a launch
uses ``-lv 4``: the lines that prove a verdict (``restored N context checkpoints
from sidecar``, ``forcing full prompt re-processing``) would scroll away. The
file keeps every line, so ``kv-valet check PROFILE`` and the log-driven verdicts
can read them without ``--log-file``, and a user can attach it to a bug report.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from app import files

MAX_BYTES = 20 * 1024 * 1024  # per file
BACKUPS = 3  # <profile>.log.1 … .3


class ServerLogFile:
    def __init__(self, path: str | os.PathLike, *, max_bytes: int = MAX_BYTES, backups: int = BACKUPS):
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self._f = None
        self._size = 0
        self._lock = threading.Lock()  # written by the supervisor's reader thread, opened/closed by the loop

    def open(self, header: str = "") -> None:
        """Open for appending; ``header`` starts a new section (one launch)."""
        files.private_dir(self.path.parent)  # 0700, the log 0600: it holds prompts and outputs
        with self._lock:
            self._f = files.open_private(self.path, "a", encoding="utf-8", errors="replace", buffering=1)
            self._size = self.path.stat().st_size
            self._prune()
        if header:
            self.write(f"===== {time.strftime('%Y-%m-%d %H:%M:%S')} {header}")

    def write(self, line: str) -> None:
        with self._lock:
            if self._f is None:
                return
            text = line.rstrip("\n") + "\n"
            if self._size + len(text) > self.max_bytes and self._size > 0:
                self._rotate()
            try:
                self._f.write(text)
            except (OSError, ValueError):  # a full disk must not stop the server's supervision
                return
            self._size += len(text)

    def _rotate(self) -> None:
        self._f.close()
        for i in range(self.backups, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            newer = self.path.with_name(f"{self.path.name}.{i - 1}") if i > 1 else self.path
            if newer.exists():
                os.replace(newer, older)
        # with no backups kept, the file starts over
        self._f = files.open_private(self.path, "a" if self.backups else "w", encoding="utf-8", errors="replace",
                                     buffering=1)
        self._size = 0
        self._prune()

    def _prune(self) -> None:
        """Drop rotated files past ``backups`` (the preference may have been lowered)."""
        prefix = self.path.name + "."
        try:
            for old in self.path.parent.glob(prefix + "*"):
                suffix = old.name[len(prefix):]
                if suffix.isdigit() and int(suffix) > self.backups:
                    old.unlink(missing_ok=True)
        except OSError:
            pass

    def close(self) -> None:
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None
