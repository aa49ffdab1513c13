"""The slot lease manager against an in-memory backend (no server): rotation, parks, restores,
failures, waits, resets, crash recovery and the disk budget."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from app.proxy.lease_journal import open_conversation_store
from app.proxy.lease_parks import RestoreAvoided
from app.proxy.lease_table import SlotState, park_name
from app.proxy.leases import MIN_PARK_TOKENS, SlotLeases
from app.core.conversation import Cause, Conversation

PROFILE = "gemma"
BYTES_PER_TOKEN = 10


class FakeBackend:
    """llama-server's slot actions in memory: a slot holds a token count, a park a token count.
    ``gates`` hold a save/restore until the test opens them; ``journal_at_call`` records the
    journal's last entry when each backend call starts (the journal must be written first)."""

    def __init__(self, store=None) -> None:
        self.slot_tokens: dict[int, int] = {}
        self.parks: dict[str, int] = {}
        self.calls: list[tuple] = []
        self.fail_save: set[int] = set()
        self.fail_restore: set[str] = set()
        self.avoid_restore: dict[str, str] = {}  # park -> why the backend will not restore it (slot untouched)
        self.gates: dict[tuple[str, int], asyncio.Event] = {}
        self.store = store
        self.journal_at_call: list[tuple[str, str | None]] = []

    def _note(self, kind: str) -> None:
        if self.store is not None:
            last = self.store.journal_entries(PROFILE)[-1]
            self.journal_at_call.append((kind, last.event))

    async def save(self, slot: int, name: str) -> int:
        self.calls.append(("save", slot, name))
        self._note("save")
        if gate := self.gates.get(("save", slot)):
            await gate.wait()
        if slot in self.fail_save:
            raise RuntimeError("Unable to save slot")
        self.parks[name] = self.slot_tokens.get(slot, 0)
        return self.parks[name]

    async def restore(self, slot: int, name: str) -> int:
        self.calls.append(("restore", slot, name))
        self._note("restore")
        if gate := self.gates.get(("restore", slot)):
            await gate.wait()
        if name in self.avoid_restore:
            raise RestoreAvoided(self.avoid_restore[name])
        if name in self.fail_restore or name not in self.parks:
            self.slot_tokens[slot] = 0  # a failed restore empties the slot
            raise RuntimeError("Unable to restore slot: No available space in KV cache or invalid slot save file")
        self.slot_tokens[slot] = self.parks[name]
        return self.parks[name]

    async def erase(self, slot: int) -> None:
        self.calls.append(("erase", slot))
        self.slot_tokens[slot] = 0

    def parked_size(self, name: str) -> int:
        return self.parks.get(name, 0) * BYTES_PER_TOKEN

    def delete_park(self, name: str) -> None:
        self.calls.append(("delete", name))
        self.parks.pop(name, None)

    def kinds(self) -> list[tuple]:
        return [c for c in self.calls if c[0] != "delete"]


def make(n_slots=2, *, backend=None, store=None, rate=None, restore_ms=None, budget=None):
    ticks = itertools.count(1000)
    return SlotLeases(n_slots, backend or FakeBackend(), store=store, profile=PROFILE,
                      prefill_ms_per_token=rate or (lambda: None),
                      restore_ms_estimate=restore_ms or (lambda n: 1.0),
                      disk_budget_bytes=budget, clock=lambda: float(next(ticks)))


async def turn(leases, backend, conv, n_tokens, prompt_tokens=None):
    """One request of ``conv`` that leaves ``n_tokens`` in its slot."""
    lease = await leases.acquire(conv, n_tokens if prompt_tokens is None else prompt_tokens)
    backend.slot_tokens[lease.slot] = n_tokens
    leases.release(lease, n_tokens, ok=True)
    return lease


async def settle():
    """Let every ready task run (a few loop turns; no timed sleep)."""
    for _ in range(20):
        await asyncio.sleep(0)


@pytest.fixture
def store(tmp_path):
    with open_conversation_store(tmp_path / "data" / "conversations.sqlite3") as s:
        yield s


def conv(cid: str) -> Conversation:
    return Conversation(id=cid, setup="setup-1")


# -- rotation -----------------------------------------------------------------------------------


