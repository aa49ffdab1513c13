"""What one park-then-stop did: a value, in the sessions layer because it is made of parks.

:meth:`app.servers.service.ServerService.park_then_stop` fills it; a session service hands it
back from :meth:`app.sessions.service.SessionService.park_all_and_stop`; the window and
``kv-valet serve`` say it. It lives here, below both services, so that the session service
names what it returns without importing the server service's events (a floor above it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from app.core.lifecycle import StopTrigger
from app.sessions.park import ParkResult
from app.sessions.resume_plan import PlanEntry


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
