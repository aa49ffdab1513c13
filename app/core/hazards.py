"""Flag combinations known to crash, stall or waste parks, for a profile on its own.

A thin view of :mod:`app.core.rules` for the profile form and ``kv-valet profiles``:
the rules run with no gathered facts (no binary, model or catalog), so only what
the profile itself says can fire. ``kv-valet doctor`` runs them with the facts.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.core.findings import Severity
from app.core.profile import LaunchProfile
from app.core.rules import Facts, diagnose


@dataclass(frozen=True)
class Hazard:
    key: str  # the rule id
    text: str
    severity: Severity = Severity.WARNING


def hazards(p: LaunchProfile) -> list[Hazard]:
    return [Hazard(f.rule_id, f.message, f.severity) for f in diagnose(p, Facts())]


def hazard_prefix(h: Hazard) -> str:
    """How a hazard line starts in plain text: "error", "warning" or "note"."""
    return {Severity.ERROR: "error", Severity.WARNING: "warning"}.get(h.severity, "note")