async def test_more_conversations_than_slots_rotate_lru_park_and_restore(store):
    be = FakeBackend(store)
    leases = make(2, backend=be, store=store)
    a, b, c = conv("A"), conv("B"), conv("C")

    la = await turn(leases, be, a, 100)
    lb = await turn(leases, be, b, 200)
    assert (la.slot, lb.slot) == (0, 1)
    assert leases.state(0) is leases.state(1) is SlotState.IDLE_DIRTY

    lc = await turn(leases, be, c, 300)  # slot 0 is the LRU one: A is saved, then C takes it
    assert lc.slot == 0 and lc.evicted == "A"
    assert be.kinds() == [("save", 0, "proxy-A")]
    assert a.parked_as == "proxy-A" and a.slot is None and a.n_tokens == 100
    assert be.parks == {"proxy-A": 100}
    assert lc.slot_context.previous_owner == "A" and not lc.slot_context.held
    assert leases.lost_cause("A") == (Cause.SLOT_TAKEN, "C")

    back = await leases.acquire(a, 120)  # B's slot 1 is now the LRU one: B saved, A restored there
    assert back.slot == 1 and back.evicted == "B"
    assert back.restored_from == "proxy-A" and not back.restore_failed
    ctx = back.slot_context
    assert ctx.restored and ctx.restored_tokens == 100 and ctx.expected_tokens == 100
    assert ctx.previous_owner == "B" and ctx.lost is Cause.SLOT_TAKEN and ctx.taken_by == "C"
    assert back.taken_by == "C" and not (back.restarted or back.slept or back.idle_cleared)
    assert be.kinds()[1:] == [("save", 1, "proxy-B"), ("restore", 1, "proxy-A")]
    assert leases.state(1) is SlotState.BUSY
    leases.release(back, 130, ok=True)

    again = await leases.acquire(a, 140)  # still in slot 1, nobody took it: no save, no restore
    assert again.slot == 1 and again.slot_context.held and again.slot_context.expected_tokens == 130
    assert again.evicted is None and again.restored_from is None
    assert len(be.kinds()) == 3
    leases.release(again, 150, ok=True)

    # every backend call found its intent already journaled
    assert be.journal_at_call == [("save", "saving"), ("save", "saving"), ("restore", "restoring")]
    events = [(e.event, e.slot, e.conversation) for e in store.journal_entries(PROFILE)]
    i = events.index(("saving", 0, "A"))
    assert events[i + 1] == ("saved", 0, "A")
    stored = store.get("A")
    assert stored.slot == 1 and stored.parked_as == "proxy-A" and stored.n_tokens == 150


async def test_a_clean_lru_slot_is_taken_without_saving():
    be = FakeBackend()
    leases = make(2, backend=be)
    a, b, c = conv("A"), conv("B"), conv("C")
    await turn(leases, be, a, 100)
    await turn(leases, be, b, 200)
    assert await leases.save_dirty() == ["A", "B"]
    assert leases.state(0) is SlotState.IDLE_CLEAN
    be.calls.clear()
    lc = await leases.acquire(c, 10)
    assert lc.slot == 0 and lc.evicted == "A" and be.calls == []
    assert a.parked_as == "proxy-A" and a.slot is None


async def test_restore_is_skipped_when_prefilling_is_cheaper():
    be = FakeBackend()
    # 0.01 ms per token: 100 tokens re-prefill in 1 ms, the restore is estimated at 50 ms
    leases = make(1, backend=be, rate=lambda: 0.01, restore_ms=lambda n: 50.0)
    a, b = conv("A"), conv("B")
    await turn(leases, be, a, 100)
    await turn(leases, be, b, 100)  # A parked
    lease = await leases.acquire(a, 110)
    assert lease.restored_from is None and lease.slot_context.restore_skipped
    assert not lease.slot_context.restored and lease.slot_context.expected_tokens == 0
    assert [c[0] for c in be.kinds()] == ["save", "save"]  # B saved, nothing restored
    assert a.parked_as == "proxy-A"  # the park is kept


async def test_the_request_size_is_guessed_only_when_a_restore_is_weighed():
    be = FakeBackend()
    leases = make(1, backend=be, rate=lambda: 2.0, restore_ms=lambda n: 50.0)
    a, b = conv("A"), conv("B")
    guessed: list[str] = []

    def size(who: str, n: int):
        return lambda: guessed.append(who) or n

    await turn(leases, be, a, 100, prompt_tokens=size("A", 100))  # a free slot: nothing weighed
    await turn(leases, be, a, 120, prompt_tokens=size("A", 120))  # kept its slot: nothing weighed
    await turn(leases, be, b, 100, prompt_tokens=size("B", 100))  # A parked, B new: nothing weighed
    assert guessed == []
    lease = await leases.acquire(a, size("A", 130))  # its 120 tokens re-prefill in 240 ms: restored
    assert guessed == ["A"] and lease.slot_context.restore_skipped is False
    assert lease.restored_from == "proxy-A"


