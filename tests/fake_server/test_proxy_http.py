"""The proxy's HTTP layer (app/proxy/http.py) against the fake llama-server: real sockets, a real
subprocess, the ``openai`` package as the chat client.

Ordering, not timing: where a test needs the upstream to be "still generating", the fake holds
its stream after the first token (FAKE_COMPLETION_DELAY) until the test sends SIGUSR2; the
interceptor's ``after`` is awaited through a queue. No sleeps, no wall-clock thresholds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal

import httpx
import openai
import pytest
from aiohttp import web

from app.proxy.http import INTERCEPTED, ProxyRefused, ProxyServer, Result, is_loopback_host
from app.server.client import LlamaClient, ServerError, ServerUnreachable
from tests.conftest import free_port
from tests.fake_server.conftest import run_fake_server

HOLD = "600"  # FAKE_COMPLETION_DELAY: held until SIGUSR2, never this long
WAIT = 30.0  # a bound for a failing test, never a measure
PROMPT = "the quiet valet parks the cache and fetches it back " * 4
AUTH_401 = {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}}


class Recorder:
    """An interceptor that records what it sees; ``slot`` pins every request to that slot."""

    def __init__(self, slot: int | None = None, fail_after: bool = False):
        self.slot = slot
        self.fail_after = fail_after
        self.seen: list[tuple[str, dict]] = []
        self.results: list[tuple[object, Result]] = []
        self.sent_ctx: list[object] = []
        self._done: asyncio.Queue[tuple[object, Result]] = asyncio.Queue()

    async def before(self, path, headers, body):
        self.seen.append((path, dict(body)))
        out = dict(body)
        if self.slot is not None:
            out["id_slot"] = self.slot
        out["cache_prompt"] = True
        return out, f"ctx-{len(self.seen)}"

    def ended(self, ctx):
        pass

    def sent(self, ctx):
        self.sent_ctx.append(ctx)

    async def after(self, ctx, result):
        self.results.append((ctx, result))
        self._done.put_nowait((ctx, result))
        if self.fail_after:
            raise RuntimeError("the interceptor's after broke")

    async def next_result(self) -> tuple[object, Result]:
        return await asyncio.wait_for(self._done.get(), WAIT)


@contextlib.asynccontextmanager
async def proxied(tmp_path, interceptor=None, api_key=None, upstream_key=None, extra_args=(), on_idle=None, **env):
    """``(fake_url, proxy, proc)``: the fake llama-server and a proxy in front of it."""
    with run_fake_server(tmp_path, extra_args=extra_args, **env) as (url, proc):
        client = LlamaClient(url, api_key=upstream_key)
        proxy = ProxyServer(client, interceptor=interceptor, api_key=api_key, on_idle=on_idle)
        await proxy.start("127.0.0.1", 0)
        try:
            yield url, proxy, proc
        finally:
            await proxy.stop()
            await client.aclose()


async def sse_events(resp: httpx.Response):
    async for line in resp.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def log_text(proc) -> str:
    return proc.log_path.read_text(errors="replace")


# -- pass-through --------------------------------------------------------------------------

async def test_read_only_endpoints_pass_through_byte_identical(tmp_path):
    async with proxied(tmp_path, Recorder()) as (url, proxy, proc):
        async with httpx.AsyncClient(base_url=url) as direct, httpx.AsyncClient(base_url=proxy.url) as via:
            await direct.post("/completion", json={"prompt": PROMPT, "n_predict": 2})  # /slots shows a task
            for path in ("/health", "/props", "/slots", "/metrics", "/nope"):
                d, p = await direct.get(path), await via.get(path)
                assert (p.status_code, p.content) == (d.status_code, d.content), path
                assert p.headers["content-type"] == d.headers["content-type"], path
            # /v1/models carries the time of the answer: the proxy's lies between two direct ones
            d1, p, d2 = await direct.get("/v1/models"), await via.get("/v1/models"), await direct.get("/v1/models")
            assert p.status_code == 200 and p.content in (d1.content, d2.content)
            assert p.json()["data"][0]["owned_by"] == "llamacpp"
            # a POST that is not a completion, and a query string, pass through too
            d, p = (await direct.post("/tokenize", json={"content": "hello world"}),
                    await via.post("/tokenize", json={"content": "hello world"}))
            assert (p.status_code, p.content) == (d.status_code, d.content)
            p = await via.post("/slots/0?action=frobnicate", json={"filename": "x.bin"})
            assert p.status_code == 400 and p.json()["error"]["message"] == "Invalid action"


async def test_a_body_that_is_not_json_passes_through_untouched(tmp_path):
    rec = Recorder()
    async with proxied(tmp_path, rec) as (url, proxy, proc):
        async with httpx.AsyncClient() as h:
            d = await h.post(url + "/completion", content=b"{not json")
            p = await h.post(proxy.url + "/completion", content=b"{not json")
    assert (p.status_code, p.content) == (d.status_code, d.content) and p.status_code == 400
    assert rec.seen == [] and rec.results == []


# -- completions through the interceptor --------------------------------------------------------

async def test_completion_not_streamed_is_the_same_as_direct(tmp_path):
    rec = Recorder()
    async with proxied(tmp_path, rec) as (url, proxy, proc):
        async with httpx.AsyncClient() as h:
            body = {"prompt": PROMPT, "n_predict": 8}
            direct = (await h.post(url + "/completion", json=body)).json()
            r = await h.post(proxy.url + "/completion", json=body)
            via = r.json()
        ctx, result = await rec.next_result()
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    assert via["content"] == direct["content"] and via["tokens_predicted"] == 8
    assert rec.seen == [("/completion", body)]
    assert ctx == "ctx-1"
    assert result.status == 200 and result.stream is False and not result.disconnected and result.error is None
    assert result.final == via and result.final["timings"]["predicted_n"] == 8


async def test_completion_streamed_is_the_same_as_direct(tmp_path):
    rec = Recorder()
    async with proxied(tmp_path, rec) as (url, proxy, proc):
        body = {"prompt": PROMPT, "n_predict": 6, "stream": True}
        async with httpx.AsyncClient() as h:
            async with h.stream("POST", url + "/completion", json=body) as r:
                direct = [e async for e in sse_events(r)]
            async with h.stream("POST", proxy.url + "/completion", json=body) as r:
                assert r.headers["content-type"] == "text/event-stream"
                assert "content-length" not in r.headers
                via = [e async for e in sse_events(r)]
        ctx, result = await rec.next_result()
    assert "".join(e["content"] for e in via) == "".join(e["content"] for e in direct)
    assert [e["stop"] for e in via] == [False] * 6 + [True]
    assert result.stream is True and result.status == 200 and result.error is None and not result.disconnected
    assert result.final == via[-1] and result.final["timings"]["predicted_n"] == 6
    assert rec.seen[0][1]["stream"] is True


async def test_chat_with_the_openai_client_not_streamed_and_streamed(tmp_path):
    rec = Recorder()
    messages = [{"role": "system", "content": "You park cars."}, {"role": "user", "content": "Where is my car?"}]
    async with proxied(tmp_path, rec) as (url, proxy, proc):
        direct = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        via = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
        try:
            d = await direct.chat.completions.create(model="m", messages=messages, max_tokens=8)
            p = await via.chat.completions.create(model="m", messages=messages, max_tokens=8)
            _, plain = await rec.next_result()

            async def streamed(client, **kw):
                stream = await client.chat.completions.create(model="m", messages=messages, max_tokens=8,
                                                               stream=True, **kw)
                return [c async for c in stream]

            d_chunks = await streamed(direct)
            p_chunks = await streamed(via)
            _, live = await rec.next_result()
            u_chunks = await streamed(via, stream_options={"include_usage": True})
            _, usage = await rec.next_result()
        finally:
            await direct.close()
            await via.close()

    assert p.choices[0].message.content == d.choices[0].message.content != ""
    assert [path for path, _ in rec.seen] == ["/v1/chat/completions"] * 3
    assert rec.seen[0][1]["messages"] == messages and rec.seen[0][1]["max_tokens"] == 8
    assert plain.stream is False and plain.final["timings"] == p.model_extra["timings"]
    assert plain.final["choices"][0]["message"]["content"] == p.choices[0].message.content

    def text(chunks):
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    assert text(p_chunks) == text(d_chunks) == p.choices[0].message.content
    assert live.stream is True and live.status == 200 and live.error is None
    assert live.final["timings"] == p_chunks[-1].model_extra["timings"]
    assert live.final["choices"][0]["finish_reason"] == "length"
    # with usage: the timings ride on the last chunk (no choices), after the finish chunk
    assert usage.final["choices"] == [] and usage.final["usage"]["completion_tokens"] == 8
    assert usage.final["timings"] == u_chunks[-1].model_extra["timings"]


async def test_the_interceptor_pins_the_slot(tmp_path):
    """Left alone the fake picks slot 1 (LRU); the interceptor sends the request to slot 0."""
    rec = Recorder(slot=0)
    async with proxied(tmp_path, rec) as (url, proxy, proc):
        via = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
        try:
            await via.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        finally:
            await via.close()
        await rec.next_result()
        async with httpx.AsyncClient() as h:
            slots = (await h.get(url + "/slots")).json()
    assert "id_task" in slots[0] and "id_task" not in slots[1]
    assert "selected slot by id (0)" in log_text(proc)
    assert "id_slot" not in rec.seen[0][1]  # the client sent none: the interceptor added it


async def test_after_failing_is_logged_and_the_client_gets_its_answer(tmp_path, caplog):
    rec = Recorder(fail_after=True)
    async with proxied(tmp_path, rec) as (url, proxy, proc):
        async with httpx.AsyncClient() as h:
            r = await h.post(proxy.url + "/completion", json={"prompt": PROMPT, "n_predict": 2})
            await rec.next_result()
            again = await h.post(proxy.url + "/completion", json={"prompt": PROMPT, "n_predict": 2})
            await rec.next_result()
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 2 and again.status_code == 200
    failures = [rec_ for rec_ in caplog.records if "interceptor failed after" in rec_.getMessage()]
    assert len(failures) == 2 and "POST /completion" in failures[0].getMessage()
    assert "the interceptor's after broke" in str(failures[0].exc_info[1])


async def test_the_idle_work_runs_once_nothing_is_in_flight_never_inside_a_request(tmp_path):
    """``on_idle`` (where the proxy's service checkpoints its store and ``serve`` collects garbage) comes
    after an answer's ``after``, and not while another request waits in ``before`` or runs upstream."""
    entered, gate = asyncio.Event(), asyncio.Event()

    class Gated(Recorder):
        async def before(self, path, headers, body):
            if body.get("prompt") == "held":
                entered.set()
                await gate.wait()
            return await super().before(path, headers, body)

    rec, idle, seen = Gated(), [], []
    async with proxied(tmp_path, rec, on_idle=lambda: idle.append((seen[0].waiting, seen[0].running,
                                                                   len(rec.results)))) as (url, proxy, proc):
        seen.append(proxy)
        async with httpx.AsyncClient(timeout=WAIT) as h:
            one = {"prompt": PROMPT, "n_predict": 2}
            assert (await h.post(proxy.url + "/completion", json=one)).status_code == 200
            await rec.next_result()
            assert idle == [(0, 0, 1)]  # the answer judged, nothing else in flight
            held = asyncio.create_task(h.post(proxy.url + "/completion", json={"prompt": "held", "n_predict": 2}))
            await asyncio.wait_for(entered.wait(), WAIT)
            assert (await h.post(proxy.url + "/completion", json=one)).status_code == 200
            await rec.next_result()
            assert idle == [(0, 0, 1)]  # judged, but the held request still waits in before: no idle work
            gate.set()
            assert (await asyncio.wait_for(held, WAIT)).status_code == 200
            await rec.next_result()
    assert idle == [(0, 0, 1), (0, 0, 3)]


# -- streaming: never buffered; a client that goes away ----------------------------------------

async def test_a_stream_reaches_the_client_before_the_upstream_has_finished(tmp_path):
    """The fake sends the first token, then holds the rest until SIGUSR2; the client must see
    that first token through the proxy while the upstream still holds its last one."""
    rec = Recorder()
    order: list[str] = []
    async with proxied(tmp_path, rec, FAKE_COMPLETION_DELAY=HOLD) as (url, proxy, proc):
        async with httpx.AsyncClient(timeout=WAIT) as h:
            body = {"prompt": PROMPT, "n_predict": 5, "stream": True}
            async with h.stream("POST", proxy.url + "/completion", json=body) as r:
                events = sse_events(r)
                first = await asyncio.wait_for(anext(events), WAIT)
                order.append("first token at the client")
                assert first["stop"] is False and first["tokens_predicted"] == 1
                assert not rec.results  # the request is still running
                proc.send_signal(signal.SIGUSR2)  # only now may the upstream send the rest
                order.append("upstream released")
                rest = [e async for e in events]
                order.append("last event at the client")
        _, result = await rec.next_result()
    assert order == ["first token at the client", "upstream released", "last event at the client"]
    assert [e["stop"] for e in rest] == [False] * 4 + [True]
    assert result.final["timings"]["predicted_n"] == 5 and not result.disconnected


async def test_a_client_that_goes_away_mid_stream(tmp_path):
    rec = Recorder(slot=0)
    async with proxied(tmp_path, rec, FAKE_COMPLETION_DELAY=HOLD) as (url, proxy, proc):
        async with httpx.AsyncClient(timeout=WAIT) as h:
            body = {"messages": [{"role": "user", "content": "tell me a long story"}], "max_tokens": 64,
                    "stream": True}
            async with h.stream("POST", proxy.url + "/v1/chat/completions", json=body) as r:
                events = sse_events(r)
                first = await asyncio.wait_for(anext(events), WAIT)
                assert first["choices"][0]["delta"]["role"] == "assistant"
            # leaving the block mid-stream closes the connection: the client is gone
            _, result = await rec.next_result()
            assert result.disconnected is True and result.stream is True and result.status == 200
            assert result.error is None
            proc.send_signal(signal.SIGUSR2)  # the fake writes on, into the closed connection
            # the proxy keeps serving; this request waits for slot 0, which the cancel frees
            r = await h.post(proxy.url + "/completion", json={"prompt": PROMPT, "n_predict": 3})
            _, after = await rec.next_result()
    assert r.status_code == 200 and r.json()["id_slot"] == 0
    assert not after.disconnected and after.final["timings"]["predicted_n"] == 3
    assert "cancel task" in log_text(proc)  # the upstream request was dropped, not drained
    assert len(rec.results) == 2  # after: exactly once per request


async def test_an_upstream_that_dies_mid_stream_cuts_the_client_short(tmp_path):
    """The client must see an incomplete answer (no clean end of the chunked body), and ``after``
    the error."""
    rec = Recorder()
    async with proxied(tmp_path, rec, FAKE_COMPLETION_DELAY=HOLD) as (url, proxy, proc):
        async with httpx.AsyncClient(timeout=WAIT) as h:
            body = {"prompt": PROMPT, "n_predict": 5, "stream": True}
            async with h.stream("POST", proxy.url + "/completion", json=body) as r:
                events = sse_events(r)
                first = await asyncio.wait_for(anext(events), WAIT)
                proc.kill()
                with pytest.raises(httpx.RemoteProtocolError):
                    [e async for e in events]
            _, result = await rec.next_result()
            assert (await h.get(proxy.url + "/health")).status_code == 502  # and it still answers
    assert result.status == 200 and result.error and not result.disconnected
    assert result.final == first  # the last event it saw; none carried timings


async def test_stopping_the_proxy_mid_stream_still_calls_after(tmp_path):
    rec = Recorder()
    with run_fake_server(tmp_path, FAKE_COMPLETION_DELAY=HOLD) as (url, proc):
        client = LlamaClient(url)
        proxy = ProxyServer(client, interceptor=rec)
        await proxy.start("127.0.0.1", 0)
        try:
            async with httpx.AsyncClient(timeout=WAIT) as h:
                body = {"prompt": PROMPT, "n_predict": 5, "stream": True}
                async with h.stream("POST", proxy.url + "/completion", json=body) as r:
                    events = sse_events(r)
                    await asyncio.wait_for(anext(events), WAIT)
                    await proxy.stop()  # the held request is cancelled after the shutdown grace
                    with pytest.raises(httpx.RemoteProtocolError):
                        [e async for e in events]
            _, result = await rec.next_result()
        finally:
            await proxy.stop()
            await client.aclose()
    assert result.disconnected and result.error == "the proxy stopped" and len(rec.results) == 1


async def test_parallel_streams_all_arrive(tmp_path):
    rec = Recorder()
    async with proxied(tmp_path, rec) as (url, proxy, proc):
        async with httpx.AsyncClient(timeout=WAIT) as h:
            async def one(i: int) -> dict:
                body = {"prompt": f"{PROMPT} number {i}", "n_predict": 4, "stream": True}
                async with h.stream("POST", proxy.url + "/completion", json=body) as r:
                    return [e async for e in sse_events(r)][-1]

            finals = await asyncio.gather(*(one(i) for i in range(6)))
            results = [await rec.next_result() for _ in range(6)]
    assert all(f["stop"] and f["timings"]["predicted_n"] == 4 for f in finals)
    assert sorted(ctx for ctx, _ in results) == sorted(f"ctx-{i}" for i in range(1, 7))
    assert all(not r.disconnected and r.error is None for _, r in results)


# -- security --------------------------------------------------------------------------------

async def test_a_public_host_without_a_key_is_refused():
    client = LlamaClient("http://127.0.0.1:9")
    try:
        for host in ("0.0.0.0", "", "::", "192.168.1.20", "myhost.lan"):
            with pytest.raises(ProxyRefused) as e:
                await ProxyServer(client).start(host, 0)
            assert "without an API key" in str(e.value) and "anyone on the network" in str(e.value)
    finally:
        await client.aclose()
    assert all(is_loopback_host(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"))


async def test_every_listen_address_is_served(tmp_path):
    """llama-server's ``--host 127.0.0.1,::1``: the proxy listens on both, on the one port; a list with a
    public address in it still needs a key."""
    with run_fake_server(tmp_path) as (url, proc):
        client = LlamaClient(url)
        proxy = ProxyServer(client)
        try:
            with pytest.raises(ProxyRefused):
                await ProxyServer(client).start("127.0.0.1,192.168.1.20", 0)
            await proxy.start("127.0.0.1,::1", 0)
            assert [h for h, _ in proxy.addresses] == ["127.0.0.1", "::1"]
            port = proxy.addresses[0][1]
            assert proxy.addresses[1][1] == port and proxy.url == f"http://127.0.0.1:{port}"
            async with httpx.AsyncClient() as h:
                for base in (f"http://127.0.0.1:{port}", f"http://[::1]:{port}"):
                    r = await h.get(base + "/health")
                    assert r.status_code == 200 and r.json()["status"] == "ok", base
        finally:
            await proxy.stop()
            await client.aclose()


async def test_the_key_is_required_and_never_shown(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    key, upstream_key = "proxy-sekrit-42", "upstream-sekrit-7"
    rec = Recorder()
    async with proxied(tmp_path, rec, api_key=key, upstream_key=upstream_key,
                       extra_args=["--api-key", upstream_key]) as (url, proxy, proc):
        assert key not in repr(proxy) and upstream_key not in repr(proxy)
        wrong = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="wrong", max_retries=0)
        right = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0)
        try:
            with pytest.raises(openai.AuthenticationError) as e:
                await wrong.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            assert e.value.status_code == 401
            # the proxy's key is replaced by the server's own on the way up
            ok = await right.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=2)
            await rec.next_result()
        finally:
            await wrong.close()
            await right.close()
        async with httpx.AsyncClient(base_url=proxy.url) as h:
            assert (await h.get("/health")).status_code == 200  # public, like llama-server's
            r = await h.get("/slots")
            assert r.status_code == 401 and r.json() == AUTH_401
            r = await h.get("/slots", headers={"Authorization": "Bearer " + upstream_key})
            assert r.status_code == 401  # the server's key is not the proxy's
            assert (await h.get("/slots", headers={"Authorization": f"Bearer {key}"})).status_code == 200
    assert ok.choices[0].message.content
    assert len(rec.seen) == 1  # the refused request never reached the interceptor
    assert key not in caplog.text and upstream_key not in caplog.text


# -- upstream down; forward() ----------------------------------------------------------------

async def test_upstream_down_is_a_502(caplog):
    rec = Recorder()
    client = LlamaClient(f"http://127.0.0.1:{free_port()}")
    proxy = ProxyServer(client, interceptor=rec)
    await proxy.start("127.0.0.1", 0)
    try:
        async with httpx.AsyncClient(base_url=proxy.url) as h:
            r = await h.get("/health")
            c = await h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        _, result = await rec.next_result()
    finally:
        await proxy.stop()
        await client.aclose()
    for resp in (r, c):
        assert resp.status_code == 502
        err = resp.json()["error"]
        assert err["code"] == 502 and err["type"] == "unavailable_error" and "unreachable" in err["message"]
    assert result.status == 502 and result.error and result.final is None and not result.disconnected
    assert rec.sent_ctx == []  # never sent: never told so


async def test_the_interceptor_is_told_once_the_request_is_sent_before_its_answer():
    """``sent`` (where the proxy runs what it held off the request's path, issue #38) comes once the body is
    on its way, before the answer: the upstream here reads the body, then answers only once it was told."""
    told = asyncio.Event()
    bodies: list[bytes] = []

    async def handler(request):
        bodies.append(await request.read())
        await asyncio.wait_for(told.wait(), WAIT)
        return web.json_response({"content": "ok"})

    class Telling(Recorder):
        def sent(self, ctx):
            super().sent(ctx)
            told.set()

    rec = Telling(slot=1)
    async with served(handler) as (port, client):
        proxy = ProxyServer(client, interceptor=rec)
        await proxy.start("127.0.0.1", 0)
        try:
            async with httpx.AsyncClient(base_url=proxy.url, timeout=WAIT) as h:
                r = await h.post("/completion", json={"prompt": PROMPT, "n_predict": 2})
            ctx, result = await rec.next_result()
        finally:
            await proxy.stop()
    assert r.status_code == 200 and r.json() == {"content": "ok"} and result.status == 200
    assert rec.sent_ctx == [ctx]  # once, for that request
    assert json.loads(bodies[0]) == {"prompt": PROMPT, "n_predict": 2, "id_slot": 1, "cache_prompt": True}


@contextlib.asynccontextmanager
async def served(handler, **client_kw):
    """``handler`` on every path of a loopback aiohttp server, and a LlamaClient to it: (its port, the client)."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    client = LlamaClient(f"http://127.0.0.1:{port}", **client_kw)
    try:
        yield port, client
    finally:
        await client.aclose()
        await runner.cleanup()


async def test_forward_drops_hop_by_hop_headers_and_replaces_the_authorization():
    seen: list[dict] = []

    async def echo(request: web.Request) -> web.Response:
        seen.append({k.lower(): v for k, v in request.headers.items()})
        return web.json_response({"path": request.path_qs})

    async with served(echo, api_key="server-key") as (port, client):
        headers = {"Authorization": "Bearer client-key", "X-Api-Key": "client-key", "Connection": "close, X-Hop",
                   "X-Hop": "1", "Keep-Alive": "timeout=5", "TE": "trailers", "Trailer": "X-T", "Upgrade": "h2c",
                   "Proxy-Authorization": "Basic eA==", "Host": "elsewhere.example", "Content-Length": "999",
                   "Transfer-Encoding": "chunked", "Accept-Encoding": "gzip", "X-Session-Id": "abc"}
        async with client.forward("POST", "/slots/0?action=save", headers=headers, content=b"{}") as r:
            assert r.status_code == 200 and json.loads(await r.aread()) == {"path": "/slots/0?action=save"}
        with pytest.raises(ValueError):
            async with client.forward("GET", "http://elsewhere.example/", headers={}, content=None):
                pass
    got = seen[0]
    assert got["authorization"] == "Bearer server-key" and "x-api-key" not in got
    for name in ("x-hop", "keep-alive", "te", "trailer", "upgrade", "proxy-authorization", "transfer-encoding"):
        assert name not in got, name
    assert got["host"] == f"127.0.0.1:{port}" and got["content-length"] == "2"
    assert got["accept-encoding"] == "identity" and got["x-session-id"] == "abc"
    assert "content-type" not in got  # none made up for a body the client sent without one


async def test_forward_passes_a_redirect_and_a_head_on_as_they_are():
    """forward() hands the server's own answer back: a redirect is not followed, a HEAD has no body."""
    async def moved(request: web.Request) -> web.Response:
        return web.Response(status=302, headers={"Location": "/elsewhere", "X-Case": "Kept"})

    async with served(moved) as (_port, client):
        async with client.forward("GET", "/moved", headers={}, content=None) as r:
            assert r.status_code == 302 and r.headers.get("location") == "/elsewhere"
            assert (b"X-Case", b"Kept") in list(r.headers.raw)
        async with client.forward("HEAD", "/moved", headers={}, content=None) as r:
            assert r.status_code == 302 and await r.aread() == b""


class Unanswering:
    """A bare HTTP/1.1 server (asyncio streams) that plays llama-server's close after an event
    stream at its worst: a connection that carried a stream (or ``/then-close``) stays open,
    announcing keep-alive, and the next request on it is dropped unanswered. Other requests get
    ``[]``. Counts the requests it answered."""

    def __init__(self):
        self.answered: list[str] = []
        self.dropped = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        doomed = False
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                lines = head.decode().split("\r\n")
                path = lines[0].split(" ")[1]
                length = next((int(v) for k, _, v in (x.partition(": ") for x in lines[1:])
                               if k.lower() == "content-length"), 0)
                await reader.readexactly(length)
                if doomed:
                    self.dropped += 1
                    break
                self.answered.append(path)
                if path == "/stream":
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                 b"Transfer-Encoding: chunked\r\nKeep-Alive: timeout=5, max=100\r\n\r\n")
                    for event in (b'data: {"content":"a"}\n\n', b'data: {"stop":true,"timings":{}}\n\n'):
                        writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                    writer.write(b"0\r\n\r\n")
                    doomed = True
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
                                 b"Keep-Alive: timeout=5, max=100\r\n\r\n[]")
                    doomed = path == "/then-close"
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def unanswering():
    srv = Unanswering()
    server = await asyncio.start_server(srv.serve, "127.0.0.1", 0)
    client = LlamaClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    try:
        yield srv, client
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()


