"""The sidecar-writing llama-server (tests/sidecar-server/build) really writes and reads PKCL v1.

Gemma 3 270M (SWA, n_swa = 512) on the patched build 11434: fill a slot with a
~2,700-token prompt, save it, check the `<state>.ckpt` next to the state file
(parsed here with struct, independently of the app), restart the server,
restore, and prove that the follow-up turn is served from the restored cache
(`cache_n` > 2,000, `prompt_n` < 100) thanks to the restored checkpoints. On
the stock build the same follow-up re-processes the whole prompt.
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port
from tests.llama_server import start_llama_server
from tests.real.sidecar_bin import sidecar_server_bin  # noqa: F401  (fixture)

pytestmark = pytest.mark.real_server

PKCL_MAGIC = 0x4C434B50
SAVED_RE = re.compile(r"saved (\d+) context checkpoints to sidecar")
RESTORED_RE = re.compile(r"restored (\d+) context checkpoints from sidecar")
COLOURS = ("red", "blue", "green", "silver", "black", "white", "yellow")


def wait_for(cond, timeout: float, what: str, interval: float = 0.1):
    """Poll `cond` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def server_env() -> dict:
    """KV Valet's PKCL v1 port (this file proves its layout); start_llama_server adds what the app's
    launcher adds (--no-repack where AMX crashes in a VM)."""
    return {**os.environ, "KVV_SIDECAR_MODE": "port"}


class Server:
    """One llama-server process with its log in a file."""

    def __init__(self, binary: Path, model: str, slot_dir: Path, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = start_llama_server(
            [binary, "-m", model, "--host", "127.0.0.1", "--port", str(self.port),
             "-c", "8192", "-np", "1", "--slot-save-path", str(slot_dir) + "/", "-lv", "4"],
            log=self._log, env=server_env())
        self.http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(300.0, connect=5.0))

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def wait_ready(self, timeout: float = 120.0) -> None:
        def ready():
            if self.proc.poll() is not None:
                pytest.fail(f"llama-server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                return self.http.get("/health", timeout=2.0).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(ready, timeout, "llama-server /health", interval=0.2)

    def wait_log(self, pattern: re.Pattern, timeout: float = 120.0) -> re.Match:
        return wait_for(lambda: pattern.search(self.log()), timeout, f"log line /{pattern.pattern}/")

    def post(self, path: str, body: dict) -> dict:
        r = self.http.post(path, json=body)
        assert r.status_code == 200, f"{path}: {r.status_code} {r.text}"
        return r.json()

    def stop(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self._log.close()


def make_prompt(server: Server, min_tokens: int = 2600) -> tuple[str, int]:
    """Varied text (not one sentence repeated) of at least `min_tokens` tokens."""
    lines: list[str] = []
    i = 0
    while True:
        for _ in range(20):
            c = COLOURS[i % len(COLOURS)]
            lines.append(f"Bay {i}: the valet parked a {c} car for guest number {i * 7 + 3}, "
                         f"wrote ticket {1000 + i * 13} and noted that it leaves at {8 + i % 10} o'clock.")
            i += 1
        text = "Parking log of the KV Valet garage.\n" + "\n".join(lines) + "\n"
        n = len(server.post("/tokenize", {"content": text})["tokens"])
        if n >= min_tokens:
            return text, n


def parse_pkcl(path: Path) -> list[tuple[int, int, int, int, int]]:
    """PKCL v1: u32 magic, u32 version, u32 count, then per checkpoint
    i64 n_tokens, i32 pos_min, i32 pos_max, u64 n_tgt, u64 n_dft, n_tgt + n_dft bytes."""
    data = path.read_bytes()
    assert data[:4] == b"PKCL"
    magic, version, count = struct.unpack_from("<III", data, 0)
    assert magic == PKCL_MAGIC and version == 1
    assert 1 <= count <= 1024
    off = 12
    out = []
    for _ in range(count):
        n_tokens, pos_min, pos_max, n_tgt, n_dft = struct.unpack_from("<qiiQQ", data, off)
        off += 32 + n_tgt + n_dft
        assert off <= len(data)
        out.append((n_tokens, pos_min, pos_max, n_tgt, n_dft))
    assert off == len(data), "checkpoint sizes must add up to the file size"
    return out


@pytest.mark.timeout(900)
def test_sidecar_build_saves_and_restores_checkpoints(sidecar_server_bin, real_model, tmp_path):  # noqa: F811
    slot_dir = tmp_path / "slots"
    slot_dir.mkdir()
    state = slot_dir / "sidecar.bin"
    ckpt = slot_dir / "sidecar.bin.ckpt"

    # 1. fill and save
    srv = Server(sidecar_server_bin, real_model, slot_dir, tmp_path / "server-1.log")
    try:
        srv.wait_ready()
        prompt, n_prompt = make_prompt(srv)
        first = srv.post("/completion", {"prompt": prompt, "n_predict": 4, "cache_prompt": True,
                                         "id_slot": 0, "temperature": 0})
        assert first["timings"]["prompt_n"] >= 2500
        saved = srv.post("/slots/0?action=save", {"filename": state.name})
        n_saved = saved["n_saved"]
        assert n_saved >= n_prompt
        m = srv.wait_log(SAVED_RE)
    finally:
        srv.stop()

    assert state.is_file() and ckpt.is_file()
    ckpts = parse_pkcl(ckpt)
    assert int(m.group(1)) == len(ckpts) >= 1
    for n_tokens, pos_min, pos_max, n_tgt, _n_dft in ckpts:
        assert 0 <= n_tokens <= n_saved and pos_max >= pos_min and n_tgt > 0

    # 2. a new process: restore, then a follow-up turn
    srv = Server(sidecar_server_bin, real_model, slot_dir, tmp_path / "server-2.log")
    try:
        srv.wait_ready()
        restored = srv.post("/slots/0?action=restore", {"filename": state.name})
        assert restored["n_restored"] == n_saved
        m = srv.wait_log(RESTORED_RE)
        assert int(m.group(1)) == len(ckpts)
        follow = srv.post("/completion", {"prompt": prompt + "Where is the blue car?", "n_predict": 4,
                                          "cache_prompt": True, "id_slot": 0, "temperature": 0})
        log2 = srv.log()
    finally:
        srv.stop()

    timings = follow["timings"]
    assert "forcing full prompt re-processing" not in log2
    assert timings["cache_n"] > 2000, timings
    assert timings["prompt_n"] < 100, timings
    print(f"\nsidecar build: prompt {n_prompt} tokens, saved {n_saved}, {len(ckpts)} checkpoints "
          f"({ckpt.stat().st_size} bytes), save {saved['timings']['save_ms']:.1f} ms, "
          f"restore {restored['timings']['restore_ms']:.1f} ms, follow-up cache_n {timings['cache_n']}, "
          f"prompt_n {timings['prompt_n']}, prompt_ms {timings['prompt_ms']:.0f}")