async def test_restore_when_it_beats_prefill_or_the_rate_is_unknown():
    be = FakeBackend()
    rate: list[float | None] = [2.0]  # 2 ms per token: 100 tokens = 200 ms > the 50 ms restore
    leases = make(1, backend=be, rate=lambda: rate[0], restore_ms=lambda n: 50.0)
    a, b = conv("A"), conv("B")
    await turn(leases, be, a, 100)
    await turn(leases, be, b, 100)
    lease = await leases.acquire(a, 110)
    assert lease.restored_from == "proxy-A"
    leases.release(lease, 110, ok=True)
    rate[0] = None  # not measured: restore
    lease = await leases.acquire(b, 110)
    assert lease.restored_from == "proxy-B"


async def test_a_failed_restore_empties_the_slot_and_the_request_reprefills(store):
    be = FakeBackend(store)
    leases = make(1, backend=be, store=store)
    a, b = conv("A"), conv("B")
    await turn(leases, be, a, 100)
    await turn(leases, be, b, 100)
    be.fail_restore.add("proxy-A")
    lease = await leases.acquire(a, 110)
    assert lease.restore_failed and lease.restored_from is None and lease.slot == 0
    assert not lease.slot_context.restored and lease.slot_context.expected_tokens == 0
    assert be.slot_tokens[0] == 0  # the server emptied it
    assert leases.state(0) is SlotState.BUSY  # still this request's: it re-prefills there
    assert a.parked_as is None and ("delete", "proxy-A") in be.calls  # not tried again
    entries = [(e.event, e.state) for e in store.journal_entries(PROFILE)]
    assert entries[-2:] == [("restore_failed", "free"), ("acquired", "busy")]
    leases.release(lease, 110, ok=True)
    assert leases.state(0) is SlotState.IDLE_DIRTY and a.slot == 0


async def test_an_avoided_restore_keeps_the_park_and_the_request_reprocesses(store):
    """The backend declines a restore that would be unsafe (the fork would roll back onto another
    chat's checkpoints): unlike a failure the park is kept, and restored later where it is safe."""
    be = FakeBackend(store)
    leases = make(1, backend=be, store=store)
    a, b = conv("A"), conv("B")
    await turn(leases, be, a, 100)
    await turn(leases, be, b, 100)
    be.avoid_restore["proxy-A"] = "slot 0 still holds the context checkpoints of session 'proxy-B': ..."
    lease = await leases.acquire(a, 110)
    assert lease.restore_avoided and "proxy-B" in lease.restore_avoided
    assert lease.restored_from is None and not lease.restore_failed and not lease.slot_context.restored
    assert a.parked_as == "proxy-A" and ("delete", "proxy-A") not in be.calls  # kept
    assert [(e.event, e.state) for e in store.journal_entries(PROFILE)][-2:] == [("restore_avoided", "busy"),
                                                                                 ("acquired", "busy")]
    leases.release(lease, 110, ok=True)
    assert leases.state(0) is SlotState.IDLE_DIRTY and a.slot == 0
    # later, where it is safe, the park is restored as usual
    del be.avoid_restore["proxy-A"]
    await turn(leases, be, b, 120)
    again = await leases.acquire(a, 120)
    assert again.restored_from == "proxy-A" and again.restore_avoided is None
    leases.release(again, 120, ok=True)


async def test_a_failed_save_takes_the_next_lru_slot(store):
    be = FakeBackend(store)
    leases = make(2, backend=be, store=store)
    a, b, c = conv("A"), conv("B"), conv("C")
    await turn(leases, be, a, 100)
    await turn(leases, be, b, 200)
    be.fail_save.add(0)
    lc = await leases.acquire(c, 10)
    assert lc.slot == 1 and lc.evicted == "B"
    assert be.kinds() == [("save", 0, "proxy-A"), ("save", 1, "proxy-B")]
    assert leases.state(0) is SlotState.IDLE_DIRTY and leases.holder(0) == "A"
    assert a.slot == 0 and a.parked_as is None  # still in its slot, not parked
    assert b.parked_as == "proxy-B"
    assert "save_failed" in [e.event for e in store.journal_entries(PROFILE)]


async def test_when_no_save_succeeds_the_request_waits_for_a_release():
    be = FakeBackend()
    leases = make(2, backend=be)
    a, b, c = conv("A"), conv("B"), conv("C")
    await turn(leases, be, a, 100)
    lb = await leases.acquire(b, 200)  # busy
    be.fail_save.add(0)
    task = asyncio.create_task(leases.acquire(c, 10))
    await settle()
    assert not task.done() and leases.waiting == 1
    be.fail_save.clear()
    be.slot_tokens[1] = 200
    leases.release(lb, 200, ok=True)  # slot 0 is left out (its save failed), slot 1 is saved and taken
    lc = await task
    assert lc.slot == 1 and lc.evicted == "B" and b.parked_as == "proxy-B"
    assert leases.holder(0) == "A"


