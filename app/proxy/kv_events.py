"""KV events of a server's slots and parks, in vLLM's wire format (pure: no socket, no I/O).

A KV-aware router (NVIDIA Dynamo's KV router, llm-d's precise prefix scorer) sends a returning
conversation to the server that holds its prefix, and learns what each server holds from the "KV
events" vLLM publishes (RFC vllm-project/vllm#20492): blocks stored, blocks removed, all blocks
cleared. llama-server publishes none. The proxy knows what each slot holds (the conversation its
lease says is there, and that conversation's prompt tokens as the server tokenised them) and which
conversations are parked on disk, so it can publish them for the server: a slot's blocks with
medium ``"GPU"`` (the server's live KV cache, on whatever device it runs), a park's with medium
``"DISK"`` (Dynamo's ``StorageTier::from_kv_medium`` reads ``"DISK"`` as its disk tier, which its router
weighs below a device hit), and a server restart as ``AllBlocksCleared`` followed by the parks again
(they outlive the process).

**The format** follows vLLM's ``vllm/distributed/kv_events.py`` (msgspec structs, ``tag=True``,
``array_like=True``, as in vLLM's ``examples/online_serving/kv_events_subscriber.py``; decoded the same
way by Dynamo's Rust wire types for vLLM's ZMQ events, ``KvEventBatch`` and ``RawKvEvent``, which read
``[ts, events, dp_rank]`` and tagged arrays): a batch is the msgpack array ``[ts, [event, ...], data_parallel_rank]`` and each event a
tagged array

* ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``
* ``["BlockRemoved", block_hashes, medium]``
* ``["AllBlocksCleared"]``

(newer vLLM appends ``lora_name``, ``extra_keys``, ``group_idx`` …, all optional; consumers ignore
what they do not read, so they are left out). The socket side (:mod:`app.proxy.kv_publisher`) sends
each batch as the multipart message ``[topic, seq, payload]``, ``seq`` an 8-byte big-endian counter.

**Blocks and hashes.** A slot's tokens are cut into blocks of :data:`BLOCK_SIZE` tokens (16, vLLM's
default); a trailing partial block is not published (vLLM publishes full blocks only, and Dynamo drops
a block of another size). Each block's hash chains the previous one's: the first 8 bytes of
``sha256(parent hash, 8 bytes big-endian | token ids, 4 bytes big-endian each)``, masked to 63 bits
(it fits a signed and an unsigned 64-bit decoder alike); the first block's parent is a hash of the
serving setup (model, KV types, template: the proxy's conversation chain starts there too), so two
models never share a block. These hashes are identities, not something a consumer recomputes: Dynamo
(1.x) computes its own hash of each block from ``token_ids`` and the router's ``--kv-cache-block-size``
(``compute_block_hash_for_seq``) to match a request's tokens, and uses ours only to link a block to its
parent and to remove it; so a consumer must run with the same block size (16) and tokenise requests as
the server does. Token ids are what the server made of the request (``/apply-template`` then
``/tokenize``): the prompt, not the reply it generated after it (whose tokens the server does not give;
the next turn's prompt carries the reply as the template renders it, and that is what a router matches).

**Counting.** Two slots, or a slot and a park, can hold the same block (a shared system prompt, a
conversation parked and still in its slot). A consumer keeps one set of blocks per server and medium,
so a block is stored when its first holder in that medium appears and removed when its last goes.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Sequence, Union

import msgpack

#: tokens per block (vLLM's default ``--block-size``); a consumer must use the same (Dynamo's
#: ``--kv-cache-block-size``)
BLOCK_SIZE = 16
#: where the blocks are (vLLM's ``medium``): the server's live KV cache, and a park on disk
MEDIUM_SLOT = "GPU"
MEDIUM_PARK = "DISK"
#: hashes are kept below 2**63: a signed and an unsigned 64-bit decoder read them alike
HASH_MASK = (1 << 63) - 1


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    medium: str | None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


def _h(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big") & HASH_MASK


def root_hash(setup: str) -> int:
    """The parent of a chain's first block: the serving setup's own hash."""
    return _h(b"kv-valet setup\0" + setup.encode("utf-8", "surrogatepass"))


def block_hashes(tokens: Sequence[int], setup: str = "", block_size: int = BLOCK_SIZE) -> list[int]:
    """The chained hash of each full block of ``tokens`` (the module's doc says how)."""
    out: list[int] = []
    parent = root_hash(setup)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start:start + block_size]
        parent = _h(parent.to_bytes(8, "big") + struct.pack(f">{block_size}I", *(t & 0xFFFFFFFF for t in block)))
        out.append(parent)
    return out


