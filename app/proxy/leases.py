"""Slot leases: which conversation runs in which llama-server slot, and parking/restoring them
when there are more conversations than slots.

No HTTP here: the slot actions go through a :class:`SlotBackend` (the HTTP layer's, or a fake in
the tests). Everything runs on one asyncio loop; the state changes between two ``await``s are
synchronous, so no lock is needed: a coroutine that must wait registers itself and re-checks
when any slot changes (``_changed``), which cannot miss a wake-up.

The rules (each one is tested in tests/unit/test_proxy_leases.py):

* **Which slot.** A conversation goes back to the slot that still holds it (no other
  conversation used it since). Else to a FREE slot (the lowest index). Else the least
  recently used idle slot is taken from its conversation: LRU by the end of its last request;
  at an equal age IDLE_CLEAN before IDLE_DIRTY (no save needed), then the lower index. A busy,
  restoring or saving slot is never taken: eviction happens between generations only.
* **Park before evicting.** An IDLE_DIRTY slot is saved first (park ``proxy-<conversation id>``).
  If the save fails, that slot is kept out (until its state changes) and the next LRU idle
  slot is tried. When no idle slot can be freed the request waits for a slot to be released;
  when nothing at all is in use (so nothing will ever be released) and every save failed, the
  LRU idle slot is taken all the same and its conversation loses its cache (journaled
  "dropped"): a re-prefill later beats a request that hangs forever.
* **Restore only when it pays.** A conversation with a park that its slot does not hold is
  restored when ``restore_ms_estimate(n_tokens) < reusable × prefill_ms_per_token()``, where
  reusable is ``min(conversation.n_tokens, prompt_tokens)`` (all of n_tokens when prompt_tokens
  is unknown, 0); an unknown prefill rate means restore. A failed restore empties the slot (the
  server clears it on any failure, llama-server.md): the lease keeps it (BUSY, holding nothing),
  says ``restore_failed``, the park is deleted and the request re-prefills.
* **One request per conversation at a time.** A second request of a conversation whose slot
  is busy (or being saved or restored) waits until the first releases it, then reuses it; a
  request of another conversation gets another slot.
* **Journal first.** Every state change is written to the store's lease journal before the
  backend call that depends on it ("saving" before the save, "restoring" before the restore,
  "acquired" before the request is sent), with the lease fields of the conversations it
  touched, in one transaction: after a crash :meth:`SlotLeases.recover` finds an interrupted
  save ("saving" never followed by "saved") and drops that park. A store that cannot be written
  (full disk) is logged and does not stop the requests.
  The store is written synchronously on the loop (a
  WAL commit without fsync, well under a millisecond): the order of the journal is the order of
  the changes, which a write from a worker thread would not guarantee.
* **The server's RAM cache as a restore source (#28276).** With ``ram_cache`` (the server runs
  ``--cache-ram`` != 0) a conversation that left its slot through the server's own doing (idle-slot
  caching cleared it, or another conversation's request took its slot: the server saves the slot's
  prompt to its RAM cache then) is noted with the tokens it held. When it comes back and that copy
  is longer than its park (no park, or a park older than its last request), the park is not
  restored over it: a request pinned to a slot that holds another prompt makes the server look in
  its RAM cache and load the longest match. A request pinned to an EMPTY slot never looks there
  (server-context.cpp ``get_available_slot``), so such a conversation takes an idle slot that holds
  another conversation (LRU) over a FREE one when that costs nothing (``idle_slots_cleared``: the
  server clears that idle slot when the task starts anyway) or when no slot is FREE; in a FREE slot
  the (shorter) park is restored, the best the server can be given. The copy is only likely (the
  cache may be too small for it, or have evicted it): the request's verdict says what happened. A
  restart or a sleep empties the RAM cache: the notes go.
* **Disk budget.** After each save, when the parks of this profile exceed the budget, the
  parks of the conversations not in a slot are deleted, least recently used first.

A conversation is one object per id: :meth:`SlotLeases.acquire` adopts the object it is given
(its slot and park fields are set from what the leases know) and changes it in place afterwards.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import re
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Protocol

from app.core import conversation as model
from app.core.conversation import Cause, Conversation
from app.sessions.journal import JournalKind, Recovery, recovers
from app.store.conversations import ConversationStore, ConversationStoreError, JournalEntry

log = logging.getLogger(__name__)
#: a conversation holding fewer tokens is not parked before a stop, a sleep or idle-slot clearing: it
#: re-processes them in less time than a park and a restore take (a state file's fixed cost, tens of ms)
MIN_PARK_TOKENS = 32

PARK_PREFIX = "proxy-"
#: The journal is rewritten as a snapshot of the slots after this many entries.
JOURNAL_COMPACT_EVERY = 2000
#: How many "why is this conversation in no slot" notes are kept (the most recent).
LOST_NOTES_KEPT = 4096


def open_conversation_store(path: str | Path | None = None) -> ConversationStore:
    """The conversation store with the proxy's value types (``<data>/conversations.sqlite3`` by default)."""
    return ConversationStore(path, values=model)