async def test_when_every_save_fails_and_nothing_runs_the_lru_slot_is_taken_anyway():
    be = FakeBackend()
    leases = make(2, backend=be)
    a, b, c = conv("A"), conv("B"), conv("C")
    await turn(leases, be, a, 100)
    await turn(leases, be, b, 200)
    be.fail_save.update({0, 1})
    lc = await asyncio.wait_for(leases.acquire(c, 10), 5)  # would hang forever if it waited
    assert lc.slot == 0 and lc.evicted == "A"
    assert a.slot is None and a.parked_as is None
    assert leases.lost_cause("A") == (Cause.SLOT_TAKEN, "C")


# -- one conversation, two requests -------------------------------------------------------------


async def test_a_second_request_of_a_conversation_waits_for_the_first():
    be = FakeBackend()
    leases = make(2, backend=be)
    a, b = conv("A"), conv("B")
    order: list[str] = []
    first = await leases.acquire(a, 100)
    order.append("first acquired")

    async def second():
        lease = await leases.acquire(a, 120)
        order.append("second acquired")
        return lease

    task = asyncio.create_task(second())
    await settle()
    assert not task.done() and leases.waiting == 1

    other = await leases.acquire(b, 50)  # another conversation does not wait: it gets the other slot
    order.append("other acquired")
    assert other.slot == 1

    be.slot_tokens[first.slot] = 110
    leases.release(first, 110, ok=True)
    order.append("first released")
    lease2 = await task
    assert order == ["first acquired", "other acquired", "first released", "second acquired"]
    assert lease2.slot == first.slot and lease2.slot_context.held and lease2.slot_context.expected_tokens == 110


async def test_a_conversation_being_evicted_waits_for_the_save_then_goes_elsewhere():
    be = FakeBackend()
    leases = make(2, backend=be)
    a, b, c = conv("A"), conv("B"), conv("C")
    await turn(leases, be, a, 100)
    await turn(leases, be, b, 200)
    gate = be.gates[("save", 0)] = asyncio.Event()
    tc = asyncio.create_task(leases.acquire(c, 10))  # saves A's slot 0 to take it
    await settle()
    assert leases.state(0) is SlotState.SAVING
    ta = asyncio.create_task(leases.acquire(a, 110))  # A waits: its slot is being saved
    await settle()
    assert not ta.done()
    gate.set()
    lc = await tc
    la = await ta
    assert lc.slot == 0 and la.slot == 1 and la.restored_from == "proxy-A" and la.evicted == "B"


# -- release, save_dirty, what the server did ----------------------------------------------------


async def test_release_not_ok_frees_the_slot(store):
    be = FakeBackend()
    leases = make(2, backend=be, store=store)
    a = conv("A")
    lease = await leases.acquire(a, 100)
    leases.release(lease, 0, ok=False)
    assert leases.state(0) is SlotState.FREE and leases.holder(0) is None
    assert a.slot is None and leases.lost_cause("A") == (Cause.UNKNOWN, None)
    assert store.get("A").slot is None
    leases.release(lease, 0, ok=False)  # twice: nothing more
    again = await leases.acquire(a, 100)
    assert not again.slot_context.held and again.slot_context.lost is Cause.UNKNOWN


async def test_save_dirty_parks_every_dirty_slot(store):
    be = FakeBackend(store)
    leases = make(3, backend=be, store=store)
    a, b, c = conv("A"), conv("B"), conv("C")
    await turn(leases, be, a, 100)
    await turn(leases, be, b, 200)
    lc = await leases.acquire(c, 300)
    assert await leases.save_dirty() == ["A", "B"]
    assert [leases.state(i) for i in range(3)] == [SlotState.IDLE_CLEAN, SlotState.IDLE_CLEAN, SlotState.BUSY]
    assert (a.parked_as, b.parked_as, a.slot, b.slot) == ("proxy-A", "proxy-B", 0, 1)
    assert store.get("B").parked_as == "proxy-B"
    assert await leases.save_dirty() == []  # clean slots are not saved again

    task = asyncio.create_task(leases.save_dirty(all=True))  # waits for C's request
    await settle()
    assert not task.done()
    be.slot_tokens[2] = 300
    leases.release(lc, 300, ok=True)
    assert await task == ["C"]
    assert leases.state(2) is SlotState.IDLE_CLEAN and be.parks["proxy-C"] == 300


