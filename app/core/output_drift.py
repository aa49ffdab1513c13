"""How far a correct restore's log-probs may move from a cold prefill's: the measured bound.

A correct restore is not bit-identical to a cold prefill of the same prompt: the resumed server
computed the restored positions in other batches than the cold prefill does, and float sums in
another order differ. The output check (:mod:`app.core.output_check`) therefore compares the two
sides' log-probs position by position and calls a restore wrong only when they moved apart by more
than correct restores were *measured* to move: ``output_drift.json`` beside this module holds that
measurement (``tests/real/output_drift.py --write`` makes it on real servers: every family of the
resume matrix, the stock server and KV Valet's sidecar build in fork and v2 mode, one and two
threads, at least 20 correct restores each) and the bound per model architecture that follows from it.

The statistic is :func:`app.core.output_check.position_delta`'s, maximised over the ``k`` compared
positions of one restore. The bound of an architecture is the largest value measured on it, times
the safety factor the file states (one stated rule, not a value fitted to any test); an architecture
that was not measured gets the largest bound of all and the verdict says so.

Pure: reads one packaged file, once.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA_FILE = Path(__file__).with_name("output_drift.json")


class DriftDataError(RuntimeError):
    """The packaged measurement is missing or malformed (an install problem, said in plain words)."""


@dataclass(frozen=True)
class Bound:
    """The largest log-prob move (nats) a correct restore of ``arch`` showed, with the safety factor."""

    nats: float
    arch: str | None  # the architecture it was measured on; None: not measured, the largest bound of all
    restores: int  # how many correct restores the bound rests on
    measured_max: float  # the largest value measured (before the factor)
    factor: float

    def source(self) -> str:
        """One line for a verdict: where the bound comes from."""
        what = f"{self.arch}" if self.arch else "any measured architecture (this one was not measured)"
        return (f"the largest drift measured on {self.restores:,} correct restores of {what}, "
                f"{self.measured_max:.3f} nats, x{self.factor:g}")


def load(path: str | None = None) -> dict[str, Any]:
    """The measurement (``DATA_FILE`` unless ``path``; a measuring run points ``DATA_FILE`` at a file
    whose bound lets every position be scored)."""
    return _load(str(DATA_FILE if path is None else path))


@functools.lru_cache(maxsize=4)
def _load(path: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DriftDataError(f"the output check's drift measurement {path} cannot be read: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("cells"), list) or not data.get("factor"):
        raise DriftDataError(f"the output check's drift measurement {path} has no cells or no factor")
    return data


def bound_for(arch: str | None, data: dict[str, Any] | None = None) -> Bound:
    """The bound for a model of architecture ``arch`` (GGUF ``general.architecture``)."""
    data = load() if data is None else data
    factor = float(data["factor"])
    cells = [c for c in data["cells"] if isinstance(c, dict) and c.get("n")]
    mine = [c for c in cells if arch and c.get("arch") == arch]
    used = mine or cells
    if not used:
        raise DriftDataError("the output check's drift measurement holds no measured cells")
    top = max(float(c["max"]) for c in used)
    n = sum(int(c["n"]) for c in used)
    return Bound(round(_ceil3(top * factor), 3), arch if mine else None, n, top, factor)


def _ceil3(x: float) -> float:
    return -(-round(x * 1000, 6) // 1) / 1000