async def test_the_connection_of_a_stream_is_not_pooled():
    """After an event stream forward() shuts the connection, so the client's next request (the
    app's own, which does not retry) never meets it."""
    async with unanswering() as (srv, client):
        for _ in range(3):
            async with client.forward("GET", "/stream", headers={}, content=None) as r:
                assert b"timings" in b"".join([c async for c in r.aiter_raw()])
            assert await client.slots() == []
    assert srv.answered == ["/stream", "/slots"] * 3 and srv.dropped == 0


async def test_forward_retries_a_connection_the_server_closed_unanswered():
    async with unanswering() as (srv, client):
        assert await client.slots() == []
        async with client.forward("GET", "/then-close", headers={}, content=None) as r:
            assert await r.aread() == b"[]"  # pooled again, and doomed
        async with client.forward("POST", "/completion", headers={}, content=b"{}") as r:
            assert r.status_code == 200 and await r.aread() == b"[]"
    assert srv.answered == ["/slots", "/then-close", "/completion"] and srv.dropped == 1


async def test_forward_says_unreachable():
    client = LlamaClient(f"http://127.0.0.1:{free_port()}")
    try:
        with pytest.raises(ServerUnreachable):
            async with client.forward("GET", "/health", headers={}, content=None):
                pass
    finally:
        await client.aclose()