async def test_save_dirty_leaves_a_conversation_of_a_few_tokens_unparked(store):
    """Re-processing a handful of tokens costs less than a park and a restore (llama.cpp's own sleep test
    reads /metrics around a sleep and expects nothing to have happened for a 6-token prompt)."""
    be = FakeBackend(store)
    leases = make(2, backend=be, store=store)
    tiny, big = conv("tiny"), conv("big")
    await turn(leases, be, tiny, MIN_PARK_TOKENS - 1)
    await turn(leases, be, big, MIN_PARK_TOKENS)
    assert await leases.save_dirty() == ["big"]
    assert tiny.parked_as is None and big.parked_as == "proxy-big"
    assert [leases.state(i) for i in range(2)] == [SlotState.IDLE_DIRTY, SlotState.IDLE_CLEAN]
    assert await leases.save_dirty() == []  # and it is not tried again and again


async def test_save_dirty_leaves_a_slot_whose_save_fails_dirty():
    be = FakeBackend()
    leases = make(2, backend=be)
    a, b = conv("A"), conv("B")
    await turn(leases, be, a, 100)
    await turn(leases, be, b, 200)
    be.fail_save.add(0)
    assert await leases.save_dirty() == ["B"]
    assert leases.state(0) is SlotState.IDLE_DIRTY and a.parked_as is None


# -- park ahead ------------------------------------------------------------------------------------


async def three_over_two():
    """A, B, C over two slots: C took A's slot 0 (A saved on its path); B's slot 1 is the next to leave."""
    be = FakeBackend()
    leases = make(2, backend=be)
    convs = conv("A"), conv("B"), conv("C")
    for c, n in zip(convs, (100, 200, 300)):
        await turn(leases, be, c, n)
    return be, leases, convs


async def test_conversations_that_fit_in_the_slots_are_never_parked_ahead():
    be = FakeBackend()
    leases = make(2, backend=be)
    a, b = conv("A"), conv("B")
    await turn(leases, be, a, 100)
    assert leases.park_ahead_slot() is None  # a slot is FREE: the next conversation takes it
    for _ in range(3):
        await turn(leases, be, b, 200)
        await turn(leases, be, a, 100)
        assert leases.park_ahead_slot() is None  # both slots taken, but no conversation ever had to leave one
    assert await leases.park_ahead() is None and be.calls == []


async def test_once_conversations_outnumber_the_slots_the_next_to_leave_is_parked_between_requests(store):
    be = FakeBackend(store)
    leases = make(2, backend=be, store=store)
    a, b, c = conv("A"), conv("B"), conv("C")
    await turn(leases, be, a, 100)
    await turn(leases, be, b, 200)
    await turn(leases, be, c, 300)  # takes A's slot 0: A is saved on C's path, as before
    assert be.kinds() == [("save", 0, "proxy-A")]
    assert leases.park_ahead_slot() == 1  # B's slot is the least recently used: the next to be taken

    assert await leases.park_ahead() == "B"
    assert be.kinds()[1:] == [("save", 1, "proxy-B")] and be.journal_at_call[-1] == ("save", "saving")
    assert leases.state(1) is SlotState.IDLE_CLEAN and b.parked_as == "proxy-B" and b.slot == 1
    assert store.get("B").parked_as == "proxy-B"
    assert leases.park_ahead_slot() is None  # the LRU slot is parked already: nothing more to do

    back = await leases.acquire(a, 120)  # A comes back: B's slot is clean, so no save on A's path
    assert back.slot == 1 and back.evicted == "B" and back.restored_from == "proxy-A"
    assert be.kinds()[2:] == [("restore", 1, "proxy-A")]
    assert leases.park_ahead_slot() is None  # a request runs: nothing is saved under it
    be.slot_tokens[1] = 130
    leases.release(back, 130, ok=True)
    assert leases.park_ahead_slot() == 0  # C's slot is the LRU one now
    assert await leases.park_ahead() == "C" and leases.state(0) is SlotState.IDLE_CLEAN


async def test_nothing_is_parked_ahead_that_is_clean_tiny_or_in_use():
    be = FakeBackend()
    leases = make(2, backend=be)
    a, b, c = conv("A"), conv("B"), conv("C")
    await turn(leases, be, a, MIN_PARK_TOKENS - 1)
    await turn(leases, be, b, 200)
    await turn(leases, be, c, 300)  # takes A's slot 0 (an eviction saves whatever the size)
    await turn(leases, be, a, MIN_PARK_TOKENS - 1)  # A takes B's slot 1: C's slot 0 is the LRU one now
    lease = await leases.acquire(c, 310)
    assert leases.park_ahead_slot() is None  # C's request runs
    leases.release(lease, MIN_PARK_TOKENS + 1, ok=True)
    assert leases.park_ahead_slot() is None  # the LRU slot (A's, a few tokens) is not worth a park
    assert leases.state(1) is SlotState.IDLE_DIRTY and leases.holder(1) == "A"


