#!/usr/bin/env python3
"""A fake llama-server (build 11434) for KV Valet's tests.

It is launched like the real binary and answers like the captures in
tests/fixtures/llama-server-b11434, tests/fixtures/sidecar-build-b11434 and
tests/fixtures/sidecar-modes-b11434 (same JSON keys, error bodies, status codes, log lines and log format), without
a model: a deterministic fake tokenizer, no real prefill (timings are computed,
not slept), fake sequence-state bytes. See README.md next to this file.

Independence: this file imports nothing from ``app/``. The state files and
checkpoint sidecars it writes and reads are coded here, from the layouts in
/work/shared/reference/llama-server.md (and the real bytes in the fixtures), so
a format mistake in the app cannot be copied into the fake.

What it models, from llama.cpp build 11434 tools/server/server-context.cpp:
* prompt reuse (update_slots, ~lines 3440-3650): n_past = common prefix with the
  slot's tokens; ``pos_min_thold = max(0, pos_next - n_swa - (has_new_tokens ? 0 : 1))``;
  if the slot's memory no longer reaches back that far (``pos_min >= pos_min_thold``)
  the context checkpoints are searched newest first (``cur.pos_max <= pos_next`` and
  ``cur.pos_min < pos_min_thold || cur.pos_min == 0``), n_past becomes the checkpoint's
  position, else "forcing full prompt re-processing"; checkpoints past pos_next are
  erased; at least one prompt token is always processed;
* checkpoint creation (~lines 3700-3910, create_checkpoint ~2513): batches of
  n_batch tokens, cut 4 + n_ubatch and 4 tokens before the end of the prompt, a
  checkpoint of the memory before each batch near the end of the prompt, min
  spacing (--checkpoint-min-step), at most --ctx-checkpoints, same n_tokens superseded;
* the memory of the slot: a sliding-window model keeps n_swa + n_ubatch cells of its
  SWA cache, a state file or a checkpoint holds only the n_swa window, a
  recurrent-hybrid model keeps only its last position, a dense model keeps all;
* slot selection, the RAM prompt cache and idle-slot saves (get_available_slot,
  process_single_task), /slots as server_slot::to_json, slot save/restore/erase;
* streaming (``"stream": true``) as server-sent events, one HTTP chunk each, in the shapes the
  real build sends (captured from it): /completion's token events and its final event with
  ``timings``; /v1/chat/completions and /v1/completions (also not streamed) wrapped as OpenAI
  objects with ``timings``, then ``data: [DONE]``; GET /v1/models. A client that goes away
  mid-stream cancels the task (``srv stop: cancel task``) at the next token written; the
  connection is closed after a stream although keep-alive was announced (as the real one does);
* FAKE_SIDECAR=1: KV Valet's sidecar build (build 11434 + app/serverbuild/kvv-sidecar.patch),
  checkpoints saved to and loaded from ``<state>.ckpt``, in the behaviour KVV_SIDECAR_MODE
  picks like the real binary: ``v2`` (unset or unknown: PKCL v2 with the state file's FNV-1a,
  written on every save, atomically; strict loader; tip checkpoint fallback), ``fork`` (the
  turboquant fork at #206: PKCL v1, lax silent loader, tip fallback, restore and erase keep the
  slot's checkpoints, save_ms before the sidecar), ``port`` (PKCL v1, strict loader, no tip).

Environment knobs:
  FAKE_LOAD_SECONDS (0.3)          time /health answers 503 "Loading model" (SIGUSR1 ends it at once)
  FAKE_MODEL_KIND (sliding-window) dense | sliding-window | recurrent-hybrid
  FAKE_N_SWA (512)                 sliding window of the fake model
  FAKE_PREFILL_TPS (280)           reported prompt tokens per second
  FAKE_GEN_TPS (40)                reported generated tokens per second
  FAKE_COMPLETION_DELAY (0)        seconds a completion really keeps its slot busy, a streamed one
                                   right after its first token (SIGUSR2 ends the delays at once, and
                                   every later one)
  FAKE_STOP_WAITS (0)               1: as build 11434 does (captured: 04-stop-during-generation.log), a
                                   SIGTERM while a completion is held (FAKE_COMPLETION_DELAY) says
                                   "cleaning up before exit" and the process stays until a second
                                   SIGTERM: "Received second interrupt, terminating immediately.", exit 1
  FAKE_PREFILL_HOLD (0)            1: a prompt past one full batch (-b) stops after that batch, the
                                   slot busy, until SIGUSR2 (as FAKE_COMPLETION_DELAY); meanwhile
                                   /slots answers as build 11434 does between batches (captured:
                                   is_processing, n_prompt_tokens_processed, n_prompt_tokens_cache)
  FAKE_SIDECAR (0)                 1: the sidecar build: write/read <state>.ckpt sidecars
  KVV_SIDECAR_MODE (v2)            with FAKE_SIDECAR=1: v2 | fork | port, as the real sidecar build
  FAKE_STATE_BYTES_PER_TOKEN (64)  size of the fake sequence state per token
  FAKE_CKPT_BYTES_PER_TOKEN (16)   size of a fake checkpoint per cell of its window
  FAKE_STATE_VERSION (4)           state file version written and required
  FAKE_SAVE_ERROR (0)              1: the state write fails: 500 "Unable to save slot" (fork mode:
                                   success with n_written 0, the sidecar still written)
  FAKE_SAVE_DELAY (0)              seconds added to every save
  FAKE_DIE_DURING_SAVE (0)         1: write half the state file, then SIGKILL
  FAKE_ABORT_ON_SAVE (0)           1: print the seed-002 GGML_ASSERT and abort
  FAKE_ABORT_ON_IDLE_SAVE (0)      1: the same on the first idle-slot save of a slot holding tokens
                                   (seed 002: the KV cache on an RPC backend; --cache-ram 0 avoids it)
  FAKE_IDLE_SAVE_SECONDS (0)       seconds an idle-slot save blocks the server (seed 004's stall)
  FAKE_BUILD_INFO (b11434-fake)    /props build_info
  FAKE_LOG_FLOOD (0)               lines/s: once listening, print the captured real logs of
                                   tests/fixtures (cycled, verbatim) at this rate until stopped
                                   (the soak's log flood: tests/soak/soak_window.py)
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
import string
import struct
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llama-server-b11434"
END_LOAD = threading.Event()  # set by SIGUSR1 (or a stop): the model is "loaded" now
END_COMPLETION_DELAY = threading.Event()  # set by SIGUSR2: FAKE_COMPLETION_DELAY is over
N_VOCAB = 262144
N_CTX_TRAIN = 32768
BOS, EOS = 2, 1
SPECIAL = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<start_of_turn>": 105, "<end_of_turn>": 106}
WORDS = ["the", "cache", "slot", "park", "resume", "token", "model", "quiet", "valet", "disk"]
MIB = 1024 * 1024

# state file (llama_state_seq_save_file) and packed token payload (server_tokens::serialize)
STATE_MAGIC = 0x67677371  # 'ggsq', bytes 71 73 67 67 on disk
STATE_VERSION = 4  # LLAMA_STATE_SEQ_VERSION in build 11434
TOKEN_NULL = -1  # LLAMA_TOKEN_NULL: first word of a packed payload
TOKENS_STATE_VERSION = 1  # SERVER_TOKENS_STATE_VERSION
# the fake's own sequence state (the real one is per-cell positions and per-layer tensors)
SEQ_HEADER = struct.Struct("<IIIIQ")  # n_stream, cell_count, k_type, v_type, n_bytes
GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20, "bf16": 30}
# turboquant PR #206 sidecar
PKCL_MAGIC = 0x4C434B50  # bytes 'PKCL' on disk
PKCL_VERSION = 1
PKCL_MAX = 1024
PKCL_HEADER = struct.Struct("<III")  # magic, version, count
PKCL_ENTRY = struct.Struct("<qiiQQ")  # n_tokens, pos_min, pos_max, n_tgt, n_dft
PKCL_MAX_BLOB = 16 << 30  # the fork's per-blob limit
# PKCL v2 (KV Valet's sidecar build, KVV_SIDECAR_MODE=v2)
PKCL_VERSION_2 = 2
PKCL2_HEADER = struct.Struct("<IIQI")  # magic, version, state_hash, count
PKCL2_ENTRY = struct.Struct("<qii")  # n_tokens, pos_min, pos_max; then 3 x (u64 size, bytes)
U64 = struct.Struct("<Q")
FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3

FULL_REPROCESS = ("forcing full prompt re-processing due to lack of cache data (likely due to SWA or "
                  "hybrid/recurrent memory, see https://github.com/ggml-org/llama.cpp/pull/13194"
                  "#issuecomment-2868343055)")
RESTORE_FAILED = "No available space in KV cache or invalid slot save file"
SAMPLER_CHAIN = ("logits -> ?penalties -> ?dry -> ?top-n-sigma -> top-k -> ?typical -> top-p -> min-p "
                 "-> ?xtc -> temp-ext -> dist ")
CHAT_TEMPLATE_EXAMPLE = ("<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHello"
                         "<|im_end|>\n<|im_start|>assistant\nHi there<|im_end|>\n<|im_start|>user\n"
                         "How are you?<|im_end|>\n<|im_start|>assistant\n")


def abort_tensor_not_allocated() -> None:
    """Seed 002 (llama.cpp #26128): the assert text, then abort (SIGABRT)."""
    sys.stderr.write('/src/ggml/src/ggml-backend.cpp:359: GGML_ASSERT(tensor->data != NULL && '
                     '"tensor not allocated") failed\n')
    sys.stderr.flush()
    os.abort()


def env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def env_flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0", "false", "no")


def mib(n_bytes: int) -> str:
    return f"{n_bytes / MIB:.3f}"


# ---------------------------------------------------------------- logging

T0 = time.monotonic()
_log_lock = threading.Lock()
VERBOSITY = 3  # llama.cpp default: info; the cache events are trace (-lv 4)
TRACE = 4


def log(level: str, text: str, verbosity: int = 3) -> None:
    """``<min>.<sec>.<ms>.<us> <L> <text>`` on stderr, like common/log.cpp. A text
    with newlines continues on untimestamped lines (e.g. "sampler params")."""
    if verbosity > VERBOSITY and level != "E":
        return
    us = int((time.monotonic() - T0) * 1e6)
    stamp = f"{us // 60_000_000}.{(us // 1_000_000) % 60:02d}.{(us // 1000) % 1000:03d}.{us % 1000:03d}"
    with _log_lock:
        sys.stderr.write(f"{stamp} {level} {text}\n")
        sys.stderr.flush()


def srv_log(level: str, func: str, text: str, verbosity: int = 3) -> None:
    log(level, f"srv  {func[:12]:>12}: {text}", verbosity)  # SRV_*: "srv  %12.*s: "


def slot_log(level: str, func: str, slot_id: int, task: int, text: str, verbosity: int = 3) -> None:
    log(level, f"slot {func[:12]:>12}: id {slot_id:2d} | task {task} | {text}", verbosity)


def ts_us() -> int:
    return int((time.monotonic() - T0) * 1e6)


# ---------------------------------------------------------------- arguments

VALUE_FLAGS = {
    "-m": "model", "--model": "model", "--host": "host", "--port": "port",
    "-c": "ctx", "--ctx-size": "ctx", "-np": "parallel", "--parallel": "parallel",
    "-b": "n_batch", "--batch-size": "n_batch", "-ub": "n_ubatch", "--ubatch-size": "n_ubatch",
    "--slot-save-path": "slot_save_path", "-ctxcp": "ctx_checkpoints",
    "--ctx-checkpoints": "ctx_checkpoints", "--swa-checkpoints": "ctx_checkpoints",
    "-cms": "checkpoint_min_step", "--checkpoint-min-step": "checkpoint_min_step",
    "-cram": "cache_ram", "--cache-ram": "cache_ram",
    "-sps": "slot_prompt_similarity", "--slot-prompt-similarity": "slot_prompt_similarity",
    "-ctk": "ctk", "--cache-type-k": "ctk", "-ctv": "ctv", "--cache-type-v": "ctv",
    "-lv": "verbosity", "--verbosity": "verbosity", "--log-verbosity": "verbosity",
    "--api-key": "api_key", "--api-key-file": "api_key_file", "-a": "alias", "--alias": "alias",
}
BOOL_FLAGS = {"--metrics": ("metrics", True), "--no-slots": ("no_slots", True), "--slots": ("no_slots", False),
              "-v": ("verbose", True), "--verbose": ("verbose", True), "--log-verbose": ("verbose", True),
              "-kvu": ("kv_unified", True), "--kv-unified": ("kv_unified", True),
              "-no-kvu": ("kv_unified", False), "--no-kv-unified": ("kv_unified", False),
              "--cache-idle-slots": ("cache_idle_slots", True), "--no-cache-idle-slots": ("cache_idle_slots", False),
              "--swa-full": ("swa_full", True)}


def parse_args(argv: list[str]) -> dict:
    opts = {"host": "127.0.0.1", "port": "8080", "ctx": "0", "parallel": "-1", "n_batch": "2048",
            "n_ubatch": "512", "ctx_checkpoints": "32", "checkpoint_min_step": "8192", "cache_ram": "8192",
            "slot_prompt_similarity": "0.1", "ctk": "f16", "ctv": "f16", "verbosity": "3", "api_keys": [],
            "cache_idle_slots": True, "kv_unified": None, "swa_full": False}
    i = 0
    while i < len(argv):
        arg = argv[i]
        value = None
        if arg.startswith("--") and "=" in arg:
            arg, value = arg.split("=", 1)
        if arg in ("-h", "--help", "--usage"):
            sys.stdout.write((FIXTURES / "help.txt").read_text())
            sys.stdout.flush()
            sys.exit(0)
        if arg == "--version":
            sys.stderr.write((FIXTURES / "version.txt").read_text())
            sys.stderr.flush()
            sys.exit(0)
        if arg in VALUE_FLAGS:
            if value is None:
                i += 1
                if i >= len(argv):
                    sys.stderr.write(f"error: expected value for argument {arg}\n")
                    sys.exit(1)
                value = argv[i]
            key = VALUE_FLAGS[arg]
            if key == "api_key":
                opts["api_keys"].extend(k for k in value.split(",") if k)
            else:
                opts[key] = value
        elif arg in BOOL_FLAGS:
            key, flag = BOOL_FLAGS[arg]
            opts[key] = flag
        elif value is None and i + 1 < len(argv) and re.match(r"^(?!-)|^-\d", argv[i + 1]):
            i += 1  # unknown flag with a value: ignore both
        i += 1
    if os.environ.get("LLAMA_API_KEY") and not opts["api_keys"]:
        opts["api_keys"].append(os.environ["LLAMA_API_KEY"])
    if opts.get("api_key_file"):
        for line in Path(opts["api_key_file"]).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                opts["api_keys"].append(line)
    return opts


# ---------------------------------------------------------------- tokenizer

_pieces: dict[int, str] = {v: k for k, v in SPECIAL.items()}
_pieces_lock = threading.Lock()
_ids: dict[str, int] = {}  # piece -> id, each piece's id computed once (a long prompt repeats its pieces)
_PIECE_RE = re.compile(r"<[A-Za-z_]+>|\w+|\s+|[^\w\s]")


# A real model has a fixed vocabulary: a restarted server detokenises what an earlier
# process tokenised. The fake learns its pieces, so it keeps them in a file beside the
# model (``<model>.vocab``, one JSON line per piece) that every process of it shares.
_vocab_file: Path | None = None


def load_vocab(model_path: str) -> None:
    global _vocab_file
    _vocab_file = Path(model_path + ".vocab")
    try:
        lines = _vocab_file.read_text(encoding="utf-8").splitlines()
    except OSError:
        return
    with _pieces_lock:
        for line in lines:
            try:
                tid, piece = json.loads(line)
            except ValueError:
                continue  # a line cut by a killed process
            _pieces.setdefault(int(tid), piece)


def token_id(piece: str) -> int:
    tid = _ids.get(piece)
    if tid is not None:
        return tid
    _ids[piece] = tid = _new_token_id(piece)
    return tid


def _new_token_id(piece: str) -> int:
    if piece in SPECIAL:
        return SPECIAL[piece]
    tid = 256 + zlib.crc32(piece.encode()) % (N_VOCAB - 256)
    with _pieces_lock:
        if tid not in _pieces:
            _pieces[tid] = piece
            if _vocab_file is not None:
                try:
                    with open(_vocab_file, "a", encoding="utf-8") as f:
                        f.write(json.dumps([tid, piece]) + "\n")
                except OSError:
                    pass  # a read-only model folder: this process still knows the piece
    return tid


def tokenize(text: str, add_bos: bool = False) -> list[int]:
    """Deterministic fake pieces: a word, a run of whitespace, a punctuation mark or <special>."""
    known = _ids.get
    ids = [t if (t := known(p)) is not None else token_id(p) for p in _PIECE_RE.findall(text)]
    return [BOS, *ids] if add_bos else ids


def detokenize(tokens: list[int]) -> str:
    return "".join(_pieces.get(t, f"<{t}>") for t in tokens)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def fake_bytes(seed: int, n: int) -> bytes:
    block = hashlib.sha256(str(seed).encode()).digest()
    return (block * (n // len(block) + 1))[:n]


# ---------------------------------------------------------------- state files

class TokensStateError(Exception):
    """server_tokens::deserialize refused the token words (message as the server's)."""


def pack_token_words(tokens: list[int]) -> list[int]:
    """server_tokens::serialize: LLAMA_TOKEN_NULL, payload version, the token vector
    (u32 count + tokens), the media key vector (u32 count 0), padded to 4 bytes."""
    return [TOKEN_NULL, TOKENS_STATE_VERSION, len(tokens), *tokens, 0]


def unpack_token_words(words: list[int]) -> list[int]:
    """server_tokens::deserialize for a server without an mmproj."""
    if not words or words[0] != TOKEN_NULL:
        return list(words)  # plain token list, as written by older builds
    pos = 1

    def read_u32() -> int:
        nonlocal pos
        if pos >= len(words):
            raise TokensStateError("Unexpected end of server tokens state")
        pos += 1
        return words[pos - 1] & 0xFFFFFFFF

    if read_u32() != TOKENS_STATE_VERSION:
        raise TokensStateError("Unsupported server tokens state version")
    n = read_u32()
    if n > len(words) - pos:
        raise TokensStateError("Unexpected end of server tokens state")
    tokens = list(words[pos:pos + n])
    pos += n
    n_media = read_u32()
    if n_media > len(words) - pos:
        raise TokensStateError("Unexpected end of server tokens state")
    if n_media:
        raise TokensStateError("Cannot restore media tokens without an mmproj")
    if len(words) - pos >= 1:
        raise TokensStateError("Trailing data in server tokens state")
    return tokens


def ggml_type_id(name: str) -> int:
    return GGML_TYPES.get(name, 100 + zlib.crc32(name.encode()) % 1000)


def seq_state_bytes(n_cells: int, k_type: int, v_type: int, seed: int) -> bytes:
    """The fake's stand-in for state_seq_write_data: a small header, then opaque bytes."""
    n = 256 + n_cells * int(env_float("FAKE_STATE_BYTES_PER_TOKEN", 64))
    return SEQ_HEADER.pack(1, n_cells, k_type, v_type, n) + fake_bytes(seed, n)


def encode_state_file(words: list[int], seq_state: bytes, version: int) -> bytes:
    """llama_state_seq_save_file: u32 magic, u32 version, u32 n_token_count, the words, the state."""
    return struct.pack("<III", STATE_MAGIC, version, len(words)) + struct.pack(f"<{len(words)}i", *words) + seq_state


class LoadError(Exception):
    """llama_state_seq_load_file returned 0; ``lines`` are the E lines libllama logs."""

    def __init__(self, *lines: str):
        super().__init__(lines[-1])
        self.lines = lines


@dataclass
class LoadedState:
    words: list[int]
    n_cells: int
    n_read: int


def load_state_file(path: str, version: int, n_cells_max: int, k_type: int, v_type: int) -> LoadedState:
    """llama_context::state_seq_load_file (src/llama-context.cpp ~3326) on the fake's state."""
    outer = "llama_state_seq_load_file: error loading sequence state file: "
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise LoadError(f"{outer}failed to open {path}: {exc.strerror}") from None
    with f:
        data = f.read()
    if len(data) < 12:
        raise LoadError(f"{outer}unexpectedly reached end of file")
    magic, file_version, n_words = struct.unpack_from("<III", data)
    if magic != STATE_MAGIC or file_version != version:
        raise LoadError(f"state_seq_load_file: unknown (magic, version) for sequence state file: "
                        f"{magic:08x}, {file_version:08x}")
    n_word_max = (len(data) - 12) // 4
    if n_words > n_word_max:
        raise LoadError(f"state_seq_load_file: token count in sequence state file exceeds the file size! "
                        f"{n_words} > {n_word_max}")
    words = list(struct.unpack_from(f"<{n_words}i", data, 12))
    pos = 12 + 4 * n_words
    if len(data) - pos < SEQ_HEADER.size:
        raise LoadError(f"{outer}unexpectedly reached end of file")
    n_stream, n_cells, k_file, v_file, n_bytes = SEQ_HEADER.unpack_from(data, pos)
    if n_stream != 1:
        raise LoadError(f"{outer}n_stream mismatch")
    if n_cells > n_cells_max:
        raise LoadError("state_read_meta: not enough cells in kv cache", f"{outer}failed to restore kv cache")
    if k_file != k_type:
        raise LoadError(f"state_read_data: mismatched key type ({k_file} != {k_type}, layer 0)",
                        f"{outer}failed to restore kv cache")
    if v_file != v_type:
        raise LoadError(f"state_read_data: mismatched value type ({v_file} != {v_type}, layer 0)",
                        f"{outer}failed to restore kv cache")
    end = pos + SEQ_HEADER.size + n_bytes
    if end > len(data):
        raise LoadError(f"{outer}unexpectedly reached end of file")
    return LoadedState(words=words, n_cells=n_cells, n_read=end)


# ---------------------------------------------------------------- checkpoints and sidecars

@dataclass
class Ckpt:
    n_tokens: int
    pos_min: int
    pos_max: int
    size_tgt: int
    size_dft: int = 0
    id_task: int = -1
    size_spec: int = 0  # PKCL v2's speculative-decoding block

    @property
    def size(self) -> int:
        return self.size_tgt + self.size_dft + self.size_spec


class SidecarReadError(Exception):
    """pkcl_read refused the file; the message is the patch's ``reason``."""


# KVV_SIDECAR_MODE of KV Valet's sidecar build (app/serverbuild/kvv-sidecar.patch): "" and anything
# unknown run as v2; the start line names the mode (a warning for an unknown value).
SIDECAR_MODES = ("v2", "fork", "port")


def sidecar_mode() -> tuple[str, str]:
    """(mode, raw KVV_SIDECAR_MODE) like kvv_mode() / kvv_mode_raw()."""
    raw = os.environ.get("KVV_SIDECAR_MODE", "")
    return (raw if raw in ("fork", "port") else "v2"), raw


def fnv1a64(data: bytes, h: int = FNV_OFFSET) -> int:
    """64-bit FNV-1a (kvv_fnv1a_file), the PKCL v2 state hash."""
    prime, mask = FNV_PRIME, (1 << 64) - 1
    for b in data:
        h = ((h ^ b) * prime) & mask
    return h


def fnv1a64_path(path: str) -> int:
    """The hash of every byte of ``path``; OSError when it cannot be read."""
    h = FNV_OFFSET
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h = fnv1a64(chunk, h)
    return h


def _ckpt_blob(cp: Ckpt, which: int, size: int) -> bytes:
    return fake_bytes(cp.n_tokens * 31 + cp.pos_min if which == 0 else -cp.n_tokens - which, size)


def write_pkcl(path: str, checkpoints: list[Ckpt], cap: int = 0) -> int:
    """pkcl_write_v1: the newest ``cap`` checkpoints (0: all, as the fork writes), not atomic.
    Returns how many were written."""
    cps = checkpoints[-cap:] if cap > 0 else list(checkpoints)
    with open(path, "wb") as f:
        f.write(PKCL_HEADER.pack(PKCL_MAGIC, PKCL_VERSION, len(cps)))
        for cp in cps:
            f.write(PKCL_ENTRY.pack(cp.n_tokens, cp.pos_min, cp.pos_max, cp.size_tgt, cp.size_dft))
            f.write(_ckpt_blob(cp, 0, cp.size_tgt))
            f.write(_ckpt_blob(cp, 1, cp.size_dft))
    return len(cps)


def write_pkcl2(path: str, state_hash: int, checkpoints: list[Ckpt]) -> int:
    """pkcl_write_v2: through ``<path>.tmp`` and a rename (a crash never leaves a half sidecar)."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(PKCL2_HEADER.pack(PKCL_MAGIC, PKCL_VERSION_2, state_hash, len(checkpoints)))
            for cp in checkpoints:
                f.write(PKCL2_ENTRY.pack(cp.n_tokens, cp.pos_min, cp.pos_max))
                for which, size in enumerate((cp.size_tgt, cp.size_dft, cp.size_spec)):
                    f.write(U64.pack(size))
                    f.write(_ckpt_blob(cp, which, size))
        os.replace(tmp, path)
    except OSError:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    return len(checkpoints)


def read_pkcl_file(path: str, version: int, strict: bool, n_restored: int, n_ctx_checkpoints: int,
                   want_hash: int = 0) -> list[Ckpt]:
    """pkcl_read (all or nothing): ``strict`` are the port's (v1) and v2's checks, else only the
    fork's (magic, version, count <= 1024, blobs <= 16 GiB, short reads). Raises SidecarReadError
    with the patch's reason."""
    if not os.path.isfile(path):
        raise SidecarReadError("not a regular file")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        raise SidecarReadError("cannot open") from None
    size = len(data)
    head = PKCL2_HEADER.size if version == 2 else PKCL_HEADER.size
    if size < head:
        raise SidecarReadError("file too short")
    magic, file_version = struct.unpack_from("<II", data)
    if magic != PKCL_MAGIC:
        raise SidecarReadError("bad magic")
    if file_version != version:
        raise SidecarReadError(f"unsupported version {file_version}")
    if version == 2:
        _m, _v, stored_hash, count = PKCL2_HEADER.unpack_from(data)
        if stored_hash != want_hash:
            raise SidecarReadError("state hash mismatch (the sidecar belongs to another save)")
    else:
        _m, _v, count = PKCL_HEADER.unpack_from(data)
    if count > PKCL_MAX:
        raise SidecarReadError(f"count {count} exceeds {PKCL_MAX}")
    if strict and count == 0:
        raise SidecarReadError("no checkpoints")
    if strict and count > n_ctx_checkpoints:
        raise SidecarReadError(f"count {count} exceeds the limit (--ctx-checkpoints {n_ctx_checkpoints})")
    out, off = [], head
    entry = PKCL2_ENTRY if version == 2 else PKCL_ENTRY
    for i in range(count):
        if size - off < entry.size:
            raise SidecarReadError(f"truncated header of checkpoint {i}")
        fields = entry.unpack_from(data, off)
        off += entry.size
        n_tokens, pos_min, pos_max = fields[:3]
        if strict and not 0 <= n_tokens <= n_restored:
            raise SidecarReadError(f"checkpoint {i}: n_tokens {n_tokens} outside [0, {n_restored}]")
        if strict and pos_max < pos_min:
            raise SidecarReadError(f"checkpoint {i}: pos_max < pos_min")
        sizes = [0, 0, 0]
        if version == 1:
            sizes[:2] = fields[3:5]
        for b in range(3 if version == 2 else 2):
            if version == 2:
                if size - off < U64.size:
                    raise SidecarReadError(f"checkpoint {i}: truncated block size")
                (sizes[b],) = U64.unpack_from(data, off)
                off += U64.size
            if sizes[b] > PKCL_MAX_BLOB or (strict and sizes[b] > size - off):
                raise SidecarReadError(f"checkpoint {i}: data runs past the end of the file")
            if sizes[b] > size - off:
                raise SidecarReadError(f"read error in checkpoint {i}")
            off += sizes[b]
        out.append(Ckpt(n_tokens, pos_min, pos_max, sizes[0], sizes[1], -1, sizes[2]))
    if strict and off != size:
        raise SidecarReadError(f"{size - off} trailing bytes")
    return out


# ---------------------------------------------------------------- fixtures

def load_fixture_bodies() -> dict:
    data = json.loads((FIXTURES / "responses.json").read_text())
    return {
        "props": data["props"]["body"],
        "slot_params": data["slots_after_task"]["body"][1]["params"],
        "generation_settings": data["completion"]["body"]["generation_settings"],
    }


def error_body(code: int, message: str, etype: str, **extra) -> dict:
    return {"error": {"code": code, "message": message, "type": etype, **extra}}


class HttpError(Exception):
    def __init__(self, code: int, message: str, etype: str = "invalid_request_error", **extra):
        super().__init__(message)
        self.code, self.message, self.etype, self.extra = code, message, etype, extra


def valid_filename(name: str) -> bool:
    """Like common's fs_validate_filename: no paths, no control or reserved characters."""
    if not name or len(name.encode()) > 255 or name in (".", "..") or ".." in name:
        return False
    if name != name.strip() or name.endswith("."):
        return False
    return not any(ord(c) < 0x20 or ord(c) == 0x7F or c in '/\\:*?"<>|' for c in name)


def sampled(prompt: list[int], n_predict: int) -> list[int]:
    """The tokens a completion "generates": deterministic from the prompt's tail (16 by default)."""
    n_gen = n_predict if n_predict >= 0 else 16
    seed = zlib.crc32(repr(prompt[-8:]).encode())
    return [token_id(" ") if i % 2 == 0 else token_id(WORDS[(seed + i) % len(WORDS)]) for i in range(n_gen)]


def token_probabilities(generated: list[int], n_probs: int) -> list[dict]:
    """``completion_probabilities`` as llama-server answers ``n_probs`` (pre-sampling log-probs):
    each generated token first in its ``top_logprobs``, then runners-up a nat apart. Fixed by the
    tokens, so a warm and a cold continuation of the same prompt agree."""
    def entry(tok: int, lp: float) -> dict:
        piece = detokenize([tok])
        return {"id": tok, "token": piece, "bytes": list(piece.encode()), "logprob": lp}

    out = []
    for i, tok in enumerate(generated):
        lp = -0.1 - 0.01 * i
        others = [token_id(WORDS[(tok + j) % len(WORDS)]) for j in range(1, n_probs + 4)]
        top = [entry(tok, lp)] + [entry(t, lp - j) for j, t in enumerate(
            [t for t in dict.fromkeys(others) if t != tok][:n_probs - 1], start=1)]
        out.append({**entry(tok, lp), "top_logprobs": top})
    return out


HELD = [0]  # completions held now (FAKE_COMPLETION_DELAY): FAKE_STOP_WAITS waits for a second signal
HELD_LOCK = threading.Lock()


def hold_completion() -> None:
    """FAKE_COMPLETION_DELAY: keep the slot busy (a streamed completion: after its first token)."""
    delay = env_float("FAKE_COMPLETION_DELAY", 0)
    if delay > 0:
        with HELD_LOCK:
            HELD[0] += 1
        try:
            END_COMPLETION_DELAY.wait(delay)
        finally:
            with HELD_LOCK:
                HELD[0] -= 1


# ---------------------------------------------------------------- server state

@dataclass
class Slot:
    id: int
    n_ctx: int
    tokens: list[int] = field(default_factory=list)  # slot.prompt.tokens
    checkpoints: list[Ckpt] = field(default_factory=list)  # slot.prompt.checkpoints
    pos_min: int = -1  # llama_memory_seq_pos_min of the slot's sequence (-1: empty)
    pos_max: int = -1
    processing: bool = False
    task: dict | None = None  # the running task
    task_prev: dict | None = None  # kept after release: /slots still shows it
    n_prompt_processed: int = 0  # slot.stats, reset at release
    n_prompt_cached: int = 0
    n_gen: int = 0
    n_predict_max: int = -1
    has_next_token: bool = True
    t_last_used: int = -1

    def task_id(self) -> int:
        return self.task["id"] if self.task else -1


@dataclass
class CacheEntry:
    tokens: list[int]
    checkpoints: list[Ckpt]
    state_size: int
    addr: int

    @property
    def size(self) -> int:
        return self.state_size + sum(cp.size for cp in self.checkpoints)


class FakeServer:
    def __init__(self, opts: dict):
        self.opts = opts
        self.model_path = opts.get("model") or "models/7B/ggml-model-f16.gguf"
        self.alias = opts.get("alias") or self.model_path
        n_parallel = int(opts["parallel"])
        kv_unified = opts["kv_unified"]
        self.auto_parallel = n_parallel < 0
        if n_parallel < 0:  # server.cpp: "n_parallel is set to auto, using n_parallel = 4 and kv_unified = true"
            n_parallel, kv_unified = 4, True
        self.kv_unified = bool(kv_unified)
        self.n_ctx = int(opts["ctx"]) or N_CTX_TRAIN
        self.n_ctx_slot = self.n_ctx if self.kv_unified else self.n_ctx // max(1, n_parallel)
        self.slots = [Slot(i, self.n_ctx_slot) for i in range(max(1, n_parallel))]
        self.save_path = opts.get("slot_save_path")
        self.n_batch = max(1, int(opts["n_batch"]))
        self.n_ubatch = max(1, min(int(opts["n_ubatch"]), self.n_batch))
        self.max_checkpoints = int(opts["ctx_checkpoints"])
        self.checkpoint_min_step = int(opts["checkpoint_min_step"])
        self.cache_ram_mib = int(opts["cache_ram"])
        self.cache_idle_slots = bool(opts["cache_idle_slots"])
        self.slot_prompt_similarity = float(opts["slot_prompt_similarity"])
        self.k_type, self.v_type = ggml_type_id(opts["ctk"]), ggml_type_id(opts["ctv"])
        self.api_keys = opts["api_keys"]
        self.metrics_enabled = bool(opts.get("metrics"))
        kind = os.environ.get("FAKE_MODEL_KIND", "sliding-window")
        self.model_n_swa = int(env_float("FAKE_N_SWA", 512)) if kind == "sliding-window" else 0
        if kind == "sliding-window" and opts["swa_full"]:
            kind = "dense"  # a full-size SWA cache keeps every position; n_swa = 0 for the server
        self.kind = kind
        self.n_swa = self.model_n_swa if kind == "sliding-window" else 0
        # the SWA cache: n_swa + n_ubatch cells per sequence, padded to 256 (llama-kv-cache-iswa.cpp)
        pad = 256
        self.swa_cells = min(self.n_ctx_slot, (self.n_swa + self.n_ubatch + pad - 1) // pad * pad)
        self.prefill_tps = env_float("FAKE_PREFILL_TPS", 280)
        self.gen_tps = env_float("FAKE_GEN_TPS", 40)
        self.state_version = int(env_float("FAKE_STATE_VERSION", 4))
        self.sidecar = env_flag("FAKE_SIDECAR")
        self.sidecar_mode, self.sidecar_mode_raw = sidecar_mode()  # only with FAKE_SIDECAR=1
        self.loading = True
        self.cv = threading.Condition(threading.RLock())
        self.prefill_hold = env_flag("FAKE_PREFILL_HOLD")
        self.next_task = 0
        self.n_graphs_reused = 0
        self.cache: list[CacheEntry] | None = [] if self.cache_ram_mib != 0 else None
        self.cache_limit_size = MIB * max(0, self.cache_ram_mib)
        self.cache_limit_tokens = self.n_ctx
        self.next_addr = 0x55C84AFA1870
        if self.cache is None:
            self.cache_idle_slots = False
        self.fixtures = load_fixture_bodies()
        self.m = dict(prompt_tokens=0, prompt_cached=0, prompt_seconds=0.0, predicted=0,
                      predicted_seconds=0.0, n_decode=0, n_tokens_max=0, processing=0, deferred=0)

    # ------------------------------------------------------------ tasks

    def new_task(self) -> int:
        with self.cv:
            self.next_task += 1
            return self.next_task - 1

    def slot_by_id(self, id_slot: int) -> Slot | None:
        # "allow id_slot to be out of bounds (wrap around)": C++ %, so a negative id finds nothing
        idx = abs(id_slot) % len(self.slots)
        return self.slots[idx] if id_slot >= 0 else None

    def idle_tick(self) -> None:
        """update_slots after a task: the trace line when no slot is processing."""
        if not any(s.processing for s in self.slots):
            srv_log("I", "update_slots", "all slots are idle", TRACE)

    def send_error(self, task: int, message: str) -> None:
        srv_log("E", "send_error", f"task id = {task}, error: {message}")

    def cancel_after_error(self, task: int) -> None:
        """server_response_reader::stop() after an error result: the task is cancelled."""
        self.idle_tick()
        srv_log("W", "stop", f"cancel task, id_task = {task}")
        self.new_task()
        self.idle_tick()

    # ------------------------------------------------------------ the slot's memory

    def seq_state_size(self, n_tokens: int) -> int:
        return SEQ_HEADER.size + 256 + n_tokens * int(env_float("FAKE_STATE_BYTES_PER_TOKEN", 64))

    def mem_clear(self, slot: Slot) -> None:
        slot.pos_min = slot.pos_max = -1

    def mem_decode(self, slot: Slot, p0: int, p1: int) -> None:
        """Positions [p0, p1) were decoded into the slot's sequence."""
        if p1 <= p0:
            return
        if slot.pos_min < 0:
            slot.pos_min = p0
        slot.pos_max = p1 - 1
        if self.kind == "sliding-window":  # the SWA ring reuses the oldest masked cells
            slot.pos_min = max(slot.pos_min, slot.pos_max - self.swa_cells + 1)
        elif self.kind == "recurrent-hybrid":  # the recurrent state holds only the last position
            slot.pos_min = slot.pos_max

    def mem_seq_rm(self, slot: Slot, p0: int) -> None:
        """memory_seq_rm [p0, end)."""
        if slot.pos_min < 0:
            return
        if p0 <= slot.pos_min:
            self.mem_clear(slot)
        else:
            slot.pos_max = min(slot.pos_max, p0 - 1)

    def mem_load_full(self, slot: Slot, n_tokens: int) -> None:
        """A whole sequence state was loaded (state file, prompt cache): the SWA part
        of a state holds only the cells of the window (pos_max - n_swa, pos_max]."""
        if n_tokens <= 0:
            self.mem_clear(slot)
            return
        slot.pos_max = n_tokens - 1
        if self.kind == "sliding-window":
            slot.pos_min = max(0, slot.pos_max - self.n_swa + 1)
        elif self.kind == "recurrent-hybrid":
            slot.pos_min = slot.pos_max
        else:
            slot.pos_min = 0

    def mem_load_checkpoint(self, slot: Slot, cp: Ckpt) -> None:
        """load_tgt(..., LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY): the SWA/recurrent part of the
        memory becomes the checkpoint's, which holds only its window [TAG_CHECKPOINTS_FIX_POS_MIN]."""
        slot.pos_max = cp.pos_max
        if self.kind == "sliding-window":
            slot.pos_min = max(cp.pos_min, cp.pos_max - self.n_swa + 1)
        else:
            slot.pos_min = cp.pos_min

    def checkpoint_cells(self, pos_min: int, pos_max: int) -> int:
        if self.kind == "recurrent-hybrid":
            return 64  # a recurrent state does not grow with the context
        return pos_max - max(pos_min, pos_max - self.n_swa + 1) + 1

    # ------------------------------------------------------------ prompt cache (server_prompt_cache)

    def cache_update(self) -> None:
        c = self.cache
        if self.cache_limit_size > 0:
            while c and sum(e.size for e in c) > self.cache_limit_size:
                srv_log("W", "update", f" - cache size limit reached, removing oldest entry (size = {mib(c[0].size)} MiB)")
                c.pop(0)
        size = sum(e.size for e in c)
        n_tok = sum(len(e.tokens) for e in c)
        size_per_token = max(1.0, size / max(1, n_tok))
        limit_cur = (max(self.cache_limit_tokens, int(self.cache_limit_size / size_per_token))
                     if self.cache_limit_size > 0 else self.cache_limit_tokens)
        if self.cache_limit_tokens > 0:
            while c and sum(len(e.tokens) for e in c) > limit_cur:
                srv_log("W", "update", f" - cache token limit ({self.cache_limit_tokens}, est: {limit_cur}) reached, "
                        f"removing oldest entry (size = {mib(c[0].size)} MiB)")
                c.pop(0)
            size = sum(e.size for e in c)
        srv_log("I", "update", f" - cache state: {len(c)} prompts, {mib(size)} MiB (limits: "
                f"{self.cache_limit_size / MIB:.3f} MiB, {self.cache_limit_tokens} tokens, {limit_cur} est)", TRACE)
        for e in c:
            srv_log("I", "update", f"   - prompt {e.addr:#x}: {len(e.tokens):7d} tokens, checkpoints: "
                    f"{len(e.checkpoints):2d}, {e.size / MIB:9.3f} MiB", TRACE)

    def prompt_save(self, slot: Slot) -> bool:
        if not slot.tokens:
            return False
        state_size = self.seq_state_size(len(slot.tokens))
        srv_log("I", "prompt_save", f" - saving prompt with length {len(slot.tokens)}, total state size = "
                f"{mib(state_size)} MiB (draft: 0.000 MiB)", TRACE)
        for e in self.cache:
            if common_prefix(e.tokens, slot.tokens) == len(slot.tokens):
                srv_log("I", "alloc", " - prompt is already in the cache, skipping", TRACE)
                return False
        new = CacheEntry(list(slot.tokens), list(slot.checkpoints), state_size, self.next_addr)
        if self.cache_limit_size > 0 and new.size > self.cache_limit_size:
            srv_log("W", "alloc", f" - prompt state size {mib(new.size)} MiB exceeds cache size limit "
                    f"{self.cache_limit_size / MIB:.3f} MiB, skipping")
            return False
        for e in list(self.cache):
            n = common_prefix(e.tokens, slot.tokens)
            if n == len(e.tokens):
                srv_log("I", "alloc", f" - removing obsolete cached prompt with length {n}", TRACE)
                self.cache.remove(e)
        if self.cache_limit_size > 0:
            while self.cache and sum(e.size for e in self.cache) + new.size > self.cache_limit_size:
                srv_log("W", "alloc", f" - making room for prompt cache entry, removing oldest entry "
                        f"(size = {mib(self.cache[0].size)} MiB)")
                self.cache.pop(0)
        self.next_addr += 0x1000
        self.cache.append(new)
        return True

    def prompt_load(self, slot: Slot, tokens_new: list[int]) -> None:
        lcp_best = common_prefix(slot.tokens, tokens_new)
        f_keep_best = lcp_best / len(slot.tokens) if slot.tokens else -1.0
        f_sim_best = lcp_best / len(tokens_new)
        srv_log("I", "load", f" - looking for better prompt, base f_keep = {f_keep_best:.3f}, f_sim = {f_sim_best:.3f}",
                TRACE)
        best = None
        for e in self.cache:
            lcp = common_prefix(e.tokens, tokens_new)
            f_keep, f_sim = lcp / len(e.tokens), lcp / len(tokens_new)
            srv_log("I", "load", f"   - prompt with length {len(e.tokens):7d}, lcp = {lcp:7d}, f_keep = {f_keep:.3f}, "
                    f"f_sim = {f_sim:.3f}", TRACE)
            if f_keep < 0.25:
                continue
            if f_keep_best < f_keep and f_sim_best < f_sim:
                f_keep_best, f_sim_best, best = f_keep, f_sim, e
        if best is not None:
            srv_log("I", "load", f" - found better prompt with f_keep = {f_keep_best:.3f}, f_sim = {f_sim_best:.3f}",
                    TRACE)
            slot.tokens = list(best.tokens)
            slot.checkpoints = list(best.checkpoints)
            self.mem_load_full(slot, len(slot.tokens))
            self.cache.remove(best)

    # ------------------------------------------------------------ completion

    def get_available_slot(self, prompt: list[int], id_slot: int) -> Slot:
        """get_available_slot (server-context.cpp ~1680). The caller waited until the
        requested slot (or, without one, any slot) is idle: a deferred task."""
        ret = None
        update_cache = False
        if id_slot != -1:
            ret = self.slot_by_id(id_slot)  # a negative id finds no slot: LRU below
            if ret is not None:
                slot_log("I", "get_availabl", ret.id, ret.task_id(), f"selected slot by id ({id_slot})")
        if self.slot_prompt_similarity != 0.0:
            f_sim_best = 0.0
            for s in self.slots:
                if id_slot != -1 and s.id != id_slot:
                    continue
                if s.processing:
                    slot_log("I", "get_availabl", s.id, s.task_id(), " - skipping, is_processing = 1", TRACE)
                    continue
                if not s.tokens:
                    slot_log("I", "get_availabl", s.id, s.task_id(), " - skipping, slot is empty", TRACE)
                    continue
                lcp = common_prefix(s.tokens, prompt)
                f_sim = lcp / len(prompt)
                slot_log("I", "get_availabl", s.id, s.task_id(), f" - checking sim = {f_sim:.3f} ({lcp}/{len(prompt)})"
                         f" > {self.slot_prompt_similarity:.3f}", TRACE)
                if f_sim > f_sim_best and f_sim > self.slot_prompt_similarity:
                    f_sim_best, ret = f_sim, s
            if ret is not None:
                f_keep = (f_sim_best * len(prompt)) / len(ret.tokens) if ret.tokens else float("nan")
                if id_slot == -1:
                    slot_log("I", "get_availabl", ret.id, ret.task_id(),
                             f"selected slot by LCP similarity, f_sim_best = {f_sim_best:.3f} "
                             f"(> {self.slot_prompt_similarity:.3f} thold), f_keep = {f_keep:.3f}")
                if f_keep < 0.5:
                    update_cache = True
        if ret is None:
            t_last = -1
            for s in self.slots:
                if s.processing:
                    continue
                if ret is None or s.t_last_used <= t_last:
                    t_last, ret = s.t_last_used, s
            slot_log("I", "get_availabl", ret.id, ret.task_id(), f"selected slot by LRU, t_last = {t_last}")
            update_cache = True
        if update_cache and self.cache is not None:
            srv_log("I", "get_availabl", "updating prompt cache", TRACE)
            t0 = time.perf_counter()
            self.prompt_save(ret)
            self.prompt_load(ret, prompt)
            self.cache_update()
            srv_log("I", "get_availabl", f"prompt cache update took {(time.perf_counter() - t0) * 1000:.2f} ms", TRACE)
        return ret

    def completion(self, body: dict, on_token=None) -> dict:
        """``POST /completion``: the final result. Streamed (``"stream": true``), ``on_token(i, token)``
        is called for each generated token as it is "sampled", with the slot still processing; an
        ``OSError`` from it (the client went away) cancels the task like llama-server does."""
        stream = bool(body.get("stream"))
        if stream and on_token is None:
            raise HttpError(501, "fake llama-server: streaming is not supported", "not_supported_error")
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            tokens = tokenize(prompt, add_bos=True)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            tokens = list(prompt)
        else:
            raise HttpError(400, "\"prompt\" must be a string or a list of tokens")
        if not tokens:
            raise HttpError(400, "empty prompt")
        n_predict = int(body.get("n_predict", body.get("max_tokens", -1)))
        id_slot = int(body.get("id_slot", -1))
        cache_prompt = bool(body.get("cache_prompt", True))
        temp = float(body.get("temperature", 0.8))
        srv_log("I", "server_stream_create_spipe", "conv_id= (empty=1)", TRACE)
        with self.cv:
            task = self.new_task()
            target = self.slot_by_id(id_slot) if id_slot != -1 else None

            def blocked() -> bool:
                return target.processing if target is not None else all(s.processing for s in self.slots)

            if blocked():  # "requested slot is unavailable, defer task"
                self.m["deferred"] += 1
                while blocked():
                    self.cv.wait()
                self.m["deferred"] -= 1
            slot = self.get_available_slot(tokens, id_slot)
            self._launch(slot, task, tokens, n_predict, temp)
            try:
                cache_n, prompt_n, n_batches = self._process_prompt(slot, tokens, cache_prompt)
            except HttpError:
                self._release(slot)
                self.cancel_after_error(task)
                self.cv.notify_all()
                raise
        if stream:
            generated = sampled(tokens, n_predict)
            sent = 0
            try:
                for i, tok in enumerate(generated):
                    on_token(i, tok)
                    sent = slot.n_gen = i + 1
                    if i == 0:  # the slot stays busy after the first token while the delay lasts
                        hold_completion()
                if not generated:
                    hold_completion()
            except OSError:  # the connection closed: llama-server cancels the task
                with self.cv:
                    srv_log("W", "stop", f"cancel task, id_task = {task}")
                    p0 = len(slot.tokens)
                    slot.tokens.extend(generated[:sent])
                    self.mem_decode(slot, p0, len(slot.tokens))
                    self._release(slot)
                    self.cv.notify_all()
                raise
            with self.cv:
                result = self._finish(slot, tokens, n_predict, cache_n, prompt_n, n_batches, stream=True)
                self.cv.notify_all()
            return result
        try:
            hold_completion()
        finally:
            with self.cv:
                result = self._finish(slot, tokens, n_predict, cache_n, prompt_n, n_batches)
                self.cv.notify_all()
        n_probs = int(body.get("n_probs", 0) or 0)
        if n_probs > 0:
            result["completion_probabilities"] = token_probabilities(sampled(tokens, n_predict), n_probs)
        return result

    def _launch(self, slot: Slot, task: int, tokens: list[int], n_predict: int, temp: float) -> None:
        """launch_slot_with_task, then the idle-slot saves of process_single_task."""
        slot_log("I", "launch_slot_with_task", slot.id, slot.task_id(), f"sampler chain: {SAMPLER_CHAIN}", TRACE)
        slot_log("I", "launch_slot_with_task", slot.id, slot.task_id(), (
            "sampler params: \n"
            "\trepeat_last_n = 64, repeat_penalty = 1.000, frequency_penalty = 0.000, presence_penalty = 0.000\n"
            "\tdry_multiplier = 0.000, dry_base = 1.750, dry_allowed_length = 2, dry_penalty_last_n = 64\n"
            "\ttop_k = 40, top_p = 0.950, min_p = 0.050, xtc_probability = 0.000, xtc_threshold = 0.100, "
            f"typical_p = 1.000, top_n_sigma = -1.000, temp = {temp:.3f}\n"
            "\tmirostat = 0, mirostat_lr = 0.100, mirostat_ent = 5.000, adaptive_target = -1.000, "
            "adaptive_decay = 0.900"), TRACE)
        slot.n_predict_max = n_predict
        slot.task = {"id": task, "n_tokens": len(tokens), "n_predict": n_predict}
        slot.processing = True
        slot.has_next_token = True
        slot.n_prompt_processed = slot.n_prompt_cached = slot.n_gen = 0
        self.m["processing"] += 1
        slot_log("I", "launch_slot_with_task", slot.id, task, "processing task, is_child = 0")
        if self.cache_idle_slots:
            for s in self.slots:
                if s.processing:
                    continue
                slot_log("I", "process_single_task", s.id, s.task_id(), "saving idle slot to prompt cache", TRACE)
                if s.tokens and env_flag("FAKE_ABORT_ON_IDLE_SAVE"):
                    abort_tensor_not_allocated()
                if self.prompt_save(s):
                    time.sleep(env_float("FAKE_IDLE_SAVE_SECONDS", 0))  # the copy, under the server's lock
                    self.cache_update()
                if self.kv_unified:  # [TAG_IDLE_SLOT_CLEAR]
                    self._clear(s)

    def _n_past(self, slot: Slot, prompt: list[int], cache_prompt: bool) -> int:
        """How many prompt tokens the slot reuses: update_slots, SLOT_STATE_STARTED
        (server-context.cpp ~3440-3640, build 11434)."""
        tid = slot.task_id()
        n_past = common_prefix(slot.tokens, prompt) if cache_prompt else 0
        pos_next = n_past  # no media chunks: positions are token indices
        has_new_tokens = n_past < len(prompt)
        # the largest pos_min required for a checkpoint to be useful
        pos_min_thold = max(0, pos_next - self.n_swa - (0 if has_new_tokens else 1))
        if 0 < n_past <= len(slot.tokens):
            pos_min = slot.pos_min
            if pos_min == -1:
                slot_log("E", "update_slots", slot.id, tid, f"n_past = {n_past}, slot.prompt.tokens.size() = "
                         f"{len(slot.tokens)}, seq_id = {slot.id}, pos_min = {pos_min}")
                pos_min = pos_min_thold  # the real server aborts here; the fake re-processes
                slot.checkpoints = []
            if pos_min >= pos_min_thold:
                found = None
                for cur in reversed(slot.checkpoints):  # newest first
                    slot_log("I", "operator()", slot.id, tid, f"checking checkpoint with [{cur.pos_min}, "
                             f"{cur.pos_max}] against {pos_min_thold}...", TRACE)
                    if cur.pos_max > pos_next:  # [TAG_CHECKPOINTS_FIX_POS_MIN] workaround
                        continue
                    if cur.pos_min < pos_min_thold or cur.pos_min == 0:
                        found = cur
                        break
                if found is not None:
                    self.mem_load_checkpoint(slot, found)
                    pos_next = min(pos_next, max(found.pos_min + 1, found.pos_max))
                    n_past = min(min(pos_next, len(slot.tokens)), found.n_tokens)
                    slot_log("I", "operator()", slot.id, tid, f"restored context checkpoint (pos_min = {found.pos_min}, "
                             f"pos_max = {found.pos_max}, n_tokens = {found.n_tokens}, n_past = {n_past}, "
                             f"size = {mib(found.size)} MiB)", TRACE)
                else:
                    slot_log("I", "operator()", slot.id, tid, FULL_REPROCESS, TRACE)
                    pos_next = 0
                    n_past = 0
        kept = []
        for cur in slot.checkpoints:  # erase any checkpoints with pos_max > pos_next
            if cur.pos_max > pos_next:
                slot_log("I", "operator()", slot.id, tid, f"erased invalidated context checkpoint (pos_min = "
                         f"{cur.pos_min}, pos_max = {cur.pos_max}, n_tokens = {cur.n_tokens}, n_swa = {self.n_swa}, "
                         f"pos_next = {pos_next}, size = {mib(cur.size)} MiB)", TRACE)
            else:
                kept.append(cur)
        slot.checkpoints = kept
        if n_past == len(prompt) and n_past > 0:  # [TAG_PROMPT_LOGITS]
            slot_log("W", "update_slots", slot.id, tid, f"need to evaluate at least 1 token for each active slot "
                     f"(n_past = {n_past}, task.n_tokens() = {len(prompt)})")
            n_past -= 1
            slot_log("W", "update_slots", slot.id, tid, f"n_past was set to {n_past}")
        return n_past

    def _create_checkpoint(self, slot: Slot, n_tokens_cur: int) -> None:
        """create_checkpoint (server-context.cpp ~2513): the memory before this batch."""
        tid = slot.task_id()
        cps, max_n = slot.checkpoints, self.max_checkpoints
        last, i = -1, 0
        while len(cps) + 1 >= max_n and i < len(cps):
            cur = cps[i]
            if cur.id_task != tid and last >= 0 and cur.n_tokens <= last + self.checkpoint_min_step:
                slot_log("I", "create_checkpoint", slot.id, tid, f"erasing context checkpoint too close to an earlier "
                         f"one (pos_min = {cur.pos_min}, pos_max = {cur.pos_max}, n_tokens = {cur.n_tokens}, "
                         f"size = {mib(cur.size)} MiB)", TRACE)
                del cps[i]
                continue
            last = cur.n_tokens
            i += 1
        while cps and len(cps) >= max_n:
            cur = cps.pop(0)
            slot_log("W", "create_checkpoint", slot.id, tid, f"erasing old context checkpoint (pos_min = {cur.pos_min}, "
                     f"pos_max = {cur.pos_max}, n_tokens = {cur.n_tokens}, size = {mib(cur.size)} MiB)")
        n_tokens_new = len(slot.tokens) - n_tokens_cur
        for cur in list(cps):
            if cur.n_tokens == n_tokens_new:
                slot_log("I", "create_checkpoint", slot.id, tid,
                         f"superseding context checkpoint at n_tokens = {cur.n_tokens}", TRACE)
                cps.remove(cur)
        size = self.checkpoint_cells(slot.pos_min, slot.pos_max) * int(env_float("FAKE_CKPT_BYTES_PER_TOKEN", 16))
        cp = Ckpt(n_tokens_new, slot.pos_min, slot.pos_max, size, 0, tid)
        cps.append(cp)
        slot_log("I", "create_checkpoint", slot.id, tid, f"created context checkpoint {len(cps)} of {max_n} "
                 f"(pos_min = {cp.pos_min}, pos_max = {cp.pos_max}, n_tokens = {cp.n_tokens}, size = {mib(cp.size)} MiB)",
                 TRACE)

    def _process_prompt(self, slot: Slot, prompt: list[int], cache_prompt: bool) -> tuple[int, int, int]:
        """update_slots for one slot, from SLOT_STATE_STARTED to the end of the prompt.
        Returns (cache_n, prompt_n, number of batches)."""
        tid = slot.task_id()
        n_task = len(prompt)
        slot_log("I", "operator()", slot.id, tid, f"new prompt, n_ctx_slot = {slot.n_ctx}, n_keep = 0, "
                 f"task.n_tokens = {n_task}", TRACE)
        if n_task >= slot.n_ctx:
            msg = (f"request ({n_task} tokens) exceeds the available context size ({slot.n_ctx} tokens), "
                   "try increasing it")
            self.send_error(tid, msg)
            raise HttpError(400, msg, "exceed_context_size_error", n_prompt_tokens=n_task, n_ctx=slot.n_ctx)
        n_past = self._n_past(slot, prompt, cache_prompt)
        slot.n_prompt_cached = n_past
        slot.n_prompt_processed = 0
        self.m["prompt_cached"] += n_past
        del slot.tokens[n_past:]  # keep_first(n_past)
        do_checkpoint_task = self.max_checkpoints > 0 and (self.kind == "recurrent-hybrid" or self.n_swa > 0)
        n_batches = 0
        while len(slot.tokens) < n_task:
            t_prompt_ms = slot.n_prompt_processed / self.prefill_tps * 1000
            if t_prompt_ms >= 3000.0:  # print_timings_pp
                slot_log("I", "print_timing", slot.id, tid, f"prompt processing, n_tokens = "
                         f"{slot.n_prompt_processed:6d}, progress = {len(slot.tokens) / n_task:.2f}, t = "
                         f"{t_prompt_ms / 1e3:6.2f} s / {self.prefill_tps:.2f} tokens per second")
            p0 = len(slot.tokens)
            slot_log("I", "operator()", slot.id, tid, f"cached n_tokens = {p0}, memory_seq_rm [{p0}, end)", TRACE)
            self.mem_seq_rm(slot, p0)
            do_checkpoint = do_checkpoint_task
            n_cur = 0
            while len(slot.tokens) < n_task and n_cur < self.n_batch:
                slot.tokens.append(prompt[len(slot.tokens)])
                n_cur += 1
                # process the last few tokens of the prompt separately, to allow for a checkpoint
                if do_checkpoint and any(n_task == len(slot.tokens) + min(self.n_batch, off)
                                         for off in (4 + self.n_ubatch, 4)):
                    break
            n_start = len(slot.tokens) - n_cur
            near_prompt_end = n_task < len(slot.tokens) + self.n_ubatch
            if len(slot.tokens) == n_task:
                slot_log("I", "init_sampler", slot.id, tid, f"init sampler, took 0.01 ms, tokens: text = {n_task}, "
                         f"total = {n_task}", TRACE)
            elif not near_prompt_end:
                do_checkpoint = False  # no user-message spans on /completion
            if do_checkpoint and slot.pos_min < 0:
                do_checkpoint = False
            do_checkpoint = do_checkpoint and (not slot.checkpoints or near_prompt_end or
                                               n_start > slot.checkpoints[-1].n_tokens + self.checkpoint_min_step)
            if do_checkpoint:
                self._create_checkpoint(slot, n_cur)
            self.mem_decode(slot, n_start, len(slot.tokens))
            slot.n_prompt_processed += n_cur
            n_batches += 1
            if self.prefill_hold and n_batches == 1 and n_cur == self.n_batch and len(slot.tokens) < n_task:
                self._hold_prefill()
            self.n_graphs_reused += max(0, -(-n_cur // self.n_ubatch) - 1)
        return n_past, slot.n_prompt_processed, n_batches

    def _hold_prefill(self) -> None:
        """FAKE_PREFILL_HOLD: wait between batches (the lock released, so /slots answers) until SIGUSR2."""
        if not END_COMPLETION_DELAY.is_set():
            start_thread(self._wake_on_sigusr2)
            self.cv.wait_for(END_COMPLETION_DELAY.is_set)

    def _wake_on_sigusr2(self) -> None:
        END_COMPLETION_DELAY.wait()
        with self.cv:
            self.cv.notify_all()

    def _finish(self, slot: Slot, prompt: list[int], n_predict: int, cache_n: int, prompt_n: int,
                n_batches: int, stream: bool = False) -> dict:
        tid = slot.task_id()
        generated = sampled(prompt, n_predict)
        # every sampled token but the last is decoded into the slot's memory
        p0 = len(slot.tokens)
        slot.tokens.extend(generated[:-1])
        self.mem_decode(slot, p0, len(slot.tokens))
        slot.n_gen = len(generated)
        slot.has_next_token = False
        content = detokenize(generated)
        self.n_graphs_reused += max(0, len(generated) - 2)

        prompt_ms = prompt_n / self.prefill_tps * 1000
        predicted_ms = len(generated) / self.gen_tps * 1000
        timings = {
            "cache_n": cache_n,
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n,
            "prompt_per_second": 1000.0 * prompt_n / prompt_ms if prompt_ms else 0.0,
            "predicted_n": len(generated),
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / len(generated) if generated else 0.0,
            "predicted_per_second": 1000.0 * len(generated) / predicted_ms if predicted_ms else 0.0,
        }
        slot_log("I", "print_timing", slot.id, tid,
                 f"prompt eval time = {prompt_ms:10.2f} ms / {prompt_n:5d} tokens "
                 f"({timings['prompt_per_token_ms']:8.2f} ms per token, {timings['prompt_per_second']:8.2f} tokens per second)")
        slot_log("I", "print_timing", slot.id, tid,
                 f"       eval time = {predicted_ms:10.2f} ms / {len(generated):5d} tokens "
                 f"({timings['predicted_per_token_ms']:8.2f} ms per token, {timings['predicted_per_second']:8.2f} tokens per second)")
        slot_log("I", "print_timing", slot.id, tid,
                 f"      total time = {prompt_ms + predicted_ms:10.2f} ms / {prompt_n + len(generated):5d} tokens")
        slot_log("I", "print_timing", slot.id, tid, f"   graphs reused = {self.n_graphs_reused:10d}")
        m = self.m
        m["prompt_tokens"] += prompt_n
        m["prompt_seconds"] += prompt_ms / 1000
        m["predicted"] += len(generated)
        m["predicted_seconds"] += predicted_ms / 1000
        m["n_decode"] += n_batches + max(0, len(generated) - 1)
        m["n_tokens_max"] = max(m["n_tokens_max"], len(slot.tokens))
        settings = dict(self.fixtures["generation_settings"], n_predict=n_predict, max_tokens=n_predict,
                        stream=stream)
        result = {
            "index": 0,
            "content": content,
            "tokens": [],
            "id_slot": slot.id,
            "stop": True,
            "model": self.alias,
            "tokens_predicted": len(generated),
            "tokens_evaluated": len(prompt),
            "generation_settings": settings,
            "prompt": detokenize(prompt),
            "has_new_line": "\n" in content,
            "truncated": False,
            "stop_type": "limit",
            "stopping_word": "",
            "tokens_cached": len(slot.tokens),
            "timings": timings,
        }
        self._release(slot)
        return result

    def _release(self, slot: Slot) -> None:
        """server_slot::release + reset: the task becomes task_prev, the stats are cleared."""
        if not slot.processing:
            return
        slot_log("I", "release", slot.id, slot.task_id(), f"stop processing: n_tokens = {len(slot.tokens)}, truncated = 0")
        slot.t_last_used = ts_us()
        slot.processing = False
        slot.task_prev, slot.task = slot.task, None
        slot.n_prompt_processed = slot.n_prompt_cached = slot.n_gen = 0
        slot.n_predict_max = -1
        self.m["processing"] -= 1
        self.idle_tick()

    # ------------------------------------------------------------ slot actions

    def slot_action(self, id_str: str, action: str, body: dict) -> dict:
        if not self.save_path:
            raise HttpError(501, "This server does not support slots action. Start it with `--slot-save-path`",
                            "not_supported_error")
        try:
            id_slot = int(id_str)
        except ValueError:
            raise HttpError(400, "Invalid slot ID") from None
        if action not in ("save", "restore", "erase"):
            raise HttpError(400, "Invalid action")
        filename = ""
        if action != "erase":
            if "filename" not in body:
                raise HttpError(500, "[json.exception.out_of_range.403] key 'filename' not found", "server_error")
            filename = body["filename"]
            if not isinstance(filename, str) or not valid_filename(filename):
                raise HttpError(400, "Invalid filename")
        with self.cv:
            task = self.new_task()
            slot = self.slot_by_id(id_slot)
            try:
                if slot is None:
                    raise HttpError(400, "Invalid slot ID")
                while slot.processing:  # deferred until the slot is idle
                    self.cv.wait()
                if action == "save":
                    result = self._save(slot, id_slot, filename)
                elif action == "restore":
                    result = self._restore(slot, id_slot, filename)
                else:
                    n = len(slot.tokens)
                    self._clear(slot, keep_checkpoints=self.fork)  # the fork keeps the checkpoint list
                    result = {"id_slot": id_slot, "n_erased": n}
            except HttpError as exc:
                self.send_error(task, exc.message)
                self.cancel_after_error(task)
                raise
            self.idle_tick()
            return result

    @property
    def fork(self) -> bool:
        """The sidecar build as the turboquant fork: restore and erase keep the checkpoints."""
        return self.sidecar and self.sidecar_mode == "fork"

    def _clear(self, slot: Slot, keep_checkpoints: bool = False) -> None:
        """server_slot::prompt_clear."""
        slot_log("I", "prompt_clear", slot.id, slot.task_id(), f"clearing prompt with {len(slot.tokens)} tokens", TRACE)
        self.mem_clear(slot)
        slot.tokens = []
        if not keep_checkpoints:
            slot.checkpoints = []

    def _save(self, slot: Slot, id_slot: int, filename: str) -> dict:
        t0 = time.perf_counter()
        time.sleep(env_float("FAKE_SAVE_DELAY", 0))
        if env_flag("FAKE_ABORT_ON_SAVE"):
            abort_tensor_not_allocated()
        path = self.save_path + filename  # plain concatenation, like llama-server
        data = encode_state_file(pack_token_words(slot.tokens),
                                 seq_state_bytes(len(slot.tokens), self.k_type, self.v_type, len(slot.tokens)),
                                 self.state_version)
        written = 0
        if env_flag("FAKE_SAVE_ERROR"):
            log("E", "llama_state_seq_save_file: error saving sequence state file: write error: "
                     "No space left on device")
        else:
            try:
                with open(path, "wb") as f:
                    if env_flag("FAKE_DIE_DURING_SAVE"):
                        f.write(data[: len(data) // 2])
                        f.flush()
                        os.fsync(f.fileno())
                        os.kill(os.getpid(), signal.SIGKILL)
                    f.write(data)
                written = len(data)
            except OSError as exc:
                log("E", f"llama_state_seq_save_file: error saving sequence state file: failed to open {path}: "
                         f"{exc.strerror}")
        if written == 0 and not self.fork:
            raise HttpError(500, "Unable to save slot", "server_error")
        # the fork does not check the state save: success with n_written 0, and the sidecar is written
        t_state_ms = (time.perf_counter() - t0) * 1000
        if self.sidecar:
            self._save_sidecar(slot, path)
        # the fork takes save_ms before the sidecar write
        save_ms = t_state_ms if self.fork else (time.perf_counter() - t0) * 1000
        return {"id_slot": id_slot, "filename": filename, "n_saved": len(slot.tokens), "n_written": written,
                "timings": {"save_ms": save_ms}}

    def _save_sidecar(self, slot: Slot, path: str) -> None:
        """The checkpoint sidecar ``<state>.ckpt`` after the state file (kvv-sidecar.patch, SLOT_SAVE):
        v2 on every save while --ctx-checkpoints > 0 (also with none), atomically; fork and port
        PKCL v1 only when the slot holds checkpoints (fork: all, port: the newest 1024), not atomically."""
        ckpt_path = path + ".ckpt"
        attempted, n = False, 0
        try:
            if self.sidecar_mode == "v2":
                if self.max_checkpoints > 0:
                    attempted = True
                    n = write_pkcl2(ckpt_path, fnv1a64_path(path), slot.checkpoints)
            elif slot.checkpoints:
                attempted = True
                n = write_pkcl(ckpt_path, slot.checkpoints, 0 if self.fork else PKCL_MAX)
            ok = True
        except OSError:
            ok = False
        if attempted and ok:
            slot_log("I", "process_single_task", slot.id, slot.task_id(), f"saved {n} context checkpoints to sidecar")
        elif attempted:
            slot_log("W", "process_single_task", slot.id, slot.task_id(),
                     f"failed to write checkpoint sidecar {ckpt_path}")

    def _restore(self, slot: Slot, id_slot: int, filename: str) -> dict:
        t0 = time.perf_counter()
        path = self.save_path + filename
        try:
            try:
                state = load_state_file(path, self.state_version, slot.n_ctx, self.k_type, self.v_type)
            except LoadError as exc:
                for line in exc.lines:
                    log("E", line)
                raise TokensStateError(RESTORE_FAILED) from None
            # the sequence state is in the memory now (whatever comes next)
            tokens = unpack_token_words(state.words)
            if len(tokens) > slot.n_ctx:
                raise TokensStateError("Restored prompt does not fit in the slot context")
            if any(t < 0 or t >= N_VOCAB for t in tokens):
                raise TokensStateError("Invalid tokens in slot save file")
        except TokensStateError as exc:
            self._clear(slot, keep_checkpoints=self.fork)
            raise HttpError(400, f"Unable to restore slot: {exc}") from None
        slot.tokens = tokens  # slot->prompt.clear(): the in-memory checkpoints are gone too (not on the fork)
        if not self.fork:
            slot.checkpoints = []
        self.mem_load_full(slot, state.n_cells)
        if self.sidecar:
            self._restore_sidecar(slot, path)
        return {"id_slot": id_slot, "filename": filename, "n_restored": len(tokens), "n_read": state.n_read,
                "timings": {"restore_ms": (time.perf_counter() - t0) * 1000}}

    def _restore_sidecar(self, slot: Slot, path: str) -> None:
        """Read ``<state>.ckpt`` back after the tokens (kvv-sidecar.patch, SLOT_RESTORE): the fork's lax
        loader (silent), or the strict one of v2 / port ("ignoring checkpoint sidecar: REASON (PATH)");
        fork and v2 fall back to a tip checkpoint over the restored positions."""
        mode, ckpt_path = self.sidecar_mode, path + ".ckpt"
        n_restored = len(slot.tokens)
        want_tip = False
        if self.max_checkpoints > 0 and (mode != "fork" or n_restored > 0):
            exists = os.path.exists(ckpt_path)
            cps, loaded = [], False
            if mode == "fork":
                if exists:
                    try:
                        cps = read_pkcl_file(ckpt_path, 1, False, n_restored, self.max_checkpoints)
                        loaded = True
                    except SidecarReadError:
                        pass
                want_tip = not loaded  # silent, as the fork
            elif exists:
                try:
                    want_hash = 0
                    if mode == "v2":
                        try:
                            want_hash = fnv1a64_path(path)
                        except OSError:
                            raise SidecarReadError("cannot hash the state file") from None
                    cps = read_pkcl_file(ckpt_path, 2 if mode == "v2" else 1, True, n_restored,
                                         self.max_checkpoints, want_hash)
                    loaded = True
                except SidecarReadError as exc:
                    slot_log("W", "process_single_task", slot.id, slot.task_id(),
                             f"ignoring checkpoint sidecar: {exc} ({ckpt_path})")
                want_tip = not loaded and mode == "v2"
            else:
                want_tip = mode == "v2"
            if loaded:
                slot.checkpoints = cps  # replaces the list (the fork's kept one too)
                slot_log("I", "process_single_task", slot.id, slot.task_id(),
                         f"restored {len(cps)} context checkpoints from sidecar")
        if want_tip and n_restored > 0 and slot.pos_min >= 0 and slot.pos_max >= slot.pos_min:
            # the tip fallback: one checkpoint over the restored positions, made as create_checkpoint
            # makes one (a restore has no task: id_task -1)
            # the oldest erased with create_checkpoint's warning; the fork's older create_checkpoint
            # appends a duplicate at the same n_tokens where 11434's replaces it
            cps = slot.checkpoints
            while cps and len(cps) >= self.max_checkpoints:
                cur = cps.pop(0)
                slot_log("W", "process_single_task", slot.id, slot.task_id(), "erasing old context checkpoint "
                         f"(pos_min = {cur.pos_min}, pos_max = {cur.pos_max}, n_tokens = {cur.n_tokens}, "
                         f"size = {mib(cur.size)} MiB)")
            if not self.fork:
                cps[:] = [cp for cp in cps if cp.n_tokens != n_restored]
            size = self.checkpoint_cells(slot.pos_min, slot.pos_max) * int(env_float("FAKE_CKPT_BYTES_PER_TOKEN", 16))
            cp = Ckpt(n_restored, slot.pos_min, slot.pos_max, size, 0, -1)
            cps.append(cp)
            slot_log("I", "process_single_task", slot.id, slot.task_id(),
                     f"created context checkpoint {len(cps)} of {self.max_checkpoints} (pos_min = {cp.pos_min}, "
                     f"pos_max = {cp.pos_max}, n_tokens = {cp.n_tokens}, size = {mib(cp.size)} MiB)", TRACE)

    # ------------------------------------------------------------ read-only endpoints

    def slots_json(self) -> list:
        """server_slot::to_json(only_metrics): the task fields only once the slot ran a task
        (the running one, else the previous one); token counts are the slot's current ones."""
        with self.cv:
            self.new_task()
            out = []
            for s in self.slots:
                entry = {"id": s.id, "n_ctx": s.n_ctx, "speculative": False, "is_processing": s.processing}
                ptask = s.task or s.task_prev
                if ptask is not None:
                    n_predict = ptask["n_predict"]
                    n_remain = -1 if s.n_predict_max == -1 else s.n_predict_max - s.n_gen
                    entry.update(
                        id_task=ptask["id"],
                        n_prompt_tokens=len(s.tokens),
                        n_prompt_tokens_processed=s.n_prompt_processed,
                        n_prompt_tokens_cache=s.n_prompt_cached,
                        params=dict(self.fixtures["slot_params"], n_predict=n_predict, max_tokens=n_predict),
                        next_token=[{"has_next_token": s.has_next_token, "has_new_line": False,
                                     "n_remain": n_remain, "n_decoded": s.n_gen}],
                    )
                out.append(entry)
            self.idle_tick()
            return out

    def props_json(self) -> dict:
        props = json.loads(json.dumps(self.fixtures["props"]))
        props["default_generation_settings"]["n_ctx"] = self.n_ctx_slot
        props.update(total_slots=len(self.slots), model_alias=self.alias, model_path=self.model_path,
                     build_info=os.environ.get("FAKE_BUILD_INFO", "b11434-fake"),
                     endpoint_slots=not self.opts.get("no_slots"), endpoint_metrics=self.metrics_enabled)
        return props

    def metrics_text(self) -> str:
        with self.cv:
            self.new_task()
            m = dict(self.m)
            self.idle_tick()
        rows = [
            ("prompt_tokens_total", "counter", "Number of prompt tokens processed, excluding cached tokens", m["prompt_tokens"]),
            ("prompt_tokens_cached_total", "counter", "Number of prompt tokens reused from the cache", m["prompt_cached"]),
            ("prompt_seconds_total", "counter", "Total time spent processing prompts", round(m["prompt_seconds"], 6)),
            ("tokens_predicted_total", "counter", "Number of generation tokens processed", m["predicted"]),
            ("tokens_predicted_seconds_total", "counter", "Total time spent generating tokens", round(m["predicted_seconds"], 6)),
            ("n_decode_total", "counter", "Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding", m["n_decode"]),
            ("n_tokens_max", "counter", "Largest observed sequence length (prompt + generation)", m["n_tokens_max"]),
            ("spec_decode_num_draft_tokens_total", "counter", "Speculative: Total draft tokens generated", 0),
            ("spec_decode_num_accepted_tokens_total", "counter", "Speculative: Total draft tokens accepted by the target model", 0),
            ("spec_decode_num_drafts_total", "counter", "Speculative: Total speculative decoding verification steps", 0),
            ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s",
             round(m["prompt_tokens"] / m["prompt_seconds"], 2) if m["prompt_seconds"] else 0),
            ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s",
             round(m["predicted"] / m["predicted_seconds"], 2) if m["predicted_seconds"] else 0),
            ("requests_processing", "gauge", "Number of requests processing.", m["processing"]),
            ("requests_deferred", "gauge", "Number of requests deferred.", m["deferred"]),
        ]
        lines = []
        for name, kind, help_text, value in rows:
            lines += [f"# HELP llamacpp:{name} {help_text}", f"# TYPE llamacpp:{name} {kind}", f"llamacpp:{name} {value}"]
        return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- OpenAI-compatible shapes
#
# As build 11434 answers them (captured from the real server with Gemma 3 270M): the chat
# template renders the messages (the props fixture's chatml template), the completion runs as
# /completion does, and the answer is wrapped in the OpenAI objects, "timings" appended.

def render_chat(messages: list) -> str:
    """The props fixture's chat template: ``<|im_start|>ROLE\nCONTENT<|im_end|>\n`` per message,
    then the generation prompt."""
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise HttpError(400, "messages must be an array of objects")
        content = m.get("content")
        if isinstance(content, list):  # typed parts: the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        out.append(f"<|im_start|>{m.get('role', 'user')}\n{content or ''}<|im_end|>\n")
    return "".join(out) + "<|im_start|>assistant\n"


def oai_completion_body(body: dict, chat: bool) -> dict:
    """The /completion body an OpenAI-compatible request runs as."""
    out = {k: v for k, v in body.items() if k not in ("messages", "max_tokens", "max_completion_tokens")}
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise HttpError(400, "'messages' is required")
        out["prompt"] = render_chat(messages)
    n = body.get("max_completion_tokens", body.get("max_tokens", body.get("n_predict", -1)))
    out["n_predict"] = -1 if n is None else int(n)
    return out


def oai_id() -> str:
    return "chatcmpl-" + "".join(random.choice(string.ascii_letters + string.digits) for _ in range(32))


def oai_usage(result: dict) -> dict:
    t = result["timings"]
    return {"completion_tokens": t["predicted_n"], "prompt_tokens": result["tokens_evaluated"],
            "total_tokens": t["predicted_n"] + result["tokens_evaluated"],
            "prompt_tokens_details": {"cached_tokens": t["cache_n"]}}


def oai_finish_reason(result: dict) -> str:
    return "length" if result["stop_type"] == "limit" else "stop"


def oai_chat_response(result: dict) -> dict:
    return {"choices": [{"finish_reason": oai_finish_reason(result), "index": 0,
                         "message": {"role": "assistant", "content": result["content"]}}],
            "created": int(time.time()), "model": result["model"],
            "system_fingerprint": os.environ.get("FAKE_BUILD_INFO", "b11434-fake"), "object": "chat.completion",
            "usage": oai_usage(result), "id": oai_id(), "timings": result["timings"]}


def oai_text_response(result: dict) -> dict:
    return {"choices": [{"text": result["content"], "index": 0, "logprobs": None,
                         "finish_reason": oai_finish_reason(result)}],
            "created": int(time.time()), "model": result["model"],
            "system_fingerprint": os.environ.get("FAKE_BUILD_INFO", "b11434-fake"), "object": "text_completion",
            "usage": oai_usage(result), "id": oai_id(), "timings": result["timings"]}


class OaiStream:
    """The events of a streamed /v1/chat/completions or /v1/completions, in the real order: (chat)
    a role chunk with the first token, one chunk per token, the finish chunk with "timings" (with
    ``stream_options.include_usage``: the finish chunk, then an empty-choices chunk with "usage" and
    "timings"; /v1/completions always carries "usage"), then ``[DONE]``."""

    def __init__(self, chat: bool, body: dict, model: str):
        self.chat, self.model = chat, model
        self.include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.id, self.created = oai_id(), int(time.time())
        self.fp = os.environ.get("FAKE_BUILD_INFO", "b11434-fake")

    def _chat_chunk(self, choices: list, **extra) -> dict:
        return {"choices": choices, "created": self.created, "id": self.id, "model": self.model,
                "system_fingerprint": self.fp, "object": "chat.completion.chunk", **extra}

    def _text_chunk(self, text: str, finish_reason: str | None, **extra) -> dict:
        return {"choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}],
                "created": self.created, "model": self.model, "system_fingerprint": self.fp,
                "object": "text_completion", **extra, "id": self.id}

    def token(self, i: int, piece: str) -> list[dict]:
        if not self.chat:
            return [self._text_chunk(piece, None)]
        out = []
        if i == 0:
            out.append(self._chat_chunk([{"finish_reason": None, "index": 0,
                                          "delta": {"role": "assistant", "content": None}}]))
        out.append(self._chat_chunk([{"finish_reason": None, "index": 0, "delta": {"content": piece}}]))
        return out

    def final(self, result: dict) -> list[dict]:
        reason = oai_finish_reason(result)
        if not self.chat:
            text = self._text_chunk("", reason, usage=oai_usage(result))
            return [dict(text, timings=result["timings"])]
        if self.include_usage:
            return [self._chat_chunk([{"finish_reason": reason, "index": 0, "delta": {}}]),
                    self._chat_chunk([], usage=oai_usage(result), timings=result["timings"])]
        return [self._chat_chunk([{"finish_reason": reason, "index": 0, "delta": {}}], timings=result["timings"])]


def models_json() -> dict:
    """GET /v1/models (and /models): the Ollama-style list and the OpenAI one, as build 11434."""
    s = SERVER
    return {"models": [{"name": s.alias, "model": s.alias, "modified_at": "", "size": "", "digest": "",
                        "type": "model", "description": "", "tags": [""], "capabilities": ["completion"],
                        "parameters": "", "details": {"parent_model": "", "format": "gguf", "family": "",
                                                      "families": [""], "parameter_size": "",
                                                      "quantization_level": ""}}],
            "object": "list",
            "data": [{"id": s.alias, "aliases": [s.alias], "tags": [], "object": "model",
                      "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
                      "created": int(time.time()), "owned_by": "llamacpp",
                      "meta": {"vocab_type": 1, "n_vocab": N_VOCAB, "n_ctx": s.n_ctx_slot, "n_ctx_train": N_CTX_TRAIN,
                               "n_embd": 640, "n_params": 268098176, "size": 246587904,
                               "ftype": "Q4_K - Medium"}}]}


# ---------------------------------------------------------------- HTTP

SERVER: FakeServer


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "llama.cpp"
    # Headers and body go out in two writes: with Nagle's algorithm and the client's
    # delayed ACK every keep-alive answer would wait 40 ms (the real server answers in ~1 ms).
    disable_nagle_algorithm = True

    def log_message(self, fmt, *args):  # the real server logs requests only at debug level
        pass

    def _send(self, code: int, body, content_type: str = "application/json; charset=utf-8") -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body, separators=(",", ":")).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Access-Control-Allow-Origin", "*")
        self.end_headers()
        self.wfile.write(data)

    def _sse(self, events: list[dict], done: bool = False) -> None:
        """Server-sent events (``data: JSON``, a blank line), each its own HTTP chunk; the headers
        go out with the first event, so an error before it is still a plain JSON answer."""
        if not self._sse_started:
            self._sse_started = True
            self.send_response(200)
            self.send_header("Access-Control-Allow-Origin", "*")
            self.send_header("X-Accel-Buffering", "no")
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
        lines = [b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in events]
        if done:
            lines.append(b"data: [DONE]\n\n")
        for data in lines:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _stream_completion(self, body: dict, oai: OaiStream | None) -> None:
        # build 11434 closes the connection after an event stream, although its headers announced
        # keep-alive: a client that pools it meets a closed connection on its next request
        self.close_connection = True

        def on_token(i: int, tok: int) -> None:
            piece = detokenize([tok])
            if oai is not None:
                return self._sse(oai.token(i, piece))
            self._sse([{"index": 0, "content": piece, "tokens": [tok], "stop": False, "id_slot": -1,
                        "tokens_predicted": i + 1, "tokens_evaluated": n_eval}])

        n_eval = 0
        prompt = body.get("prompt", "")
        if isinstance(prompt, str):
            n_eval = len(tokenize(prompt, add_bos=True))
        elif isinstance(prompt, list):
            n_eval = len(prompt)
        result = SERVER.completion(body, on_token)
        if oai is not None:
            self._sse(oai.final(result), done=True)
        else:
            self._sse([dict(result, content="", tokens=[])])
        self.wfile.write(b"0\r\n\r\n")

    def _body(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if not raw.strip():
            return {}
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise HttpError(400, f"invalid JSON body: {exc}") from None
        if not isinstance(data, dict):
            raise HttpError(400, "JSON body must be an object")
        return data

    def _handle(self, method: str) -> None:
        url = urlsplit(self.path)
        path = url.path.rstrip("/") or "/"
        self._sse_started = False
        try:
            body = self._body() if method == "POST" else {}
            if SERVER.loading:
                raise HttpError(503, "Loading model", "unavailable_error")
            if SERVER.api_keys and path not in ("/health", "/v1/health") and not (method == "GET" and path == "/"):
                auth = self.headers.get("Authorization", "")
                if not (auth.startswith("Bearer ") and auth[7:] in SERVER.api_keys):
                    raise HttpError(401, "Invalid API Key", "authentication_error")
            self._route(method, path, parse_qs(url.query), body)
        except HttpError as exc:
            if self._sse_started:  # no error after the first event (the fake's errors come before it)
                self.close_connection = True
            else:
                self._send(exc.code, error_body(exc.code, exc.message, exc.etype, **exc.extra))
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as exc:  # like llama-server's ex_wrapper: an exception becomes a 500
            body = error_body(500, str(exc), "server_error")
            srv_log("W", "operator()", f"got exception: {json.dumps(body, separators=(',', ':'))}")
            if self._sse_started:
                self.close_connection = True
            else:
                self._send(500, body)

    def _route(self, method: str, path: str, query: dict, body: dict) -> None:
        if method == "GET" and path in ("/health", "/v1/health"):
            return self._send(200, {"status": "ok"})
        if method == "GET" and path == "/props":
            return self._send(200, SERVER.props_json())
        if method == "GET" and path == "/slots":
            if SERVER.opts.get("no_slots"):
                raise HttpError(501, "This server does not support slots endpoint. Start it with `--slots`",
                                "not_supported_error")
            return self._send(200, SERVER.slots_json())
        if method == "GET" and path == "/metrics":
            if not SERVER.metrics_enabled:
                raise HttpError(501, "This server does not support metrics endpoint. Start it with `--metrics`",
                                "not_supported_error")
            return self._send(200, SERVER.metrics_text(), "text/plain; version=0.0.4")
        if method == "POST" and path.startswith("/slots/"):
            action = (query.get("action") or [""])[0]
            return self._send(200, SERVER.slot_action(path[len("/slots/"):], action, body))
        if method == "POST" and path in ("/completion", "/completions"):
            if body.get("stream"):
                return self._stream_completion(body, None)
            return self._send(200, SERVER.completion(body))
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions", "/chat/completions"):
            chat = path != "/v1/completions"
            cbody = oai_completion_body(body, chat)
            if body.get("stream"):
                return self._stream_completion(cbody, OaiStream(chat, body, SERVER.alias))
            result = SERVER.completion(cbody)
            return self._send(200, oai_chat_response(result) if chat else oai_text_response(result))
        if method == "GET" and path in ("/models", "/v1/models"):
            return self._send(200, models_json())
        if method == "POST" and path == "/tokenize":
            content = body.get("content", "")
            tokens = tokenize(content, add_bos=bool(body.get("add_special", False)))
            if body.get("with_pieces"):
                return self._send(200, {"tokens": [{"id": t, "piece": detokenize([t])} for t in tokens]})
            return self._send(200, {"tokens": tokens})
        if method == "POST" and path == "/detokenize":
            return self._send(200, {"content": detokenize([int(t) for t in body.get("tokens", [])])})
        raise HttpError(404, "File Not Found", "not_found_error")

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")

    def do_OPTIONS(self):
        self._send(200, "")


def flood_log(rate: float, stop: threading.Event) -> None:
    """FAKE_LOG_FLOOD: real captured lines, cycled, ``rate`` a second (paced in 10 ms steps)."""
    lines = [line for p in sorted(FIXTURES.parent.glob("*/*.log"))
             for line in p.read_text(errors="replace").splitlines() if line.strip()]
    i = n = 0
    t0 = time.monotonic()
    while not stop.is_set():
        due = int((time.monotonic() - t0) * rate) - n
        if due > 0:
            chunk = [lines[(i + k) % len(lines)] for k in range(due)]
            i, n = (i + due) % len(lines), n + due
            with _log_lock:
                sys.stderr.write("\n".join(chunk) + "\n")
                sys.stderr.flush()
        stop.wait(0.01)  # pacing of the flood, not synchronisation


SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)


def start_thread(target, *args) -> None:
    """A daemon thread that never takes the signals: the kernel may hand a process's signal to any
    thread that does not block it, and Python runs the handler only when the main thread next runs
    bytecode; the main thread, blocked in a wait, would not notice it (a SIGUSR2 lost for good)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        threading.Thread(target=target, args=args, daemon=True).start()  # inherits the mask
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def main(argv: list[str]) -> int:
    global SERVER, VERBOSITY
    opts = parse_args(argv)
    VERBOSITY = 10 if opts.get("verbose") else int(opts["verbosity"])
    srv_log("I", "llama_server", "initializing ...")
    if int(opts["parallel"]) < 0:
        srv_log("I", "llama_server", "n_parallel is set to auto, using n_parallel = 4 and kv_unified = true", TRACE)
    try:
        httpd = ThreadingHTTPServer((opts["host"], int(opts["port"])), Handler)
    except OSError:
        srv_log("E", "init_listener",
                f"couldn't bind HTTP server socket, hostname: {opts['host']}, port: {opts['port']}")
        return 1
    httpd.daemon_threads = True
    SERVER = FakeServer(opts)
    load_vocab(SERVER.model_path)
    host, port = opts["host"], httpd.server_address[1]

    stop = threading.Event()
    second = threading.Event()

    def on_signal(signum, frame):
        if stop.is_set():
            second.set()
        stop.set()
        END_LOAD.set()

    # A test that must see the loading state or a busy slot holds it (a long FAKE_LOAD_SECONDS,
    # FAKE_COMPLETION_DELAY) until it has, then ends it with a signal: no timed window to catch.
    signal.signal(signal.SIGUSR1, lambda signum, frame: END_LOAD.set())
    signal.signal(signal.SIGUSR2, lambda signum, frame: END_COMPLETION_DELAY.set())

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    srv_log("I", "init_listener", "running without SSL", TRACE)
    srv_log("I", "init", "using 6 threads for HTTP server", TRACE)
    if not SERVER.api_keys:
        srv_log("W", "llama_server", "security: no API key is set and CORS allows all origins "
                "(see https://github.com/ggml-org/llama.cpp/pull/25655)")
    start_thread(httpd.serve_forever)
    srv_log("I", "load_model", f"loading model '{SERVER.model_path}'")
    srv_log("I", "load_model", f"local path '{SERVER.model_path}'", TRACE)
    if not os.path.isfile(SERVER.model_path):
        log("E", f"llama_model_load: error loading model: llama_model_loader: failed to open "
                 f"{SERVER.model_path}: No such file or directory")
        log("E", "llama_model_load_from_file_impl: failed to load model")
        srv_log("E", "load_model", f"failed to load model, '{SERVER.model_path}'")
        srv_log("E", "llama_server", "exiting due to model loading error")
        return 1
    END_LOAD.wait(env_float("FAKE_LOAD_SECONDS", 0.3))
    if stop.is_set():
        srv_log("I", "operator()", "operator(): cleaning up before exit...")
        return 0
    s = SERVER
    srv_log("I", "load_model", f"initializing, n_slots = {len(s.slots)}, n_ctx_slot = {s.n_ctx_slot}, "
            f"kv_unified = '{'true' if s.kv_unified else 'false'}'")
    for slot in s.slots:
        slot_log("I", "load_model", slot.id, -1, f"new slot, n_ctx = {slot.n_ctx}", TRACE)
    if s.cache is not None:
        limit = "no limit" if s.cache_ram_mib < 0 else f"{s.cache_ram_mib} MiB"
        srv_log("I", "load_model", f"prompt cache is enabled, size limit: {limit}", TRACE)
        srv_log("I", "load_model", "use `--cache-ram 0` to disable the prompt cache", TRACE)
    else:
        srv_log("I", "load_model", "prompt cache is disabled - use `--cache-ram N` to enable it", TRACE)
    srv_log("I", "load_model", "for more info see https://github.com/ggml-org/llama.cpp/pull/16391", TRACE)
    if s.max_checkpoints > 0:
        srv_log("I", "load_model", f"context checkpoints enabled, max = {s.max_checkpoints}, "
                f"min spacing = {s.checkpoint_min_step}", TRACE)
    else:
        srv_log("I", "load_model", "context checkpoints disabled", TRACE)
    if s.sidecar:  # KV Valet's sidecar build says which behaviour this process runs
        if s.sidecar_mode_raw and s.sidecar_mode_raw != s.sidecar_mode:
            srv_log("W", "load_model", f"checkpoint sidecars: {s.sidecar_mode} (KVV_SIDECAR_MODE "
                    f"'{s.sidecar_mode_raw}' is not one of v2, fork, port)")
        else:
            srv_log("I", "load_model", f"checkpoint sidecars: {s.sidecar_mode}")
    if opts["cache_idle_slots"] and s.cache is None:
        srv_log("W", "init", "--cache-idle-slots requires --cache-ram, disabling")
    elif s.cache_idle_slots:
        srv_log("I", "init", "idle slots will be saved to prompt cache and cleared upon starting a new task"
                if s.kv_unified else "idle slots will be saved to prompt cache upon starting a new task", TRACE)
    srv_log("I", "init", f"init: chat template, example_format: '{CHAT_TEMPLATE_EXAMPLE}'", TRACE)
    srv_log("I", "init", "init: chat template, thinking = 0", TRACE)
    srv_log("I", "init", "preserve_reasoning kwarg: not supported by template", TRACE)
    s.loading = False
    srv_log("I", "llama_server", "model loaded")
    srv_log("I", "llama_server", f"listening on http://{host}:{port}")
    srv_log("I", "update_slots", "all slots are idle", TRACE)
    if env_float("FAKE_LOG_FLOOD", 0) > 0:
        start_thread(flood_log, env_float("FAKE_LOG_FLOOD", 0), stop)
    stop.wait()
    srv_log("I", "operator()", "operator(): cleaning up before exit...")
    if env_float("FAKE_STOP_WAITS", 0) > 0 and HELD[0] > 0:
        second.wait()  # the held request's HTTP thread waits for the ended loop, and the process with it
        print("Received second interrupt, terminating immediately.", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
