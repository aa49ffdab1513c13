"""Why a llama-server process ended, as a value the UI can explain.

Modelled on qutebrowser's ``ProcessOutcome``: exit code or signal, the last
log lines, and a classified cause.
"""

from __future__ import annotations

import enum
import signal as _signal
import time
from dataclasses import dataclass, field

from app.server.logparse import BindFailed, GgmlAssert, Kind, parse_line


class Cause(str, enum.Enum):
    STOPPED_BY_USER = "stopped by the user"
    ASSERT = "GGML assertion failed (abort)"
    ILLEGAL_INSTRUCTION = "illegal instruction (the binary uses CPU instructions this machine lacks)"
    PORT_IN_USE = "port already in use"
    MODEL_UNREADABLE = "model file missing or unreadable"
    OUT_OF_MEMORY = "out of memory"
    KILLED = "killed by a signal"
    EXITED = "exited with an error"
    EXITED_CLEANLY = "shut down in order (exit code 0)"


@dataclass(frozen=True)
class Outcome:
    exit_code: int | None
    signal: int | None
    cause: Cause
    detail: str
    last_lines: tuple[str, ...] = ()
    at: float = field(default_factory=time.time)

    @property
    def by_user(self) -> bool:
        return self.cause == Cause.STOPPED_BY_USER

    def summary(self) -> str:
        how = (f"signal {self.signal} ({_signal_name(self.signal)})" if self.signal
               else f"exit code {self.exit_code}")
        text = f"{self.cause.value} — {how}"
        if self.detail:
            text += f": {self.detail}"
        return text


def _signal_name(sig: int | None) -> str:
    try:
        return _signal.Signals(sig).name if sig else ""
    except ValueError:
        return str(sig)


def classify(returncode: int | None, last_lines: list[str], stopped_by_user: bool) -> Outcome:
    """Turn a return code (negative = signal, as asyncio reports it) and the
    tail of the log into an Outcome."""
    sig = -returncode if returncode is not None and returncode < 0 else None
    code = returncode if returncode is not None and returncode >= 0 else None
    if code is not None and code > 128 and code - 128 in (4, 6, 9, 11):
        sig = code - 128  # a shell-style report of a signal
    lines = tuple(last_lines[-40:])
    if stopped_by_user:
        return Outcome(code, sig, Cause.STOPPED_BY_USER, "", lines)

    events = [parse_line(line) for line in lines]
    for ev in reversed(events):
        if isinstance(ev, GgmlAssert):
            return Outcome(code, sig, Cause.ASSERT, ev.assertion, lines)
    for ev in reversed(events):
        if isinstance(ev, BindFailed):
            return Outcome(code, sig, Cause.PORT_IN_USE, f"port {ev.port} on {ev.host} is already in use", lines)
    for ev in reversed(events):
        if ev.kind == Kind.OUT_OF_MEMORY:
            return Outcome(code, sig, Cause.OUT_OF_MEMORY, ev.text.strip(), lines)
    for ev in events:
        if ev.kind == Kind.MODEL_LOAD_FAILED:
            detail = next((e.text.strip() for e in events if "failed to open" in e.text or "No such file" in e.text),
                          ev.text.strip())
            return Outcome(code, sig, Cause.MODEL_UNREADABLE, detail, lines)
    if sig == _signal.SIGILL:
        return Outcome(code, sig, Cause.ILLEGAL_INSTRUCTION, "", lines)
    if sig == _signal.SIGABRT:
        return Outcome(code, sig, Cause.ASSERT, _last_error(events) or "aborted", lines)
    if sig:
        return Outcome(code, sig, Cause.KILLED, _signal_name(sig), lines)
    if code == 0:
        return Outcome(code, sig, Cause.EXITED_CLEANLY, "", lines)
    return Outcome(code, sig, Cause.EXITED, _last_error(events), lines)


def _last_error(events) -> str:
    for ev in reversed(events):
        if ev.kind in (Kind.ERROR,) or ev.level == "E":
            return ev.text.strip()
    return ""