async def test_the_conversation_parked_ahead_keeps_its_slot_when_it_asks_during_the_save():
    be, leases, (a, b, c) = await three_over_two()
    gate = be.gates[("save", 1)] = asyncio.Event()
    ahead = asyncio.create_task(leases.park_ahead())
    await settle()
    assert leases.state(1) is SlotState.SAVING
    tb = asyncio.create_task(leases.acquire(b, 210))  # B asks while it is being parked: it waits for the save
    await settle()
    assert not tb.done()
    gate.set()
    assert await ahead == "B"
    lb = await tb
    assert lb.slot == 1 and lb.slot_context.held and lb.restored_from is None and lb.evicted is None


async def test_a_new_conversation_arriving_during_a_park_ahead_waits_for_that_slot():
    be, leases, _ = await three_over_two()  # slot 0: C (most recent), slot 1: B (next to leave)
    d = conv("D")
    gate = be.gates[("save", 1)] = asyncio.Event()
    ahead = asyncio.create_task(leases.park_ahead())
    await settle()
    td = asyncio.create_task(leases.acquire(d, 10))  # D must not push out C, the most recent conversation
    await settle()
    assert not td.done() and leases.state(0) is SlotState.IDLE_DIRTY and leases.holder(0) == "C"
    gate.set()
    assert await ahead == "B"
    ld = await td
    assert ld.slot == 1 and ld.evicted == "B" and be.kinds().count(("save", 1, "proxy-B")) == 1
    assert ("save", 0, "proxy-C") not in be.kinds()


async def test_a_park_ahead_that_fails_leaves_the_slot_to_be_saved_on_the_next_eviction():
    be, leases, (a, b, c) = await three_over_two()
    be.fail_save.add(1)
    assert await leases.park_ahead() is None
    assert leases.state(1) is SlotState.IDLE_DIRTY and b.parked_as is None
    be.fail_save.clear()
    back = await leases.acquire(a, 120)  # the eviction saves B on A's path, as without a park ahead
    assert back.slot == 1 and back.evicted == "B" and be.parks["proxy-B"] == 200


async def test_server_restart_frees_every_slot_and_keeps_the_parks(store):
    be = FakeBackend()
    leases = make(3, backend=be, store=store)
    a, b, c = conv("A"), conv("B"), conv("C")
    await turn(leases, be, a, 100)  # never parked
    await turn(leases, be, b, 200)
    assert await leases.save_dirty() == ["A", "B"]
    await turn(leases, be, a, 150)  # A dirty again: its park is older than its slot
    running = await leases.acquire(c, 300)
    leases.note_server_restarted()
    be.slot_tokens.clear()
    assert leases.state(0) is leases.state(1) is SlotState.FREE
    assert leases.state(2) is SlotState.BUSY  # the request in flight keeps its slot until it ends
    assert running.interrupted is Cause.SERVER_RESTARTED
    assert a.slot is None and b.slot is None
    assert (a.parked_as, b.parked_as) == ("proxy-A", "proxy-B")  # parks survive a restart
    assert leases.lost_cause("A") == (Cause.SERVER_RESTARTED, None)
    leases.release(running, 310, ok=True)  # what it left is not trusted
    assert leases.state(2) is SlotState.FREE and c.slot is None
    assert leases.lost_cause("C") == (Cause.SERVER_RESTARTED, None)

    lb = await leases.acquire(b, 210)
    assert lb.restored_from == "proxy-B" and lb.slot_context.lost is Cause.SERVER_RESTARTED
    assert lb.restarted and lb.taken_by is None
    lc = await leases.acquire(c, 320)
    assert lc.restored_from is None and lc.slot_context.lost is Cause.SERVER_RESTARTED
    assert store.get("A").slot is None


