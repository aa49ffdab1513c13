"""One-click remedy: apply a finding's profile change without losing a chat.

The change goes to a **copy** of the profile (``<name>-fix-<rule>``; the
original stays as it was, to go back to), which parks into the same folder.
Before the restart every slot that holds tokens is parked; after it, each
parked session goes back into its slot (or the first empty one, when the
change left fewer slots), and its verdict comes with the next query, as after
any resume. A server that already crashed has nothing left to park: the
sessions that had been resumed into it are put back instead (their files are
on disk).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from app.core.findings import Remedy
from app.core.profile import LaunchProfile
from app.sessions.park import ParkResult
from app.server.launcher import slot_save_path_for

log = logging.getLogger(__name__)

#: restart(profile) stops the running server, starts ``profile`` and returns the
#: SessionService connected to it (the window and the CLI each know how).
Restart = Callable[[LaunchProfile], Awaitable[object]]


@dataclass
class Resumed:
    session: str
    slot: int | None
    ok: bool
    detail: str


@dataclass
class RemedyOutcome:
    profile: LaunchProfile  # the copy that now runs
    parked: list[ParkResult] = field(default_factory=list)
    resumed: list[Resumed] = field(default_factory=list)

    def summary(self) -> str:
        parts = [f"now running profile '{self.profile.name}'"]
        if self.parked:
            parts.append(f"parked {sum(1 for r in self.parked if r.ok)} of {len(self.parked)} slots first")
        for r in self.resumed:
            parts.append(f"'{r.session}' → slot {r.slot}: {'resumed' if r.ok else r.detail}")
        return "; ".join(parts)


def fixed_copy(profile: LaunchProfile, remedy: Remedy, rule_id: str) -> LaunchProfile:
    """The profile with the remedy's change, under a new name, parking into the same folder."""
    name = f"{profile.name}-fix-{rule_id}"[:64].rstrip("-_. ")
    return remedy.apply(profile).replace(name=name, slot_save_path=slot_save_path_for(profile))


async def apply_remedy(profile: LaunchProfile, remedy: Remedy, rule_id: str, *, service=None, restored=None,
                       store=None, restart: Restart) -> RemedyOutcome:
    """Park (``service``: connected to the live server), restart with the fixed copy
    of ``profile`` (saved in ``store``), resume. ``restored``: for a server that
    crashed, what had been resumed into it (slot -> RestoredSlot). Raises
    ServiceError when the restart does not give a connected service."""
    from app.sessions.service import ServiceError

    new = fixed_copy(profile, remedy, rule_id)
    if store is not None:
        store.save(new, overwrite=True)
    to_resume: list[tuple[str, int | None]] = []
    parked: list[ParkResult] = []
    if service is not None:
        parked = await service.park_all(f"before {rule_id}")
        to_resume = [(r.record.name, r.slot_id) for r in parked if r.ok]
    elif restored:
        # the server is gone (a crash): what had been resumed into it is on disk
        to_resume = [(e.session, slot) for slot, e in sorted(restored.items()) if e.session]
    new_service = await restart(new)
    if new_service is None:
        raise ServiceError(f"the server of '{new.name}' did not start")
    out = RemedyOutcome(new, parked)
    for name, slot in to_resume:
        rows = await new_service.slot_rows()
        target = slot if any(r.id == slot for r in rows) else None
        try:
            res = await new_service.resume(name, target, force=True)
            out.resumed.append(Resumed(name, res.slot_id, True, f"{res.n_restored:,} tokens"))
        except Exception as e:  # report: one session that does not come back must not stop the others
            log.exception("remedy %s: resuming session %r into slot %s of '%s' failed", rule_id, name, target, new.name)
            out.resumed.append(Resumed(name, target, False, str(e)))
    return out
