"""The server's RAM prompt cache as a restore source (#28276), decided by the slot leases.

Build 11434 (tools/server/server-context.cpp, ``get_available_slot``): a request pinned to a slot
that holds another prompt saves that prompt to the RAM cache and loads the longest match for its
own; a request pinned to an EMPTY slot never looks in the RAM cache. So a conversation whose RAM
copy is longer than its park is not restored from the park, and goes to a slot that holds a prompt.
"""

from __future__ import annotations

from app.proxy.explain import ram_cache_missed
from app.proxy.lease_table import SlotState, park_name
from app.core.conversation import Cause, Explanation
from tests.unit.test_proxy_leases import FakeBackend, conv, make, turn


def ram_leases(*, cleared: bool, ram: bool = True, n_slots: int = 2):
    backend = FakeBackend()
    leases = make(n_slots, backend=backend)
    leases.ram_cache, leases.idle_slots_cleared = ram, cleared
    return leases, backend


async def a_cleared(*, ram: bool = True):
    """A (200 tokens) on slot 0, B (100) on slot 1, whose task made the server clear A's idle slot."""
    leases, backend = ram_leases(cleared=True, ram=ram)
    a, b = conv("A"), conv("B")
    await turn(leases, backend, a, 200)
    await turn(leases, backend, b, 100)
    leases.note_slot_cleared(0)
    return leases, backend, a


def restores(backend) -> list[tuple]:
    return [c for c in backend.calls if c[0] == "restore"]


async def test_a_slot_cleared_by_idle_slot_caching_is_left_to_the_ram_cache_in_an_idle_slot_that_holds_a_prompt():
    leases, backend = ram_leases(cleared=True)
    a, b = conv("A"), conv("B")
    await turn(leases, backend, a, 200)
    await turn(leases, backend, b, 180)
    leases.note_slot_cleared(0)  # B's task made the server save A to its RAM cache and clear slot 0
    assert leases.state(0) is SlotState.FREE and leases.ram_longer(a)  # no park: the RAM copy is longer
    lease = await leases.acquire(a, 220)
    # not the FREE slot 0 (pinned to an empty slot the server never looks in its RAM cache): B's idle slot
    assert lease.slot == 1 and lease.evicted == "B"
    assert lease.restored_from is None and lease.slot_context.ram_tokens == 200
    assert leases.ram_chosen == 1
    # B was dirty: parked first, as every eviction; the server's RAM cache now has B as well
    assert ("save", 1, park_name("B")) in backend.calls and restores(backend) == []
    leases.release(lease, 230, ok=True)
    assert not leases.ram_longer(a)  # its slot holds it now


async def test_a_park_older_than_the_last_request_is_not_restored_over_the_longer_ram_copy():
    leases, backend = ram_leases(cleared=True)
    a, b = conv("A"), conv("B")
    await turn(leases, backend, a, 200)
    assert await leases.save_dirty() == ["A"]  # parked at 200 (before a sleep, a stop…)
    await turn(leases, backend, a, 300)  # then used again: the park is older than its last request
    await turn(leases, backend, b, 100)
    leases.note_slot_cleared(0)
    assert leases.ram_longer(a)
    lease = await leases.acquire(a, 320)
    assert lease.slot == 1 and lease.restored_from is None and lease.slot_context.ram_tokens == 300
    assert restores(backend) == []


async def test_a_park_as_long_as_the_ram_copy_is_restored():
    """The save-before-clear workaround parks the slot at its full length: the park is restored (it also
    survives a restart, the RAM copy does not), into the FREE slot."""
    leases, backend = ram_leases(cleared=True)
    a, b = conv("A"), conv("B")
    await turn(leases, backend, a, 200)
    await leases.save_dirty()
    await turn(leases, backend, b, 100)
    leases.note_slot_cleared(0)
    assert not leases.ram_longer(a)
    lease = await leases.acquire(a, 220)
    assert lease.slot == 0 and lease.restored_from == park_name("A") and lease.slot_context.ram_tokens == 0


async def test_without_a_slot_that_holds_a_prompt_the_shorter_park_is_restored():
    """Only FREE slots: the RAM copy cannot be reached (a pinned empty slot never looks), the park can."""
    leases, backend = ram_leases(cleared=True)
    a, b = conv("A"), conv("B")
    await turn(leases, backend, a, 200)
    await leases.save_dirty()
    await turn(leases, backend, a, 300)
    await turn(leases, backend, b, 100)
    leases.note_slot_cleared(0)
    leases.note_slot_cleared(1)
    lease = await leases.acquire(a, 320)
    assert lease.slot == 0 and lease.restored_from == park_name("A") and lease.slot_context.ram_tokens == 0
    assert leases.ram_longer(a)  # still noted: a later request may reach it