async def test_server_sleep_and_idle_slot_clearing():
    be = FakeBackend()
    leases = make(2, backend=be)
    a, b = conv("A"), conv("B")
    await turn(leases, be, a, 100)
    await turn(leases, be, b, 200)
    leases.note_slot_cleared(0)
    assert leases.state(0) is SlotState.FREE and leases.state(1) is SlotState.IDLE_DIRTY
    assert leases.lost_cause("A") == (Cause.IDLE_SLOT_CLEARED, None)
    la = await leases.acquire(a, 110)
    assert la.slot == 0 and la.slot_context.lost is Cause.IDLE_SLOT_CLEARED
    assert la.idle_cleared and not la.restarted
    leases.note_slot_cleared(0)  # busy: idle-slot caching does not touch it
    assert leases.state(0) is SlotState.BUSY
    leases.release(la, 110, ok=True)
    leases.note_server_slept()
    assert leases.state(0) is leases.state(1) is SlotState.FREE
    assert leases.lost_cause("B") == (Cause.SERVER_SLEPT, None)


async def test_a_restart_during_a_save_drops_that_park():
    be = FakeBackend()
    leases = make(1, backend=be)
    a = conv("A")
    await turn(leases, be, a, 100)
    gate = be.gates[("save", 0)] = asyncio.Event()
    task = asyncio.create_task(leases.save_dirty())
    await settle()
    leases.note_server_restarted()
    gate.set()
    assert await task == []  # the save "succeeded" against a server that lost the slot: not trusted
    assert a.parked_as is None and "proxy-A" not in be.parks
    assert leases.state(0) is SlotState.FREE


# -- crash recovery ------------------------------------------------------------------------------


async def crash_mid_save(tmp_path):
    """A store whose journal says "slot 0: saving A" and never "saved" (the app died)."""
    path = tmp_path / "conversations.sqlite3"
    store = open_conversation_store(path)
    be = FakeBackend(store)
    leases = make(2, backend=be, store=store)
    a, b, c = conv("A"), conv("B"), conv("C")
    await turn(leases, be, a, 100)
    await leases.save_dirty()  # an earlier park of A, to be overwritten
    await turn(leases, be, a, 120)
    await turn(leases, be, b, 200)
    be.gates[("save", 0)] = asyncio.Event()
    task = asyncio.create_task(leases.acquire(c, 10))
    await settle()
    assert leases.state(0) is SlotState.SAVING
    return path, store, be, task


async def test_recover_after_a_crash_mid_save(tmp_path):
    path, old_store, old_be, task = await crash_mid_save(tmp_path)
    events = [e.event for e in old_store.journal_entries(PROFILE)]
    assert events[-1] == "saving"
    with open_conversation_store(path) as store:  # the next start of the app
        be = FakeBackend()
        be.parks = dict(old_be.parks)
        leases = make(2, backend=be, store=store)
        report = leases.recover(server_same_process=False)
        assert report.interrupted_saves == ("A",)
        assert set(report.lost) == {"A", "B"} and report.kept == {}
        assert store.get("A").parked_as is None and ("delete", "proxy-A") in be.calls
        assert [leases.state(i) for i in range(2)] == [SlotState.FREE, SlotState.FREE]
        assert store.get("B").slot is None and store.get("A").slot is None
        assert leases.lost_cause("B") == (Cause.SERVER_RESTARTED, None)
        assert [e.event for e in store.journal_entries(PROFILE)] == ["recovered"]
        a = store.get("A")
        la = await leases.acquire(a, 130)
        assert la.restored_from is None  # its park was dropped: re-prefill
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    old_store.close()


async def test_recover_keeps_the_idle_owners_when_the_server_is_the_same_process(tmp_path):
    path, old_store, old_be, task = await crash_mid_save(tmp_path)
    with open_conversation_store(path) as store:
        be = FakeBackend()
        leases = make(2, backend=be, store=store)
        report = leases.recover(server_same_process=True)
        assert report.interrupted_saves == ("A",) and report.kept == {0: "A", 1: "B"}
        # the save never finished, but A's tokens are still in slot 0: dirty, not parked
        assert leases.state(0) is SlotState.IDLE_DIRTY and leases.state(1) is SlotState.IDLE_DIRTY
        assert store.get("A").slot == 0 and store.get("A").parked_as is None
        b = store.get("B")
        lb = await leases.acquire(b, 210)
        assert lb.slot == 1 and lb.slot_context.held and lb.slot_context.expected_tokens == 200
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    old_store.close()


async def test_the_journal_is_compacted_and_still_recovers(store, monkeypatch):
    monkeypatch.setattr("app.proxy.lease_journal.JOURNAL_COMPACT_EVERY", 5)
    be = FakeBackend()
    leases = make(2, backend=be, store=store)
    a, b = conv("A"), conv("B")
    for n in range(10):
        await turn(leases, be, a, 100 + n)
        await turn(leases, be, b, 200 + n)
    assert store.journal_size(PROFILE) < 10
    fresh = make(2, backend=FakeBackend(), store=store)
    report = fresh.recover(server_same_process=True)
    assert report.kept == {0: "A", 1: "B"} and fresh.snapshot()[1].n_tokens == 209


