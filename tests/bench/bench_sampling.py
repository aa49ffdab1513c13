"""Benchmark the monitor against a running llama-server (fake or real).

Not a test: the caller starts the server. Prints the median and max time of
one ``take_snapshot`` tick over ``--ticks`` (200) ticks, then this process's
CPU usage over ``--idle-seconds`` (60) while a :class:`Sampler` runs at its
default rates (1 s idle, 0.25 s while a slot is busy).

    .venv/bin/python tests/bench/bench_sampling.py --url http://127.0.0.1:18080 [--pid PID]
    .venv/bin/python tests/bench/bench_sampling.py --fake-8x2     # 8 slots (fake server), 2 GPUs (fake NVML)
    .venv/bin/python tests/bench/bench_sampling.py --busy-only    # the busy interval's tick spacing alone

Targets (issue "Scale and speed"): one tick with 8 slots and 2 GPUs <= 5 ms
median; the idle app <= 0.5 % of one core. Ticks use the app's own HTTP client.

Last, ``--busy-seconds`` (3) of ticks while a slot is busy (a synthetic busy /slots, no
server: the sampler's own scheduling) print their spacing against the busy interval
(tests/unit/test_sampler.py checks by counting that the busy interval is the one used;
how close to it the ticks come is this figure: median about the interval, max well under
the idle interval).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx  # noqa: E402
import psutil  # noqa: E402

from app.monitor.gpu import GpuMonitor  # noqa: E402
from app.monitor.process import ProcessMonitor  # noqa: E402
from app.monitor.sampler import Sampler  # noqa: E402
from app.monitor.snapshot import format_snapshot, take_snapshot  # noqa: E402


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


def _error_message(r: httpx.Response) -> str:
    try:
        body = r.json()
        return str(body.get("error", {}).get("message") or r.text)
    except Exception:
        return r.text[:200]


def make_fetchers(client: httpx.AsyncClient, url: str):
    base = url.rstrip("/")

    async def fetch_health():
        r = await client.get(f"{base}/health")
        if r.status_code != 200:
            raise HttpError(r.status_code, _error_message(r))
        return r.json()

    async def fetch_slots():
        r = await client.get(f"{base}/slots")
        if r.status_code != 200:
            raise HttpError(r.status_code, _error_message(r))
        return r.json()

    return fetch_health, fetch_slots


async def busy_tick_spacing(seconds: float, busy_interval: float = 0.25) -> None:
    """Ticks while a slot is busy, from a synthetic /slots: their spacing (ms)."""

    async def health():
        return {"status": "ok"}

    async def slots():
        return [{"id": 0, "n_ctx": 4096, "is_processing": True}]

    async def take():
        return await take_snapshot(health, slots, None, None, {}, None, "http://synthetic")

    loop = asyncio.get_running_loop()
    times: list[float] = []
    sampler = Sampler(take, on_snapshot=lambda _snap: times.append(loop.time()), busy_interval=busy_interval)
    sampler.start()
    try:
        await asyncio.sleep(seconds)  # measuring, not synchronising
    finally:
        await sampler.stop()
    gaps = [(b - a) * 1000.0 for a, b in zip(times, times[1:])]
    if gaps:
        print(f"sampler while a slot is busy (busy interval {busy_interval * 1000:.0f} ms, {seconds:g} s): "
              f"{len(times)} ticks, spacing median {statistics.median(gaps):.1f} ms, max {max(gaps):.1f} ms, "
              f"{sampler.skipped_ticks} skipped")


async def main_async(args: argparse.Namespace) -> int:
    if args.busy_only:
        await busy_tick_spacing(args.busy_seconds)
        return 0
    server = None
    if args.fake_8x2:
        import socket
        import subprocess

        from tests.doubles.fake_nvml import two_gpus

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        fake = Path(__file__).resolve().parents[1] / "fake_server" / "fake_llama_server.py"
        model = Path(os.environ.get("TMPDIR", "/tmp")) / "kvv-bench-model.gguf"
        model.write_bytes(b"GGUF" + bytes(60))
        server = subprocess.Popen([sys.executable, str(fake), "-m", str(model), "--port", str(port), "-c", "16384",
                                   "-np", "8"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        args.url, args.pid = f"http://127.0.0.1:{port}", server.pid
        gpu = GpuMonitor(nvml=two_gpus())
    else:
        gpu = GpuMonitor()
    proc = ProcessMonitor(args.pid) if args.pid else None
    from app.server.client import LlamaClient

    async with LlamaClient(args.url) as client:
        for _ in range(200):  # wait until it answers (a bench: a bounded poll is fine)
            if (await client.health()).ok:
                break
            await asyncio.sleep(0.05)
        if args.fake_8x2:  # every slot has run a task: the full /slots body
            await asyncio.gather(*(client.completion("hello there " * 40, slot_id=i, n_predict=2) for i in range(8)))

        async def fetch_health():
            h = await client.health()
            return "ok" if h.ok else f"unreachable: {h.message}"

        async def take():
            return await take_snapshot(fetch_health, client.slots, gpu, proc, {}, None, args.url)

        first = await take()
        print(format_snapshot(first))

        times_ms = []
        for _ in range(args.ticks):
            t0 = time.perf_counter()
            await take()
            times_ms.append((time.perf_counter() - t0) * 1000.0)
        print(
            f"take_snapshot over {args.ticks} ticks: median {statistics.median(times_ms):.2f} ms, "
            f"max {max(times_ms):.2f} ms"
        )

        if args.idle_seconds > 0:
            me = psutil.Process(os.getpid())
            ticks = 0

            def count(_snap):
                nonlocal ticks
                ticks += 1

            sampler = Sampler(take, on_snapshot=count, url=args.url)
            c0 = me.cpu_times()
            w0 = time.monotonic()
            sampler.start()
            try:
                await asyncio.sleep(args.idle_seconds)  # measuring, not synchronising
            finally:
                await sampler.stop()
            c1 = me.cpu_times()
            wall = time.monotonic() - w0
            cpu_s = (c1.user - c0.user) + (c1.system - c0.system)
            print(
                f"sampler at default rates for {wall:.1f} s: {ticks} ticks, "
                f"CPU {100.0 * cpu_s / wall:.2f} % of one core ({cpu_s * 1000:.0f} ms CPU)"
            )
    gpu.close()
    if server is not None:
        server.terminate()
        server.wait()
    if args.busy_seconds > 0:
        await busy_tick_spacing(args.busy_seconds)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="base URL of a running llama-server")
    p.add_argument("--fake-8x2", action="store_true", help="start the fake server with 8 slots; 2 fake GPUs")
    p.add_argument("--pid", type=int, default=None, help="server pid (process + GPU memory)")
    p.add_argument("--ticks", type=int, default=200)
    p.add_argument("--idle-seconds", type=float, default=60.0)
    p.add_argument("--busy-seconds", type=float, default=3.0, help="busy-interval tick spacing (0: skip)")
    p.add_argument("--busy-only", action="store_true", help="only the busy-interval tick spacing (no server)")
    args = p.parse_args(argv)
    if not args.url and not args.fake_8x2 and not args.busy_only:
        p.error("give --url or --fake-8x2 (or --busy-only)")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
