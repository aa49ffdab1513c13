"""The lease table of one server: what each slot is (its state, the conversation in it, the one before,
the lease out on it), the conversations known, why one is in no slot, and the wait for a slot to change.

The values the rest of the proxy reads (:class:`SlotState`, :class:`Lease`, :class:`SlotView`) and the
table :class:`app.proxy.leases.SlotLeases` keeps them in. No decision here (which slot a request gets,
when a conversation is parked: the lease manager's) and no I/O but the conversation store's reads.
Everything runs on one asyncio loop: a coroutine that must wait registers itself (:meth:`LeaseTable.changed`)
and re-checks when any slot changes (:meth:`LeaseTable.wake`), which cannot miss a wake-up.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import re
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from app.core.conversation import Cause, Conversation
from app.store.conversations import ConversationStore

PARK_PREFIX = "proxy-"
#: How many "why is this conversation in no slot" notes are kept (the most recent).
LOST_NOTES_KEPT = 4096


def park_name(conv_id: str) -> str:
    """The parked session of a conversation: ``proxy-<id>``. An id the server would refuse as a file
    name (``/``, ``..``, control characters, …) is made safe and keeps a hash of the original."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", conv_id)[:100]
    if safe != conv_id or not safe:
        safe = f"{safe}-{hashlib.sha256(conv_id.encode()).hexdigest()[:12]}"
    return PARK_PREFIX + safe


class SlotState(enum.Enum):
    FREE = "free"  # holds nothing the proxy knows of
    RESTORING = "restoring"  # leased; a park is being restored into it
    BUSY = "busy"  # leased: a request runs in it
    IDLE_DIRTY = "idle-dirty"  # holds a conversation not saved since its last request
    IDLE_CLEAN = "idle-clean"  # holds a conversation whose park is up to date
    SAVING = "saving"  # its conversation is being saved (to park it, or before a stop); nobody takes it


IDLE = frozenset({SlotState.IDLE_DIRTY, SlotState.IDLE_CLEAN})
ACTIVE = frozenset({SlotState.BUSY, SlotState.RESTORING, SlotState.SAVING})


@dataclass(frozen=True)
class SlotContext:
    """What the slot was to this conversation when its request started: what an explanation needs."""

    held: bool = False  # the slot still held this conversation from its last request
    previous_owner: str | None = None  # the conversation that used the slot last, when not this one
    lost: Cause | None = None  # why this conversation was in no slot (None: held, or never in one)
    taken_by: str | None = None  # with Cause.SLOT_TAKEN: the conversation that took its slot
    restored: bool = False  # its park was restored into the slot
    restored_tokens: int = 0
    restore_skipped: bool = False  # it had a park, but re-prefilling was estimated cheaper
    expected_tokens: int = 0  # tokens of this conversation in the slot when the request starts
    ram_tokens: int = 0  # > 0: its park was left for the server's RAM-cache copy of this many tokens


@dataclass
class Lease:
    """One request's hold on a slot, from :meth:`SlotLeases.acquire` to :meth:`SlotLeases.release`."""

    slot: int
    conversation: str
    restored_from: str | None = None  # the park restored into the slot first
    restore_failed: bool = False  # a restore was tried and failed: the slot was emptied
    restore_avoided: str | None = None  # why the park was not restored although it pays (the request re-processes)
    evicted: str | None = None  # the conversation this lease took the slot from
    slot_context: SlotContext = field(default_factory=SlotContext)
    interrupted: Cause | None = None  # the server restarted / slept while the slot was leased
    # Not known to the leases (the backend reports tokens only): for the caller to set when it knows.
    restore_had_checkpoints: bool | None = None
    id: int = 0
    epoch: int = 0
    released: bool = False

    # Shorthands of slot_context for an explanation.

    @property
    def taken_by(self) -> str | None:
        """The conversation that took this conversation's slot since its last request."""
        return self.slot_context.taken_by if self.slot_context.lost is Cause.SLOT_TAKEN else None

    @property
    def idle_cleared(self) -> bool:
        return self.slot_context.lost is Cause.IDLE_SLOT_CLEARED

    @property
    def restarted(self) -> bool:
        return Cause.SERVER_RESTARTED in (self.slot_context.lost, self.interrupted)

    @property
    def slept(self) -> bool:
        return Cause.SERVER_SLEPT in (self.slot_context.lost, self.interrupted)


@dataclass(frozen=True)
class SlotView:
    """A slot as the faces show it."""

    index: int
    state: SlotState
    conversation: str | None  # whose tokens are in it (or who leases it)
    n_tokens: int
    previous_owner: str | None  # the conversation in it before
    claimant: str | None  # while it is saved to be taken: the conversation that will take it