# -- disk budget --------------------------------------------------------------------------------


async def test_disk_budget_deletes_the_oldest_parks(store):
    be = FakeBackend()
    # each park is 100 tokens x 10 bytes = 1000 bytes; two fit
    leases = make(1, backend=be, store=store, budget=2500)
    convs = [conv(x) for x in "ABCD"]
    for c in convs:
        await turn(leases, be, c, 100)
    # A, B, C were parked in turn; the third park went over the budget: A's (the oldest) went
    assert ("delete", "proxy-A") in be.calls
    assert sorted(be.parks) == ["proxy-B", "proxy-C"]
    assert [c.parked_as for c in convs] == [None, "proxy-B", "proxy-C", None]
    assert store.get("A").parked_as is None
    assert "park_deleted" in [e.event for e in store.journal_entries(PROFILE)]


async def test_disk_budget_spares_conversations_in_a_slot():
    be = FakeBackend()
    leases = make(2, backend=be, budget=500)
    a, b = conv("A"), conv("B")
    await turn(leases, be, a, 100)
    await turn(leases, be, b, 100)
    assert await leases.save_dirty() == ["A", "B"]  # 2000 bytes, over budget, but both are in a slot
    assert be.parks.keys() == {"proxy-A", "proxy-B"}


# -- names and forgetting -------------------------------------------------------------------------


def test_park_names_are_safe_file_names():
    assert park_name("abc-123_x") == "proxy-abc-123_x"
    odd = park_name("../etc/passwd")
    assert odd.startswith("proxy-") and "/" not in odd and ".." not in odd
    assert park_name("a/b") != park_name("a_b")


async def test_forget_erases_the_slot_and_the_park(store):
    be = FakeBackend()
    leases = make(1, backend=be, store=store)
    a, b = conv("A"), conv("B")
    await turn(leases, be, a, 100)
    await turn(leases, be, b, 100)  # A parked
    await turn(leases, be, a, 110)  # A back, B parked
    gone = await leases.forget("A")
    assert gone is not None and gone.id == "A" and store.get("A") is None
    assert ("erase", 0) in be.calls and "proxy-A" not in be.parks
    assert leases.state(0) is SlotState.FREE


# -- the entries held until the request is sent (issue #38) -------------------------------------------


async def test_entries_no_crash_can_make_wrong_wait_for_the_send_and_keep_their_order(store):
    """A dirty slot kept by its conversation and a restore's end are journaled once the request is sent
    (``flush_journal``), or with the next entry written at once, in their order; a clean slot's "acquired"
    is written at once (lost, the slot would stay clean, its park taken for all it holds)."""
    be = FakeBackend(store)
    leases = make(2, backend=be, store=store)
    a, b, c = conv("A"), conv("B"), conv("C")

    def events():
        return [(e.event, e.conversation) for e in store.journal_entries(PROFILE)]

    await turn(leases, be, a, 100)
    kept = await leases.acquire(a, 110)  # its dirty slot, kept: held
    assert kept.slot_context.held and leases.journal_held
    assert events()[-1] == ("released", "A")
    leases.flush_journal()
    assert events()[-1] == ("acquired", "A") and not leases.journal_held
    leases.release(kept, 120, ok=True)

    again = await leases.acquire(a, 130)  # held, then written ahead of the next entry written at once
    leases.release(again, 140, ok=True)
    assert events()[-2:] == [("acquired", "A"), ("released", "A")]

    await turn(leases, be, b, 200)
    await turn(leases, be, c, 300)  # A parked, C in its slot
    back = await leases.acquire(a, 150)  # B parked, A restored: "restored" held after "restoring"
    assert back.restored_from == "proxy-A"
    assert events()[-1] == ("restoring", "A") and leases.journal_held
    leases.flush_journal()
    assert events()[-1] == ("restored", "A")
    leases.release(back, 160, ok=True)

    # a clean slot kept by its conversation (parked since its last request): "acquired" at once
    leases2 = make(1, backend=FakeBackend(store), store=store)
    d = conv("D")
    await turn(leases2, leases2._parks.backend, d, 50)
    await leases2.save_dirty()
    assert leases2.state(0) is SlotState.IDLE_CLEAN
    lease = await leases2.acquire(d, 60)
    assert not leases2.journal_held and events()[-1] == ("acquired", "D")
    leases2.release(lease, 60, ok=True)
