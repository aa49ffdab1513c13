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
positions of one restore. Drift depends on the weights' precision as much as on the architecture: the
F32 tiny models restore bit for bit (0.000 nats), Gemma 3 270M at Q4_K_M moved up to 1.08 nats on
correct checkpoint restores. So a cell says its ``precision`` (``f32``: GGUF file type F32 or not set;
``reduced``: any other). The bound for a reduced-precision model is the largest value measured on cells
of its architecture at reduced precision, else at reduced precision on any architecture (never an F32
cell's ~0, which would call its correct restores wrong); for an F32 model, on its architecture at any
precision (the wider bound wins: the F32 measurement of some architectures saw no drift at all, which no
bound can rest on); for a model of unknown precision, the largest of all — each times the safety factor
the file states (one stated rule, not a value fitted to any test). The verdict says
which cells the bound rests on.

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


F32 = "f32"
REDUCED = "reduced"


def precision_of(file_type: int | None) -> str:
    """A model's precision class from its GGUF ``general.file_type`` (0: all F32; absent: F32 too,
    as llama.cpp's test-llama-archs writes it)."""
    return F32 if file_type in (None, 0) else REDUCED


@dataclass(frozen=True)
class Bound:
    """The largest log-prob move (nats) a correct restore of ``arch`` showed, with the safety factor."""

    nats: float
    arch: str | None  # the architecture it was measured on; None: not measured, the largest bound of all
    restores: int  # how many correct restores the bound rests on
    measured_max: float  # the largest value measured (before the factor)
    factor: float
    precision: str | None = None  # the precision class of the cells it rests on (None: every class)

    def source(self) -> str:
        """One line for a verdict: where the bound comes from."""
        weights = {F32: "F32 ", REDUCED: "reduced-precision "}.get(self.precision or "", "")
        what = (f"{weights}{self.arch}" if self.arch else
                f"{weights}models of any architecture (this one was not measured{' at this precision' if self.precision else ''})")
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


def bound_for(arch: str | None, precision: str | None = None, data: dict[str, Any] | None = None) -> Bound:
    """The bound for a model of architecture ``arch`` (GGUF ``general.architecture``) and precision
    class ``precision`` (:func:`precision_of`; None: not known, so the largest of all)."""
    data = load() if data is None else data
    factor = float(data["factor"])
    cells = [c for c in data["cells"] if isinstance(c, dict) and c.get("n")]
    if not cells:
        raise DriftDataError("the output check's drift measurement holds no measured cells")
    if precision == F32:  # an F32 model: its architecture's cells at any precision (the wider bound wins)
        mine = [c for c in cells if arch and c.get("arch") == arch]
        used, on_arch, on_precision = (mine, arch, None) if mine else (cells, None, None)
    else:  # reduced precision: never an F32 cell's drift of ~0, which would call its correct restores wrong
        same_precision = [c for c in cells if precision is not None and c.get("precision", REDUCED) == precision]
        mine = [c for c in same_precision if arch and c.get("arch") == arch]
        used, on_arch, on_precision = ((mine, arch, precision) if mine else
                                       (same_precision, None, precision) if same_precision else (cells, None, None))
    top = max(float(c["max"]) for c in used)
    n = sum(int(c["n"]) for c in used)
    return Bound(round(_ceil3(top * factor), 3), on_arch, n, top, factor, on_precision)


def _ceil3(x: float) -> float:
    return -(-round(x * 1000, 6) // 1) / 1000
