"""GPU check (needs an NVIDIA GPU and a CUDA build of llama-server; not run in CI).

Starts the server with -ngl 99 through the app's launcher, samples it with the
app's GPU code, and prints per-GPU and per-process memory beside what
``nvidia-smi --query-compute-apps`` reports, so the two can be compared.

    LLAMA_SERVER=/path/to/cuda/llama-server .venv/bin/python tests/bench/gpu_check.py [--model M.gguf]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from app.core.profile import LaunchProfile  # noqa: E402
from app.monitor.gpu import GpuMonitor  # noqa: E402
from app.monitor.process import ProcessMonitor  # noqa: E402
from app.server.discovery import ensure_default_model  # noqa: E402
from app.server.launcher import make_supervisor, plan_launch  # noqa: E402


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--port", type=int, default=18431)
    args = ap.parse_args()
    model = args.model or str(ensure_default_model())
    profile = LaunchProfile(name="gpu-check", model=model, port=args.port, gpu_layers="99", ctx_size=4096)
    sup = make_supervisor(plan_launch(profile))
    await sup.start()
    try:
        pids = {sup.pid, *ProcessMonitor(sup.pid).sample().children_pids}
        snap = await asyncio.to_thread(GpuMonitor().sample, pids)
        print(f"KV Valet: {snap.message or 'NVML ok'}; driver {snap.driver_version}")
        for g in snap.gpus:
            print(f"  GPU {g.index} {g.name} {g.bus_id}: used {g.mem_used} / {g.mem_total} B; "
                  f"server {g.server_mem} B; lost={g.lost}")
        if shutil.which("nvidia-smi"):
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id,used_memory",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
            print("nvidia-smi --query-compute-apps (pid, bus id, MiB):")
            for line in out.stdout.strip().splitlines():
                print("  " + line + ("   <- the server" if line.split(",")[0].strip() in map(str, pids) else ""))
        else:
            print("nvidia-smi not found")
    finally:
        await sup.aclose()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
