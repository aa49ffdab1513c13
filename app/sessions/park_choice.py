"""Which slots a "park every slot" saves, and under which name: the one rule of every park-then-stop
(:func:`choose_parks`); :func:`app.sessions.park.park_all` runs what it chooses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from app.monitor.slots import SlotRow, held_tokens
from app.sessions.target import HeldSession, ServerTarget
from app.store.catalog import SessionRecord


@dataclass(frozen=True)
class ParkChoice:
    slot_id: int
    name: str
    unchanged: SessionRecord | None = None  # already parked as this session, nothing ran since: no new copy
    continues: bool = False  # the slot goes on from this session: the park updates it (no dated copy)


def _newest_on_slot(target: ServerTarget, slot_id: int) -> HeldSession | None:
    """What this server process last parked from or restored into ``slot_id``, this process's or
    another KV Valet process's (the catalog: parked or restored since the server started)."""
    mine = target.held_as.get(slot_id)
    if mine is not None or target.started_at is None:
        return mine
    best, best_at = None, target.started_at
    for rec in target.catalog.list(target.profile_name):
        if rec.slot_id != slot_id:
            continue
        for at, n in ((rec.updated_at, rec.n_tokens), (rec.last_restore_at, rec.last_n_restored)):
            if at is not None and n and at >= best_at:
                best, best_at = HeldSession(rec.name, int(n), None), at
    return best


def choose_parks(target: ServerTarget, rows: list[SlotRow], prefix: str | None = None) -> list[ParkChoice]:
    """Which slots a "park every slot" saves, and under which name: the one rule of every
    park-then-stop (the quit, a logout, shutdown and sleep, ``serve``'s Ctrl-C, Park all & stop).

    * A slot holding exactly the tokens it was just parked as or resumed as (no task ran on
      it since) is not parked again: a second, dated copy of the same chat buys nothing.
    * A slot whose last task went on from such a session (it reused at least half of that
      session's tokens from the cache) is parked *as that session*: the session is updated
      (its older copy is kept until the new one verifies) instead of adding a dated one.
    * Any other slot that holds tokens is parked as "<prefix> slot N" (prefix: the date).
    """
    prefix = (prefix or "").strip() or time.strftime("%Y-%m-%d %H-%M")
    out: list[ParkChoice] = []
    for row in rows:
        sid = row.id
        if sid is None or held_tokens(row) <= 0:
            continue
        before = _newest_on_slot(target, sid)
        if before is not None and held_tokens(row) == before.n_tokens and \
                (before.id_task is None or row.id_task == before.id_task):
            rec = target.catalog.get(target.profile_name, before.name)
            if rec is not None:
                out.append(ParkChoice(sid, before.name, unchanged=rec))
                continue
        if before is not None and held_tokens(row) > before.n_tokens and (row.n_cached or 0) * 2 >= before.n_tokens \
                and target.catalog.get(target.profile_name, before.name) is not None:
            out.append(ParkChoice(sid, before.name, continues=True))
            continue
        out.append(ParkChoice(sid, f"{prefix} slot {sid}"))
    return out
