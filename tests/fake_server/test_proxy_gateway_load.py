"""The two request gauges a gateway reads (``vllm:num_requests_waiting`` and ``..._running``, issue #38)
as the proxy's HTTP layer counts them, scraped at ``/kv-valet/metrics`` through real sockets: a request
the interceptor holds (a slot lease, a park, a restore) is waiting; one sent to the server whose answer
has not ended is running; neither once its answer has ended or ``before`` refused it.

Ordering, not timing: the interceptor's ``before`` waits on an event the test sets, and the fake holds
its stream after the first token (FAKE_COMPLETION_DELAY) until the test sends SIGUSR2."""

from __future__ import annotations

import asyncio
import signal

import httpx
from prometheus_client.parser import text_string_to_metric_families

from app.proxy.http import ProxyServer
from app.proxy.metrics import ProxyMetrics, proxy_load
from app.server.client import LlamaClient
from tests.fake_server.conftest import run_fake_server
from tests.fake_server.test_proxy_http import HOLD, PROMPT, WAIT, Recorder, sse_events


class Gated(Recorder):
    """Holds each request in ``before`` until ``gate`` is set (as a request waiting for a slot lease);
    refuses one that asks for it."""

    def __init__(self):
        super().__init__()
        self.entered, self.gate = asyncio.Event(), asyncio.Event()

    async def before(self, path, headers, body):
        self.entered.set()
        await self.gate.wait()
        if body.get("refuse"):
            raise RuntimeError("refused by the test")
        return await super().before(path, headers, body)


async def test_waiting_then_running_then_neither(tmp_path):
    rec = Gated()
    with run_fake_server(tmp_path, FAKE_COMPLETION_DELAY=HOLD) as (url, proc):
        client = LlamaClient(url)
        proxy = ProxyServer(client, interceptor=rec, metrics=lambda: metrics.exposition())
        metrics = ProxyMetrics("fake", model_name="m", load=lambda: proxy_load(proxy, None, [], False))
        await proxy.start("127.0.0.1", 0)
        try:
            async with httpx.AsyncClient(timeout=WAIT) as h:
                async def gauges() -> tuple[float, float]:
                    r = await h.get(proxy.url + "/kv-valet/metrics")
                    got = {s.name: s.value for f in text_string_to_metric_families(r.text) for s in f.samples}
                    return got["vllm:num_requests_running"], got["vllm:num_requests_waiting"]

                first_token = asyncio.Event()

                async def stream():
                    body = {"prompt": PROMPT, "n_predict": 3, "stream": True}
                    async with h.stream("POST", proxy.url + "/completion", json=body) as r:
                        events = sse_events(r)
                        await anext(events)
                        first_token.set()
                        return [e async for e in events]

                assert await gauges() == (0, 0)
                task = asyncio.create_task(stream())
                await asyncio.wait_for(rec.entered.wait(), WAIT)
                assert await gauges() == (0, 1)  # held by the proxy, not sent yet
                rec.gate.set()
                await asyncio.wait_for(first_token.wait(), WAIT)
                assert await gauges() == (1, 0)  # at the server: the fake holds the rest of its answer
                proc.send_signal(signal.SIGUSR2)
                rest = await asyncio.wait_for(task, WAIT)
                assert rest[-1]["stop"] is True
                await rec.next_result()  # ``after`` runs once the answer has ended
                assert await gauges() == (0, 0)
                r = await h.post(proxy.url + "/completion", json={"prompt": "x", "refuse": True})
                assert r.status_code == 500 and await gauges() == (0, 0)  # refused in ``before``: counted out
        finally:
            await proxy.stop()
            await client.aclose()
