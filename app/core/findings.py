"""What KV Valet tells a user about a profile or a running server: findings with remedies.

A :class:`Finding` comes from a profile rule (app.core.rules, before launch) or
from a runtime detector (app.tools.cache_health, while the server runs). Both
say the same things: what is wrong in the user's words, how bad it is, where it
is known from (a seed report, an upstream issue), and, when there is one, the
:class:`Remedy`: a change to the profile that KV Valet can apply for the user.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Severity(enum.StrEnum):
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"  # the server will crash, stall or lose the parked sessions' value

    @property
    def rank(self) -> int:
        return {"info": 0, "warning": 1, "error": 2}[self.value]


@dataclass(frozen=True)
class Remedy:
    """A profile change: field name -> new value (LaunchProfile fields; None clears)."""

    label: str  # e.g. "Set --cache-ram 0"
    changes: dict[str, Any] = field(default_factory=dict)

    def apply(self, profile):
        return profile.replace(**self.changes)


@dataclass(frozen=True)
class Finding:
    rule_id: str  # stable id, e.g. "rpc-prompt-cache-assert"
    severity: Severity
    message: str  # one or two sentences in the user's words
    remedies: tuple[Remedy, ...] = ()
    source: str = ""  # where it is known from: "seed 002, llama.cpp #26128"
    slot: int | None = None  # runtime findings: the slot it happened on
    at: float | None = None  # runtime findings: when (epoch seconds)
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def remedy(self) -> Remedy | None:
        return self.remedies[0] if self.remedies else None