@dataclass
class _Place:
    medium: str
    hashes: list[int]
    tokens: list[int]


class KvBlocks:
    """What one server holds, by place (a slot, a park), and the events that bring a consumer from
    what it was told to what is true now. Each change returns its events, in the order to send them."""

    def __init__(self, setup: str = "", block_size: int = BLOCK_SIZE) -> None:
        self.setup, self.block_size = setup, block_size
        self._places: dict[str, _Place] = {}
        self._count: Counter[tuple[str, int]] = Counter()
        self._chains: dict[tuple[int, ...], list[int]] = {}  # the last few token lists hashed

    def tokens(self, place: str) -> list[int] | None:
        p = self._places.get(place)
        return None if p is None else p.tokens

    def places(self) -> dict[str, str]:
        """Each place held, and its medium."""
        return {k: p.medium for k, p in self._places.items()}

    def held(self, medium: str) -> set[int]:
        """The block hashes a consumer was told this server holds in ``medium``."""
        return {h for (m, h), n in self._count.items() if m == medium and n > 0}

    def _chain(self, tokens: list[int]) -> list[int]:
        key = tuple(tokens)
        chain = self._chains.get(key)
        if chain is None:
            chain = block_hashes(tokens, self.setup, self.block_size)
            if len(self._chains) >= 64:
                self._chains.pop(next(iter(self._chains)))
            self._chains[key] = chain
        return chain

    def put(self, place: str, medium: str, tokens: Sequence[int]) -> list[Event]:
        """``place`` holds ``tokens`` now (in ``medium``), whatever it held before. ``tokens`` is kept as
        it is given (never changed by the caller afterwards): the same list again costs nothing."""
        old = self._places.get(place)
        if old is not None and old.medium == medium and (old.tokens is tokens or old.tokens == tokens):
            return []
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        chain = self._chain(tokens)
        self._places[place] = _Place(medium, chain, tokens)
        stored = self._hold(medium, chain, tokens)  # first: the blocks old and new share never reach 0
        return (self._release(old) if old is not None else []) + stored

    def drop(self, place: str) -> list[Event]:
        """``place`` holds nothing now."""
        old = self._places.pop(place, None)
        return self._release(old) if old is not None else []

    def clear(self) -> list[Event]:
        """The server lost everything (a new process): one event, and nothing is held."""
        self._places.clear()
        self._count.clear()
        return [AllBlocksCleared()]

    def resend(self) -> list[Event]:
        """Everything held, from scratch: ``AllBlocksCleared``, then every place's blocks (for a
        subscriber that just arrived)."""
        self._count.clear()
        events: list[Event] = [AllBlocksCleared()]
        for p in self._places.values():
            events += self._hold(p.medium, p.hashes, p.tokens)
        return events

    def _release(self, place: _Place) -> list[Event]:
        gone = []
        for h in reversed(place.hashes):  # the deepest first: a consumer's tree never holds an orphan
            key = (place.medium, h)
            self._count[key] -= 1
            if self._count[key] <= 0:
                del self._count[key]
                gone.append(h)
        return [BlockRemoved(tuple(gone), place.medium)] if gone else []

    def _hold(self, medium: str, chain: list[int], tokens: list[int]) -> list[Event]:
        """Count ``chain`` held once more in ``medium``; a BlockStored per run of blocks new there."""
        events: list[Event] = []
        run: list[int] = []
        run_start = 0
        bs = self.block_size

        def flush(end: int) -> None:
            if run:
                parent = chain[run_start - 1] if run_start else None
                events.append(BlockStored(tuple(run), parent, tuple(tokens[run_start * bs:end * bs]), bs,
                                          None, medium))

        for i, h in enumerate(chain):
            key = (medium, h)
            self._count[key] += 1
            if self._count[key] == 1:
                if not run:
                    run_start = i
                run.append(h)
            else:
                flush(i)
                run = []
        flush(len(chain))
        return events


