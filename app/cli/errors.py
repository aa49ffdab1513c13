"""One exit-code table and one error printer for every ``kv-valet`` command."""

from __future__ import annotations

import enum
import sys


class Exit(enum.IntEnum):
    OK = 0
    FAIL = 1  # an error, a refusal, or a slot that could not be parked
    USAGE = 2  # wrong arguments
    DISCARDED = 3  # check: the resume bought nothing (the server re-prefilled)
    DIFFERS = 4  # check: warm but wrong (the output differs from a cold prefill)
    INTERRUPTED = 130  # Ctrl-C


class CliError(Exception):
    """A user-facing failure; ``exit`` is the status to leave with."""

    def __init__(self, message: str, exit: Exit = Exit.FAIL, details: list[str] | None = None,
                 refused: str | None = None):
        super().__init__(message)
        self.exit = exit
        self.details = list(details or [])
        self.refused = refused  # a resume left parked on purpose: why, in one word ("--json" prints it)


def error(message: str, details: list[str] | None = None) -> None:
    """Print ``error: message`` (and indented details) on stderr."""
    print(f"error: {message}", file=sys.stderr)
    for d in details or []:
        print(f"  - {d}", file=sys.stderr)


def note(message: str) -> None:
    """A side remark on stderr (recovery, progress), never mixed into stdout's output."""
    print(f"[kv-valet] {message}", file=sys.stderr, flush=True)
