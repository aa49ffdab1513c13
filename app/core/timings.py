"""The ``timings`` of a llama-server response, read once into one value.

``/completion`` answers ``{"timings": {"cache_n": 2880, "prompt_n": 5, "prompt_ms": 78.4,
"predicted_n": 4, "predicted_ms": 40.1, ...}}``; ``/slots/N?action=save`` answers
``{"timings": {"save_ms": ...}}`` and ``?action=restore`` ``{"timings": {"restore_ms": ...}}``.
:meth:`Timings.from_json` reads any of them and never raises: a figure that is missing,
not a number, negative, or not finite is None. A count that is a whole number written as a
float or a numeric string (``2880.0``, ``"2880"``) is read as that number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

_COUNTS = ("prompt_n", "cache_n", "predicted_n")
_FIGURES = ("prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_ms", "predicted_per_token_ms",
            "predicted_per_second", "save_ms", "restore_ms")


@dataclass(frozen=True)
class Timings:
    """Token counts (``*_n``) and durations in milliseconds (``*_ms``); None when unknown."""

    prompt_n: int | None = None  # prompt tokens processed (not taken from the cache)
    prompt_ms: float | None = None
    prompt_per_token_ms: float | None = None
    prompt_per_second: float | None = None
    cache_n: int | None = None  # prompt tokens reused from the slot's cache
    predicted_n: int | None = None
    predicted_ms: float | None = None
    predicted_per_token_ms: float | None = None
    predicted_per_second: float | None = None
    save_ms: float | None = None  # a slot save
    restore_ms: float | None = None  # a slot restore

    @classmethod
    def from_json(cls, data: Any) -> "Timings | None":
        """The ``timings`` object of a response; None when it is not an object at all."""
        if not isinstance(data, Mapping):
            return None
        values: dict[str, Any] = {k: _count(data.get(k)) for k in _COUNTS}
        values.update({k: _figure(data.get(k)) for k in _FIGURES})
        return cls(**values)

    @classmethod
    def of(cls, response: Any) -> "Timings":
        """The timings of a whole response (``response["timings"]``); all None when it has none."""
        t = cls.from_json(response.get("timings")) if isinstance(response, Mapping) else None
        return t if t is not None else cls()

    @property
    def ttft_ms(self) -> float | None:
        """Time to the first token: the prompt, plus one predicted token when there was one."""
        if self.prompt_ms is None:
            return None
        n = self.predicted_n or 0
        if n >= 1:
            per = self.predicted_per_token_ms
            if per is None and self.predicted_ms is not None:
                per = self.predicted_ms / n
            return self.prompt_ms + (per or 0.0)
        return self.prompt_ms


def _number(value: Any) -> float | None:
    if isinstance(value, bool):  # JSON true is not a count
        return None
    if isinstance(value, (int, float)):
        x = float(value) if not isinstance(value, int) or abs(value) < 2**53 else None
    elif isinstance(value, str) and len(value) <= 40:
        try:
            x = float(value.strip())
        except ValueError:
            return None
    else:
        return None
    if x is None or not math.isfinite(x) or x < 0:
        return None
    return x


def _count(value: Any) -> int | None:
    x = _number(value)
    return int(x) if x is not None and x.is_integer() else None


def _figure(value: Any) -> float | None:
    return _number(value)
