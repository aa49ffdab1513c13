"""The proxy's KV events (app/proxy/kv_events.py), decoded by vLLM's own struct layout (msgspec,
tests/vllm_kv_events.py): the wire format, the chained block hashes, and the events that keep a
consumer's view of a server equal to what its slots and parks hold."""

from __future__ import annotations

import msgpack

from app.proxy.kv_events import (BLOCK_SIZE, MEDIUM_PARK, MEDIUM_SLOT, AllBlocksCleared, BlockRemoved,
                                 BlockStored, KvBlocks, ProxyKv, block_hashes, encode_batch)
from tests import vllm_kv_events as vllm


def toks(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def frames(events, seq: int = 0) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), encode_batch(1234.5, events)]


def test_a_batch_decodes_with_vllms_own_structs_field_by_field():
    stored = BlockStored((11, 12), 10, tuple(toks(32)), 16, None, "GPU")
    batch = vllm.decode(encode_batch(1234.5, [stored, BlockRemoved((12,), "DISK"), AllBlocksCleared()]))
    assert batch.ts == 1234.5 and batch.data_parallel_rank == 0
    s, r, c = batch.events
    assert isinstance(s, vllm.BlockStored) and s.block_hashes == [11, 12] and s.parent_block_hash == 10
    assert s.token_ids == toks(32) and s.block_size == 16 and s.lora_id is None and s.medium == "GPU"
    assert isinstance(r, vllm.BlockRemoved) and r.block_hashes == [12] and r.medium == "DISK"
    assert isinstance(c, vllm.AllBlocksCleared)


def test_the_layout_is_the_array_like_tagged_one_dynamo_reads():
    """Dynamo's wire types read the batch as a 3-tuple (ts, events, dp_rank) and each event as a tagged
    array in this order: any other shape is refused there."""
    raw = msgpack.unpackb(encode_batch(1.0, [BlockStored((5,), None, tuple(toks(16)), 16, None, "DISK"),
                                             BlockRemoved((5,), "GPU"), AllBlocksCleared()]))
    assert raw == [1.0, [["BlockStored", [5], None, toks(16), 16, None, "DISK"], ["BlockRemoved", [5], "GPU"],
                         ["AllBlocksCleared"]], 0]


def test_block_hashes_chain_full_blocks_and_fit_in_63_bits():
    a = block_hashes(toks(40), "setup")
    assert len(a) == 2  # the partial third block is not published
    assert all(0 <= h < 2 ** 63 for h in a)
    assert block_hashes(toks(32), "setup") == a  # a prefix hashes the same
    other_first = [999] + toks(31, 1001)
    assert block_hashes(other_first, "setup")[1] != a[1]  # the second block's hash depends on the first
    assert block_hashes(toks(32), "another model") != a  # the setup starts the chain


def test_a_slot_stores_its_blocks_once_and_a_longer_prompt_only_the_new_ones():
    kv = KvBlocks("s")
    [first] = kv.put("slot 0", MEDIUM_SLOT, toks(40))
    assert first.parent_block_hash is None and first.token_ids == tuple(toks(32)) and first.medium == "GPU"
    assert kv.put("slot 0", MEDIUM_SLOT, toks(40)) == []  # nothing new
    [more] = kv.put("slot 0", MEDIUM_SLOT, toks(70))
    assert more.parent_block_hash == first.block_hashes[-1] and more.token_ids == tuple(toks(64)[32:])


def test_an_edit_removes_the_tail_deepest_first_and_stores_from_the_divergence():
    kv = KvBlocks("s")
    [old] = kv.put("slot 0", MEDIUM_SLOT, toks(64))
    edited = toks(20) + [7] * 44
    removed, stored = kv.put("slot 0", MEDIUM_SLOT, edited)
    assert removed.block_hashes == tuple(reversed(old.block_hashes[1:]))
    assert stored.parent_block_hash == old.block_hashes[0] and stored.token_ids == tuple(edited[16:])