def park_name(conv_id: str) -> str:
    """The parked session of a conversation: ``proxy-<id>``. An id the server would refuse as a file
    name (``/``, ``..``, control characters, …) is made safe and keeps a hash of the original."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", conv_id)[:100]
    if safe != conv_id or not safe:
        safe = f"{safe}-{hashlib.sha256(conv_id.encode()).hexdigest()[:12]}"
    return PARK_PREFIX + safe


class SlotBackend(Protocol):
    """The server's slot actions (``POST /slots/{id}?action=…``) and the park files."""

    async def save(self, slot: int, name: str) -> int:
        """Save ``slot`` as ``name``; the tokens saved. Raises on failure."""
        ...

    async def restore(self, slot: int, name: str) -> int:
        """Restore ``name`` into ``slot``; the tokens restored. Raises on failure, and then the
        server has emptied the slot."""
        ...

    async def erase(self, slot: int) -> None:
        ...

    def parked_size(self, name: str) -> int:
        """Bytes ``name`` takes on disk (its sidecar included); 0 if unknown."""
        ...

    def delete_park(self, name: str) -> None:
        ...


class RestoreAvoided(Exception):
    """The backend did not restore the park, on purpose (the restore would have been unsafe): unlike
    a failed restore the slot is untouched and the park is kept for a later, safe restore."""


class SlotState(enum.Enum):
    FREE = "free"  # holds nothing the proxy knows of
    RESTORING = "restoring"  # leased; a park is being restored into it
    BUSY = "busy"  # leased: a request runs in it
    IDLE_DIRTY = "idle-dirty"  # holds a conversation not saved since its last request
    IDLE_CLEAN = "idle-clean"  # holds a conversation whose park is up to date
    SAVING = "saving"  # its conversation is being saved (to park it, or before a stop); nobody takes it


_IDLE = frozenset({SlotState.IDLE_DIRTY, SlotState.IDLE_CLEAN})
_ACTIVE = frozenset({SlotState.BUSY, SlotState.RESTORING, SlotState.SAVING})


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


@dataclass(frozen=True)
class RecoveryReport:
    """What :meth:`SlotLeases.recover` found in the journal."""

    interrupted_saves: tuple[str, ...] = ()  # conversations whose save never finished: park dropped
    kept: dict[int, str] = field(default_factory=dict)  # slot -> conversation trusted to be in it still
    lost: tuple[str, ...] = ()  # conversations stored as in a slot that are no longer

    def messages(self) -> list[str]:
        out = [f"conversation {c}: its save was interrupted, the park is dropped" for c in self.interrupted_saves]
        out += [f"slot {i}: still holds conversation {c}" for i, c in sorted(self.kept.items())]
        return out + [f"conversation {c}: no longer in a slot" for c in self.lost]


@recovers(JournalKind.PROXY_LEASE)
def recover_leases(run: Recovery) -> list[str]:
    """The journal kind of the proxy's slot leases: :meth:`SlotLeases.recover` of ``run.subject``
    (``run.same_process``: the server outlived the crash), through the one recovery loop."""
    return run.subject.recover(server_same_process=run.same_process).messages()


@dataclass
class _Slot:
    index: int
    state: SlotState = SlotState.FREE
    holder: str | None = None
    n_tokens: int = 0
    used_at: int = 0  # LRU tick of its last take or release
    last_holder: str | None = None  # the conversation in it before the current holder
    claimant: str | None = None
    lease_id: int | None = None
    version: int = 0  # bumped on every change (a failed save keeps a slot out until it changes)

    def set(self, state: SlotState) -> None:
        self.state = state
        self.version += 1

    def set_holder(self, conv_id: str | None) -> None:
        if self.holder is not None and self.holder != conv_id:
            self.last_holder = self.holder
        self.holder = conv_id


