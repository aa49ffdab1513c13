"""Where a leased conversation's tokens go and come back from: its park (saved from an idle slot,
restored into a leased one, through a :class:`SlotBackend`), the server's RAM cache (a likely copy the
server loads itself), and the disk budget of the parks.

The lease manager (:class:`app.proxy.leases.SlotLeases`) decides when; :class:`SlotParks` does it and
keeps the lease table and its journal true meanwhile (the rules are in :mod:`app.proxy.leases`'s doc:
park before evicting, restore only when it pays, the RAM cache as a restore source, the disk budget).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Callable, Protocol

from app.core.conversation import Cause, Conversation
from app.proxy.lease_journal import LeaseJournal
from app.proxy.lease_table import LOST_NOTES_KEPT, Lease, LeaseTable, Slot, SlotState, park_name
from app.store.conversations import ConversationStore

log = logging.getLogger(__name__)


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


class RamCache:
    """The server's RAM prompt cache (#28276) as the leases know it: on (``--cache-ram`` != 0), whether
    it clears idle slots (so taking an idle slot costs nothing), the conversations it likely holds copies
    of (tokens), the tokens of each park, and how many requests were sent to the RAM copy instead of the
    park."""

    def __init__(self) -> None:
        self.on = False
        self.idle_slots_cleared = False
        self.copies: OrderedDict[str, int] = OrderedDict()
        # FREE slots (to the proxy) that hold the prompt of a request passed through untouched: slot ->
        # (its conversation, tokens); the server saves that prompt to its RAM cache when it clears the
        # slot or a task is pinned over it, and the conversation, back, finds it there or in the slot
        self.outside: dict[int, tuple[str, int]] = {}
        self.park_tokens: dict[str, int] = {}
        self.chosen = 0

    def longer(self, conv: Conversation) -> bool:
        """Whether the server's RAM cache likely holds a longer copy of ``conv`` than its park (or it has
        no park): then its park is not restored over it (:mod:`app.proxy.leases`'s doc)."""
        n = self.copies.get(conv.id, 0) if self.on else 0
        return n > 0 and n > self.parked_tokens(conv)

    def parked_tokens(self, conv: Conversation) -> int:
        if not conv.parked_as:
            return 0
        # a park saved by an earlier run of the app: its token count is not known here, its conversation's is
        return self.park_tokens.get(conv.id, conv.n_tokens)

    def note(self, conv_id: str, n_tokens: int) -> None:
        if not self.on or n_tokens <= 0:
            return
        self.copies[conv_id] = n_tokens
        self.copies.move_to_end(conv_id)
        while len(self.copies) > LOST_NOTES_KEPT:
            self.copies.popitem(last=False)


class SlotParks:
    """Saves, restores and deletes the parks of one server's leased slots."""

    def __init__(self, backend: SlotBackend, table: LeaseTable, journal: LeaseJournal, ram: RamCache, *,
                 store: ConversationStore | None, profile: str,
                 prefill_ms_per_token: Callable[[], float | None], restore_ms_estimate: Callable[[int], float],
                 disk_budget_bytes: int | None) -> None:
        self.backend = backend
        self._table = table
        self._journal = journal
        self._ram = ram
        self._store = store
        self.profile = profile
        self._prefill_rate = prefill_ms_per_token
        self._restore_ms = restore_ms_estimate
        self.disk_budget_bytes = disk_budget_bytes

    def restore_pays(self, conv: Conversation, prompt_tokens: int | Callable[[], int]) -> bool:
        rate = self._prefill_rate()
        if rate is None or rate <= 0:
            return True  # not measured yet: a restore is almost always cheaper
        if callable(prompt_tokens):
            prompt_tokens = prompt_tokens()
        reusable = conv.n_tokens if prompt_tokens <= 0 else min(conv.n_tokens, prompt_tokens)
        return self._restore_ms(conv.n_tokens) < reusable * rate

    async def restore(self, slot: Slot, conv: Conversation, lease: Lease, name: str, *,
                      keep_park_on_cancel: bool = False) -> int:
        """Restore ``name`` into the leased ``slot``; the tokens restored (0 when it failed: then the
        slot is empty, the park deleted, and ``lease.restore_failed`` set). ``keep_park_on_cancel``: a
        cancel (a warm start's, at a stop) empties the slot but keeps the park: its file is whole."""
        table = self._table
        epoch = table.epoch
        try:
            n = await self.backend.restore(slot.index, name)
        except RestoreAvoided as e:  # the park stays; the request processes its prompt anew
            log.info("slot %d: park %s of conversation %s not restored: %s", slot.index, name, conv.id, e)
            lease.restore_avoided = str(e)
            slot.n_tokens = 0
            self._journal.write("restore_avoided", slot, park=name, detail=str(e), touched=[conv],
                                state=SlotState.BUSY)
            return 0
        except asyncio.CancelledError:
            if not keep_park_on_cancel:
                self._restore_failed(slot, conv, lease, name, "cancelled")
            table.leases.pop(lease.id, None)  # the request will not run: the slot is given back, empty
            lease.released = True
            slot.lease_id = None
            table.empty(slot, Cause.UNKNOWN if keep_park_on_cancel else Cause.RESTORE_FAILED)
            self._journal.write("freed", slot, conv_id=conv.id, touched=[conv], detail="restore cancelled")
            table.wake()
            raise
        except Exception as e:  # report: logged here; the server emptied the slot, the request re-prefills
            log.warning("slot %d: restoring %s for conversation %s failed: %s", slot.index, name, conv.id, e)
            self._restore_failed(slot, conv, lease, name, str(e) or type(e).__name__)
            return 0
        if epoch != table.epoch:
            self._restore_failed(slot, conv, lease, name, "the server restarted during the restore")
            return 0
        slot.n_tokens = n
        conv.n_tokens = n
        # held until the request is sent (app.proxy.lease_journal): lost, "restoring" leaves the slot unknown
        self._journal.write("restored", slot, park=name, n_tokens=n, touched=[conv], later=True)
        return n

    def _restore_failed(self, slot: Slot, conv: Conversation, lease: Lease, name: str, why: str) -> None:
        # llama-server empties the slot on any failed restore (#27068: its KV may even be corrupt):
        # the slot stays leased, holding nothing; the park is not tried again.
        lease.restore_failed = True
        slot.n_tokens = 0
        conv.parked_as = None
        self.delete_park(name)
        slot.set(SlotState.BUSY)
        # journaled as FREE (emptied); the "acquired" that follows gives it to the request
        self._journal.write("restore_failed", slot, park=name, detail=why, touched=[conv], state=SlotState.FREE)

    async def save(self, slot: Slot, claimant: str | None) -> bool:
        """Save the conversation of the idle ``slot`` as its park. With a ``claimant`` (an eviction)
        the slot stays reserved for it after a success; else it becomes IDLE_CLEAN."""
        table = self._table
        conv = table.conv(slot.holder) if slot.holder else None
        if conv is None:  # nothing known to save (cannot happen: holders are kept): as good as free
            table.empty(slot, Cause.UNKNOWN)
            return claimant is not None
        name = park_name(conv.id)
        slot.set(SlotState.SAVING)
        slot.claimant = claimant
        conv.parked_as = conv.park_chain = None  # the file is being overwritten: the old park is gone whatever happens
        epoch = table.epoch
        self._journal.write("saving", slot, park=name, touched=[conv])
        try:
            n = await self.backend.save(slot.index, name)
        except asyncio.CancelledError:
            self._save_failed(slot, conv, name, epoch, "cancelled")
            raise
        except Exception as e:  # report: logged here; the next LRU slot is tried
            log.warning("slot %d: saving conversation %s as %s failed: %s", slot.index, conv.id, name, e)
            self._save_failed(slot, conv, name, epoch, str(e) or type(e).__name__)
            return False
        if epoch != table.epoch:
            self._save_failed(slot, conv, name, epoch, "the server restarted during the save")
            return False
        conv.parked_as = name
        conv.park_chain = conv.slot_chain  # the request whose render it holds (app.proxy.session_backend.RestoreFor)
        if n > 0:
            conv.n_tokens = slot.n_tokens = n
        self._ram.park_tokens[conv.id] = n if n > 0 else slot.n_tokens
        if claimant is not None:
            conv.slot = None  # leaving: the claimant's lease takes the slot right after this
        else:
            slot.claimant = None
        slot.set(SlotState.IDLE_CLEAN if claimant is None else SlotState.SAVING)
        self._journal.write("saved", slot, park=name, n_tokens=n, touched=[conv], state=SlotState.IDLE_CLEAN)
        self._enforce_budget()
        table.wake()
        return True

    def _save_failed(self, slot: Slot, conv: Conversation, name: str, epoch: int, why: str) -> None:
        self.delete_park(name)  # a half-written park (or the old one it overwrote) is not to be restored
        conv.parked_as = None
        slot.claimant = None
        if epoch != self._table.epoch:  # the server restarted meanwhile: the slot holds nothing now
            conv.slot = None
            self._table.empty(slot, self._table.reset_cause)
        else:
            slot.set(SlotState.IDLE_DIRTY)
        self._journal.write("save_failed", slot, conv_id=conv.id, park=name, detail=why, touched=[conv])
        self._table.wake()

    def _enforce_budget(self) -> None:
        """Delete the oldest parks (by their conversation's last use) of conversations not in a slot
        until the parks of this profile fit in the disk budget."""
        if self.disk_budget_bytes is None:
            return
        table = self._table
        parks: dict[str, tuple[str, float]] = {}
        if self._store is not None:
            for p in self._store.parks(self.profile):
                parks[p.conversation] = (p.parked_as, p.last_used)
        for conv in [*table.seen.values(), *table.holders.values()]:  # in memory: newer than the store
            if conv.parked_as:
                parks[conv.id] = (conv.parked_as, conv.last_used)
            else:
                parks.pop(conv.id, None)
        sizes = {cid: max(0, self.backend.parked_size(name)) for cid, (name, _) in parks.items()}
        total = sum(sizes.values())
        if total <= self.disk_budget_bytes:
            return
        in_slot = {s.holder for s in table.slots
                   if s.holder is not None and not (s.state is SlotState.SAVING and s.claimant is not None)}
        for cid, (name, _) in sorted(parks.items(), key=lambda kv: (kv[1][1], kv[0])):
            if total <= self.disk_budget_bytes:
                break
            if cid in in_slot:
                continue
            if not self.delete_park(name):
                continue
            total -= sizes[cid]
            conv = table.conv(cid)
            if conv is not None:
                conv.parked_as = None
            self._journal.write("park_deleted", None, conv_id=cid, park=name,
                                detail=f"disk budget {self.disk_budget_bytes} bytes", touched=[conv])

    def delete_park(self, name: str) -> bool:
        try:
            self.backend.delete_park(name)
            return True
        except Exception as e:  # report: a park that cannot be deleted is logged and left
            log.warning("cannot delete the park %s: %s", name, e)
            return False
