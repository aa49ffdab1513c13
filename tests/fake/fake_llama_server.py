#!/usr/bin/env python3
"""A fake llama-server (build 11434) for KV Valet's tests.

It is launched exactly like the real binary and answers like the captures in
tests/fixtures/llama-server-b11434 (same JSON keys, error bodies, status codes
and log line format, log on stderr), without a model: a deterministic fake
tokenizer, no real prefill (timings are computed, not slept), and state files
laid out like real ones (app.server.statefile / app.server.sidecar writers).

What it models, because KV Valet's whole job depends on it:
* a sliding-window (default) or recurrent-hybrid model can only roll back to a
  context checkpoint; checkpoints live in memory and a restore clears them, so
  the first query after a restore re-prefills everything ("forcing full prompt
  re-processing ...") unless a checkpoint sidecar was loaded (FAKE_SIDECAR=1, the
  turboquant PR #206 behaviour);
* a dense model (FAKE_MODEL_KIND=dense) resumes from any prefix;
* slot ids wrap around, a failed restore clears the slot, slot actions need
  --slot-save-path, file names are validated like fs_validate_filename.

Environment knobs:
  FAKE_LOAD_SECONDS (0.3)          time /health answers 503 "Loading model"
  FAKE_MODEL_KIND (sliding-window) dense | sliding-window | recurrent-hybrid
  FAKE_N_SWA (512)                 sliding window of the fake model
  FAKE_PREFILL_TPS (280)           reported prompt tokens per second
  FAKE_GEN_TPS (40)                reported generated tokens per second
  FAKE_COMPLETION_DELAY (0)        seconds a completion really keeps its slot busy
  FAKE_SIDECAR (0)                 1: write/read <state>.ckpt PKCL v1 sidecars
  FAKE_STATE_BYTES_PER_TOKEN (64)  size of the fake sequence state per token
  FAKE_CKPT_BYTES_PER_TOKEN (16)   size of a fake checkpoint per token of window
  FAKE_STATE_VERSION (4)           state file version written and required
  FAKE_SAVE_ERROR (0)              1: save answers 500 "Unable to save slot"
  FAKE_SAVE_DELAY (0)              seconds added to every save
  FAKE_DIE_DURING_SAVE (0)         1: write half the state file, then SIGKILL
  FAKE_ABORT_ON_SAVE (0)           1: print the seed-002 GGML_ASSERT and abort
  FAKE_BUILD_INFO (b11434-fake)    /props build_info
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import sys
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from app.server.sidecar import (  # noqa: E402
    Checkpoint, SidecarError, latest_covering_checkpoint, read_pkcl, validate_checkpoints, write_pkcl,
)
from app.server.statefile import StateFileError, encode_state_file, read_state_header, read_state_tokens  # noqa: E402

FIXTURES = REPO / "tests" / "fixtures" / "llama-server-b11434"
N_VOCAB = 262144
BOS, EOS = 2, 1
SPECIAL = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<start_of_turn>": 105, "<end_of_turn>": 106}
WORDS = ["the", "cache", "slot", "park", "resume", "token", "model", "quiet", "valet", "disk"]


def env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def env_flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0", "false", "no")


# ---------------------------------------------------------------- logging

T0 = time.monotonic()
_log_lock = threading.Lock()
VERBOSITY = 3  # llama.cpp default: info; cache events need -lv 4 (trace)


def log(level: str, text: str, verbosity: int = 3) -> None:
    """``<min>.<sec>.<ms>.<us> <L> <text>`` on stderr, like common/log.cpp."""
    if verbosity > VERBOSITY and level != "E":
        return
    us = int((time.monotonic() - T0) * 1e6)
    stamp = f"{us // 60_000_000}.{(us // 1_000_000) % 60:02d}.{(us // 1000) % 1000:03d}.{us % 1000:03d}"
    with _log_lock:
        sys.stderr.write(f"{stamp} {level} {text}\n")
        sys.stderr.flush()


def srv_log(level: str, func: str, text: str, verbosity: int = 3) -> None:
    log(level, f"srv  {func[:12]:>12}: {text}", verbosity)


def slot_log(level: str, func: str, slot_id: int, task: int, text: str, verbosity: int = 3) -> None:
    log(level, f"slot {func[:12]:>12}: id {slot_id:2d} | task {task} | {text}", verbosity)


# ---------------------------------------------------------------- arguments

VALUE_FLAGS = {
    "-m": "model", "--model": "model", "--host": "host", "--port": "port",
    "-c": "ctx", "--ctx-size": "ctx", "-np": "parallel", "--parallel": "parallel",
    "--slot-save-path": "slot_save_path", "-ctxcp": "ctx_checkpoints",
    "--ctx-checkpoints": "ctx_checkpoints", "--swa-checkpoints": "ctx_checkpoints",
    "-ctk": "ctk", "--cache-type-k": "ctk", "-ctv": "ctv", "--cache-type-v": "ctv",
    "-lv": "verbosity", "--verbosity": "verbosity", "--log-verbosity": "verbosity",
    "--api-key": "api_key", "--api-key-file": "api_key_file", "-a": "alias", "--alias": "alias",
}
BOOL_FLAGS = {"--metrics": "metrics", "--no-slots": "no_slots", "-v": "verbose",
              "--verbose": "verbose", "--log-verbose": "verbose"}


def parse_args(argv: list[str]) -> dict:
    opts = {"host": "127.0.0.1", "port": "8080", "ctx": "4096", "parallel": "1",
            "ctx_checkpoints": "32", "ctk": "f16", "ctv": "f16", "verbosity": "3",
            "api_keys": []}
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
            opts[BOOL_FLAGS[arg]] = True
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
_PIECE_RE = re.compile(r"<[A-Za-z_]+>|\w+|\s+|[^\w\s]")


def token_id(piece: str) -> int:
    if piece in SPECIAL:
        return SPECIAL[piece]
    tid = 256 + zlib.crc32(piece.encode()) % (N_VOCAB - 256)
    with _pieces_lock:
        _pieces.setdefault(tid, piece)
    return tid


def tokenize(text: str, add_bos: bool = False) -> list[int]:
    ids = [token_id(p) for p in _PIECE_RE.findall(text)]
    return [BOS, *ids] if add_bos else ids


def detokenize(tokens: list[int]) -> str:
    return "".join(_pieces.get(t, f"<{t}>") for t in tokens)


# ---------------------------------------------------------------- fixtures

def load_fixture_bodies() -> dict:
    data = json.loads((FIXTURES / "responses.json").read_text())
    return {
        "props": data["props"]["body"],
        "slot_params": data["slots_after_task"]["body"][1]["params"],
        "generation_settings": data["completion"]["body"]["generation_settings"],
    }


def error_body(code: int, message: str, etype: str) -> dict:
    return {"error": {"code": code, "message": message, "type": etype}}


class HttpError(Exception):
    def __init__(self, code: int, message: str, etype: str = "invalid_request_error"):
        super().__init__(message)
        self.code, self.message, self.etype = code, message, etype


RESTORE_FAILED = "Unable to restore slot: No available space in KV cache or invalid slot save file"


def valid_filename(name: str) -> bool:
    """Like common's fs_validate_filename: no paths, no control or reserved characters."""
    if not name or len(name.encode()) > 255 or name in (".", "..") or ".." in name:
        return False
    if name != name.strip() or name.endswith("."):
        return False
    return not any(ord(c) < 0x20 or ord(c) == 0x7F or c in '/\\:*?"<>|' for c in name)


