"""Slot leases: which conversation runs in which llama-server slot, and parking/restoring them
when there are more conversations than slots.

This module decides (which slot a request gets, what the server did to the slots, what a stop
parks); its collaborators keep the rest: the lease table of the slots (:mod:`app.proxy.lease_table`),
its journal (:mod:`app.proxy.lease_journal`), the parks, the RAM cache and the disk budget
(:mod:`app.proxy.lease_parks`). No HTTP here: the slot actions go through a
:class:`app.proxy.lease_parks.SlotBackend` (the HTTP layer's, or a fake in the tests). Everything runs
on one asyncio loop; the state changes between two ``await``s are synchronous, so no lock is needed: a
coroutine that must wait registers itself and re-checks when any slot changes
(:meth:`app.proxy.lease_table.LeaseTable.changed`), which cannot miss a wake-up.

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
  (full disk) is logged and does not stop the requests. Two entries no crash can make wrong (a
  dirty slot's "acquired" by the conversation it holds, "restored") are held until the request is
  sent and written while the server works (:meth:`SlotLeases.flush_journal`; app.proxy.lease_journal).
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
* **Warm start.** At a start (:meth:`SlotLeases.warm`) the parks of the conversations used last are
  restored into the FREE slots before any request asks, most recent first, while no request waits
  and the restore pays for the conversation's whole length: the first turn of a conversation that
  comes back after a restart then finds it in its slot, and its time to the first token has no
  restore in it. Such a slot is IDLE_CLEAN (its park is what it holds): taking it costs no save.
  The request that finds its conversation there is judged as a restored one (``restored_from``).
* **Park ahead.** When every slot holds a conversation and one of the last ``2 × n_slots`` new leases
  took a slot from another conversation (conversations outnumber the slots), the conversation the
  next eviction would take (the LRU idle slot, IDLE_DIRTY, at least ``MIN_PARK_TOKENS``) is saved
  while nothing runs (:meth:`SlotLeases.park_ahead`, called at the proxy's idle moments). The
  conversation that arrives next then takes an IDLE_CLEAN slot: no save on its path. Conversations
  that fit in the slots are never parked ahead (no eviction happens); a request arriving during the
  save waits for it and takes that slot, as it would have after the save on its path (not a more
  recently used one).
* **Disk budget.** After each save, when the parks of this profile exceed the budget, the
  parks of the conversations not in a slot are deleted, least recently used first.

A conversation is one object per id: :meth:`SlotLeases.acquire` adopts the object it is given
(its slot and park fields are set from what the leases know) and changes it in place afterwards.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable

from app.core.conversation import Cause, Conversation
from app.proxy.lease_journal import LeaseJournal, RecoveryReport
from app.proxy.lease_parks import RamCache, SlotBackend, SlotParks
from app.proxy.lease_table import ACTIVE, IDLE, Lease, LeaseTable, Slot, SlotContext, SlotState, SlotView
from app.sessions.journal import JournalKind, Recovery, recovers
from app.store.conversations import ConversationStore

log = logging.getLogger(__name__)
#: a conversation holding fewer tokens is not parked before a stop, a sleep or idle-slot clearing: it
#: re-processes them in less time than a park and a restore take (a state file's fixed cost, tens of ms)
MIN_PARK_TOKENS = 32


@recovers(JournalKind.PROXY_LEASE)
def recover_leases(run: Recovery) -> list[str]:
    """The journal kind of the proxy's slot leases: :meth:`SlotLeases.recover` of ``run.subject``
    (``run.same_process``: the server outlived the crash), through the one recovery loop."""
    return run.subject.recover(server_same_process=run.same_process).messages()


class _Kept:
    """An attribute of :class:`SlotLeases` that one of its collaborators keeps: read and set there."""

    def __init__(self, owner: str, name: str) -> None:
        self.owner, self.name = owner, name

    def __get__(self, obj, cls=None):
        return self if obj is None else getattr(getattr(obj, self.owner), self.name)

    def __set__(self, obj, value) -> None:
        setattr(getattr(obj, self.owner), self.name, value)


class SlotLeases:
    """The slot lease manager of one server (see the module's doc for the rules)."""

    def __init__(self, n_slots: int, backend: SlotBackend, *, store: ConversationStore | None, profile: str,
                 prefill_ms_per_token: Callable[[], float | None], restore_ms_estimate: Callable[[int], float],
                 disk_budget_bytes: int | None, clock: Callable[[], float] = time.time) -> None:
        if n_slots < 1:
            raise ValueError(f"a server has at least one slot, not {n_slots}")
        self.n_slots = n_slots
        self._store = store
        self.profile = profile
        self._clock = clock
        self._table = LeaseTable(n_slots, store, clock)
        self._journal = LeaseJournal(store, profile, clock, self._table)
        # the server's RAM prompt cache (#28276), set from its caching at start (app.proxy.lease_parks)
        self._ram = RamCache()
        # per new lease, whether it took a slot from another conversation (see park_ahead)
        self._took: deque[bool] = deque(maxlen=2 * n_slots)
        self._parks = SlotParks(backend, self._table, self._journal, self._ram, store=store, profile=profile,
                                prefill_ms_per_token=prefill_ms_per_token, restore_ms_estimate=restore_ms_estimate,
                                disk_budget_bytes=disk_budget_bytes)

    # -- the settings its owner sets, kept by its collaborators

    #: the parks' disk budget in bytes (None: no limit), enforced at the next save
    disk_budget_bytes = _Kept("_parks", "disk_budget_bytes")
    #: told ``(event, conversation)`` of every journaled change (the proxy's KV events follow them)
    on_change = _Kept("_journal", "on_change")
    #: the server runs ``--cache-ram`` != 0: its RAM cache is a restore source (the module's doc)
    ram_cache = _Kept("_ram", "on")
    #: the server clears idle slots (so taking an idle slot costs nothing)
    idle_slots_cleared = _Kept("_ram", "idle_slots_cleared")

    @property
    def backend(self) -> SlotBackend:
        return self._parks.backend

    @property
    def ram_chosen(self) -> int:
        """How many requests were sent to the server's RAM copy of their conversation instead of its park."""
        return self._ram.chosen

    # -- what the faces read

    def outside_prompts(self) -> dict[int, tuple[str, int]]:
        """FREE slots holding a prompt of a request passed through untouched: slot -> (conversation, tokens)."""
        return dict(self._ram.outside)

    def snapshot(self) -> list[SlotView]:
        return self._table.snapshot()

    def state(self, slot: int) -> SlotState:
        return self._table.slots[slot].state

    def holder(self, slot: int) -> str | None:
        return self._table.slots[slot].holder

    def lost_cause(self, conv_id: str) -> tuple[Cause, str | None] | None:
        """Why ``conv_id`` is in no slot, and who took its slot (Cause.SLOT_TAKEN); None if not known."""
        return self._table.lost.get(conv_id)

    @property
    def waiting(self) -> int:
        """Coroutines waiting for a slot to change (requests queued, a park-before-stop waiting)."""
        return self._table.waiting

    def ram_longer(self, conv: Conversation) -> bool:
        """Whether the server's RAM cache likely holds a longer copy of ``conv`` than its park (or it has
        no park): then its park is not restored over it (the module's doc)."""
        return self._ram.longer(conv)

    # -- acquire / release

    async def acquire(self, conv: Conversation, prompt_tokens: int | Callable[[], int]) -> Lease:
        """A slot for one request of ``conv``, BUSY until :meth:`release`; waits while the conversation's
        own slot is in use (a second request of one conversation runs after the first) and while
        no slot can be freed. ``prompt_tokens``: the request's size, or a function that guesses it (called
        only when a restore is weighed: a conversation that kept its slot never needs it)."""
        t, ram = self._table, self._ram
        conv = t.adopt(conv)
        tried: dict[int, int] = {}  # slot -> its version when saving its conversation failed
        while True:
            own = t.slot_of(conv.id)
            if own is not None:
                if own.state in IDLE and own.holder == conv.id:
                    return self._lease_held(own, conv)
                await t.changed()  # its own slot is busy, saving or restoring: after that one
                continue
            free = [s for s in t.slots if s.state is SlotState.FREE]
            # its own prompt still in a slot a request passed through untouched left it in, else any FREE one
            slot = next((s for s in free if ram.outside.get(s.index, ("",))[0] == conv.id), None) or \
                next(iter(free), None)
            evicted = None
            dropped = False
            idle = sorted((s for s in t.slots if s.state in IDLE), key=t.lru_key)
            candidates = [s for s in idle if tried.get(s.index) != s.version]
            foreign = [s for s in free if s.index in ram.outside and ram.outside[s.index][0] != conv.id]
            if slot is not None and ram.outside.get(slot.index, ("",))[0] != conv.id and foreign \
                    and ram.longer(conv):
                # a FREE slot that holds another prompt costs nothing to take and makes the server look in its
                # RAM cache (an empty one does not)
                slot = foreign[0]
            elif slot is not None and ram.idle_slots_cleared and ram.longer(conv):
                # only pinned to a slot that holds a prompt does the server look in its RAM cache; the server
                # clears that idle slot when this task starts anyway
                holding = [s for s in candidates if s.n_tokens > 0]
                if holding:
                    slot, candidates = None, holding
            if slot is None:
                ahead = [s for s in t.slots if s.state is SlotState.SAVING and s.claimant is None]
                if ahead and candidates and min(map(t.lru_key, ahead)) < t.lru_key(candidates[0]):
                    await t.changed()  # a park ahead of the least recently used slot: that slot, once saved
                    continue
                if not candidates:
                    if not idle or any(s.state in ACTIVE for s in t.slots):
                        await t.changed()  # a slot will be released
                        continue
                    slot, evicted, dropped = idle[0], idle[0].holder, True  # nothing will ever be released
                else:
                    victim = candidates[0]
                    if victim.state is SlotState.IDLE_DIRTY:
                        holder = victim.holder
                        if not await self._parks.save(victim, claimant=conv.id):
                            tried[victim.index] = victim.version
                            continue
                        evicted = holder
                    else:
                        evicted = victim.holder
                    slot = victim
            self._took.append(evicted is not None)
            return await self._lease_new(slot, conv, prompt_tokens, evicted, dropped)

    def release(self, lease: Lease, n_tokens: int, ok: bool) -> None:
        """The request of ``lease`` ended. ``ok``: the slot now holds the conversation, ``n_tokens``
        of it (IDLE_DIRTY). Not ok (failed, cancelled) or interrupted by a server restart: what the
        slot holds is not known, so it is FREE and the conversation in no slot."""
        if lease.released:
            return
        t = self._table
        lease.released = True
        t.leases.pop(lease.id, None)
        slot = t.slots[lease.slot]
        if slot.lease_id != lease.id:
            return
        slot.lease_id = None
        t.tick += 1
        slot.used_at = t.tick
        conv = t.conv(lease.conversation)
        if ok and lease.interrupted is None and conv is not None:
            slot.set(SlotState.IDLE_DIRTY)
            slot.n_tokens = n_tokens
            conv.slot, conv.n_tokens = slot.index, n_tokens
            conv.last_used = max(conv.last_used, self._clock())
            t.lost.pop(conv.id, None)
            self._ram.copies.pop(conv.id, None)  # its slot holds it: a RAM copy of it is older
            self._journal.write("released", slot, touched=[conv])
        else:
            t.empty(slot, lease.interrupted or Cause.UNKNOWN)
            if lease.interrupted is None and lease.epoch == t.epoch:
                t.failed.add(lease.conversation)
            self._journal.write("freed", slot, conv_id=lease.conversation, touched=[conv],
                                detail="the request failed" if not ok else str(lease.interrupted or ""))
        t.wake()

    # -- park before a stop, and what the server did by itself

    async def save_dirty(self, all: bool = False) -> list[str]:
        """Save every IDLE_DIRTY slot (park before a server stop or sleep); the conversations saved.
        ``all``: also wait for the requests running now, and save their slots when they end. A slot
        whose save fails stays IDLE_DIRTY (logged and journaled) and is not tried twice. A slot that
        holds fewer than ``MIN_PARK_TOKENS`` is not saved: re-processing them costs less than a park
        and a restore."""
        t = self._table
        waiting_for = set(t.leases) if all else set()
        tried: dict[int, int] = {}
        saved: list[str] = []
        while True:
            dirty = next((s for s in t.slots if s.state is SlotState.IDLE_DIRTY
                          and tried.get(s.index) != s.version and s.n_tokens >= MIN_PARK_TOKENS), None)
            if dirty is not None:
                holder = dirty.holder
                if await self._parks.save(dirty, claimant=None):
                    saved.append(holder)
                else:
                    tried[dirty.index] = dirty.version
                continue
            if not waiting_for & set(t.leases):
                return saved
            await t.changed()

    def park_ahead_slot(self) -> int | None:
        """The slot :meth:`park_ahead` would save now (the module's doc, "Park ahead"), or None: a slot
        is FREE, a request runs or waits, no recent lease took a slot from another conversation, or
        the LRU idle slot is already parked (IDLE_CLEAN) or holds too few tokens to be worth it."""
        t = self._table
        if not any(self._took) or t.waiting or any(s.state is SlotState.FREE or s.state in ACTIVE
                                                     for s in t.slots):
            return None
        lru = min((s for s in t.slots if s.state in IDLE), key=t.lru_key, default=None)
        if lru is None or lru.state is not SlotState.IDLE_DIRTY or lru.n_tokens < MIN_PARK_TOKENS:
            return None
        return lru.index

    async def park_ahead(self) -> str | None:
        """Save the conversation the next eviction would take, while nothing runs (see
        :meth:`park_ahead_slot`); the conversation saved, or None (nothing to do, or the save failed:
        logged and journaled, the slot stays IDLE_DIRTY and a later eviction saves it on its path)."""
        index = self.park_ahead_slot()
        if index is None:
            return None
        slot = self._table.slots[index]
        holder = slot.holder
        return holder if await self._parks.save(slot, claimant=None) else None

    def note_slot_cleared(self, slot: int) -> None:
        """The server emptied an idle slot (idle-slot caching saves it to its RAM cache and clears it
        when another task starts): its conversation is in no slot now."""
        s = self._table.slots[slot]
        outside = self._ram.outside.pop(slot, None) if s.state is SlotState.FREE else None
        if outside is not None:
            self._ram.note(*outside)  # a prompt passed through untouched, saved to the RAM cache
            return
        if s.state not in IDLE:
            return  # a slot in use is not idle: idle-slot caching leaves it alone
        conv_id, n = s.holder, s.n_tokens
        conv = self._table.empty(s, Cause.IDLE_SLOT_CLEARED)
        if conv_id is not None:
            self._ram.note(conv_id, n)  # idle-slot caching saved it to the RAM cache before clearing it
        self._journal.write("cleared", s, conv_id=conv_id, touched=[conv])
        self._table.wake()

    def note_slot_used_outside(self, slot: int, by: str, *, conv_id: str | None = None, n_tokens: int = 0) -> None:
        """A request the proxy passed through untouched (its client chose the slot, or turned prompt
        caching off) ran in ``slot``: an idle conversation there lost its tokens, taken by ``by``.
        ``conv_id``/``n_tokens``: that request's conversation and the tokens it left in the slot, noted
        (the slot stays FREE to the proxy): when the server clears the slot or a task is pinned over it,
        that prompt goes to the server's RAM cache, where the conversation, back, is looked for."""
        t, outside = self._table, self._ram.outside
        s = t.slots[slot]
        if s.state is SlotState.FREE:
            outside.pop(slot, None)
            if conv_id is not None and n_tokens > 0:
                outside[slot] = (conv_id, n_tokens)
            return
        if s.state not in IDLE:
            return  # leased or being saved: the proxy's own request owns it now
        conv_id = s.holder
        conv = t.empty(s, Cause.SLOT_TAKEN)
        if conv_id is not None:
            t.note_lost(conv_id, Cause.SLOT_TAKEN, by)
        self._journal.write("cleared", s, conv_id=conv_id, touched=[conv], detail=by)
        if s.state is SlotState.FREE and conv_id is not None and n_tokens > 0:
            outside[slot] = (conv_id, n_tokens)
        t.wake()

    def note_server_restarted(self) -> None:
        """Every slot is empty; conversations keep their parks, those never parked lost their cache."""
        self._reset_all(Cause.SERVER_RESTARTED)

    def note_server_slept(self) -> None:
        """--sleep-idle-seconds destroyed the context: as a restart."""
        self._reset_all(Cause.SERVER_SLEPT)

    def _reset_all(self, cause: Cause) -> None:
        t = self._table
        t.epoch += 1
        t.reset_cause = cause
        for conv_id in self._ram.copies:  # cleared into the RAM cache, which is gone now: lost by this
            if t.lost.get(conv_id, (None, None))[0] is Cause.IDLE_SLOT_CLEARED:
                t.note_lost(conv_id, cause, None)
        self._ram.copies.clear()  # a new server process, or a slept one: its RAM cache is empty too
        self._ram.outside.clear()
        for conv_id in t.failed:  # failed just before: the restart emptied their slot all the same
            if t.lost.get(conv_id, (None, None))[0] is Cause.UNKNOWN:
                t.note_lost(conv_id, cause, None)
        t.failed.clear()
        touched = []
        for s in t.slots:
            if s.state in IDLE:
                touched.append(t.empty(s, cause))
            elif s.state in (SlotState.BUSY, SlotState.RESTORING) and s.lease_id in t.leases:
                # The request keeps its slot until it releases it (it fails, or ran on the new server);
                # what the slot holds then is not known: release frees it.
                t.leases[s.lease_id].interrupted = cause
                s.n_tokens = 0
            # SAVING: the save in flight sees the new epoch and frees the slot itself
        self._journal.write("reset", None, detail=cause.name, touched=touched)
        t.wake()

    # -- start after a crash

    def recover(self, server_same_process: bool = False) -> RecoveryReport:
        """Read the journal at start (before any acquire): :meth:`app.proxy.lease_journal.LeaseJournal.recover`
        (an interrupted save's park deleted; with ``server_same_process`` the last idle owners kept)."""
        return self._journal.recover(self._parks.delete_park, server_same_process)

    # -- forgetting a conversation

    async def forget(self, conv_id: str) -> Conversation | None:
        """Erase the slot that holds ``conv_id`` (after its request, if one runs), delete its park and
        its stored record; the conversation it was, or None when the store did not know it."""
        t = self._table
        while (s := t.slot_of(conv_id)) is not None and s.state not in IDLE:
            await t.changed()
        conv = t.conv(conv_id)
        if s is not None:
            s.set(SlotState.BUSY)  # reserved while the erase runs: no request may start in it meanwhile
            self._journal.write("erasing", s, conv_id=conv_id)
            try:
                await self._parks.backend.erase(s.index)
            finally:
                t.empty(s, Cause.UNKNOWN)
                self._journal.write("erased", s, conv_id=conv_id)
                t.wake()
        if conv is not None and conv.parked_as:
            self._parks.delete_park(conv.parked_as)
            conv.parked_as = None
        t.lost.pop(conv_id, None)
        self._ram.copies.pop(conv_id, None)
        t.holders.pop(conv_id, None)
        return self._store.forget(conv_id) if self._store is not None else conv

    # -- the steps

    async def warm(self, conversations: list[Conversation]) -> list[str]:
        """Restore the parks of ``conversations`` (the most recently used first; those without a park,
        or in a slot already, are passed over) into the FREE slots, before any request asks (the rule
        "Warm start" of the module's doc). Stops when no slot is FREE or a request waits for a slot.
        The conversations now in a slot."""
        t = self._table
        warmed: list[str] = []
        for conv in sorted(conversations, key=lambda c: c.last_used, reverse=True):
            free = [s for s in t.slots if s.state is SlotState.FREE and s.index not in self._ram.outside]
            if not free or t.waiting or self._ram.idle_slots_cleared:
                break  # (a server that clears idle slots would throw a warmed slot away at the next task)
            conv = t.adopt(conv)
            name = conv.parked_as
            if not name or conv.slot is not None or t.slot_of(conv.id) is not None \
                    or not self._parks.restore_pays(conv, conv.n_tokens):
                continue
            slot = free[0]
            # a warm restore is no use of the conversation: when it was used last, what its last reply left
            # (a park older than that is judged against it at its next turn) and why it is in no slot stay
            last_used, held, lost = conv.last_used, conv.n_tokens, t.lost.get(conv.id)
            lease = t.new_lease(slot, conv)
            conv.last_used = last_used
            slot.set(SlotState.RESTORING)
            self._journal.write("restoring", slot, park=name, touched=[conv], detail="warm start")
            n = await self._parks.restore(slot, conv, lease, name, keep_park_on_cancel=True)
            t.leases.pop(lease.id, None)
            lease.released = True
            if slot.lease_id == lease.id:
                slot.lease_id = None
            if n > 0 and not lease.restore_failed and lease.restore_avoided is None and slot.holder == conv.id:
                slot.set(SlotState.IDLE_CLEAN)  # what it holds is its park
                slot.warmed_from = name
                conv.slot, conv.n_tokens = slot.index, max(held, n)
                self._journal.write("released", slot, touched=[conv], detail="warm start")
                warmed.append(conv.id)
            elif slot.holder == conv.id:  # logged by the parks; the conversation is where it was (a failed
                t.empty(slot, Cause.UNKNOWN)  # restore deleted its park: it re-prefills when it comes back)
                if lost is not None:
                    t.lost[conv.id] = lost
                else:
                    t.lost.pop(conv.id, None)
                self._journal.write("freed", slot, conv_id=conv.id, touched=[conv], detail="warm start: not restored")
            t.wake()
        return warmed

    def _lease_held(self, slot: Slot, conv: Conversation) -> Lease:
        lease = self._table.new_lease(slot, conv)
        if slot.warmed_from is not None:  # restored at the start for this request: judged as a restore,
            # against what its last reply left (a park older than that lost the turns after it: why, said)
            lease.restored_from = slot.warmed_from
            lost, taken_by = self._table.lost.get(conv.id, (None, None))
            lease.slot_context = SlotContext(held=True, restored=True, restored_tokens=slot.n_tokens,
                                             expected_tokens=max(slot.n_tokens, conv.n_tokens), lost=lost,
                                             taken_by=taken_by)
            slot.warmed_from = None
            slot.set(SlotState.BUSY)
            self._journal.write("acquired", slot, touched=[conv])
            return lease
        lease.slot_context = SlotContext(held=True, expected_tokens=slot.n_tokens)
        # a dirty slot's "acquired" is held until the request is sent (app.proxy.lease_journal: a crash
        # before it leaves the slot dirty with this conversation, as it is); a clean one's is not: lost, it
        # would leave the slot clean, its park taken for its whole content
        later = slot.state is SlotState.IDLE_DIRTY
        slot.set(SlotState.BUSY)
        self._journal.write("acquired", slot, touched=[conv], later=later)
        return lease

    @property
    def journal_held(self) -> bool:
        """Journal entries are held until the request is sent (app.proxy.lease_journal)."""
        return self._journal.held

    def flush_journal(self) -> None:
        """Write the journal entries held until the request was sent (app.proxy.lease_journal)."""
        self._journal.flush()

    async def _lease_new(self, slot: Slot, conv: Conversation, prompt_tokens: int | Callable[[], int],
                         evicted: str | None, dropped: bool) -> Lease:
        t, ram = self._table, self._ram
        touched = [conv]
        outside = ram.outside.pop(slot.index, None)  # a prompt passed through untouched, in this FREE slot
        held_prompt = (slot.n_tokens > 0 and slot.holder not in (None, conv.id)  # what the server sees pinned
                       or outside is not None and outside[0] != conv.id)
        if outside is not None and outside[0] != conv.id:
            ram.note(*outside)  # pinned over it: the server saves that prompt to its RAM cache first
        ram_longer = ram.longer(conv)
        if evicted is not None and evicted != conv.id:
            other = t.conv(evicted)
            if other is not None:
                other.slot = None
                touched.append(other)
            t.note_lost(evicted, Cause.SLOT_TAKEN, conv.id)
            t.holders.pop(evicted, None)
            # a pinned request over another prompt: the server saves that prompt to its RAM cache first
            ram.note(evicted, slot.n_tokens)
        slot.set_holder(conv.id)
        previous = slot.last_holder if slot.last_holder != conv.id else None
        lost, taken_by = t.lost.get(conv.id, (None, None))
        slot.claimant = None
        slot.n_tokens = 0
        lease = t.new_lease(slot, conv)
        if dropped:
            self._journal.write("dropped", slot, conv_id=evicted, detail="no save succeeded and no slot is in use",
                                touched=touched[1:])
        restored, restored_tokens, skipped = False, 0, False
        ram_tokens = ram.copies.pop(conv.id, 0) if ram_longer and held_prompt else 0
        if ram_tokens:
            ram.chosen += 1
            log.info("slot %d: conversation %s is left to the server's RAM cache (%d tokens there, its park %d)",
                     slot.index, conv.id, ram_tokens, ram.parked_tokens(conv))
        if conv.parked_as and not ram_tokens:
            name = conv.parked_as
            if self._parks.restore_pays(conv, prompt_tokens):
                slot.set(SlotState.RESTORING)
                self._journal.write("restoring", slot, park=name, touched=touched)
                touched = []
                restored_tokens = await self._parks.restore(slot, conv, lease, name)
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
            self._journal.write("acquired", slot, touched=[conv])
        return lease
