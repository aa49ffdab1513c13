"""How big a park will be, before it runs: the state file and its checkpoint sidecar (issue #26, item 4).

Pure arithmetic, no I/O. Two sources, named in every prediction (:attr:`ParkSize.source`):

* **the model's metadata** (:class:`ModelShape`, read from the GGUF by
  ``app.server.gguf_info.read_model_shape``): the byte layout llama-server b11434 writes
  (``llama_state_seq_save_file``: ``src/llama-kv-cache.cpp``, ``llama-memory-recurrent.cpp``), laid out
  below. Measured on the real server for every memory kind (tests/real/test_real_park_sizes.py): within
  a few bytes of the real files (:data:`TOLERANCE_FRACTION`, :data:`TOLERANCE_BYTES`).
* **this server's earlier parks** (:func:`calibrate`): the catalog keeps ``state_size``, ``n_tokens``,
  ``sidecar_size`` and ``sidecar_count`` of every park; where the metadata does not say enough (an
  architecture whose memory is not laid out here, a KV type of a fork) two parks of the same model
  give the bytes per token and the fixed part, one park the bytes per token alone.

The state file (build 11434, a text-only slot of ``n`` tokens)::

    12 bytes                       magic, version, token-word count
    4 × (n + 4)                    the packed token payload (-1, payload version, n, the tokens, 0 media)
    the memory's own state:
      KV cache (attention)         4 (streams) + 4 (cells) + per cell 12 (pos, n_seq_id, seq_id; +12 with
                                   M-RoPE's cell extension) + 16 + per layer 12 + cells × K row and
                                   12 + cells × V row (row = elements of the layer × the KV type's size)
      sliding-window (iSWA)        the KV cache twice: the full layers over ``n`` cells, the sliding
                                   layers over the window's ``min(n, n_swa)`` cells
      recurrent                    20 + per layer 12 + conv state (f32) and 12 + SSM state (f32):
                                   one sequence's state, whatever ``n``
      hybrid                       the attention cache, then the recurrent state

A context checkpoint (``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``) holds only what cannot be rolled back:
the sliding window's cells of the sliding layers, and/or the recurrent state: **independent of the
context** once the chat is longer than the window (the seed: about 150 MiB per checkpoint on the 27B
Qwen3.6, whatever the length). The server makes one per prompt 4 tokens before its end, and one more
``4 + n_ubatch`` tokens before it when the prompt is longer than that (PR #20288), plus one at user
messages at least ``--checkpoint-min-step`` apart; at most ``--ctx-checkpoints`` (default 32) per slot.
A PKCL v2 sidecar is 20 bytes + per checkpoint 40 bytes + its blob (v1: 12 + 32 per checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable

#: bytes per block and elements per block of each KV cache type (ggml_row_size)
KV_TYPES: dict[str, tuple[int, int]] = {
    "f32": (4, 1), "f16": (2, 1), "bf16": (2, 1),
    "q8_0": (34, 32), "q4_0": (18, 32), "q4_1": (20, 32), "iq4_nl": (18, 32), "q5_0": (22, 32), "q5_1": (24, 32),
}
DEFAULT_KV_TYPE = "f16"
#: the server's defaults that decide how many checkpoints a prompt makes
DEFAULT_CTX_CHECKPOINTS = 32
DEFAULT_UBATCH = 512
DEFAULT_CHECKPOINT_MIN_STEP = 8192
#: a prediction from the metadata is within this of the real file (measured, tests/real/test_real_park_sizes.py)
TOLERANCE_FRACTION = 0.005
TOLERANCE_BYTES = 256

STATE_HEADER = 12
TOKEN_PAYLOAD_WORDS = 4  # -1, payload version, count, media count (build 11434, PR #26640)
CELL_META = 12  # pos, n_seq_id, seq_id
CELL_EXT = 12  # llama_kv_cell_ext (M-RoPE x, y; token)
RECURRENT_HEADER = 20  # cell count, one cell's meta, s_trans, n_layer (measured)
CHECKPOINT_BLOB_EXTRA = 8  # a partial sequence state's own header, measured
PKCL2_HEADER, PKCL2_ENTRY = 20, 40
PKCL1_HEADER, PKCL1_ENTRY = 12, 32

SOURCE_METADATA = "model metadata"
SOURCE_PARKS = "earlier parks"
SOURCE_PREVIOUS = "the previous copy"


def row_bytes(kv_type: str | None, elements: int) -> int | None:
    """ggml_row_size of ``elements`` of ``kv_type``, or None for a type not known here (a fork's)."""
    per_block, per = KV_TYPES.get((kv_type or DEFAULT_KV_TYPE).lower(), (0, 0))
    if not per_block:
        return None
    return elements // per * per_block


@dataclass(frozen=True)
class ModelShape:
    """What decides the size of a model's sequence state, read from its GGUF metadata.

    ``kv``: per attention layer over the whole context, (K elements, V elements) per cell;
    ``kv_swa``: the same for the sliding layers (over ``n_swa`` cells at most); ``recurrent``: per
    recurrent layer, (conv state, SSM state) elements of one sequence (f32). ``iswa``: the attention
    memory is split in two caches (a sliding window on some layers); ``cell_ext``: M-RoPE cells."""

    architecture: str
    kv: tuple[tuple[int, int], ...] = ()
    kv_swa: tuple[tuple[int, int], ...] = ()
    n_swa: int = 0
    recurrent: tuple[tuple[int, int], ...] = ()
    iswa: bool = False
    cell_ext: bool = False

    @property
    def has_attention(self) -> bool:
        return bool(self.kv or self.kv_swa) or not self.recurrent

    @property
    def checkpointed(self) -> bool:
        """A restore of it needs checkpoints: a sliding window or recurrent state."""
        return bool(self.recurrent) or (self.iswa and self.n_swa > 0)


def _kv_cache_bytes(layers: Iterable[tuple[int, int]], cells: int, ctk: str | None, ctv: str | None,
                    ext: bool) -> int | None:
    out = 8  # streams, cell count
    if cells <= 0:
        return out
    out += cells * (CELL_META + (CELL_EXT if ext else 0)) + 16  # meta, v_trans/n_layer/n_rot_k/n_rot_v
    for k, v in layers:
        kr, vr = row_bytes(ctk, k), row_bytes(ctv, v)
        if kr is None or vr is None:
            return None
        out += 12 + cells * kr + 12 + cells * vr
    return out


def recurrent_bytes(shape: ModelShape) -> int:
    """One sequence's recurrent state as written (0 without recurrent layers): context-independent."""
    if not shape.recurrent:
        return 0
    out = RECURRENT_HEADER
    for r, s in shape.recurrent:
        out += 12 + 4 * r + 12 + 4 * s  # an SSM state of 0 elements (a short convolution) still has its header
    return out


def attention_bytes(shape: ModelShape, n_tokens: int, ctk: str | None, ctv: str | None) -> int | None:
    if not shape.has_attention:
        return 0
    if shape.iswa:
        base = _kv_cache_bytes(shape.kv, n_tokens, ctk, ctv, shape.cell_ext)
        swa = _kv_cache_bytes(shape.kv_swa, min(n_tokens, shape.n_swa), ctk, ctv, shape.cell_ext)
        return None if base is None or swa is None else base + swa
    return _kv_cache_bytes(shape.kv, n_tokens, ctk, ctv, shape.cell_ext)


def state_bytes(shape: ModelShape, n_tokens: int, ctk: str | None = None, ctv: str | None = None, *,
                packed_tokens: bool = True) -> int | None:
    """The state file of a slot holding ``n_tokens``, or None where a KV type is not known here."""
    attn = attention_bytes(shape, n_tokens, ctk, ctv)
    if attn is None:
        return None
    words = n_tokens + (TOKEN_PAYLOAD_WORDS if packed_tokens else 0)
    return STATE_HEADER + 4 * words + attn + recurrent_bytes(shape)


def checkpoint_bytes(shape: ModelShape, n_tokens: int, ctk: str | None = None, ctv: str | None = None) -> int | None:
    """One context checkpoint's blob taken at ``n_tokens`` (0: the model makes none): the sliding
    window's cells (at most ``n_swa``) and the recurrent state. Past the window it no longer grows."""
    if not shape.checkpointed:
        return 0
    out = CHECKPOINT_BLOB_EXTRA + recurrent_bytes(shape)
    if shape.iswa and shape.n_swa > 0:
        swa = _kv_cache_bytes(shape.kv_swa, min(n_tokens, shape.n_swa), ctk, ctv, shape.cell_ext)
        if swa is None:
            return None
        out += swa
    return out


def checkpoints_per_prompt(n_tokens: int, *, n_ubatch: int = DEFAULT_UBATCH,
                           cap: int = DEFAULT_CTX_CHECKPOINTS) -> int:
    """How many checkpoints one prompt of ``n_tokens`` (a first request) leaves: one 4 tokens before
    its end, one ``4 + n_ubatch`` before it when the prompt is longer (server-context.cpp, PR #20288);
    at most ``cap``. Each later turn of a chat adds up to two more, until the cap."""
    if cap <= 0 or n_tokens <= 4:
        return 0
    return min(cap, 2 if n_tokens > 4 + n_ubatch else 1)


def sidecar_bytes(n_checkpoints: int, per_checkpoint: int, *, version: int = 2) -> int:
    """A PKCL sidecar of ``n_checkpoints`` blobs of ``per_checkpoint`` bytes (v2 writes its header even
    with none; v1 writes no file then)."""
    if version == 1:
        return PKCL1_HEADER + n_checkpoints * (PKCL1_ENTRY + per_checkpoint) if n_checkpoints else 0
    return PKCL2_HEADER + n_checkpoints * (PKCL2_ENTRY + per_checkpoint)


@dataclass(frozen=True)
class ParkSize:
    """A park's predicted size: the state file, and the sidecar with ``n_checkpoints`` checkpoints of
    ``per_checkpoint`` bytes (``sidecar_max``: with as many as ``--ctx-checkpoints`` allows)."""

    n_tokens: int
    state: int
    per_checkpoint: int = 0
    n_checkpoints: int = 0
    sidecar: int = 0
    sidecar_max: int = 0
    source: str = SOURCE_METADATA
    notes: tuple[str, ...] = field(default=())

    @property
    def total(self) -> int:
        return self.state + self.sidecar

    @property
    def total_max(self) -> int:
        return self.state + max(self.sidecar, self.sidecar_max)


def predict(shape: ModelShape, n_tokens: int, *, ctk: str | None = None, ctv: str | None = None,
            ctx_checkpoints: int | None = DEFAULT_CTX_CHECKPOINTS, writes_sidecar: bool = True,
            n_checkpoints: int | None = None, sidecar_version: int = 2,
            n_ubatch: int = DEFAULT_UBATCH) -> ParkSize | None:
    """The park of a slot holding ``n_tokens`` on a server with these flags, from the model's shape.
    ``n_checkpoints``: how many the slot holds when known (the previous copy's count, say), else
    what one prompt of ``n_tokens`` makes. ``writes_sidecar``: the server writes sidecars (KV Valet's
    build, the fork); a stock build writes none. None where a KV type is not known here."""
    state = state_bytes(shape, n_tokens, ctk, ctv)
    per = checkpoint_bytes(shape, n_tokens, ctk, ctv)
    if state is None or per is None:
        return None
    cap = DEFAULT_CTX_CHECKPOINTS if ctx_checkpoints is None else max(0, ctx_checkpoints)
    if not writes_sidecar or cap == 0:
        return ParkSize(n_tokens, state, per, 0, 0, 0, SOURCE_METADATA)
    if not shape.checkpointed:  # dense: no checkpoints; v2 still writes its empty header
        empty = sidecar_bytes(0, 0, version=sidecar_version)
        return ParkSize(n_tokens, state, 0, 0, empty, empty, SOURCE_METADATA)
    count = min(cap, n_checkpoints) if n_checkpoints is not None else \
        checkpoints_per_prompt(n_tokens, n_ubatch=n_ubatch, cap=cap)
    return ParkSize(n_tokens, state, per, count, sidecar_bytes(count, per, version=sidecar_version),
                    sidecar_bytes(cap, per, version=sidecar_version), SOURCE_METADATA)


@dataclass(frozen=True)
class ParkSample:
    """One earlier park of the same model and KV types (a catalog row)."""

    n_tokens: int
    state_size: int
    sidecar_size: int = 0
    sidecar_count: int = 0


def calibrate(samples: Iterable[ParkSample], n_tokens: int, *, ctx_checkpoints: int | None = None,
              n_checkpoints: int | None = None, source: str = SOURCE_PARKS) -> ParkSize | None:
    """The park of ``n_tokens`` as this server's earlier parks of the same model measured it: the state
    by a line through them (two token counts or more: bytes per token and the fixed part; one: bytes per
    token alone, which overstates a short chat of a recurrent model), the sidecar by their bytes per
    checkpoint (the header of each left out). None without a usable park."""
    rows = [s for s in samples if s.n_tokens > 0 and s.state_size > 0]
    if not rows:
        return None
    xs = {s.n_tokens for s in rows}
    if len(xs) >= 2:
        n = len(rows)
        mx = sum(s.n_tokens for s in rows) / n
        my = sum(s.state_size for s in rows) / n
        sxx = sum((s.n_tokens - mx) ** 2 for s in rows)
        slope = sum((s.n_tokens - mx) * (s.state_size - my) for s in rows) / sxx
        slope = max(slope, 0.0)
        state = int(round(my + slope * (n_tokens - mx)))
        state = max(state, min(s.state_size for s in rows) if slope == 0 else 0)
        notes: tuple[str, ...] = (f"{slope:,.1f} bytes per token from {n} parks",)
    else:
        best = max(rows, key=lambda s: s.n_tokens)
        state = int(best.state_size / best.n_tokens * n_tokens)
        notes = (f"{best.state_size / best.n_tokens:,.1f} bytes per token from one park",)
    per, count = 0, 0
    with_ckpt = [s for s in rows if s.sidecar_count > 0 and s.sidecar_size > 0]
    if with_ckpt:
        per = max(0, max((s.sidecar_size - PKCL2_HEADER) // s.sidecar_count - PKCL2_ENTRY for s in with_ckpt))
        count = n_checkpoints if n_checkpoints is not None else max(s.sidecar_count for s in with_ckpt)
    cap = DEFAULT_CTX_CHECKPOINTS if ctx_checkpoints is None else max(0, ctx_checkpoints)
    count = min(count, cap)
    sidecar = sidecar_bytes(count, per) if per else (max(s.sidecar_size for s in rows) if count else 0)
    return ParkSize(n_tokens, max(0, state), per, count, sidecar, sidecar_bytes(cap, per) if per else sidecar,
                    source, notes)


def within_tolerance(predicted: int, actual: int, *, fraction: float = TOLERANCE_FRACTION,
                     slack: int = TOLERANCE_BYTES) -> bool:
    """Whether a prediction is as close as the metadata's is measured to be."""
    return abs(predicted - actual) <= max(slack, fraction * actual)


def with_previous(size: ParkSize, previous_count: int | None) -> ParkSize:
    """``size`` with the checkpoint count of the session's previous copy, when it had more (a chat of
    many turns holds more checkpoints than one prompt makes)."""
    if not previous_count or previous_count <= size.n_checkpoints or not size.per_checkpoint:
        return size
    count = previous_count
    if size.sidecar_max:
        count = min(count, (size.sidecar_max - PKCL2_HEADER) // (PKCL2_ENTRY + size.per_checkpoint))
    return replace(size, n_checkpoints=count, sidecar=sidecar_bytes(count, size.per_checkpoint))
