"""Park every slot and stop the server; offer "Resume all" at the next start.

The resume plan (``data_dir()/resume-plans/<profile>.json``: ``[{slot,
session}]``) remembers which session came from which slot id, so a client
that pins ``id_slot`` finds its conversation where it left it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from app import paths
from app.jobs.park import ParkResult, park_all
from app.jobs.resume import ResumeRefused, resume_session
from app.jobs.target import ServerTarget


class StopSkipped(Exception):
    """Some slots could not be parked, so the server was left running."""

    def __init__(self, results: list[ParkResult]):
        self.results = results
        bad = [r for r in results if not r.ok]
        super().__init__("not stopping the server: " + "; ".join(f"slot {r.slot_id}: {r.error}" for r in bad))


def _safe(profile: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in profile) or "_"


def plan_path(profile: str) -> Path:
    return paths.data_dir() / "resume-plans" / f"{_safe(profile)}.json"


def write_resume_plan(profile: str, results: list[ParkResult]) -> list[dict[str, Any]]:
    plan = [{"slot": r.slot_id, "session": r.record.name} for r in results if r.ok and r.record]
    path = plan_path(profile)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(plan, ensure_ascii=False, indent=1), encoding="utf-8")
    os.replace(tmp, path)
    return plan


def load_resume_plan(profile: str) -> list[dict[str, Any]]:
    try:
        data = json.loads(plan_path(profile).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return [e for e in data if isinstance(e, dict) and isinstance(e.get("slot"), int)
            and isinstance(e.get("session"), str)] if isinstance(data, list) else []


def clear_resume_plan(profile: str) -> None:
    try:
        plan_path(profile).unlink()
    except FileNotFoundError:
        pass


async def park_all_and_stop(target: ServerTarget, supervisor, *, prefix: str | None = None,
                            stop_if_failed: bool = False) -> list[ParkResult]:
    """Park every non-empty slot, write the resume plan, stop the server.

    If a slot fails to park the server keeps running (its tokens would be lost)
    and StopSkipped is raised, unless ``stop_if_failed``.
    """
    results = await park_all(target, prefix=prefix)
    write_resume_plan(target.profile_name, results)
    if any(not r.ok for r in results) and not stop_if_failed:
        raise StopSkipped(results)
    await supervisor.stop()
    return results


async def resume_all(target: ServerTarget, plan: list[dict[str, Any]], force: bool = True) -> list[dict[str, Any]]:
    """Resume each planned session into its slot id; one result dict per entry
    (``ok``, ``slot``, ``session``, ``result`` or ``error``)."""
    out = []
    for entry in plan:
        slot, name = entry["slot"], entry["session"]
        try:
            res = await resume_session(target, name, slot, force=force)
            out.append({"ok": True, "slot": slot, "session": name, "result": res, "warnings": res.warnings})
        except ResumeRefused as e:
            out.append({"ok": False, "slot": slot, "session": name, "error": "; ".join(e.reasons)})
        except Exception as e:  # one failed resume must not stop the others
            out.append({"ok": False, "slot": slot, "session": name, "error": str(e)})
    return out
