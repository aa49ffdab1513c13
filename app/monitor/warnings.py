"""Warnings computed from one snapshot (pure; duck-typed on the Snapshot).

Named ``warnings`` after its role; import it as ``app.monitor.warnings``. The
dataclass is ``MonitorWarning``, so that it does not shadow the builtin where it is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.core.units import MiB, fmt_bytes, is_na

__all__ = [
    "MonitorWarning",
    "compute_warnings",
    "WARNING",
    "CRITICAL",
    "GPU_MEM_THRESHOLD",
    "SLOT_FILL_THRESHOLD",
]

WARNING = "warning"
CRITICAL = "critical"

GPU_MEM_THRESHOLD = 0.95  # warn above 95 % of a GPU's memory
SLOT_FILL_THRESHOLD = 0.90  # warn within 10 % of a slot's n_ctx


@dataclass(frozen=True)
class MonitorWarning:
    level: str  # WARNING or CRITICAL
    text: str


def compute_warnings(snapshot: Any) -> list[MonitorWarning]:
    """Warnings for the UI/CLI; never raises on partial snapshots."""
    out: list[MonitorWarning] = []

    gpu = getattr(snapshot, "gpu", None)
    for g in getattr(gpu, "gpus", ()) or ():
        if getattr(g, "lost", False):
            out.append(
                MonitorWarning(
                    CRITICAL,
                    f"GPU {g.index} ({g.name}) was lost (Xid / driver reset?): "
                    "the server on it has probably failed",
                )
            )
            continue
        total, used = getattr(g, "mem_total", None), getattr(g, "mem_used", None)
        if is_na(total) or is_na(used) or not total:
            continue
        frac = used / total
        if frac > GPU_MEM_THRESHOLD:
            out.append(
                MonitorWarning(
                    WARNING,
                    f"GPU {g.index} ({g.name}) memory {frac:.0%} full "
                    f"({fmt_bytes(used)} of {fmt_bytes(total)})",
                )
            )

    for row in getattr(snapshot, "slots", ()) or ():
        held, n_ctx = getattr(row, "tokens_held", None), getattr(row, "n_ctx", None)
        if held is None or not n_ctx:
            continue
        if held >= n_ctx * SLOT_FILL_THRESHOLD:
            level = CRITICAL if held >= n_ctx else WARNING
            out.append(
                MonitorWarning(
                    level,
                    f"slot {row.id} holds {held:,} of {n_ctx:,} tokens "
                    f"({held / n_ctx:.0%}): the context is nearly full",
                )
            )

    # --cache-ram: MiB; -1 = unlimited and 0 = disabled give no warning (no
    # finite budget to compare with).
    budget_mib = getattr(snapshot, "cache_ram_mib", None)
    host = getattr(snapshot, "host", None)
    available = getattr(host, "ram_available", None)
    if isinstance(budget_mib, int) and budget_mib > 0 and isinstance(available, int):
        budget = budget_mib * MiB
        if available < budget:
            out.append(
                MonitorWarning(
                    WARNING,
                    f"host available RAM {fmt_bytes(available)} is below the server's "
                    f"--cache-ram budget {fmt_bytes(budget)}: a growing prompt cache may push "
                    "the machine into swap",
                )
            )
    return out