@dataclass
class Slot:
    index: int
    state: SlotState = SlotState.FREE
    holder: str | None = None
    n_tokens: int = 0
    used_at: int = 0  # LRU tick of its last take or release
    last_holder: str | None = None  # the conversation in it before the current holder
    claimant: str | None = None
    lease_id: int | None = None
    version: int = 0  # bumped on every change (a failed save keeps a slot out until it changes)
    warmed_from: str | None = None  # the park restored into it at the proxy's start, before any request asked


    def set(self, state: SlotState) -> None:
        self.state = state
        self.version += 1

    def set_holder(self, conv_id: str | None) -> None:
        if self.holder is not None and self.holder != conv_id:
            self.last_holder = self.holder
            self.warmed_from = None
        self.holder = conv_id


class LeaseTable:
    """The slots of one server and the conversations in them, as the lease manager changes them."""

    def __init__(self, n_slots: int, store: ConversationStore | None, clock: Callable[[], float]) -> None:
        self.slots = [Slot(i) for i in range(n_slots)]
        self._store = store
        self._clock = clock
        self.holders: dict[str, Conversation] = {}  # conversations in a slot or a lease
        self.seen: weakref.WeakValueDictionary[str, Conversation] = weakref.WeakValueDictionary()
        self.lost: OrderedDict[str, tuple[Cause, str | None]] = OrderedDict()
        self.leases: dict[int, Lease] = {}
        self._waiters: list[asyncio.Future] = []
        self.tick = 0
        self._lease_ids = 0
        self.reset_cause = Cause.SERVER_RESTARTED
        self.epoch = 0  # bumped when the server restarts or sleeps: a backend call across it is not trusted
        # conversations whose request failed in this epoch (their slot freed, cause unknown): when the
        # restart is noticed after the failure (a killed server breaks the stream first), it is the cause
        self.failed: set[str] = set()

    # -- what the faces read

    def snapshot(self) -> list[SlotView]:
        return [SlotView(s.index, s.state, s.holder, s.n_tokens, s.last_holder, s.claimant) for s in self.slots]

    @property
    def waiting(self) -> int:
        """Coroutines waiting for a slot to change (requests queued, a park-before-stop waiting)."""
        return sum(1 for f in self._waiters if not f.done())

    # -- the conversations

    def adopt(self, conv: Conversation) -> Conversation:
        old = self.holders.get(conv.id) or self.seen.get(conv.id)
        if old is not None and old is not conv:
            conv.n_tokens, conv.parked_as = old.n_tokens, old.parked_as
        held = next((s for s in self.slots if s.holder == conv.id), None)
        conv.slot = held.index if held is not None else None
        if conv.id in self.holders:
            self.holders[conv.id] = conv
        self.seen[conv.id] = conv
        return conv

    def conv(self, conv_id: str) -> Conversation | None:
        conv = self.holders.get(conv_id) or self.seen.get(conv_id)
        if conv is None and self._store is not None:
            conv = self._store.get(conv_id)
            if conv is not None:
                self.seen[conv_id] = conv
        return conv

    def note_lost(self, conv_id: str, cause: Cause, by: str | None) -> None:
        self.lost[conv_id] = (cause, by)
        self.lost.move_to_end(conv_id)
        while len(self.lost) > LOST_NOTES_KEPT:
            self.lost.popitem(last=False)

    # -- the slots

    def new_lease(self, slot: Slot, conv: Conversation) -> Lease:
        self._lease_ids += 1
        self.tick += 1
        slot.used_at = self.tick
        slot.lease_id = self._lease_ids
        slot.set_holder(conv.id)
        conv.slot = slot.index
        conv.last_used = max(conv.last_used, self._clock())
        self.holders[conv.id] = conv
        lease = Lease(slot=slot.index, conversation=conv.id, id=self._lease_ids, epoch=self.epoch)
        self.leases[lease.id] = lease
        return lease

    def empty(self, slot: Slot, cause: Cause) -> Conversation | None:
        """``slot`` holds nothing now; its conversation (returned) is in no slot, for ``cause``."""
        conv = self.conv(slot.holder) if slot.holder else None
        if slot.holder is not None:
            self.note_lost(slot.holder, cause, None)
            self.holders.pop(slot.holder, None)
        if conv is not None:
            conv.slot = None
        slot.set_holder(None)
        slot.set(SlotState.FREE)
        slot.n_tokens = 0
        slot.claimant = None
        slot.lease_id = None
        return conv

    @staticmethod
    def lru_key(s: Slot) -> tuple[int, int, int]:
        return (s.used_at, 0 if s.state is SlotState.IDLE_CLEAN else 1, s.index)

    def slot_of(self, conv_id: str) -> Slot | None:
        """The slot that holds ``conv_id``, or is being saved to be given to it."""
        return next((s for s in self.slots if s.holder == conv_id or s.claimant == conv_id), None)

    # -- waiting for a change

    def wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    async def changed(self) -> None:
        f = asyncio.get_running_loop().create_future()
        self._waiters.append(f)
        try:
            await f
        finally:
            if f in self._waiters:
                self._waiters.remove(f)
