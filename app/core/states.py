"""The enums every layer shares: a server's state, its health, a model's memory kind, a
sidecar's status, and what the computer is about to do.

They live in core so that a layer below the one that produces them (the catalog
stores memory kinds and sidecar statuses; the window compares server states) needs
nothing else of that layer. ``app.server.gguf_info``, ``app.server.sidecar`` and
``app.server.supervisor`` re-export the first three under their old names.
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


class Health(enum.StrEnum):
    """What a server answered to its last health check (app.monitor.snapshot reads it): the one
    word every tab, the status bar and ``kv-valet status --json`` compare, never the text "ok".

    On the wire (``status --json``, a host's answer) it is the value, followed by ``": why"`` when
    there is a reason ("unreachable: connection refused"): :meth:`parse` and :func:`health_text`."""

    OK = "ok"
    LOADING = "loading"
    UNREACHABLE = "unreachable"
    ERROR = "error"  # the sample itself failed (app.monitor.snapshot.error_snapshot)
    NOT_RUNNING = "not running"  # nothing answers, and nothing was asked (a host's profile that is down)

    @classmethod
    def parse(cls, text: object) -> tuple["Health", str]:
        """``"ok"``, ``"loading"``, ``"unreachable: why"`` (a host's ``status --json``) as (health, why);
        an empty or unknown word is NOT_RUNNING / UNREACHABLE with the text as its reason."""
        if isinstance(text, Health):
            return text, ""
        raw = str(text or "").strip()
        if not raw:
            return cls.NOT_RUNNING, ""
        word, _, why = raw.partition(":")
        word = word.strip().lower()
        for h in cls:
            if word == h.value:
                return h, why.strip()
        if word in ("ready", "healthy"):
            return cls.OK, ""
        return cls.UNREACHABLE, raw

    @property
    def ready(self) -> bool:
        return self is Health.OK

    def state(self) -> ServerState:
        """The server state this health means for a server nobody here supervises (a host's)."""
        return ServerState.READY if self is Health.OK else ServerState.LOADING if self is Health.LOADING \
            else ServerState.STOPPED


def health_text(health: Health, why: str = "") -> str:
    """``health`` as written on the wire and shown: "ok", "unreachable: connection refused"."""
    return f"{health.value}: {why}" if why else health.value


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
