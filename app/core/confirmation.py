"""The one "would work, but ask first" of every step: :class:`NeedsConfirmation`.

A step (a resume whose preflight warns, a check that restores over a slot's chat or restarts
the server, a move...) that would work but costs something the user must accept raises it
with the warnings, in the user's words; the caller asks (the window: a dialog; the CLI: it
says which flag goes on) and runs the step again with ``force=True``.
"""

from __future__ import annotations

from typing import Iterable


class NeedsConfirmation(Exception):
    """The step would work but costs something the user must accept (run it again with force=True)."""

    def __init__(self, warnings: Iterable[str]):
        self.warnings = list(warnings)
        super().__init__("; ".join(self.warnings))
