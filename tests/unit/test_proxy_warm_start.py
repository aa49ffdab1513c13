"""The proxy's warm start (app.proxy.leases, "Warm start"): at a start the parks of the conversations
used last are restored into the free slots before any request asks, and the request that finds its
conversation there is judged as a restored one. Against the leases' in-memory backend."""

from __future__ import annotations

import asyncio

from app.core.conversation import Cause, Conversation
from app.proxy.lease_table import SlotState
from tests.unit.test_proxy_leases import FakeBackend, make, settle, store  # noqa: F401  (fixture)


def parked(cid: str, n_tokens: int, last_used: float, be: FakeBackend) -> Conversation:
    be.parks[f"proxy-{cid}"] = n_tokens
    return Conversation(id=cid, setup="setup-1", parked_as=f"proxy-{cid}", n_tokens=n_tokens, last_used=last_used)


async def test_the_most_recent_parks_fill_the_free_slots_and_their_turn_is_a_restored_hit(store):
    be = FakeBackend(store)
    leases = make(2, backend=be, store=store)
    old, mid, new = parked("old", 100, 1.0, be), parked("mid", 200, 2.0, be), parked("new", 300, 3.0, be)

    assert await leases.warm([old, mid, new]) == ["new", "mid"]
    assert be.kinds() == [("restore", 0, "proxy-new"), ("restore", 1, "proxy-mid")]
    assert [leases.state(i) for i in (0, 1)] == [SlotState.IDLE_CLEAN, SlotState.IDLE_CLEAN]
    assert (new.slot, mid.slot, old.slot) == (0, 1, None)
    assert (new.last_used, mid.last_used) == (3.0, 2.0)  # a warm restore is no use of the conversation
    assert be.journal_at_call == [("restore", "restoring"), ("restore", "restoring")]  # journaled first

    lease = await leases.acquire(new, 320)  # its turn: found in its slot, no restore on its path
    assert lease.slot == 0 and be.kinds()[2:] == []
    assert lease.restored_from == "proxy-new"
    ctx = lease.slot_context
    assert ctx.held and ctx.restored and ctx.restored_tokens == 300 and ctx.expected_tokens == 300
    leases.release(lease, 330, ok=True)
    again = await leases.acquire(new, 340)  # the next one is an ordinary held turn
    assert again.restored_from is None and not again.slot_context.restored
    leases.release(again, 350, ok=True)

    taker = await leases.acquire(old, 100)  # mid's warmed slot is clean: taken without a save
    assert taker.slot == 1 and taker.evicted == "mid" and taker.restored_from == "proxy-old"
    assert be.kinds()[2:] == [("restore", 1, "proxy-old")]
    assert mid.parked_as == "proxy-mid" and "proxy-mid" in be.parks


async def test_a_request_that_waits_stops_the_warm_start():
    be = FakeBackend()
    leases = make(1, backend=be)
    a, b = parked("a", 100, 2.0, be), parked("b", 200, 1.0, be)
    gate = be.gates[("restore", 0)] = asyncio.Event()
    warming = asyncio.ensure_future(leases.warm([a, b]))
    await settle()
    assert leases.state(0) is SlotState.RESTORING
    other = asyncio.ensure_future(leases.acquire(Conversation(id="c", setup="setup-1"), 50))
    await settle()
    assert not other.done() and leases.waiting == 1
    gate.set()
    assert await warming == ["a"]
    lease = await other  # a's slot, clean: no save; b was not restored
    assert lease.slot == 0 and lease.evicted == "a"
    assert be.kinds() == [("restore", 0, "proxy-a")]


async def test_a_cancelled_warm_restore_keeps_the_park():
    be = FakeBackend()
    leases = make(1, backend=be)
    a = parked("a", 100, 1.0, be)
    be.gates[("restore", 0)] = asyncio.Event()
    warming = asyncio.ensure_future(leases.warm([a]))
    await settle()
    warming.cancel()
    await asyncio.wait([warming])
    assert warming.cancelled()
    assert leases.state(0) is SlotState.FREE and a.slot is None
    assert a.parked_as == "proxy-a" and be.parks == {"proxy-a": 100}  # the file is whole: kept


async def test_a_failed_warm_restore_frees_the_slot_and_the_next_park_is_tried():
    be = FakeBackend()
    leases = make(1, backend=be)
    a, b = parked("a", 100, 2.0, be), parked("b", 200, 1.0, be)
    be.fail_restore.add("proxy-a")
    assert await leases.warm([a, b]) == ["b"]
    assert a.parked_as is None and "proxy-a" not in be.parks  # as a request's failed restore: not tried again
    assert leases.state(0) is SlotState.IDLE_CLEAN and b.slot == 0 and leases.lost_cause("a") is None


async def test_no_warm_start_over_a_server_that_clears_idle_slots():
    be = FakeBackend()
    leases = make(1, backend=be)
    leases.idle_slots_cleared = True  # its next task would clear a warmed idle slot anyway
    assert await leases.warm([parked("a", 100, 1.0, be)]) == []
    assert be.calls == []




async def test_a_park_older_than_the_last_reply_is_judged_against_the_last_reply():
    """A conversation that went on after its park (restored, two more turns) when the server restarted:
    the warm start restores the older park, and its next request expects what the last reply left, with
    the restart as the reason it is in no slot (the turns after the park were lost: not a HIT)."""
    be = FakeBackend()
    leases = make(1, backend=be)
    a = parked("a", 100, 1.0, be)
    a.n_tokens = 180  # its last reply left 180 tokens; its park holds 100
    leases.note_server_restarted()
    leases._table.note_lost("a", Cause.SERVER_RESTARTED, None)
    assert await leases.warm([a]) == ["a"]
    assert a.n_tokens == 180 and a.last_used == 1.0
    lease = await leases.acquire(a, 200)
    ctx = lease.slot_context
    assert ctx.restored and ctx.restored_tokens == 100 and ctx.expected_tokens == 180
    assert ctx.lost is Cause.SERVER_RESTARTED and lease.restarted