def event_array(event: Event) -> list:
    """An event as vLLM's msgspec writes a tagged, array-like struct."""
    if isinstance(event, BlockStored):
        return ["BlockStored", list(event.block_hashes), event.parent_block_hash, list(event.token_ids),
                event.block_size, event.lora_id, event.medium]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.block_hashes), event.medium]
    return ["AllBlocksCleared"]


def encode_batch(ts: float, events: Iterable[Event], data_parallel_rank: int = 0) -> bytes:
    """A ``KVEventBatch(ts, events, data_parallel_rank)`` as msgpack (array-like)."""
    return msgpack.packb([float(ts), [event_array(e) for e in events], data_parallel_rank], use_bin_type=True)


class ProxyKv:
    """The proxy's view of one server as places of :class:`KvBlocks`: each slot holds the tokens of the
    conversation its lease says is there, each park the tokens its conversation's slot held when it was
    saved. The proxy tells it what it learns (a conversation's prompt tokens after its request; a park
    saved; a park restored; the server restarted) and :meth:`sync` gives the events since the last one."""

    def __init__(self, setup: str = "", block_size: int = BLOCK_SIZE) -> None:
        self.blocks = KvBlocks(setup, block_size)
        self._tokens: dict[str, list[int]] = {}  # conversation -> what its slot holds (its last prompt)
        self._parked: dict[str, list[int]] = {}  # conversation -> what its park holds
        self._saves: Counter[str] = Counter()

    def saves(self, conv: str) -> int:
        """How many times ``conv`` was parked (a token list learned later says which park it is)."""
        return self._saves[conv]

    def learn(self, conv: str, tokens: Sequence[int], saves_before: int | None = None) -> None:
        """``conv``'s slot held ``tokens`` after its request; when it was parked since that request
        ended (``saves_before``: :meth:`saves` then), its park holds them too."""
        self._tokens[conv] = list(tokens)
        if saves_before is not None and self._saves[conv] > saves_before:
            self._parked[conv] = list(tokens)

    def learn_park(self, conv: str, tokens: Sequence[int]) -> None:
        """``conv``'s park holds ``tokens`` (read from its state file: a park of an earlier run)."""
        self._parked[conv] = list(tokens)

    def saved(self, conv: str) -> None:
        """``conv``'s slot was saved as its park."""
        self._saves[conv] += 1
        held = self._tokens.get(conv)
        if held is not None:
            self._parked[conv] = held

    def restored(self, conv: str) -> None:
        """``conv``'s park was restored into a slot: the slot holds what the park holds."""
        if conv in self._parked:
            self._tokens[conv] = self._parked[conv]

    def forget(self, conv: str) -> None:
        self._tokens.pop(conv, None)
        self._parked.pop(conv, None)
        self._saves.pop(conv, None)

    def cleared(self) -> list[Event]:
        """A new server process (or a slept one): no slot holds anything; the parks are re-stored by the
        next :meth:`sync`."""
        self._tokens.clear()
        return self.blocks.clear()

    def sync(self, slots: dict[int, str | None], parked: Iterable[str]) -> list[Event]:
        """The events that make a consumer's view match ``slots`` (slot -> the conversation it holds,
        None: nothing known) and ``parked`` (the conversations with a park)."""
        events: list[Event] = []
        for index, conv in sorted(slots.items()):
            held = self._tokens.get(conv) if conv is not None else None
            place = f"slot {index}"
            events += self.blocks.put(place, MEDIUM_SLOT, held) if held else self.blocks.drop(place)
        parked = set(parked)
        for place, medium in list(self.blocks.places().items()):
            if medium == MEDIUM_PARK and place[len("park "):] not in parked:
                events += self.blocks.drop(place)
        for conv in sorted(parked):
            held = self._parked.get(conv)
            place = f"park {conv}"
            events += self.blocks.put(place, MEDIUM_PARK, held) if held else self.blocks.drop(place)
        return events
