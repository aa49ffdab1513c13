"""The values of a move: its errors, the source session and its files, its result, a target's name
and a move's id.

Shared by the facts (:mod:`app.move.facts`), the target's half (:mod:`app.move.receive`), the
endpoints (:mod:`app.move.endpoints`) and the transfer (:mod:`app.move.transfer`), and by the faces,
which catch a move's errors and show its result.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from app.core.compat import Compatibility, SessionFacts
from app.store.catalog import SessionRecord

_ID_RE = re.compile(r"[0-9a-f]{12}")


class MoveError(Exception):
    """A move that cannot be done or failed; the message is user-facing."""


class MoveRefused(MoveError):
    """A compatibility rule (or the name at the target) refuses the move; nothing was copied."""

    def __init__(self, compat: Compatibility):
        self.compat = compat
        self.reasons = [str(p) for p in compat.refusals]
        super().__init__("; ".join(self.reasons))


class ChecksumMismatch(MoveError):
    """The target read back a file whose SHA-256 is not the one the manifest gave (``file``: its name)."""

    def __init__(self, message: str, *, file: str = "", got: str = "", expected: str = ""):
        super().__init__(message)
        self.file, self.got, self.expected = file, got, expected


class MoveCancelled(MoveError):
    """Raised from a progress callback to stop a move (the source stays as it was)."""



@dataclass(frozen=True)
class SourceFile:
    suffix: str  # "" for the state file, ".ckpt" / ".checkpoints" for its sidecar
    path: str  # on the source's machine
    size: int

    @property
    def role(self) -> str:
        return "state" if not self.suffix else "sidecar"


@dataclass
class SourceSession:
    record: SessionRecord
    facts: SessionFacts
    files: list[SourceFile]
    #: a local source's files against what its park wrote, read here (app.sessions.files_check: sizes and
    #: checkpoint positions); None for another machine's (its sizes are compared, its bytes as they are sent)
    files_problems: list[str] | None = None

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass
class MoveResult:
    record: SessionRecord  # as stored at the target
    source: str
    target: str
    moved: bool  # the source was deleted (a move that finished)
    bytes: int
    warnings: list[str] = field(default_factory=list)
    source_kept: str | None = None  # a move whose source could not be deleted: why


def parse_target(text: str) -> tuple[str | None, str]:
    """``PROFILE`` -> (None, PROFILE); ``HOST:PROFILE`` -> (HOST, PROFILE). Profile names hold no ':'."""
    host, sep, profile = text.rpartition(":")
    if not sep:
        return None, text
    if not host or not profile:
        raise MoveError(f"'{text}': give a profile, or HOST:PROFILE")
    return host, profile


def check_move_id(move_id: str) -> str:
    if not isinstance(move_id, str) or not _ID_RE.fullmatch(move_id):
        raise MoveError(f"not a move id: {move_id!r}")
    return move_id
