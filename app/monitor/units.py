"""The monitor's units: moved to :mod:`app.core.units` (one byte and one duration formatter
for the whole app); re-exported here for the monitor modules that import them from here."""

from __future__ import annotations

from app.core.units import (GiB, KiB, MiB, NA, NaType, TiB, fmt_bytes, fmt_duration, fmt_mib, fmt_pct,
                            fmt_uptime, is_na, na_to_none)

__all__ = [
    "KiB",
    "MiB",
    "GiB",
    "TiB",
    "NA",
    "NaType",
    "is_na",
    "na_to_none",
    "fmt_bytes",
    "fmt_duration",
    "fmt_mib",
    "fmt_pct",
    "fmt_uptime",
]