class SlotLeases:
    """The slot lease manager of one server (see the module's doc for the rules)."""

    def __init__(self, n_slots: int, backend: SlotBackend, *, store: ConversationStore | None, profile: str,
                 prefill_ms_per_token: Callable[[], float | None], restore_ms_estimate: Callable[[int], float],
                 disk_budget_bytes: int | None, clock: Callable[[], float] = time.time) -> None:
        if n_slots < 1:
            raise ValueError(f"a server has at least one slot, not {n_slots}")
        self.n_slots = n_slots
        self._backend = backend
        self._store = store
        self.profile = profile
        self._prefill_rate = prefill_ms_per_token
        self._restore_ms = restore_ms_estimate
        self.disk_budget_bytes = disk_budget_bytes
        self._clock = clock
        self._slots = [_Slot(i) for i in range(n_slots)]
        self._holders: dict[str, Conversation] = {}  # conversations in a slot or a lease
        self._seen: weakref.WeakValueDictionary[str, Conversation] = weakref.WeakValueDictionary()
        self._lost: OrderedDict[str, tuple[Cause, str | None]] = OrderedDict()
        self._leases: dict[int, Lease] = {}
        self._waiters: list[asyncio.Future] = []
        self._tick = 0
        self._lease_ids = 0
        self._reset_cause = Cause.SERVER_RESTARTED
        self._epoch = 0  # bumped when the server restarts or sleeps: a backend call across it is not trusted
        # conversations whose request failed in this epoch (their slot freed, cause unknown): when the
        # restart is noticed after the failure (a killed server breaks the stream first), it is the cause
        self._failed: set[str] = set()
        self._journal_writes = 0
        # the server's RAM prompt cache (#28276): on (--cache-ram != 0), whether it clears idle slots (so
        # taking an idle slot costs nothing), the conversations it likely holds copies of (tokens), the
        # tokens of each park, and how many requests were sent to the RAM copy instead of the park
        self.ram_cache = False
        self.idle_slots_cleared = False
        self._ram: OrderedDict[str, int] = OrderedDict()
        # FREE slots (to the proxy) that hold the prompt of a request passed through untouched: slot ->
        # (its conversation, tokens); the server saves that prompt to its RAM cache when it clears the
        # slot or a task is pinned over it, and the conversation, back, finds it there or in the slot
        self._outside: dict[int, tuple[str, int]] = {}
        self._park_tokens: dict[str, int] = {}
        self.ram_chosen = 0
        #: told ``(event, conversation)`` of every journaled change (the proxy's KV events follow them)
        self.on_change: Callable[[str, str | None], None] | None = None

    # -- what the faces read

    @property
    def backend(self) -> SlotBackend:
        return self._backend

    def outside_prompts(self) -> dict[int, tuple[str, int]]:
        """FREE slots holding a prompt of a request passed through untouched: slot -> (conversation, tokens)."""
        return dict(self._outside)

    def snapshot(self) -> list[SlotView]:
        return [SlotView(s.index, s.state, s.holder, s.n_tokens, s.last_holder, s.claimant) for s in self._slots]

    def state(self, slot: int) -> SlotState:
        return self._slots[slot].state

    def holder(self, slot: int) -> str | None:
        return self._slots[slot].holder

    def lost_cause(self, conv_id: str) -> tuple[Cause, str | None] | None:
        """Why ``conv_id`` is in no slot, and who took its slot (Cause.SLOT_TAKEN); None if not known."""
        return self._lost.get(conv_id)

    @property
    def waiting(self) -> int:
        """Coroutines waiting for a slot to change (requests queued, a park-before-stop waiting)."""
        return sum(1 for f in self._waiters if not f.done())

    # -- acquire / release

    async def acquire(self, conv: Conversation, prompt_tokens: int | Callable[[], int]) -> Lease:
        """A slot for one request of ``conv``, BUSY until :meth:`release`; waits while the conversation's
        own slot is in use (a second request of one conversation runs after the first) and while
        no slot can be freed. ``prompt_tokens``: the request's size, or a function that guesses it (called
        only when a restore is weighed: a conversation that kept its slot never needs it)."""
        conv = self._adopt(conv)
        tried: dict[int, int] = {}  # slot -> its version when saving its conversation failed
        while True:
            own = self._slot_of(conv.id)
            if own is not None:
                if own.state in _IDLE and own.holder == conv.id:
                    return self._lease_held(own, conv)
                await self._changed()  # its own slot is busy, saving or restoring: after that one
                continue
            free = [s for s in self._slots if s.state is SlotState.FREE]
            # its own prompt still in a slot a request passed through untouched left it in, else any FREE one
            slot = next((s for s in free if self._outside.get(s.index, ("",))[0] == conv.id), None) or \
                next(iter(free), None)
            evicted = None
            dropped = False
            idle = sorted((s for s in self._slots if s.state in _IDLE), key=self._lru_key)
            candidates = [s for s in idle if tried.get(s.index) != s.version]
            foreign = [s for s in free if s.index in self._outside and self._outside[s.index][0] != conv.id]
            if slot is not None and self._outside.get(slot.index, ("",))[0] != conv.id and foreign \
                    and self.ram_longer(conv):
                # a FREE slot that holds another prompt costs nothing to take and makes the server look in its
                # RAM cache (an empty one does not)
                slot = foreign[0]
            elif slot is not None and self.idle_slots_cleared and self.ram_longer(conv):
                # only pinned to a slot that holds a prompt does the server look in its RAM cache; the server
                # clears that idle slot when this task starts anyway
                holding = [s for s in candidates if s.n_tokens > 0]
                if holding:
                    slot, candidates = None, holding
            if slot is None:
                if not candidates:
                    if not idle or any(s.state in _ACTIVE for s in self._slots):
                        await self._changed()  # a slot will be released
                        continue
                    slot, evicted, dropped = idle[0], idle[0].holder, True  # nothing will ever be released
                else:
                    victim = candidates[0]
                    if victim.state is SlotState.IDLE_DIRTY:
                        holder = victim.holder
                        if not await self._save(victim, claimant=conv.id):
                            tried[victim.index] = victim.version
                            continue
                        evicted = holder
                    else:
                        evicted = victim.holder
                    slot = victim
            return await self._lease_new(slot, conv, prompt_tokens, evicted, dropped)

    def release(self, lease: Lease, n_tokens: int, ok: bool) -> None:
        """The request of ``lease`` ended. ``ok``: the slot now holds the conversation, ``n_tokens``
        of it (IDLE_DIRTY). Not ok (failed, cancelled) or interrupted by a server restart: what the
        slot holds is not known, so it is FREE and the conversation in no slot."""
        if lease.released:
            return
        lease.released = True
        self._leases.pop(lease.id, None)
        slot = self._slots[lease.slot]
        if slot.lease_id != lease.id:
            return
        slot.lease_id = None
        self._tick += 1
        slot.used_at = self._tick
        conv = self._conv(lease.conversation)
        if ok and lease.interrupted is None and conv is not None:
            slot.set(SlotState.IDLE_DIRTY)
            slot.n_tokens = n_tokens
            conv.slot, conv.n_tokens = slot.index, n_tokens
            conv.last_used = max(conv.last_used, self._clock())
            self._lost.pop(conv.id, None)
            self._ram.pop(conv.id, None)  # its slot holds it: a RAM copy of it is older
            self._journal("released", slot, touched=[conv])
        else:
            self._empty(slot, lease.interrupted or Cause.UNKNOWN)
            if lease.interrupted is None and lease.epoch == self._epoch:
                self._failed.add(lease.conversation)
            self._journal("freed", slot, conv_id=lease.conversation, touched=[conv],
                          detail="the request failed" if not ok else str(lease.interrupted or ""))
        self._wake()

    # -- park before a stop, and what the server did by itself

    async def save_dirty(self, all: bool = False) -> list[str]:
        """Save every IDLE_DIRTY slot (park before a server stop or sleep); the conversations saved.
        ``all``: also wait for the requests running now, and save their slots when they end. A slot
        whose save fails stays IDLE_DIRTY (logged and journaled) and is not tried twice. A slot that
        holds fewer than ``MIN_PARK_TOKENS`` is not saved: re-processing them costs less than a park
        and a restore."""
        waiting_for = set(self._leases) if all else set()
        tried: dict[int, int] = {}
        saved: list[str] = []
        while True:
            dirty = next((s for s in self._slots if s.state is SlotState.IDLE_DIRTY
                          and tried.get(s.index) != s.version and s.n_tokens >= MIN_PARK_TOKENS), None)
            if dirty is not None:
                holder = dirty.holder
                if await self._save(dirty, claimant=None):
                    saved.append(holder)
                else:
                    tried[dirty.index] = dirty.version
                continue
            if not waiting_for & set(self._leases):
                return saved
            await self._changed()

    def note_slot_cleared(self, slot: int) -> None:
        """The server emptied an idle slot (idle-slot caching saves it to its RAM cache and clears it
        when another task starts): its conversation is in no slot now."""
        s = self._slots[slot]
        outside = self._outside.pop(slot, None) if s.state is SlotState.FREE else None
        if outside is not None:
            self._note_ram(*outside)  # a prompt passed through untouched, saved to the RAM cache
            return
        if s.state not in _IDLE:
            return  # a slot in use is not idle: idle-slot caching leaves it alone
        conv_id, n = s.holder, s.n_tokens
        conv = self._empty(s, Cause.IDLE_SLOT_CLEARED)
        if conv_id is not None:
            self._note_ram(conv_id, n)  # idle-slot caching saved it to the RAM cache before clearing it
        self._journal("cleared", s, conv_id=conv_id, touched=[conv])
        self._wake()

    def note_slot_used_outside(self, slot: int, by: str, *, conv_id: str | None = None, n_tokens: int = 0) -> None:
        """A request the proxy passed through untouched (its client chose the slot, or turned prompt
        caching off) ran in ``slot``: an idle conversation there lost its tokens, taken by ``by``.
        ``conv_id``/``n_tokens``: that request's conversation and the tokens it left in the slot, noted
        (the slot stays FREE to the proxy): when the server clears the slot or a task is pinned over it,
        that prompt goes to the server's RAM cache, where the conversation, back, is looked for."""
        s = self._slots[slot]
        if s.state is SlotState.FREE:
            self._outside.pop(slot, None)
            if conv_id is not None and n_tokens > 0:
                self._outside[slot] = (conv_id, n_tokens)
            return
        if s.state not in _IDLE:
            return  # leased or being saved: the proxy's own request owns it now
        conv_id = s.holder
        conv = self._empty(s, Cause.SLOT_TAKEN)
        if conv_id is not None:
            self._note_lost(conv_id, Cause.SLOT_TAKEN, by)
        self._journal("cleared", s, conv_id=conv_id, touched=[conv], detail=by)
        if s.state is SlotState.FREE and conv_id is not None and n_tokens > 0:
            self._outside[slot] = (conv_id, n_tokens)
        self._wake()

    def note_server_restarted(self) -> None:
        """Every slot is empty; conversations keep their parks, those never parked lost their cache."""
        self._reset_all(Cause.SERVER_RESTARTED)

    def note_server_slept(self) -> None:
        """--sleep-idle-seconds destroyed the context: as a restart."""
        self._reset_all(Cause.SERVER_SLEPT)

    def _reset_all(self, cause: Cause) -> None:
        self._epoch += 1
        self._reset_cause = cause
        for conv_id in self._ram:  # cleared into the RAM cache, which is gone now: lost by this
            if self._lost.get(conv_id, (None, None))[0] is Cause.IDLE_SLOT_CLEARED:
                self._note_lost(conv_id, cause, None)
        self._ram.clear()  # a new server process, or a slept one: its RAM cache is empty too
        self._outside.clear()
        for conv_id in self._failed:  # failed just before: the restart emptied their slot all the same
            if self._lost.get(conv_id, (None, None))[0] is Cause.UNKNOWN:
                self._note_lost(conv_id, cause, None)
        self._failed.clear()
        touched = []
        for s in self._slots:
            if s.state in _IDLE:
                touched.append(self._empty(s, cause))
            elif s.state in (SlotState.BUSY, SlotState.RESTORING) and s.lease_id in self._leases:
                # The request keeps its slot until it releases it (it fails, or ran on the new server);
                # what the slot holds then is not known: release frees it.
                self._leases[s.lease_id].interrupted = cause
                s.n_tokens = 0
            # SAVING: the save in flight sees the new epoch and frees the slot itself
        self._journal("reset", None, detail=cause.name, touched=touched)
        self._wake()

    # -- start after a crash

    def recover(self, server_same_process: bool = False) -> RecoveryReport:
        """Read the journal at start (before any acquire). A save that was interrupted ("saving" never
        followed by "saved") leaves a park that cannot be trusted: it is deleted and its conversation
        not parked. The slots are all FREE, unless ``server_same_process`` (the app crashed, the server
        did not): then the journal's last idle slot owners are kept (a slot busy at the crash is FREE).
        The journal is then rewritten as a snapshot of the slots."""
        if self._leases or any(s.state is not SlotState.FREE for s in self._slots):
            raise RuntimeError("recover() is for a start: slots are already in use")
        if self._store is None:
            return RecoveryReport()
        last: dict[int, JournalEntry] = {}
        pending: dict[str, JournalEntry] = {}
        for e in self._store.journal_entries(self.profile):
            if e.event == "reset":
                last.clear()
            if e.event == "saving" and e.conversation:
                pending[e.conversation] = e
            elif e.event in ("saved", "save_failed") and e.conversation:
                pending.pop(e.conversation, None)
            if e.slot is not None and e.state is not None:
                last[e.slot] = e
        touched: dict[str, Conversation] = {}
        for conv_id, e in pending.items():
            conv = self._conv(conv_id)
            if conv is not None and conv.parked_as in (None, e.park):
                conv.parked_as = None
                touched[conv_id] = conv
            if e.park:
                self._delete_park(e.park)
        kept: dict[int, str] = {}
        if server_same_process:
            for index, e in sorted(last.items()):
                try:
                    state = SlotState(e.state)
                except ValueError:
                    continue
                if index >= self.n_slots or not e.conversation or state not in _IDLE | {SlotState.SAVING} \
                        or e.conversation in kept.values():
                    continue
                conv = self._conv(e.conversation)
                if conv is None:
                    continue
                s = self._slots[index]
                clean = state is SlotState.IDLE_CLEAN and conv.parked_as == park_name(conv.id)
                s.set(SlotState.IDLE_CLEAN if clean else SlotState.IDLE_DIRTY)
                s.holder, s.n_tokens = conv.id, e.n_tokens or 0
                conv.slot = index
                self._holders[conv.id] = conv
                touched[conv.id] = conv
                kept[index] = conv.id
        lost = []
        cause = Cause.UNKNOWN if server_same_process else Cause.SERVER_RESTARTED
        for conv_id in self._store.in_slots(self.profile):
            if conv_id in kept.values():
                continue
            conv = self._conv(conv_id)
            if conv is None:
                continue
            conv.slot = None
            self._note_lost(conv_id, cause, None)
            touched[conv_id] = conv
            lost.append(conv_id)
        entries = [self._entry("recovered", None, detail=f"server same process: {server_same_process}")]
        entries += [self._entry("kept", self._slots[i]) for i in sorted(kept)]
        self._rewrite_journal(entries, touched.values())
        return RecoveryReport(tuple(pending), kept, tuple(lost))

    # -- forgetting a conversation

    async def forget(self, conv_id: str) -> Conversation | None:
        """Erase the slot that holds ``conv_id`` (after its request, if one runs), delete its park and
        its stored record; the conversation it was, or None when the store did not know it."""
        while (s := self._slot_of(conv_id)) is not None and s.state not in _IDLE:
            await self._changed()
        conv = self._conv(conv_id)
        if s is not None:
            s.set(SlotState.BUSY)  # reserved while the erase runs: no request may start in it meanwhile
            self._journal("erasing", s, conv_id=conv_id)
            try:
                await self._backend.erase(s.index)
            finally:
                self._empty(s, Cause.UNKNOWN)
                self._journal("erased", s, conv_id=conv_id)
                self._wake()
        if conv is not None and conv.parked_as:
            self._delete_park(conv.parked_as)
            conv.parked_as = None
        self._lost.pop(conv_id, None)
        self._ram.pop(conv_id, None)
        self._holders.pop(conv_id, None)
        return self._store.forget(conv_id) if self._store is not None else conv

    # -- the steps

    def _lease_held(self, slot: _Slot, conv: Conversation) -> Lease:
        lease = self._new_lease(slot, conv)
        lease.slot_context = SlotContext(held=True, expected_tokens=slot.n_tokens)
        slot.set(SlotState.BUSY)
        self._journal("acquired", slot, touched=[conv])
        return lease

    async def _lease_new(self, slot: _Slot, conv: Conversation, prompt_tokens: int | Callable[[], int],
                         evicted: str | None, dropped: bool) -> Lease:
        touched = [conv]
        outside = self._outside.pop(slot.index, None)  # a prompt passed through untouched, in this FREE slot
        held_prompt = (slot.n_tokens > 0 and slot.holder not in (None, conv.id)  # what the server sees pinned
                       or outside is not None and outside[0] != conv.id)
        if outside is not None and outside[0] != conv.id:
            self._note_ram(*outside)  # pinned over it: the server saves that prompt to its RAM cache first
        ram = self.ram_longer(conv)
        if evicted is not None and evicted != conv.id:
            other = self._conv(evicted)
            if other is not None:
                other.slot = None
                touched.append(other)
            self._note_lost(evicted, Cause.SLOT_TAKEN, conv.id)
            self._holders.pop(evicted, None)
            # a pinned request over another prompt: the server saves that prompt to its RAM cache first
            self._note_ram(evicted, slot.n_tokens)
        slot.set_holder(conv.id)
        previous = slot.last_holder if slot.last_holder != conv.id else None
        lost, taken_by = self._lost.get(conv.id, (None, None))
        slot.claimant = None
        slot.n_tokens = 0
        lease = self._new_lease(slot, conv)
        if dropped:
            self._journal("dropped", slot, conv_id=evicted, detail="no save succeeded and no slot is in use",
                          touched=touched[1:])
        restored, restored_tokens, skipped = False, 0, False
        ram_tokens = self._ram.pop(conv.id, 0) if ram and held_prompt else 0
        if ram_tokens:
            self.ram_chosen += 1
            log.info("slot %d: conversation %s is left to the server's RAM cache (%d tokens there, its park %d)",
                     slot.index, conv.id, ram_tokens, self._parked_tokens(conv))
        if conv.parked_as and not ram_tokens:
            name = conv.parked_as
            if self._restore_pays(conv, prompt_tokens):
                slot.set(SlotState.RESTORING)
                self._journal("restoring", slot, park=name, touched=touched)
                touched = []
                restored_tokens = await self._restore(slot, conv, lease, name)
                restored = not lease.restore_failed and lease.restore_avoided is None
                if restored:
                    lease.restored_from = name
            else:
                skipped = True
        lease.slot_context = SlotContext(
            previous_owner=previous, lost=lost, taken_by=taken_by, restored=restored,
            restored_tokens=restored_tokens, restore_skipped=skipped, expected_tokens=slot.n_tokens,
            ram_tokens=ram_tokens)
        lease.evicted = evicted if evicted != conv.id else None
        slot.set(SlotState.BUSY)
        if not restored:
            self._journal("acquired", slot, touched=touched)
        return lease

    async def _restore(self, slot: _Slot, conv: Conversation, lease: Lease, name: str) -> int:
        """Restore ``name`` into the leased ``slot``; the tokens restored (0 when it failed: then the
        slot is empty, the park deleted, and ``lease.restore_failed`` set)."""
        epoch = self._epoch
        try:
            n = await self._backend.restore(slot.index, name)
        except RestoreAvoided as e:  # the park stays; the request processes its prompt anew
            log.info("slot %d: park %s of conversation %s not restored: %s", slot.index, name, conv.id, e)
            lease.restore_avoided = str(e)
            slot.n_tokens = 0
            self._journal("restore_avoided", slot, park=name, detail=str(e), touched=[conv], state=SlotState.BUSY)
            return 0
        except asyncio.CancelledError:
            self._restore_failed(slot, conv, lease, name, "cancelled")
            self._leases.pop(lease.id, None)  # the request will not run: the slot is given back, empty
            lease.released = True
            slot.lease_id = None
            self._empty(slot, Cause.RESTORE_FAILED)
            self._journal("freed", slot, conv_id=conv.id, touched=[conv], detail="restore cancelled")
            self._wake()
            raise
        except Exception as e:  # report: logged here; the server emptied the slot, the request re-prefills
            log.warning("slot %d: restoring %s for conversation %s failed: %s", slot.index, name, conv.id, e)
            self._restore_failed(slot, conv, lease, name, str(e) or type(e).__name__)
            return 0
        if epoch != self._epoch:
            self._restore_failed(slot, conv, lease, name, "the server restarted during the restore")
            return 0
        slot.n_tokens = n
        conv.n_tokens = n
        self._journal("restored", slot, park=name, n_tokens=n, touched=[conv])
        return n

    def _restore_failed(self, slot: _Slot, conv: Conversation, lease: Lease, name: str, why: str) -> None:
        # llama-server empties the slot on any failed restore (#27068: its KV may even be corrupt):
        # the slot stays leased, holding nothing; the park is not tried again.
        lease.restore_failed = True
        slot.n_tokens = 0
        conv.parked_as = None
        self._delete_park(name)
        slot.set(SlotState.BUSY)
        # journaled as FREE (emptied); the "acquired" that follows gives it to the request
        self._journal("restore_failed", slot, park=name, detail=why, touched=[conv], state=SlotState.FREE)

    async def _save(self, slot: _Slot, claimant: str | None) -> bool:
        """Save the conversation of the idle ``slot`` as its park. With a ``claimant`` (an eviction)
        the slot stays reserved for it after a success; else it becomes IDLE_CLEAN."""
        conv = self._conv(slot.holder) if slot.holder else None
        if conv is None:  # nothing known to save (cannot happen: holders are kept): as good as free
            self._empty(slot, Cause.UNKNOWN)
            return claimant is not None
        name = park_name(conv.id)
        slot.set(SlotState.SAVING)
        slot.claimant = claimant
        conv.parked_as = None  # the file is being overwritten: the old park is gone whatever happens
        epoch = self._epoch
        self._journal("saving", slot, park=name, touched=[conv])
        try:
            n = await self._backend.save(slot.index, name)
        except asyncio.CancelledError:
            self._save_failed(slot, conv, name, epoch, "cancelled")
            raise
        except Exception as e:  # report: logged here; the next LRU slot is tried
            log.warning("slot %d: saving conversation %s as %s failed: %s", slot.index, conv.id, name, e)
            self._save_failed(slot, conv, name, epoch, str(e) or type(e).__name__)
            return False
        if epoch != self._epoch:
            self._save_failed(slot, conv, name, epoch, "the server restarted during the save")
            return False
        conv.parked_as = name
        if n > 0:
            conv.n_tokens = slot.n_tokens = n
        self._park_tokens[conv.id] = n if n > 0 else slot.n_tokens
        if claimant is not None:
            conv.slot = None  # leaving: the claimant's lease takes the slot right after this
        else:
            slot.claimant = None
        slot.set(SlotState.IDLE_CLEAN if claimant is None else SlotState.SAVING)
        self._journal("saved", slot, park=name, n_tokens=n, touched=[conv], state=SlotState.IDLE_CLEAN)
        self._enforce_budget()
        self._wake()
        return True

    def _save_failed(self, slot: _Slot, conv: Conversation, name: str, epoch: int, why: str) -> None:
        self._delete_park(name)  # a half-written park (or the old one it overwrote) is not to be restored
        conv.parked_as = None
        slot.claimant = None
        if epoch != self._epoch:  # the server restarted meanwhile: the slot holds nothing now
            conv.slot = None
            self._empty(slot, self._reset_cause)
        else:
            slot.set(SlotState.IDLE_DIRTY)
        self._journal("save_failed", slot, conv_id=conv.id, park=name, detail=why, touched=[conv])
        self._wake()

    def _enforce_budget(self) -> None:
        """Delete the oldest parks (by their conversation's last use) of conversations not in a slot
        until the parks of this profile fit in the disk budget."""
        if self.disk_budget_bytes is None:
            return
        parks: dict[str, tuple[str, float]] = {}
        if self._store is not None:
            for p in self._store.parks(self.profile):
                parks[p.conversation] = (p.parked_as, p.last_used)
        for conv in [*self._seen.values(), *self._holders.values()]:  # in memory: newer than the store
            if conv.parked_as:
                parks[conv.id] = (conv.parked_as, conv.last_used)
            else:
                parks.pop(conv.id, None)
        sizes = {cid: max(0, self._backend.parked_size(name)) for cid, (name, _) in parks.items()}
        total = sum(sizes.values())
        if total <= self.disk_budget_bytes:
            return
        in_slot = {s.holder for s in self._slots
                   if s.holder is not None and not (s.state is SlotState.SAVING and s.claimant is not None)}
        for cid, (name, _) in sorted(parks.items(), key=lambda kv: (kv[1][1], kv[0])):
            if total <= self.disk_budget_bytes:
                break
            if cid in in_slot:
                continue
            if not self._delete_park(name):
                continue
            total -= sizes[cid]
            conv = self._conv(cid)
            if conv is not None:
                conv.parked_as = None
            self._journal("park_deleted", None, conv_id=cid, park=name,
                          detail=f"disk budget {self.disk_budget_bytes} bytes", touched=[conv])

    # -- plumbing

    def ram_longer(self, conv: Conversation) -> bool:
        """Whether the server's RAM cache likely holds a longer copy of ``conv`` than its park (or it has
        no park): then its park is not restored over it (the module's doc)."""
        n = self._ram.get(conv.id, 0) if self.ram_cache else 0
        return n > 0 and n > self._parked_tokens(conv)

    def _parked_tokens(self, conv: Conversation) -> int:
        if not conv.parked_as:
            return 0
        # a park saved by an earlier run of the app: its token count is not known here, its conversation's is
        return self._park_tokens.get(conv.id, conv.n_tokens)

    def _note_ram(self, conv_id: str, n_tokens: int) -> None:
        if not self.ram_cache or n_tokens <= 0:
            return
        self._ram[conv_id] = n_tokens
        self._ram.move_to_end(conv_id)
        while len(self._ram) > LOST_NOTES_KEPT:
            self._ram.popitem(last=False)

    def _restore_pays(self, conv: Conversation, prompt_tokens: int | Callable[[], int]) -> bool:
        rate = self._prefill_rate()
        if rate is None or rate <= 0:
            return True  # not measured yet: a restore is almost always cheaper
        if callable(prompt_tokens):
            prompt_tokens = prompt_tokens()
        reusable = conv.n_tokens if prompt_tokens <= 0 else min(conv.n_tokens, prompt_tokens)
        return self._restore_ms(conv.n_tokens) < reusable * rate

    def _new_lease(self, slot: _Slot, conv: Conversation) -> Lease:
        self._lease_ids += 1
        self._tick += 1
        slot.used_at = self._tick
        slot.lease_id = self._lease_ids
        slot.set_holder(conv.id)
        conv.slot = slot.index
        conv.last_used = max(conv.last_used, self._clock())
        self._holders[conv.id] = conv
        lease = Lease(slot=slot.index, conversation=conv.id, id=self._lease_ids, epoch=self._epoch)
        self._leases[lease.id] = lease
        return lease

    def _empty(self, slot: _Slot, cause: Cause) -> Conversation | None:
        """``slot`` holds nothing now; its conversation (returned) is in no slot, for ``cause``."""
        conv = self._conv(slot.holder) if slot.holder else None
        if slot.holder is not None:
            self._note_lost(slot.holder, cause, None)
            self._holders.pop(slot.holder, None)
        if conv is not None:
            conv.slot = None
        slot.set_holder(None)
        slot.set(SlotState.FREE)
        slot.n_tokens = 0
        slot.claimant = None
        slot.lease_id = None
        return conv

    def _note_lost(self, conv_id: str, cause: Cause, by: str | None) -> None:
        self._lost[conv_id] = (cause, by)
        self._lost.move_to_end(conv_id)
        while len(self._lost) > LOST_NOTES_KEPT:
            self._lost.popitem(last=False)

    @staticmethod
    def _lru_key(s: _Slot) -> tuple[int, int, int]:
        return (s.used_at, 0 if s.state is SlotState.IDLE_CLEAN else 1, s.index)

    def _slot_of(self, conv_id: str) -> _Slot | None:
        """The slot that holds ``conv_id``, or is being saved to be given to it."""
        return next((s for s in self._slots if s.holder == conv_id or s.claimant == conv_id), None)

    def _adopt(self, conv: Conversation) -> Conversation:
        old = self._holders.get(conv.id) or self._seen.get(conv.id)
        if old is not None and old is not conv:
            conv.n_tokens, conv.parked_as = old.n_tokens, old.parked_as
        held = next((s for s in self._slots if s.holder == conv.id), None)
        conv.slot = held.index if held is not None else None
        if conv.id in self._holders:
            self._holders[conv.id] = conv
        self._seen[conv.id] = conv
        return conv

    def _conv(self, conv_id: str) -> Conversation | None:
        conv = self._holders.get(conv_id) or self._seen.get(conv_id)
        if conv is None and self._store is not None:
            conv = self._store.get(conv_id)
            if conv is not None:
                self._seen[conv_id] = conv
        return conv

    def _delete_park(self, name: str) -> bool:
        try:
            self._backend.delete_park(name)
            return True
        except Exception as e:  # report: a park that cannot be deleted is logged and left
            log.warning("cannot delete the park %s: %s", name, e)
            return False

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    async def _changed(self) -> None:
        f = asyncio.get_running_loop().create_future()
        self._waiters.append(f)
        try:
            await f
        finally:
            if f in self._waiters:
                self._waiters.remove(f)

    # -- the journal

    def _entry(self, event: str, slot: _Slot | None, *, conv_id: str | None = None, park: str | None = None,
               n_tokens: int | None = None, detail: str = "", state: SlotState | None = None) -> JournalEntry:
        if slot is not None:
            conv_id = conv_id or slot.holder
            n_tokens = slot.n_tokens if n_tokens is None else n_tokens
            state = state or slot.state
        return JournalEntry(profile=self.profile, event=event, slot=None if slot is None else slot.index,
                            conversation=conv_id, park=park, n_tokens=n_tokens,
                            state=None if state is None else state.value, detail=detail, at=self._clock())

    def _journal(self, event: str, slot: _Slot | None, *, conv_id: str | None = None, park: str | None = None,
                 n_tokens: int | None = None, detail: str = "", state: SlotState | None = None,
                 touched: Iterable[Conversation | None] = ()) -> None:
        if self.on_change is not None:
            self.on_change(event, conv_id or (slot.holder if slot is not None else None))
        if self._store is None:
            return
        entry = self._entry(event, slot, conv_id=conv_id, park=park, n_tokens=n_tokens, detail=detail, state=state)
        try:
            self._store.journal(entry, conversations=[c for c in touched if c is not None])
        except ConversationStoreError as e:
            log.error("slot lease journal not written (%s %s): %s", event, entry.conversation, e)
            return
        self._journal_writes += 1
        if self._journal_writes >= JOURNAL_COMPACT_EVERY:
            self._compact()

    def _compact(self) -> None:
        """Rewrite the journal as what a replay of it gives: one entry per slot (a save in flight as
        its "saving" entry, so a crash during it is still found)."""
        entries = []
        for s in self._slots:
            if s.state is SlotState.SAVING and s.holder is not None:
                entries.append(self._entry("saving", s, park=park_name(s.holder)))
            elif s.holder is not None or s.state is not SlotState.FREE:
                entries.append(self._entry("snapshot", s))
        self._rewrite_journal(entries, ())

    def _rewrite_journal(self, entries: list[JournalEntry], touched: Iterable[Conversation]) -> None:
        self._journal_writes = 0
        if self._store is None:
            return
        try:
            self._store.rewrite_journal(self.profile, entries, conversations=list(touched))
        except ConversationStoreError as e:
            log.error("slot lease journal not rewritten: %s", e)
