"""The enums every layer shares: a server's state, a model's memory kind, a sidecar's
status, and what the computer is about to do.

They live in core so that a layer below the one that produces them (the catalog
stores memory kinds and sidecar statuses; the window compares server states) needs
nothing else of that layer. Every module imports them from here (tests/unit/test_states.py).
"""

from __future__ import annotations

import enum


class ServerState(enum.StrEnum):
    """A llama-server process as the supervisor sees it: Stopped → Starting → Loading →
    Ready → Stopping → Stopped, or Crashed (app.server.supervisor)."""

    STOPPED = "Stopped"
    STARTING = "Starting"
    LOADING = "Loading"
    READY = "Ready"
    STOPPING = "Stopping"
    CRASHED = "Crashed"


class MemoryKind(enum.StrEnum):
    """What a model keeps of its past positions (app.server.gguf_info reads it from the GGUF)."""

    DENSE = "dense"
    SLIDING_WINDOW = "sliding-window"
    RECURRENT_HYBRID = "recurrent-hybrid"
    UNKNOWN = "unknown"  # the model file is not readable here (attach mode to another machine)


class SidecarStatus(enum.StrEnum):
    """A parked session's checkpoint sidecar (app.server.sidecar inspects it)."""

    PRESENT_VALID = "present"
    PRESENT_UNVERIFIED = "present, unverified"  # PR #20819 companion: layout unknown
    MISSING = "missing"
    INVALID = "invalid"
    NOT_NEEDED = "not needed"  # dense model: every position stays in the KV cache


class PowerEvent(enum.StrEnum):
    """What logind announces the computer is about to do (app.ui.shutdown_guard)."""

    SHUTDOWN = "shutdown"
    SLEEP = "sleep"

    @property
    def doing(self) -> str:
        """``shut down`` / ``sleep``, for "The computer is about to …"."""
        return "shut down" if self is PowerEvent.SHUTDOWN else "sleep"