async def test_once_the_client_forwarded_its_own_requests_take_that_session_with_the_same_answers_and_errors():
    """The proxy's client: after its first forward, its reads of /slots, its restores and parks (on a request's
    path, issue #38) go over the forward's aiohttp session. Each call answers as over httpx, to the byte:
    the JSON, the server's error (status, message, type), a body that is not JSON, and no server at all."""
    seen: list[tuple[str, str, str, str, str, bytes]] = []

    async def handler(request: web.Request) -> web.Response:
        body = await request.read()
        seen.append((request.method, request.path_qs, request.headers.get("User-Agent", ""),
                     request.headers.get("Content-Type", ""), request.headers.get("Authorization", ""), body))
        if request.path == "/slots/0":
            return web.json_response({"id_slot": 0, "n_restored": 7})
        if request.path == "/slots/1":
            return web.json_response({"error": {"code": 400, "message": "failed to restore slot",
                                                "type": "invalid_request_error"}}, status=400)
        if request.path == "/props":
            return web.Response(text="<html>not json</html>", content_type="text/html")
        if request.path == "/tokenize":
            return web.Response(status=500, text="boom")
        return web.json_response([{"id": 0}])

    async def calls(client: LlamaClient) -> list[object]:
        out: list[object] = []
        for call in (lambda: client.restore_slot(0, "c1.bin"), lambda: client.restore_slot(1, "c\u00e9.bin"),
                     client.props, lambda: client.tokenize("hi"), client.slots):
            try:
                out.append(await call())
            except ServerError as e:
                out.append((type(e).__name__, e.status, e.message, e.type, e.path))
        return out

    async with served(handler, api_key="server-key") as (port, client):
        over_httpx = await calls(client)
        async with client.forward("GET", "/health", headers={}, content=None) as r:
            await r.aread()
        seen.pop()
        over_aiohttp = await calls(client)
    assert over_aiohttp == over_httpx
    assert over_httpx[0] == {"id_slot": 0, "n_restored": 7} and over_httpx[4] == [{"id": 0}]
    assert over_httpx[1] == ("ServerError", 400, "failed to restore slot", "invalid_request_error", "/slots/1")
    assert over_httpx[2][:2] == ("ServerError", 200) and "not JSON" in over_httpx[2][2]
    assert over_httpx[3] == ("ServerError", 500, "boom", "", "/tokenize")
    first, then = seen[:5], seen[5:]
    assert [s[2].split("/")[0] for s in first] == ["python-httpx"] * 5
    assert all("aiohttp" in s[2] for s in then)  # the forward's session
    for a, b in zip(first, then):  # the same request: method, path and query, body, type, the server's key
        assert (a[0], a[1], a[3], a[4]) == (b[0], b[1], b[3], b[4]) and json.loads(a[5] or b"null") == json.loads(
            b[5] or b"null")
    assert then[1][1] == "/slots/1?action=restore" and json.loads(then[1][5]) == {"filename": "c\u00e9.bin"}
    assert then[0][3] == "application/json" and then[0][4] == "Bearer server-key"
    # no server: unreachable, in the same words
    gone = LlamaClient(f"http://127.0.0.1:{free_port()}")
    try:
        with pytest.raises(ServerUnreachable) as before:
            await gone.slots()
        with pytest.raises(ServerUnreachable):
            async with gone.forward("GET", "/health", headers={}, content=None):
                pass
        assert gone._aio is not None  # (the session exists: the next call takes it)
        with pytest.raises(ServerUnreachable) as after:
            await gone.slots()
    finally:
        await gone.aclose()
    assert after.value.reason == before.value.reason == "connection refused (is the server running?)"


def test_the_intercepted_paths():
    assert INTERCEPTED == {"/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions",
                           "/completion", "/v1/messages", "/v1/responses"}
