"""Which slot: the one rule for every park, resume and check, window and CLI alike.

llama-server wraps slot ids around ("allow id_slot to be out of bounds"):
``/slots/7`` on a 2-slot server acts on slot 1. So an id is always checked
against ``GET /slots`` first (:func:`find_row`).

The default slot (:func:`default_slot`) when the user names none:

* **park**: the slot the user last looked at if it holds tokens, else the first
  slot that holds tokens; none when every slot is empty.
* **resume / check**: the slot the session was parked from, if it is idle and
  empty (a client that pins ``id_slot`` finds its chat where it left it), else
  the first idle empty slot; none when every slot holds tokens (then the user
  must choose, and is asked before tokens are replaced).
"""

from __future__ import annotations

import enum

from app.monitor.slots import SlotRow, held_tokens


class Purpose(enum.StrEnum):
    PARK = "park"
    RESUME = "resume"
    CHECK = "check"


class SlotError(Exception):
    """A slot id the server does not have, or no slot fits (user-facing)."""


def ids_text(rows: list[SlotRow]) -> str:
    ids = sorted(r.id for r in rows if r.id is not None)
    if not ids:
        return "no slots"
    if ids == list(range(ids[0], ids[-1] + 1)):
        return f"slots {ids[0]}-{ids[-1]}" if len(ids) > 1 else f"slot {ids[0]}"
    return "slots " + ", ".join(map(str, ids))


def find_row(rows: list[SlotRow], slot_id: int) -> SlotRow:
    """The row of ``slot_id``; refuses ids the server would wrap around."""
    for r in rows:
        if r.id == slot_id:
            return r
    raise SlotError(f"slot {slot_id} does not exist: this server has {ids_text(rows)}")


def default_slot(rows: list[SlotRow], purpose: Purpose, preferred: int | None = None) -> int | None:
    """The slot to use when the user names none (see the module text), or None."""
    if purpose is Purpose.PARK:
        candidates = [r for r in rows if held_tokens(r) > 0]
    else:
        candidates = [r for r in rows if held_tokens(r) <= 0 and not r.busy]
    for r in candidates:
        if preferred is not None and r.id == preferred:
            return r.id
    return candidates[0].id if candidates else None


def no_default_reason(rows: list[SlotRow], purpose: Purpose) -> str:
    if purpose is Purpose.PARK:
        return "no slot holds tokens: there is nothing to park"
    return f"no empty slot ({ids_text(rows)} all hold tokens or are busy): choose the slot to replace"
