"""Benchmark: NVIDIA Dynamo's KV router, fed by two KV Valet proxies' KV events, sends a returning
conversation to the server that holds it (its park on disk included).

Not a test: Dynamo is not one of the project's dependencies. Its runtime (``ai-dynamo-runtime`` from
PyPI; the ``ai-dynamo`` meta-package does not install here, see docs/guide/proxy.md#kv-events) lives in
a scratch venv whose interpreter is given as ``--dynamo-python``; its half runs there
(tests/bench/dynamo_router_side.py: two Dynamo workers relaying the two proxies' ZMQ events with
Dynamo's own ``KvEventPublisher``, and a ``KvRouter`` over them).

Here: two fake llama-servers (tests/fake_server, 2 slots each), each behind ``serve --proxy
--kv-events tcp://127.0.0.1:PORT`` (``launch_profile`` with ``ProxyFront(kv_events=...)``), in
throw-away folders. Server 0 gets conversations A, B, C (text prompts): C takes A's slot, so A is
parked on disk. Server 1 gets D and E. Then the router is asked where each one's next turn goes (its
prompt as the server tokenises it): A, B and C to server 0, D and E to server 1, with the blocks it
matched. Then server 0 restarts (AllBlocksCleared, then its parks again) and A is asked about again.
Prints one line per question and, last, a JSON object of the answers.

    python3 -m venv /tmp/dynamo-venv && /tmp/dynamo-venv/bin/pip install ai-dynamo-runtime==1.6.1 pyzmq msgpack
    .venv/bin/python tests/bench/bench_kv_router.py --dynamo-python /tmp/dynamo-venv/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

FAKE = str(ROOT / "tests" / "fake_server" / "fake_llama_server.py")
SIDE = str(ROOT / "tests" / "bench" / "dynamo_router_side.py")


def prompt(name: str, turns: int = 1) -> str:
    return " ".join(f"{name}word{i}" for i in range(60 * turns))


class Server:
    """One fake llama-server behind its proxy, with KV events on ``endpoint``."""

    def __init__(self, label: str, endpoint: str, folder: Path) -> None:
        self.label, self.endpoint, self.folder = label, endpoint, folder

    async def start(self) -> None:
        import httpx

        from app.core.profile import LaunchProfile
        from app.proxy.front import ProxyFront
        from app.servers.launch import launch_profile
        from app.servers.service import ServerService
        from app.store.profiles import ProfileStore
        from tests.conftest import free_port

        model = self.folder / f"{self.label}.gguf"
        model.write_bytes(b"GGUF")
        profile = LaunchProfile(name=self.label, model=str(model), server_binary=FAKE, port=free_port(),
                                ctx_size=4096, parallel=2, proxy=True, cache_ram=0)
        ProfileStore().save(profile)
        self.servers = ServerService(front=ProxyFront(kv_events=self.endpoint))
        self.handle, self.proxy = await launch_profile(self.servers, profile)
        self.http = httpx.AsyncClient(base_url=self.proxy.url, timeout=60)
        self.direct = httpx.AsyncClient(base_url=self.handle.url, timeout=60)

    async def ask(self, text: str) -> None:
        r = await self.http.post("/completion", json={"prompt": text, "n_predict": 2})
        r.raise_for_status()
        await self.proxy.settle()
        await self.proxy.kv.settle()

    async def tokens(self, text: str) -> list[int]:
        r = await self.direct.post("/tokenize", json={"content": text, "add_special": True})
        return r.json()["tokens"]

    async def close(self) -> None:
        await self.http.aclose()
        await self.direct.aclose()
        await self.servers.aclose()


async def main(args) -> dict:
    from tests.conftest import free_port

    folder = Path(os.environ["KV_VALET_DATA_DIR"]).parent
    os.environ["FAKE_SIDECAR"] = "1"
    endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    servers = [Server(f"kvrouter-{i}", ep, folder) for i, ep in enumerate(endpoints)]
    for s in servers:
        await s.start()
    (folder / "model").mkdir()
    env = dict(os.environ, DYN_FILE_KV=str(folder / "dynamo-discovery"), DYN_LOG="warn")
    side = await asyncio.create_subprocess_exec(
        args.dynamo_python, SIDE, *[a for ep in endpoints for a in ("--zmq", ep)], "--model-dir", str(folder / "model"),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env)
    answers: dict[str, dict] = {}
    try:
        line = (await asyncio.wait_for(side.stdout.readline(), 120)).decode()
        if not line.startswith("ready "):
            raise SystemExit(f"the Dynamo side did not start: {line!r}")
        print(f"Dynamo workers {json.loads(line[6:])['workers']} (server 0, server 1)", flush=True)

        async def route(tokens: list[int], want: int | None) -> dict:
            """The router's answer, asked again until the events have reached it (it reads them
            asynchronously) or 30 s have passed; ``want`` None: the first answer."""
            deadline = time.monotonic() + 30
            while True:
                side.stdin.write((json.dumps(tokens) + "\n").encode())
                await side.stdin.drain()
                got = json.loads(await side.stdout.readline())
                if want is None or got["worker"] == want and got["overlap_blocks"] > 0 \
                        or time.monotonic() > deadline:
                    return got
                await asyncio.sleep(0.2)

        for name in "ABC":
            await servers[0].ask(prompt(name))
        for name in "DE":
            await servers[1].ask(prompt(name))
        parked = [c.id for c in servers[0].proxy.list() if c.parked_as]
        print(f"server 0 parked {len(parked)} conversation(s) on disk", flush=True)
        for name, want in (("A", 0), ("B", 0), ("C", 0), ("D", 1), ("E", 1)):
            tokens = await servers[want].tokens(prompt(name, 2))
            got = await route(tokens, want)
            answers[name] = got
            print(f"{name}'s next turn ({len(tokens)} tokens): routed to server {got['worker']}, "
                  f"{got['overlap_blocks']} blocks matched (expected server {want})", flush=True)
        got = await route(await servers[0].tokens(prompt("Z")), None)
        answers["a new conversation"] = got
        print(f"a new conversation: {got['overlap_blocks']} blocks matched (server {got['worker']}, by load)",
              flush=True)
        await servers[0].handle.supervisor.restart()
        await servers[0].proxy.kv.settle()
        tokens = await servers[0].tokens(prompt("A", 2))
        got = await route(tokens, 0)
        answers["A after server 0 restarted"] = got
        print(f"after server 0 restarted, A's next turn: routed to server {got['worker']}, "
              f"{got['overlap_blocks']} blocks matched", flush=True)
    finally:
        side.stdin.close()
        try:
            await asyncio.wait_for(side.wait(), 20)
        except asyncio.TimeoutError:
            side.kill()
        for s in servers:
            await s.close()
    ok = all(answers[n]["worker"] == (1 if n in "DE" else 0) and answers[n]["overlap_blocks"] > 0
             for n in answers if n != "a new conversation") and answers["a new conversation"]["overlap_blocks"] == 0
    return {"answers": answers, "all_routed_as_expected": ok}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dynamo-python", required=True, help="an interpreter with ai-dynamo-runtime (a scratch venv)")
    p.add_argument("--json", default=None, help="also write the answers here")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvv-bench-") as d:
        os.environ["KV_VALET_CONFIG_DIR"] = os.path.join(d, "config")
        os.environ["KV_VALET_DATA_DIR"] = os.path.join(d, "data")
        os.environ["KV_VALET_STATE_DIR"] = os.path.join(d, "state")
        result = asyncio.run(main(a))
    print(json.dumps(result))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    sys.exit(0 if result["all_routed_as_expected"] else 1)
