"""The resume plan that "Park all & stop" (and the park before a suspend) leaves for "Resume all".

The resume plan (``data_dir()/resume-plans/<profile>.json``: ``[{slot,
session}]``) remembers which session came from which slot id, so a client
that pins ``id_slot`` finds its conversation where it left it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from app import paths
from app import files
from app.sessions.park import ParkResult


@dataclass(frozen=True)
class PlanEntry:
    """One slot of a resume plan: which session goes back into which slot id."""

    slot: int
    session: str


def _safe(profile: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in profile) or "_"


def plan_path(profile: str) -> Path:
    return paths.data_dir() / "resume-plans" / f"{_safe(profile)}.json"


def write_resume_plan(profile: str, results: list[ParkResult]) -> list[PlanEntry]:
    plan = [PlanEntry(r.slot_id, r.record.name) for r in results if r.ok and r.record and r.slot_id is not None]
    return write_resume_plan_entries(profile, plan)


def write_resume_plan_entries(profile: str, plan: list[PlanEntry]) -> list[PlanEntry]:
    path = plan_path(profile)
    files.write_private(path, json.dumps([{"slot": e.slot, "session": e.session} for e in plan],
                                         ensure_ascii=False, indent=1))
    return plan


def load_resume_plan(profile: str) -> list[PlanEntry]:
    try:
        data = json.loads(plan_path(profile).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    if not isinstance(data, list):
        return []
    return [PlanEntry(e["slot"], e["session"]) for e in data if isinstance(e, dict)
            and isinstance(e.get("slot"), int) and isinstance(e.get("session"), str)]


def clear_resume_plan(profile: str) -> None:
    try:
        plan_path(profile).unlink()
    except FileNotFoundError:
        pass
