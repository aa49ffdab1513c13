"""What :class:`app.servers.service.ServerService` tells its subscribers: typed events, each
carrying the server's target id (``profile:NAME`` or ``url:URL``), and the report of one
park-then-stop. The window re-emits them as Qt signals; ``kv-valet serve`` prints them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

from app.core.lifecycle import StopTrigger
from app.core.states import ServerState
from app.server.launcher import LaunchPlan
from app.server.outcome import Outcome
from app.sessions.park import ParkResult
from app.sessions.resume_plan import PlanEntry

if TYPE_CHECKING:
    from app.sessions.service import SessionService


@dataclass(frozen=True)
class StateChanged:
    target_id: str
    state: ServerState
    detail: str = ""  # the URL when Ready, the outcome's summary when Crashed
    outcome: Outcome | None = None


@dataclass(frozen=True)
class LaunchPlanned:
    target_id: str
    plan: LaunchPlan


@dataclass(frozen=True)
class LaunchRefused:
    target_id: str
    message: str  # nothing was started; the reason, for the user


@dataclass(frozen=True)
class Progress:
    target_id: str
    what: str
    percent: int


@dataclass(frozen=True)
class SessionsChanged:
    target_id: str
    sessions: SessionService | None  # connected (the server is Ready), or None (it went)


@dataclass(frozen=True)
class Notice:
    target_id: str
    message: str  # for the status line
    ok: bool = True


@dataclass(frozen=True)
class ProxyChanged:
    target_id: str
    proxy: object | None  # the conversation proxy in front of the server (app.proxy.service), or None


@dataclass(frozen=True)
class Parking:
    target_id: str
    trigger: StopTrigger
    message: str


ServerEvent = Union[StateChanged, LaunchPlanned, LaunchRefused, Progress, SessionsChanged, Parking, Notice,
                    ProxyChanged]


@dataclass
class ParkStopReport:
    """What one park-then-stop did."""

    trigger: StopTrigger
    target_id: str
    results: list[ParkResult] = field(default_factory=list)
    plan: list[PlanEntry] = field(default_factory=list)
    stopped: bool = False
    interrupted: str | None = None  # "a second signal" / "the 120 s limit": the parks were cut short
    error: str | None = None  # the parks could not run (the server stopped answering …)

    @property
    def failed(self) -> list[ParkResult]:
        return [r for r in self.results if not r.ok]

    @property
    def complete(self) -> bool:
        return not self.failed and self.interrupted is None and self.error is None