async def test_evicted_over_a_failed_save_the_ram_copy_beats_no_park():
    """Without idle-slot clearing: a conversation evicted after its save failed keeps no park, but the
    pinned request that took its slot made the server save it to its RAM cache."""
    leases, backend = ram_leases(cleared=False)
    a, b, c = conv("A"), conv("B"), conv("C")
    await turn(leases, backend, a, 200)
    await turn(leases, backend, b, 150)
    backend.fail_save = {0, 1}
    lc = await leases.acquire(c, 100)  # every save fails, nothing in use: the LRU slot (A's) is dropped
    assert lc.slot == 0 and lc.evicted == "A" and a.parked_as is None
    backend.slot_tokens[0] = 100
    leases.release(lc, 100, ok=True)
    backend.fail_save = set()
    assert leases.ram_longer(a)
    la = await leases.acquire(a, 220)  # no FREE slot: the LRU idle slot (B's, parked first) holds a prompt
    assert la.slot == 1 and la.slot_context.ram_tokens == 200 and restores(backend) == []


async def test_an_eviction_whose_park_is_whole_keeps_the_park():
    leases, backend = ram_leases(cleared=False)
    a, b, c = conv("A"), conv("B"), conv("C")
    for x, n in ((a, 200), (b, 150), (c, 100)):  # C takes A's slot: A parked whole first
        await turn(leases, backend, x, n)
    assert a.parked_as == park_name("A") and not leases.ram_longer(a)
    la = await leases.acquire(a, 220)
    assert la.restored_from == park_name("A") and la.slot_context.ram_tokens == 0


async def test_no_ram_cache_no_ram_source():
    """--cache-ram 0: nothing is left to a RAM cache the server does not have."""
    leases, backend, a = await a_cleared(ram=False)
    assert not leases.ram_longer(a)
    lease = await leases.acquire(a, 220)
    assert lease.slot == 0 and lease.slot_context.ram_tokens == 0


async def test_a_restart_or_a_sleep_empties_the_ram_cache():
    leases, backend, a = await a_cleared()
    assert leases.ram_longer(a)
    leases.note_server_slept()
    assert not leases.ram_longer(a)
    lease = await leases.acquire(a, 220)
    assert lease.slot == 0 and lease.slot_context.ram_tokens == 0 and lease.slept


async def test_a_failed_save_of_the_idle_slot_falls_back_to_the_free_slot():
    leases, backend, a = await a_cleared()
    backend.fail_save = {1}
    lease = await leases.acquire(a, 220)  # B's slot cannot be freed (its save failed): the FREE slot
    assert lease.slot == 0 and lease.slot_context.ram_tokens == 0
    assert leases.state(1) is SlotState.IDLE_DIRTY and leases.holder(1) == "B"


def test_a_ram_copy_the_server_did_not_find_is_said():
    ex = ram_cache_missed(Explanation(Cause.IDLE_SLOT_CLEARED, "The server saved and cleared the idle slot."), 1234)
    assert ex.cause is Cause.IDLE_SLOT_CLEARED
    assert ex.detail.startswith("The server saved and cleared the idle slot. ") and "1,234" in ex.detail
    assert "--cache-ram" in ex.detail


def test_the_ram_cache_is_read_from_the_argv_and_the_help_text():
    from app.core.helptext import server_caching
    from tests.unit.test_proxy_server_modes_rules import HELP_11434

    assert server_caching([], HELP_11434).ram_cache  # 11434's default: 8192 MiB
    assert server_caching(["--cache-ram", "64"], HELP_11434).ram_cache
    assert not server_caching(["-cram", "0"], HELP_11434).ram_cache
    assert not server_caching([], "no such flag here").ram_cache


async def test_a_prompt_passed_through_untouched_is_looked_for_in_the_ram_cache_when_it_comes_back():
    """llama.cpp's own test_clear_and_restore through the proxy: X pinned by its client to slot 0, Y to
    slot 1 (the server clears idle slot 0 into its RAM cache), then X again without a slot. The proxy
    knows X's prompt went to the RAM cache and pins X to slot 1, which holds Y's prompt (the server
    looks in its RAM cache only then), not to the empty slot 0."""
    leases, backend = ram_leases(cleared=True)
    leases.note_slot_used_outside(0, "outside", conv_id="X", n_tokens=120)
    assert leases.outside_prompts() == {0: ("X", 120)} and leases.state(0) is SlotState.FREE
    leases.note_slot_used_outside(1, "outside", conv_id="Y", n_tokens=10)
    leases.note_slot_cleared(0)  # Y's task made the server save X to its RAM cache and clear slot 0
    assert leases.outside_prompts() == {1: ("Y", 10)}
    x = conv("X")
    assert leases.ram_longer(x)
    lease = await leases.acquire(x, 125)
    assert lease.slot == 1 and lease.slot_context.ram_tokens == 120 and lease.restored_from is None
    assert leases.outside_prompts() == {} and leases.ram_longer(conv("Y"))  # pinned over: Y went to RAM
    assert [c for c in backend.calls if c[0] in ("save", "restore")] == []  # nothing parked or restored


async def test_its_own_prompt_still_in_a_free_slot_is_where_it_goes_back():
    leases, backend = ram_leases(cleared=True)
    leases.note_slot_used_outside(1, "outside", conv_id="X", n_tokens=120)
    lease = await leases.acquire(conv("X"), 125)
    assert lease.slot == 1 and leases.outside_prompts() == {}
    # a restart empties the server: the notes go with it
    leases.note_slot_used_outside(0, "outside", conv_id="Z", n_tokens=50)
    leases.note_server_restarted()
    assert leases.outside_prompts() == {}
