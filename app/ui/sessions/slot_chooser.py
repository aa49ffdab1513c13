"""The Sessions tab's slot chooser: the slot to park from, or to resume into.

"default slot" and one item per slot of the server's live ``/slots`` (its
tokens, restored or not, busy or not); the Sessions panel feeds it the
:class:`~app.monitor.slots.SlotRow` list of the server's one slot picture (app.ui.sessions.slot_picture).
"""

from __future__ import annotations

from PySide6.QtWidgets import QComboBox

from app.sessions.slots import Purpose, default_slot
from app.monitor.slots import SlotRow, held_tokens


class SlotChooser(QComboBox):
    """A combo box over the slots; ``currentData()`` is the slot id chosen (None: the default)."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.rows: list[SlotRow] = []

    def set_rows(self, rows) -> None:
        """Show ``rows``; nothing changes (the choice included) when they show the same."""
        rows = list(rows)
        if [(r.id, r.tokens_held, r.busy, r.tokens_known_from_restore) for r in rows] == \
                [(r.id, r.tokens_held, r.busy, r.tokens_known_from_restore) for r in self.rows] and self.count():
            return
        self.rows = rows
        current = self.currentData()
        self.blockSignals(True)
        self.clear()
        self.addItem("default slot", None)
        for r in rows:
            if r.id is None:
                continue
            n = held_tokens(r)
            text = f"{n:,} tokens" + (" (restored)" if r.tokens_known_from_restore else "") if n else "empty"
            self.addItem(f"slot {r.id} — {text}" + (" (busy)" if r.busy else ""), r.id)
        idx = self.findData(current)
        if idx < 0:
            idx = self.findData(default_slot(rows, Purpose.PARK))
        self.setCurrentIndex(max(idx, 0))
        self.blockSignals(False)

    def forget(self) -> None:
        """No server: no slots listed."""
        self.rows = []
        self.clear()