# ---------------------------------------------------------------- server state

class Slot:
    def __init__(self, sid: int, n_ctx: int):
        self.id = sid
        self.n_ctx = n_ctx
        self.tokens: list[int] = []
        self.checkpoints: list[Checkpoint] = []
        self.restored = False  # memory cannot be truncated until a checkpoint is used
        self.busy = threading.Lock()  # completions and slot actions run one at a time
        self.processing = False
        self.task: dict | None = None  # what /slots shows once the slot ran a task
        self.t_last = 0.0


class FakeServer:
    def __init__(self, opts: dict):
        self.opts = opts
        self.model_path = opts.get("model") or "models/7B/ggml-model-f16.gguf"
        self.alias = opts.get("alias") or self.model_path
        n_slots = max(1, int(opts["parallel"]))
        n_ctx = int(opts["ctx"]) or 32768
        self.n_ctx_slot = n_ctx // n_slots
        self.slots = [Slot(i, self.n_ctx_slot) for i in range(n_slots)]
        self.save_path = opts.get("slot_save_path")
        self.max_checkpoints = int(opts["ctx_checkpoints"])
        self.api_keys = opts["api_keys"]
        self.metrics_enabled = bool(opts.get("metrics"))
        self.kind = os.environ.get("FAKE_MODEL_KIND", "sliding-window")
        self.n_swa = int(env_float("FAKE_N_SWA", 512))
        self.prefill_tps = env_float("FAKE_PREFILL_TPS", 280)
        self.gen_tps = env_float("FAKE_GEN_TPS", 40)
        self.state_version = int(env_float("FAKE_STATE_VERSION", 4))
        self.sidecar = env_flag("FAKE_SIDECAR")
        self.loading = True
        self.lock = threading.Lock()
        self.next_task = 0
        self.fixtures = load_fixture_bodies()
        self.m = dict(prompt_tokens=0, prompt_cached=0, prompt_seconds=0.0, predicted=0,
                      predicted_seconds=0.0, n_decode=0, n_tokens_max=0, processing=0, deferred=0)

    def new_task(self) -> int:
        with self.lock:
            self.next_task += 1
            return self.next_task

    def slot_for(self, id_slot: int) -> Slot:
        return self.slots[id_slot % len(self.slots)]  # llama.cpp: ids wrap around

    # ------------------------------------------------------------ completion

    def pick_slot(self, prompt: list[int]) -> Slot:
        best, best_sim = None, 0.0
        for s in self.slots:
            if s.processing or not s.tokens:
                continue
            sim = common_prefix(s.tokens, prompt) / max(1, len(prompt))
            if sim > best_sim:
                best, best_sim = s, sim
        if best is not None and best_sim > 0.1:
            slot_log("I", "get_availabl", best.id, -1,
                     f"selected slot by LCP similarity, f_sim_best = {best_sim:.3f} (> 0.100 thold)", 4)
            return best
        idle = [s for s in self.slots if not s.processing] or self.slots
        lru = min(idle, key=lambda s: s.t_last)
        slot_log("I", "get_availabl", lru.id, -1, f"selected slot by LRU, t_last = {int(lru.t_last * 1e6)}", 4)
        return lru

    def completion(self, body: dict) -> dict:
        if body.get("stream"):
            raise HttpError(501, "fake llama-server: streaming is not supported", "not_supported_error")
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            tokens = tokenize(prompt, add_bos=True)
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            tokens = list(prompt)
        else:
            raise HttpError(400, "\"prompt\" must be a string or a list of tokens")
        if not tokens:
            raise HttpError(400, "empty prompt")
        n_predict = int(body.get("n_predict", body.get("max_tokens", -1)))
        if n_predict < 0:
            n_predict = 16
        id_slot = int(body.get("id_slot", -1))
        slot = self.slot_for(id_slot) if id_slot >= 0 else self.pick_slot(tokens)
        if id_slot >= 0:
            slot_log("I", "get_availabl", slot.id, -1, f"selected slot by id ({id_slot})", 4)
        if len(tokens) > slot.n_ctx:
            raise HttpError(400, "the request exceeds the available context size, try increasing it",
                            "exceed_context_size_error")
        with self.lock:
            deferred = slot.busy.locked()
            self.m["deferred"] += deferred
        with slot.busy:
            with self.lock:
                self.m["deferred"] -= deferred
            return self._run_completion(slot, tokens, n_predict, bool(body.get("cache_prompt", True)))

    def _n_past(self, slot: Slot, task: int, prompt: list[int], cache_prompt: bool) -> int:
        """How many prompt tokens the slot can reuse (llama.cpp server_context logic, simplified)."""
        n_past = min(common_prefix(slot.tokens, prompt), len(prompt) - 1) if cache_prompt else 0
        if self.kind == "dense" or n_past == 0 or not slot.tokens:
            return n_past
        # SWA / recurrent memory keeps only recent positions: a rollback is possible
        # only if the live memory still reaches back far enough, else a checkpoint is needed.
        if slot.restored:
            need_checkpoint = True
        elif self.kind == "recurrent-hybrid":
            need_checkpoint = n_past < len(slot.tokens)
        else:
            pos_min = max(0, len(slot.tokens) - 2 * self.n_swa)
            need_checkpoint = n_past < len(slot.tokens) and pos_min > max(0, n_past - self.n_swa)
        if not need_checkpoint:
            return n_past
        cp = latest_covering_checkpoint(slot.checkpoints, n_past)
        if cp is None:
            slot_log("I", "operator()", slot.id, task,
                     "forcing full prompt re-processing due to lack of cache data (likely due to SWA or "
                     "hybrid/recurrent memory, see https://github.com/ggml-org/llama.cpp/pull/13194"
                     "#issuecomment-2868343055)", 4)
            slot.checkpoints.clear()
            return 0
        slot_log("I", "operator()", slot.id, task,
                 f"checking checkpoint with [{cp.pos_min}, {cp.pos_max}] against {max(0, n_past - self.n_swa)}...", 4)
        new_past = cp.pos_max
        slot_log("I", "operator()", slot.id, task,
                 f"restored context checkpoint (pos_min = {cp.pos_min}, pos_max = {cp.pos_max}, "
                 f"n_tokens = {cp.n_tokens}, n_past = {new_past}, size = {cp.size / 1048576:.3f} MiB)", 4)
        return new_past

    def _add_checkpoint(self, slot: Slot, task: int, n_tokens: int) -> None:
        if self.kind == "dense" or self.max_checkpoints <= 0 or n_tokens <= 0:
            return
        slot.checkpoints = [c for c in slot.checkpoints if c.n_tokens != n_tokens]
        window = 2 * self.n_swa if self.kind == "sliding-window" else 1
        pos_min = max(0, n_tokens - window)
        cp = Checkpoint(n_tokens=n_tokens, pos_min=pos_min, pos_max=n_tokens - 1,
                        size_tgt=(n_tokens - pos_min) * int(env_float("FAKE_CKPT_BYTES_PER_TOKEN", 16)), size_dft=0)
        slot.checkpoints.append(cp)
        del slot.checkpoints[:-self.max_checkpoints]
        slot_log("I", "create_check", slot.id, task,
                 f"created context checkpoint {len(slot.checkpoints)} of {self.max_checkpoints} "
                 f"(pos_min = {cp.pos_min}, pos_max = {cp.pos_max}, n_tokens = {cp.n_tokens}, "
                 f"size = {cp.size / 1048576:.3f} MiB)", 4)

    def _run_completion(self, slot: Slot, prompt: list[int], n_predict: int, cache_prompt: bool) -> dict:
        task = self.new_task()
        slot.processing = True
        with self.lock:
            self.m["processing"] += 1
        try:
            slot_log("I", "launch_slot_", slot.id, task, "processing task, is_child = 0")
            slot_log("I", "operator()", slot.id, task,
                     f"new prompt, n_ctx_slot = {slot.n_ctx}, n_keep = 0, task.n_tokens = {len(prompt)}", 4)
            cache_n = self._n_past(slot, task, prompt, cache_prompt)
            slot.restored = False
            slot.checkpoints = [c for c in slot.checkpoints if c.pos_max < max(cache_n, 1)]
            prompt_n = len(prompt) - cache_n
            slot.task = {"id_task": task, "n_prompt_tokens": len(prompt), "n_prompt_tokens_processed": prompt_n,
                         "n_prompt_tokens_cache": cache_n, "n_predict": n_predict}
            slot_log("I", "operator()", slot.id, task, f"cached n_tokens = {cache_n}, memory_seq_rm [{cache_n}, end)", 4)
            if cache_n > 0 and not any(c.n_tokens == cache_n for c in slot.checkpoints):
                self._add_checkpoint(slot, task, cache_n)
            end = len(prompt) - 4
            if end - 512 > cache_n:
                self._add_checkpoint(slot, task, end - 512)
            if end > cache_n:
                self._add_checkpoint(slot, task, end)
            delay = env_float("FAKE_COMPLETION_DELAY", 0)
            if delay > 0:
                time.sleep(delay)

            seed = zlib.crc32(repr(prompt[-8:]).encode())
            generated = []
            for i in range(n_predict):
                generated.append(token_id(" ") if i % 2 == 0 else token_id(WORDS[(seed + i) % len(WORDS)]))
            slot.tokens = prompt + generated[:-1] if generated else list(prompt)
            slot.t_last = time.monotonic()
            content = detokenize(generated)

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
            slot_log("I", "print_timing", slot.id, task,
                     f"prompt eval time = {prompt_ms:10.2f} ms / {prompt_n:5d} tokens "
                     f"({timings['prompt_per_token_ms']:8.2f} ms per token, {timings['prompt_per_second']:8.2f} tokens per second)")
            slot_log("I", "print_timing", slot.id, task,
                     f"       eval time = {predicted_ms:10.2f} ms / {len(generated):5d} tokens "
                     f"({timings['predicted_per_token_ms']:8.2f} ms per token, {timings['predicted_per_second']:8.2f} tokens per second)")
            slot_log("I", "print_timing", slot.id, task,
                     f"      total time = {prompt_ms + predicted_ms:10.2f} ms / {prompt_n + len(generated):5d} tokens")
            slot_log("I", "release", slot.id, task, f"stop processing: n_tokens = {len(slot.tokens)}, truncated = 0")
            with self.lock:
                m = self.m
                m["prompt_tokens"] += prompt_n
                m["prompt_cached"] += cache_n
                m["prompt_seconds"] += prompt_ms / 1000
                m["predicted"] += len(generated)
                m["predicted_seconds"] += predicted_ms / 1000
                m["n_decode"] += 1 + len(generated)
                m["n_tokens_max"] = max(m["n_tokens_max"], len(prompt) + len(generated))
            settings = dict(self.fixtures["generation_settings"], n_predict=n_predict, max_tokens=n_predict)
            return {
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
                "tokens_cached": len(prompt) + len(generated) - 1 if generated else len(prompt),
                "timings": timings,
            }
        finally:
            slot.processing = False
            if slot.task is not None:
                slot.task["n_prompt_tokens"] = len(slot.tokens)
                slot.task["n_prompt_tokens_processed"] = 0
                slot.task["n_prompt_tokens_cache"] = 0
            with self.lock:
                self.m["processing"] -= 1
            srv_log("I", "update_slots", "all slots are idle", 4)

    # ------------------------------------------------------------ slot actions

    def slot_action(self, id_str: str, action: str, body: dict) -> dict:
        if not self.save_path:
            raise HttpError(501, "This server does not support slots action. Start it with `--slot-save-path`",
                            "not_supported_error")
        try:
            id_slot = int(id_str)
        except ValueError:
            raise HttpError(400, "Invalid slot ID") from None
        if id_slot < 0:
            raise HttpError(400, "Invalid slot ID")
        if action not in ("save", "restore", "erase"):
            raise HttpError(400, "Invalid action")
        filename = body.get("filename", "") if action != "erase" else ""
        if action != "erase" and (not isinstance(filename, str) or not valid_filename(filename)):
            raise HttpError(400, "Invalid filename")
        slot = self.slot_for(id_slot)
        task = self.new_task()
        with slot.busy:
            try:
                if action == "save":
                    return self._save(slot, id_slot, filename)
                if action == "restore":
                    return self._restore(slot, id_slot, filename)
                n = len(slot.tokens)
                self._clear(slot)
                return {"id_slot": id_slot, "n_erased": n}
            except HttpError as exc:
                srv_log("E", "send_error", f"task id = {task}, error: {exc.message}")
                raise

    def _clear(self, slot: Slot) -> None:
        slot_log("I", "prompt_clear", slot.id, -1, f"clearing prompt with {len(slot.tokens)} tokens")
        slot.tokens = []
        slot.checkpoints = []
        slot.restored = False

    def _save(self, slot: Slot, id_slot: int, filename: str) -> dict:
        t0 = time.perf_counter()
        time.sleep(env_float("FAKE_SAVE_DELAY", 0))
        if env_flag("FAKE_ABORT_ON_SAVE"):
            sys.stderr.write('/src/ggml/src/ggml-backend.cpp:359: GGML_ASSERT(tensor->data != NULL && '
                             '"tensor not allocated") failed\n')
            sys.stderr.flush()
            os.abort()
        if env_flag("FAKE_SAVE_ERROR"):
            raise HttpError(500, "Unable to save slot", "server_error")
        path = self.save_path + filename  # plain concatenation, like llama-server
        data = state_file_bytes(slot.tokens, self.state_version)
        try:
            with open(path, "wb") as f:
                if env_flag("FAKE_DIE_DURING_SAVE"):
                    f.write(data[: len(data) // 2])
                    f.flush()
                    os.fsync(f.fileno())
                    os.kill(os.getpid(), signal.SIGKILL)
                f.write(data)
        except OSError:
            raise HttpError(500, "Unable to save slot", "server_error") from None
        if self.sidecar and slot.checkpoints:
            items = [(cp, fake_bytes(cp.n_tokens, cp.size_tgt), b"") for cp in slot.checkpoints]
            try:
                write_pkcl(path + ".ckpt", items)
                slot_log("I", "process_sing", slot.id, -1, f"saved {len(items)} context checkpoints to sidecar")
            except OSError:
                slot_log("W", "process_sing", slot.id, -1, f"failed to write checkpoint sidecar {path}.ckpt")
        return {"id_slot": id_slot, "filename": filename, "n_saved": len(slot.tokens), "n_written": len(data),
                "timings": {"save_ms": (time.perf_counter() - t0) * 1000}}

    def _restore(self, slot: Slot, id_slot: int, filename: str) -> dict:
        t0 = time.perf_counter()
        path = self.save_path + filename
        try:
            header = read_state_header(path)
            if header.version != self.state_version:
                raise StateFileError(f"unknown (from file) version {header.version}, expected {self.state_version}")
            tokens = read_state_tokens(path)
        except StateFileError as exc:
            reason = str(exc)
            if not os.path.exists(path):
                reason = f"failed to open {path}: No such file or directory"
            log("E", f"llama_state_seq_load_file: error loading sequence state file: {reason}")
            self._clear(slot)
            raise HttpError(400, RESTORE_FAILED) from None
        if len(tokens) > slot.n_ctx:
            self._clear(slot)
            raise HttpError(400, "Unable to restore slot: Restored prompt does not fit in the slot context")
        if any(t < 0 or t >= N_VOCAB for t in tokens):
            self._clear(slot)
            raise HttpError(400, "Unable to restore slot: Invalid tokens in slot save file")
        slot.tokens = tokens
        slot.checkpoints = []  # even a same-process restore drops the in-memory checkpoints
        slot.restored = True
        slot.task = None  # /slots shows no task after a restore
        ckpt = path + ".ckpt"
        if self.sidecar and self.max_checkpoints > 0 and os.path.isfile(ckpt):
            try:
                cps = read_pkcl(ckpt)
                validate_checkpoints(cps, len(tokens))
                slot.checkpoints = list(cps)[-self.max_checkpoints:]
                slot_log("I", "process_sing", slot.id, -1,
                         f"restored {len(slot.checkpoints)} context checkpoints from sidecar")
            except (SidecarError, OSError) as exc:
                slot_log("W", "process_sing", slot.id, -1, f"failed to read checkpoint sidecar {ckpt}: {exc}")
        return {"id_slot": id_slot, "filename": filename, "n_restored": len(tokens), "n_read": header.file_size,
                "timings": {"restore_ms": (time.perf_counter() - t0) * 1000}}

    # ------------------------------------------------------------ read-only endpoints

    def slots_json(self) -> list:
        out = []
        for s in self.slots:
            entry = {"id": s.id, "n_ctx": s.n_ctx, "speculative": False, "is_processing": s.processing}
            if s.task is not None:
                n_predict = s.task["n_predict"]
                entry.update(
                    id_task=s.task["id_task"],
                    n_prompt_tokens=s.task["n_prompt_tokens"],
                    n_prompt_tokens_processed=s.task["n_prompt_tokens_processed"],
                    n_prompt_tokens_cache=s.task["n_prompt_tokens_cache"],
                    params=dict(self.fixtures["slot_params"], n_predict=n_predict, max_tokens=n_predict),
                    next_token=[{"has_next_token": s.processing, "has_new_line": False,
                                 "n_remain": n_predict if s.processing else -1, "n_decoded": 0}],
                )
            out.append(entry)
        return out

    def props_json(self) -> dict:
        props = json.loads(json.dumps(self.fixtures["props"]))
        props["default_generation_settings"]["n_ctx"] = self.n_ctx_slot
        props.update(total_slots=len(self.slots), model_alias=self.alias, model_path=self.model_path,
                     build_info=os.environ.get("FAKE_BUILD_INFO", "b11434-fake"),
                     endpoint_metrics=self.metrics_enabled)
        return props

    def metrics_text(self) -> str:
        m = self.m
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


def state_file_bytes(tokens: list[int], version: int) -> bytes:
    """A state file like llama_state_seq_save_file writes (packed tokens, PR #26640)."""
    payload = fake_bytes(len(tokens), 256 + len(tokens) * int(env_float("FAKE_STATE_BYTES_PER_TOKEN", 64)))
    return encode_state_file(tokens, payload, version=version, packed=True)


# ---------------------------------------------------------------- HTTP

SERVER: FakeServer


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "llama.cpp"

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
        try:
            body = self._body() if method == "POST" else {}
            if SERVER.loading:
                raise HttpError(503, "Loading model", "unavailable_error")
            if SERVER.api_keys and path not in ("/health", "/v1/health"):
                auth = self.headers.get("Authorization", "")
                if not (auth.startswith("Bearer ") and auth[7:] in SERVER.api_keys):
                    raise HttpError(401, "Invalid API Key", "authentication_error")
            self._route(method, path, parse_qs(url.query), body)
        except HttpError as exc:
            self._send(exc.code, error_body(exc.code, exc.message, exc.etype))
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as exc:  # like llama-server: an exception becomes a 500
            self._send(500, error_body(500, str(exc), "server_error"))

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
            return self._send(200, SERVER.completion(body))
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


def main(argv: list[str]) -> int:
    global SERVER, VERBOSITY
    opts = parse_args(argv)
    VERBOSITY = 10 if opts.get("verbose") else int(opts["verbosity"])
    srv_log("I", "llama_server", "initializing ...")
    try:
        httpd = ThreadingHTTPServer((opts["host"], int(opts["port"])), Handler)
    except OSError:
        srv_log("E", "init_listene",
                f"couldn't bind HTTP server socket, hostname: {opts['host']}, port: {opts['port']}")
        return 1
    httpd.daemon_threads = True
    SERVER = FakeServer(opts)
    host, port = opts["host"], httpd.server_address[1]

    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    srv_log("I", "init_listene", "running without SSL")
    srv_log("I", "init", "using 6 threads for HTTP server")
    if not SERVER.api_keys:
        srv_log("W", "llama_server", "security: no API key is set and CORS allows all origins "
                "(see https://github.com/ggml-org/llama.cpp/pull/25655)")
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    srv_log("I", "load_model", f"loading model '{SERVER.model_path}'")
    if not os.path.isfile(SERVER.model_path):
        log("E", f"llama_model_load: error loading model: llama_model_loader: failed to open "
                 f"{SERVER.model_path}: No such file or directory")
        log("E", "llama_model_load_from_file_impl: failed to load model")
        srv_log("E", "load_model", f"failed to load model, '{SERVER.model_path}'")
        srv_log("E", "llama_server", "exiting due to model loading error")
        return 1
    if stop.wait(env_float("FAKE_LOAD_SECONDS", 0.3)):
        srv_log("I", "operator()", "operator(): cleaning up before exit...")
        return 0
    srv_log("I", "load_model", f"initializing, n_slots = {len(SERVER.slots)}, n_ctx_slot = {SERVER.n_ctx_slot}, "
            "kv_unified = 'false'")
    for s in SERVER.slots:
        slot_log("I", "load_model", s.id, -1, f"new slot, n_ctx = {s.n_ctx}")
    if SERVER.max_checkpoints > 0:
        srv_log("I", "load_model", f"context checkpoints enabled, max = {SERVER.max_checkpoints}, min spacing = 8192")
    SERVER.loading = False
    srv_log("I", "llama_server", "model loaded")
    srv_log("I", "llama_server", f"listening on http://{host}:{port}")
    srv_log("I", "update_slots", "all slots are idle", 4)
    stop.wait()
    srv_log("I", "operator()", "operator(): cleaning up before exit...")
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
