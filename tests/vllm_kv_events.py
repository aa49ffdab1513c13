"""vLLM's KV event structs, written here from its published definitions (``vllm/distributed/kv_events.py``
and ``examples/online_serving/kv_events_subscriber.py``, the RFC vllm-project/vllm#20492 layout: msgspec
structs, ``tag=True``, ``array_like=True``) and decoded with msgspec as vLLM's own subscriber does: an
independent reader of what :mod:`app.proxy.kv_events` writes (no app code here), and a consumer's view
of one server built from the batches, kept per medium as a KV router keeps it."""

from __future__ import annotations

from typing import Any

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def decode(payload: bytes) -> KVEventBatch:
    return DECODER.decode(payload)


class View:
    """What a consumer knows of one server after the batches it read: per medium, each block hash with
    its parent and its tokens (a radix tree's nodes), and the sequence numbers seen."""

    def __init__(self) -> None:
        self.blocks: dict[str, dict[int, tuple[int | None, list[int]]]] = {}
        self.seqs: list[int] = []
        self.cleared = 0

    def apply(self, frames: list[bytes]) -> KVEventBatch:
        topic, seq, payload = frames
        assert len(seq) == 8
        self.seqs.append(int.from_bytes(seq, "big"))
        batch = decode(payload)
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                self.blocks.clear()
                self.cleared += 1
            elif isinstance(ev, BlockStored):
                held = self.blocks.setdefault(ev.medium, {})
                assert ev.parent_block_hash is None or ev.parent_block_hash in held, "a block without its parent"
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    held[h] = (parent, ev.token_ids[i * ev.block_size:(i + 1) * ev.block_size])
                    parent = h
            else:
                held = self.blocks.get(ev.medium, {})
                for h in ev.block_hashes:
                    assert h in held, "a block removed that was never stored"
                    del held[h]
        return batch

    def prefix(self, medium: str, tokens: list[int], block_size: int = 16) -> int:
        """How many of ``tokens`` (whole blocks) this server holds in ``medium``, matched by token ids as a
        router matches a request (its own hash of each block's tokens, chained)."""
        held = self.blocks.get(medium, {})
        by_tokens: dict[tuple[int | None, tuple[int, ...]], int] = {
            (parent, tuple(toks)): h for h, (parent, toks) in held.items()}
        parent, n = None, 0
        while n + block_size <= len(tokens):
            h = by_tokens.get((parent, tuple(tokens[n:n + block_size])))
            if h is None:
                break
            parent, n = h, n + block_size
        return n
