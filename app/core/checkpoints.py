"""A context checkpoint as llama-server's log describes it.

``created context checkpoint 1 of 32 (pos_min = 1345, pos_max = 2368, n_tokens = 2369, size = 7.506 MiB)``
and ``restored context checkpoint (pos_min = 1857, pos_max = 2880, n_tokens = 2881, n_past = 2880,
size = 7.506 MiB)``: app.server.logparse reads the figures in the parentheses into this value, and
app.core.verdict says how far a resume rolled back from it.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The integer figures the server writes in a checkpoint line's parentheses.
INT_FIGURES = ("pos_min", "pos_max", "n_tokens", "n_past", "n_swa", "pos_next")


@dataclass(frozen=True)
class CheckpointFigures:
    """The figures of one checkpoint line; a figure the line does not carry is None."""

    pos_min: int | None = None
    pos_max: int | None = None
    n_tokens: int | None = None
    n_past: int | None = None  # restored: the position the slot rolled back to
    n_swa: int | None = None
    pos_next: int | None = None
    size_mib: float | None = None  # ``size = 7.506 MiB``

    @classmethod
    def from_pairs(cls, pairs: dict[str, int | float]) -> "CheckpointFigures":
        """From the ``key = number`` pairs of a line (unknown keys are left out; an integer
        figure written with a fraction is not one this build prints: None)."""
        ints = {k: v for k in INT_FIGURES if isinstance(v := pairs.get(k), int)}
        size = pairs.get("size")
        return cls(**ints, size_mib=float(size) if size is not None else None)
