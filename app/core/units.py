"""Units, the "not available" value, and the one way KV Valet writes sizes and durations.

``NA`` follows nvitop's ``NA``: a value that stands in for a reading NVML (or
psutil) could not give, prints as ``N/A`` whatever the format spec, is falsy,
and never raises when formatted. Bytes and seconds are the units everywhere;
:func:`fmt_bytes` and :func:`fmt_duration` turn them into text only at the edge
(CLI tables, UI labels), the same text in the window and the CLI:

* sizes in binary units, one decimal: ``512 B``, ``1.5 KiB``, ``40.0 MiB``, ``1.2 GiB``;
* durations: ``850 ms``, ``12.3 s``, ``12 min 5 s``, ``1 h 2 min``, ``2 d 3 h``.
"""

from __future__ import annotations

import re
from typing import Any

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

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4

_SPEC = re.compile(r"^(?:(?P<fill>.)?(?P<align>[<>=^]))?[+\- ]?z?#?0?(?P<width>\d+)?")


class NaType:
    """Singleton for a value that is not available (prints as ``N/A``)."""

    _instance: "NaType | None" = None
    __slots__ = ()

    def __new__(cls) -> "NaType":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "NA"

    def __str__(self) -> str:
        return "N/A"

    def __bool__(self) -> bool:
        return False

    def __format__(self, spec: str) -> str:
        # Keep only fill/align/width: a numeric spec such as ">8.1f" must not
        # raise on N/A (nvitop's NA behaves the same way).
        m = _SPEC.match(spec or "")
        fill = (m.group("fill") if m else None) or " "
        align = (m.group("align") if m else None) or ">"
        if align == "=":
            align = ">"
        width = (m.group("width") if m else None) or ""
        return format("N/A", f"{fill}{align}{width}")

    def __reduce__(self) -> str:
        return "NA"

    def __copy__(self) -> "NaType":
        return self

    def __deepcopy__(self, memo: Any) -> "NaType":
        return self


NA = NaType()


def is_na(value: Any) -> bool:
    """True for ``NA`` and ``None``."""
    return value is None or value is NA


def na_to_none(value: Any) -> Any:
    return None if value is NA else value


def fmt_bytes(n: Any) -> str:
    """A size in binary units: ``512`` -> ``"512 B"``, ``1536`` -> ``"1.5 KiB"``,
    ``40 * MiB`` -> ``"40.0 MiB"``; ``NA``/``None`` -> ``"N/A"``. A value that would round
    up to 1024 of a unit is written in the next one (``"1.0 MiB"``, not ``"1024.0 KiB"``)."""
    if is_na(n):
        return "N/A"
    try:
        v = float(n)
    except (TypeError, ValueError):
        return "N/A"
    if v != v:  # NaN
        return "N/A"
    sign = "-" if v < 0 else ""
    v = abs(v)
    if v < KiB:
        return f"{sign}{int(v)} B"
    units = (("KiB", KiB), ("MiB", MiB), ("GiB", GiB), ("TiB", TiB))
    for i, (unit, size) in enumerate(units):
        if round(v / size, 1) < 1024 or i == len(units) - 1:
            return f"{sign}{v / size:,.1f} {unit}"
    return f"{sign}{int(v)} B"  # pragma: no cover


def fmt_duration(seconds: Any) -> str:
    """A duration: ``0.85`` -> ``"850 ms"``, ``12.34`` -> ``"12.3 s"``, ``725`` ->
    ``"12 min 5 s"``, ``3720`` -> ``"1 h 2 min"``, ``183600`` -> ``"2 d 3 h"``;
    ``None``/``NA`` -> ``"-"``. The smaller part is left out when it is zero (``"12 min"``)."""
    if is_na(seconds):
        return "-"
    try:
        s = float(seconds)
    except (TypeError, ValueError):
        return "-"
    if s != s or s in (float("inf"), float("-inf")):
        return "-"
    if s < 0:
        return "-" + fmt_duration(-s)
    if round(s * 1000) < 1000:
        return f"{s * 1000:.0f} ms"
    if round(s, 1) < 60:
        return f"{s:.1f} s"
    whole = round(s)  # whole seconds from here on; each step rounds the smaller part
    if whole < 3600:
        m, sec = divmod(whole, 60)
        return f"{m} min" + (f" {sec} s" if sec else "")
    minutes = round(s / 60)
    if minutes < 24 * 60:
        h, m = divmod(minutes, 60)
        return f"{h} h" + (f" {m} min" if m else "")
    d, h = divmod(round(s / 3600), 24)
    return f"{d:,} d" + (f" {h} h" if h else "")


def fmt_mib(n: Any) -> str:
    """Bytes as whole MiB with thousands separators: ``"16,280 MiB"``."""
    if is_na(n):
        return "N/A"
    try:
        return f"{float(n) / MiB:,.0f} MiB"
    except (TypeError, ValueError):
        return "N/A"


def fmt_pct(p: Any, digits: int = 0) -> str:
    if is_na(p):
        return "N/A"
    try:
        return f"{float(p):.{digits}f} %"
    except (TypeError, ValueError):
        return "N/A"


def fmt_uptime(s: float | None) -> str:
    """Seconds as ``[Nd ]HH:MM:SS`` ("-" when unknown)."""
    if s is None:
        return "-"
    s = int(s)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return (f"{d}d " if d else "") + f"{h:02d}:{m:02d}:{s:02d}"
