"""Start the fake llama-server as a real subprocess, like KV Valet's supervisor does."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from tests.conftest import free_port

FAKE_SERVER = Path(__file__).with_name("fake_llama_server.py")


def http_get(url: str, timeout: float = 2.0) -> tuple[int, dict | str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


def wait_healthy(url: str, proc: subprocess.Popen, deadline_s: float = 120.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"fake llama-server exited with {proc.returncode}")
        try:
            if http_get(url + "/health", timeout=0.5)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.02)
    raise TimeoutError("fake llama-server did not become healthy")


def server_command(model: Path, port: int, slots_dir: Path | None, extra_args=()) -> list[str]:
    cmd = [sys.executable, str(FAKE_SERVER), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "-c", "8192", "-np", "2", "-lv", "4", "--metrics"]
    if slots_dir is not None:
        cmd += ["--slot-save-path", str(slots_dir) + "/"]
    return cmd + list(extra_args)


@contextlib.contextmanager
def run_fake_server(tmp_path: Path, extra_args=(), wait: bool = True, slot_save: bool = True, **env):
    """Yield ``(url, proc)``; ``proc.log_path`` is the server's stderr log.

    The model file and the ``slots/`` folder live in ``tmp_path``, so a second
    server started on the same ``tmp_path`` sees the first one's saves.
    ``env`` values become FAKE_* (or any) environment variables.
    """
    model = tmp_path / "model.gguf"
    if not model.exists():
        model.write_bytes(b"GGUF" + bytes(60))
    slots_dir = tmp_path / "slots"
    slots_dir.mkdir(exist_ok=True)
    port = free_port()
    log_path = tmp_path / f"server-{port}.log"
    full_env = {**os.environ, **{k: str(v) for k, v in env.items()}}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(server_command(model, port, slots_dir if slot_save else None, extra_args),
                                stdout=log, stderr=subprocess.STDOUT, env=full_env)
    proc.log_path = log_path
    url = f"http://127.0.0.1:{port}"
    try:
        if wait:
            wait_healthy(url, proc)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def fake_server(tmp_path):
    """Factory fixture: ``with fake_server(**env) as (url, proc): ...``."""

    def start(**kwargs):
        return run_fake_server(tmp_path, **kwargs)

    return start
