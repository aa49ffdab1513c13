"""What :class:`app.servers.service.ServerService` tells its subscribers: typed events, each
carrying the server's target id (``profile:NAME`` or ``url:URL``). The window re-emits them as
Qt signals; ``kv-valet serve`` prints them. The report of one park-then-stop is a value of the
sessions layer (:mod:`app.sessions.park_stop`): the session service returns it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from app.core.lifecycle import StopTrigger
from app.core.states import ServerState
from app.server.launcher import LaunchPlan
from app.server.outcome import Outcome

if TYPE_CHECKING:  # type-only, still an arrow (a downward one): the events load without the service
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
