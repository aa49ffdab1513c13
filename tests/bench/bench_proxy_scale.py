"""Benchmark: the seed's scale through the proxy: a 32K-token conversation across a restart of
``kv-valet serve PROFILE --proxy`` (issue #38 item 4).

Not a test. bench_ab_scale measures the session service directly; this one goes the way a chat
client does, through the real command as its own process (``python -m app.cli serve NAME --proxy``,
the launcher's path: its CPU workarounds, never llama-server started raw), on KV Valet's sidecar
build (tests/sidecar-server/build) in its ``v2`` behaviour, with Gemma 3 270M (the real model:
sliding-window attention, so a restore without its checkpoints re-processes everything):

1. **cold**: ``serve`` starts a fresh server (``-c`` ``--tokens``, one slot); the first turn (a user
   message that fills the context but for the next turns' room) goes through the proxy with the
   ``openai`` client, streamed: its time to first token is a cold prefill of the whole prompt in a
   fresh process (the baseline, measured in the same run: the expensive part, done once);
2. **restart**: Ctrl-C (SIGINT) to ``serve``: the proxy parks the conversation (state + checkpoint
   sidecar) and the server stops; ``serve`` again starts a new server;
3. **resumed**: the conversation's next turn (its history, the answer, a short question). serve's
   proxy restores the park by itself: by its warm start (the parks used last into the free slots at
   the start, before any request) unless ``--no-warm`` (the request's own restore, on its path). With
   the warm start the turn is sent once serve says ``warm start: restored …`` (the time from ready to
   that line is ``warm_s``): a user's next turn after a restart comes seconds later, not at once.
   Time to first token (with ``--no-warm`` the restore included), and the server's own ``timings`` of the answer:
   ``prompt_n`` is the tokens re-processed, ``cache_n`` the ones reused. Steps 2-3 repeat
   ``--runs`` times (each run one more turn of the same conversation: a restart is cheap).

Figures: time to first token resumed vs cold and their ratio (goal ≥ 100×: the whole prompt's
prefill against the restore and the new turn's few tokens), the same ratio of the server's
``prompt_ms``, tokens re-processed, the proxy's line for the request (verdict, restored from).
Medians over the runs. The cold turn's prompt is the resumed one's minus the last exchanges (50
tokens a run, of 32K): the comparison is the same prompt within that.

It checks in tokens (never times): every resumed turn restored from the park, a HIT, re-processing
under 5 % of the conversation. A broken claim is printed and the exit status is 1. ``--ci`` is a
quick mode (~2K tokens, one run) for trying it out; CI does not run it (its time is tight).

    .venv/bin/python tests/bench/bench_proxy_scale.py [--tokens 32768] [--runs 1] [--ci] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.bench_ab_scale import DELTA_MAX, TEXT, med, model_path, tool_path  # noqa: E402

#: the context (``-c``) is ``--tokens``, the whole conversation (Gemma 3 270M's training context is
#: 32,768 and the server holds no more): its first turn leaves room for the chat template's markers
#: and question (``ROOM``) and, per resumed turn, an answer (``MAX_TOKENS``), a question and markers
ROOM, ROOM_PER_TURN = 128, 64
MAX_TOKENS = 8
#: serve's line for a judged request carries the server's figures (app/cli/serve.py _print_request)
FIGURES = re.compile(r"cache_n (?P<cache_n>[\d,]+), prompt_n (?P<prompt_n>[\d,]+)")
#: a 32K cold prefill of Gemma 3 270M takes minutes on two cores: the client waits that long
CLIENT_TIMEOUT_S = 3600
FAILURES: list[str] = []


def say(text: str) -> None:
    print(f"[bench_proxy_scale] {text}", file=sys.stderr, flush=True)


async def ask(client, messages: list[dict]) -> dict:
    """One streamed turn: time to the first content token, the answer, the server's ``timings``
    (llama-server's final chunk carries them; the proxy passes them on)."""
    t0 = time.perf_counter()
    first = None
    parts: list[str] = []
    timings = None
    stream = await client.chat.completions.create(model="gemma", messages=messages, max_tokens=MAX_TOKENS,
                                                  temperature=0, stream=True)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            parts.append(chunk.choices[0].delta.content)
        timings = (chunk.model_extra or {}).get("timings") or timings
    end = time.perf_counter()
    return {"ttft_ms": ((first or end) - t0) * 1000.0, "total_ms": (end - t0) * 1000.0, "answer": "".join(parts),
            "prompt_n": (timings or {}).get("prompt_n"), "cache_n": (timings or {}).get("cache_n"),
            "prompt_ms": (timings or {}).get("prompt_ms")}


async def proxy_line(app) -> dict:
    """serve's line for the request just answered: verdict, restored from, and its figures."""
    rec = await app.request()
    m = FIGURES.search(app.lines[-1])
    return {"verdict": rec["verdict"], "conversation": rec["conv"], "restored_from": rec["restored"],
            "cause": rec["cause"], "line": app.lines[-1],
            **({k: int(v.replace(",", "")) for k, v in m.groupdict().items()} if m else {})}


async def conversation_text(url: str, tokens: int) -> str:
    """About ``tokens`` tokens of text, cut by the server's own tokenizer (the proxy's /tokenize)."""
    import httpx

    async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=120) as h:
        r = await h.post("/tokenize", json={"content": TEXT * (tokens // 30 + 10)})
        r.raise_for_status()
        ids = r.json()["tokens"][:tokens]
        r = await h.post("/detokenize", json={"tokens": ids})
        r.raise_for_status()
        return r.json()["content"]


async def run(profile, args) -> dict:
    import openai

    from tests.real.test_real_proxy_hard import Serve

    say(f"serve {profile.name} --proxy (cold): ctx {profile.ctx_size:,} tokens, one slot")
    app = await Serve.start(profile.name)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{profile.port}/v1", api_key="not-needed",
                                max_retries=0, timeout=CLIENT_TIMEOUT_S)
    try:
        text = await conversation_text(profile.url, args.tokens - ROOM - ROOM_PER_TURN * args.runs)
        messages = [{"role": "user", "content": text + "\nWhere is the car?"}]
        t0 = time.perf_counter()
        cold = await ask(client, messages) | await proxy_line(app)
        say(f"cold: {cold['prompt_n']:,} tokens, first token in {cold['ttft_ms'] / 1000:,.1f} s "
            f"({time.perf_counter() - t0:,.0f} s wall); {cold['line']}")
        resumed = []
        for i in range(args.runs):
            messages += [{"role": "assistant", "content": cold["answer"] if i == 0 else resumed[-1]["answer"]},
                         {"role": "user", "content": f"And in turn {i + 2}, which bay?"}]
            t0 = time.perf_counter()
            await app.stop()  # Ctrl-C: the proxy parks the conversation, the server stops
            stop_s = time.perf_counter() - t0
            parks = sorted(p.name for p in Path(profile.slot_save_path).iterdir())
            t0 = time.perf_counter()
            app = await Serve.start(profile.name)
            start_s = time.perf_counter() - t0
            warm_s = None
            if not args.no_warm:  # the warm start's line: the park is in the slot
                t0 = time.perf_counter()
                line = await app.expect("[kv-valet] warm start: ", timeout=CLIENT_TIMEOUT_S)
                warm_s = time.perf_counter() - t0
                say(f"{line} ({warm_s:.1f} s after ready)")
            r = await ask(client, messages) | await proxy_line(app)
            r |= {"stop_s": stop_s, "start_s": start_s, "warm_s": warm_s, "parks": parks}
            resumed.append(r)
            say(f"run {i + 1} of {args.runs}: stop (park) {stop_s:.1f} s, start {start_s:.1f} s, first token in "
                f"{r['ttft_ms']:,.0f} ms ({'the restore included' if args.no_warm else 'restored before, by the warm start'}); "
                f"{r['line']}")
            judge(i + 1, r, cold)
    finally:
        await client.close()
        await app.end(profile.name)
    ttft, prompt_ms = med([r["ttft_ms"] for r in resumed]), med([r["prompt_ms"] for r in resumed])
    return {"tokens": args.tokens, "ctx": profile.ctx_size, "runs": len(resumed), "cold": cold, "resumed": resumed,
            "resumed_ttft_ms": ttft, "resumed_prompt_ms": prompt_ms,
            "resumed_prompt_n": med([r["prompt_n"] for r in resumed]),
            "resumed_cache_n": med([r["cache_n"] for r in resumed]),
            "ttft_ratio": cold["ttft_ms"] / ttft if ttft else None,
            "prompt_ratio": cold["prompt_ms"] / prompt_ms if prompt_ms and cold["prompt_ms"] else None}


def judge(i: int, r: dict, cold: dict) -> None:
    """The claims, in tokens: restored from its park by the proxy, warm (HIT), a delta re-processed."""
    conv = cold["conversation"]
    if r["conversation"] != conv or r["restored_from"] != f"proxy-{conv}":
        FAILURES.append(f"run {i}: not restored from the conversation's park: {r['line']}")
    if r["verdict"] != "HIT":
        FAILURES.append(f"run {i}: verdict {r['verdict']}, expected HIT: {r['line']}")
    whole = (r["cache_n"] or 0) + (r["prompt_n"] or 0)
    if r["prompt_n"] is None or r["prompt_n"] >= whole * DELTA_MAX:
        FAILURES.append(f"run {i}: re-processed {r['prompt_n']} of {whole:,} tokens; expected under {DELTA_MAX:.0%}")


def table(res: dict) -> str:
    f = lambda x, d=0: "-" if x is None else f"{x:,.{d}f}"  # noqa: E731
    c = res["cold"]
    return "\n".join([
        "| turn | prompt_n (processed) | cache_n | first token ms | prompt ms |", "|---|---:|---:|---:|---:|",
        f"| cold (fresh server, first turn) | {f(c['prompt_n'])} | {f(c['cache_n'])} | {f(c['ttft_ms'])} | "
        f"{f(c['prompt_ms'])} |",
        f"| resumed after restart (median of {res['runs']}) | {f(res['resumed_prompt_n'])} | "
        f"{f(res['resumed_cache_n'])} | {f(res['resumed_ttft_ms'])} | {f(res['resumed_prompt_ms'], 1)} |",
        "", f"first token, cold / resumed: {f(res['ttft_ratio'])}× (goal ≥ 100×); prompt ms, cold / resumed: "
        f"{f(res['prompt_ratio'])}×", "warm start: " + (
            f"the park in its slot {f(res['resumed_warm_s'], 1)} s after ready (median)" if res.get("warm_start")
            else "off (--no-warm): the restore is on the turn's path")])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768, help="the context and the whole conversation, in tokens")
    ap.add_argument("--runs", type=int, default=1, help="restart-and-resume runs (medians); the cold prefill is once")
    ap.add_argument("--ci", action="store_true", help="a quick mode: ~2K tokens, one run")
    ap.add_argument("--no-warm", action="store_true",
                    help="the proxy's warm start off (proxy_warm_start=false): the request restores its park")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.ci:
        args.tokens, args.runs = 2048, 1
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvv-bench-proxy-scale-") as tmp:
        work = Path(tmp)
        for var, sub in (("KV_VALET_CONFIG_DIR", "config"), ("KV_VALET_DATA_DIR", "data"),
                         ("KV_VALET_STATE_DIR", "state")):
            os.environ[var] = str(work / sub)
        os.environ["KVV_SIDECAR_MODE"] = "v2"  # serve's server inherits it

        from app.core.profile import LaunchProfile
        from app.store.profiles import ProfileStore
        from tests.bench.bench_ab import free_port

        model, _kind = model_path("gemma", work)
        profile = LaunchProfile(name="bench-proxy-scale", model=model, server_binary=tool_path(), port=free_port(),
                                ctx_size=args.tokens, parallel=1, proxy=True,
                                slot_save_path=str(work / "slots") + "/")
        ProfileStore().save(profile)
        if args.no_warm:
            from app import settings

            settings.update(proxy_warm_start=False)
        res = asyncio.run(run(profile, args))
        res["warm_start"] = not args.no_warm
        res["resumed_warm_s"] = med([r["warm_s"] for r in res["resumed"] if r["warm_s"] is not None]) \
            if not args.no_warm else None
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    machine = f"{os.cpu_count()} cores, {platform.machine()}, no GPU, {when}"
    report = {"machine": machine, "seconds": round(time.perf_counter() - t_start), "result": res, "failures": FAILURES}
    print(f"\n== a conversation across a restart of serve --proxy (sidecar build v2, Gemma 3 270M; {machine}; "
          f"{report['seconds']} s) ==\n\n{table(res)}" + "".join(f"\nFAILED: {f}" for f in FAILURES))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 1 if FAILURES else 0

if __name__ == "__main__":
    sys.exit(main())