def test_a_block_two_places_hold_is_removed_with_the_last_one_per_medium():
    kv = KvBlocks("s")
    shared = toks(32)
    kv.put("slot 0", MEDIUM_SLOT, shared + toks(16, 1))
    [b] = kv.put("slot 1", MEDIUM_SLOT, shared + toks(16, 500))
    assert b.parent_block_hash is not None and len(b.block_hashes) == 1  # the shared prefix is not stored twice
    [park] = kv.put("park A", MEDIUM_PARK, shared + toks(16, 1))
    assert len(park.block_hashes) == 3 and park.parent_block_hash is None  # on disk it is new
    [gone] = kv.drop("slot 0")
    assert len(gone.block_hashes) == 1 and gone.medium == MEDIUM_SLOT  # slot 1 still holds the shared two
    assert kv.held(MEDIUM_SLOT) == set(block_hashes(shared + toks(16, 500), "s"))
    assert kv.clear() == [AllBlocksCleared()] and kv.held(MEDIUM_SLOT) == set()


def test_a_consumer_that_applies_every_batch_sees_what_is_held():
    """Random puts and drops over three places: the consumer's view is the truth after each batch."""
    import random

    rng = random.Random(7)
    kv, view = KvBlocks("s"), vllm.View()
    for seq in range(300):
        place = rng.choice(["slot 0", "slot 1", "park A"])
        medium = MEDIUM_PARK if place.startswith("park") else MEDIUM_SLOT
        if rng.random() < 0.2:
            events = kv.drop(place)
        else:
            base = rng.choice([toks(48), toks(48, 5000)])
            events = kv.put(place, medium, base[:rng.randrange(0, 48)] + toks(rng.randrange(0, 40), rng.randrange(9000)))
        view.apply(frames(events, seq))
        for m in (MEDIUM_SLOT, MEDIUM_PARK):
            assert set(view.blocks.get(m, {})) == kv.held(m)
    assert view.seqs == list(range(300))


def test_resend_gives_a_late_subscriber_the_whole_state():
    kv = KvBlocks("s")
    kv.put("slot 0", MEDIUM_SLOT, toks(40))
    kv.put("park A", MEDIUM_PARK, toks(33, 50))
    view = vllm.View()
    view.apply(frames(kv.resend()))
    assert view.cleared == 1 and view.prefix("GPU", toks(40)) == 32 and view.prefix("DISK", toks(33, 50)) == 32


def test_the_proxys_view_parks_on_disk_and_a_restart_clears_all_but_the_parks():
    kv, view = ProxyKv("s"), vllm.View()
    a = toks(50)
    kv.learn("A", a, saves_before=0)
    view.apply(frames(kv.sync({0: "A", 1: None}, [])))
    assert view.prefix("GPU", a) == 48 and view.prefix("DISK", a) == 0
    kv.saved("A")  # parked to free its slot for B
    b = toks(40, 7000)
    kv.learn("B", b)
    view.apply(frames(kv.sync({0: "B", 1: None}, ["A"])))
    assert view.prefix("GPU", a) == 0 and view.prefix("DISK", a) == 48 and view.prefix("GPU", b) == 32
    view.apply(frames(kv.cleared() + kv.sync({0: None, 1: None}, ["A"])))  # the server restarted
    assert view.cleared == 1 and view.blocks.get("GPU", {}) == {} and view.prefix("DISK", a) == 48
    kv.restored("A")
    view.apply(frames(kv.sync({0: None, 1: "A"}, ["A"])))
    assert view.prefix("GPU", a) == 48  # restored: in a slot again, and still on disk
    kv.forget("A")
    view.apply(frames(kv.sync({0: None, 1: None}, [])))
    assert view.blocks == {"GPU": {}, "DISK": {}}


def test_tokens_learned_after_a_park_was_saved_are_that_parks():
    """The request ended, then its conversation was parked before its tokens came back from the server:
    the park holds those tokens (its save came after the request)."""
    kv = ProxyKv("s")
    kv.learn("A", toks(20))
    before = kv.saves("A")
    kv.saved("A")
    kv.learn("A", toks(40), saves_before=before)
    view = vllm.View()
    view.apply(frames(kv.sync({}, ["A"])))
    assert view.prefix("DISK", toks(40)) == 32


def test_the_block_size_is_vllms_default():
    assert BLOCK_SIZE == 16
