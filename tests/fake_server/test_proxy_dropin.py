"""The proxy as a drop-in for every client (issue #29 item 1), on the fake llama-server and a stub
upstream: what the client asked for (its own ``id_slot``, ``cache_prompt: false``, a batch) passes
through untouched and is still judged with the reason said; response headers keep their case; ``/``
stays public when the upstream serves it so; the slot actions the proxy's own ``--slot-save-path``
turned on are refused unless the user's profile asked for them."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from aiohttp import web

from app.core.conversation import Cause
from app.core.verdict import VerdictKind
from app.proxy.http import ProxyServer
from app.proxy.identity import media_in
from app.proxy.front import ProxyFront
from app.proxy.request_facts import client_choice
from app.server.client import LlamaClient
from app.servers.launch import launch_profile
from app.servers.service import ServerService
from app.ui.conversations.model import why_text
from tests.conftest import free_port
from tests.fake_server.profiles import fake_profile

WAIT = 30.0  # a bound for a failing test, never a measure
NOT_SUPPORTED = {"error": {"code": 501, "message": "This server does not support slots action. Start it with "
                                                   "`--slot-save-path`", "type": "not_supported_error"}}


def chat(name: str, *turns: str) -> list[dict]:
    msgs = [{"role": "system", "content": " ".join(f"{name}word{i}" for i in range(300))}]
    for i, t in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return msgs


class Proxied:
    def __init__(self, profile):
        self.profile = profile

    async def __aenter__(self):
        self.servers = ServerService(front=ProxyFront())
        self.handle, self.proxy = await launch_profile(self.servers, self.profile)
        assert self.proxy is not None
        self.judged: asyncio.Queue = asyncio.Queue()
        self.proxy.on_record(self.judged.put_nowait)
        self.client = openai.AsyncOpenAI(base_url=self.proxy.http.url + "/v1", api_key="x", max_retries=0)
        return self

    async def __aexit__(self, *exc):
        await self.client.close()
        await self.servers.aclose()

    async def ask(self, messages, **extra_body):
        reply = await self.client.chat.completions.create(model="m", messages=messages, max_tokens=2,
                                                          extra_body=extra_body or None)
        rec = await asyncio.wait_for(self.judged.get(), WAIT)
        return reply, rec


@pytest.fixture
def profile(tmp_path):
    return fake_profile(tmp_path).replace(proxy=True)


def test_what_the_client_chose_is_recognised():
    assert client_choice("/v1/chat/completions", {"id_slot": 1}) is not None
    assert client_choice("/v1/chat/completions", {"id_slot": 0}) is not None
    assert client_choice("/v1/chat/completions", {"id_slot": -1}) is None  # llama-server's "any slot"
    assert client_choice("/v1/chat/completions", {"id_slot": True}) is None
    assert client_choice("/completion", {"cache_prompt": False}) is not None
    assert client_choice("/completion", {"cache_prompt": True}) is None
    assert client_choice("/completion", {"prompt": ["a", "b"]}) is not None
    assert client_choice("/completion", {"prompt": [1, 2, 3]}) is None  # one prompt as token ids
    assert client_choice("/completion", {"prompt": [[1, 2], [3]]}) is not None
    assert client_choice("/completion", {"prompt": ["only one"]}) is None


def test_media_is_found_in_every_route_shape():
    img = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert media_in({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, img]}]}) == "an image"
    assert media_in({"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}) == "audio"
    # Anthropic: an image block, also one inside a tool result
    assert media_in({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}]}]}) == "an image"
    # Responses: an input item's content part, and an input_image item on its own
    assert media_in({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}) == \
        "an image"
    assert media_in({"input": [{"type": "input_file", "file_data": "x"}]}) == "a file"
    assert media_in({"prompt": {"prompt_string": "<__media__>", "multimodal_data": ["AAAA"]}}).startswith("an image")
    # text only, in each shape: nothing
    assert media_in({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}) is None
    assert media_in({"messages": [{"role": "user", "content": "image_url"}]}) is None
    assert media_in({"input": "an image please"}) is None
    assert media_in({"prompt": "hi"}) is None and media_in({"prompt": {"prompt_string": "hi"}}) is None


async def test_a_request_with_an_image_passes_through_and_says_why(profile):
    async with Proxied(profile.replace(cache_ram=0)) as p:
        _, first = await p.ask(chat("A", "hello"))
        leased = p.proxy.leases.snapshot()
        msgs = chat("B", "hello")
        msgs[-1]["content"] = [{"type": "text", "text": "what is this?"},
                               {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]
        _, seen = await p.ask(msgs)
        assert seen.conversation != first.conversation
        assert seen.explanation is not None and seen.explanation.cause is Cause.MULTIMODAL
        assert "an image" in seen.explanation.detail and "passed this request through untouched" in \
            seen.explanation.detail
        # the Conversations tab's row says why, and no slot was leased to it
        assert why_text(seen).startswith(Cause.MULTIMODAL.value)
        assert all(v.conversation != seen.conversation for v in p.proxy.leases.snapshot())
        assert [v.conversation for v in p.proxy.leases.snapshot()] == [v.conversation for v in leased]


async def test_a_pinned_request_passes_through_and_the_slot_it_took_is_said(profile):
    # no RAM prompt cache: it would bring A back by itself (as llama-server's does)
    async with Proxied(profile.replace(cache_ram=0)) as p:
        reply, first = await p.ask(chat("A", "hello"))
        assert first.verdict is VerdictKind.NEW and first.slot is not None
        leased = p.proxy.leases.snapshot()
        # another client pins A's slot for a prompt of its own: passed through, the slot given as asked
        _, own = await p.ask(chat("B", "hello"), id_slot=first.slot)
        assert own.slot == first.slot and own.conversation != first.conversation
        assert own.explanation is not None and own.explanation.cause is Cause.CLIENT_CHOSE
        assert f'"id_slot": {first.slot}' in own.explanation.detail
        # the Conversations tab's request row says why
        assert why_text(own).startswith(Cause.CLIENT_CHOSE.value) and "asked for slot" in why_text(own)
        [view] = [v for v in p.proxy.leases.snapshot() if v.index == first.slot]
        assert view.conversation is None  # the proxy knows A is no longer there
        assert [v for v in leased if v.index != first.slot] == \
            [v for v in p.proxy.leases.snapshot() if v.index != first.slot]
        # A comes back: it re-processes, and the proxy says who took its slot
        _, back = await p.ask(chat("A", "hello", reply.choices[0].message.content, "and then?"))
        assert back.conversation == first.conversation
        assert back.verdict is not VerdictKind.HIT, back
        assert back.explanation is not None and back.explanation.cause is Cause.SLOT_TAKEN, back
        assert "pinned to this slot" in back.explanation.detail


async def test_cache_prompt_false_is_kept_and_judged_with_its_reason(profile):
    async with Proxied(profile) as p:
        reply, first = await p.ask(chat("A", "hello"))
        msgs = chat("A", "hello", reply.choices[0].message.content, "and then?")
        answer, own = await p.ask(msgs, cache_prompt=False)
        assert answer.usage.prompt_tokens_details.cached_tokens == 0  # the server re-processed, as asked
        assert own.conversation == first.conversation and own.cache_n == 0
        assert own.verdict is VerdictKind.MISS
        assert own.explanation.cause is Cause.CLIENT_CHOSE and "cache_prompt" in own.explanation.detail
        # the next request of the conversation is pinned again, and judged as usual
        _, again = await p.ask(msgs)
        assert again.conversation == first.conversation and again.slot == first.slot
        assert again.explanation is None or again.explanation.cause is not Cause.CLIENT_CHOSE


async def test_slot_actions_are_refused_unless_the_profile_turned_them_on(profile, tmp_path):
    async with Proxied(profile) as p:
        async with httpx.AsyncClient(base_url=p.proxy.http.url) as h:
            for action in ("save", "restore", "erase"):
                r = await h.post(f"/slots/0?action={action}", json={"filename": "mine.bin"})
                assert r.status_code == 501 and r.json() == NOT_SUPPORTED
            assert (await h.get("/slots")).status_code == 200  # reading them stays allowed
    own = tmp_path / "own-slots"
    async with Proxied(profile.replace(slot_save_path=str(own) + "/")) as p:
        _, rec = await p.ask(chat("A", "hello"))
        async with httpx.AsyncClient(base_url=p.proxy.http.url) as h:
            r = await h.post(f"/slots/{rec.slot}?action=save", json={"filename": "mine.bin"})
            assert r.status_code == 200 and r.json()["n_saved"] > 0
        assert (own / "mine.bin").is_file()


class Stub:
    """A stand-in upstream with headers in the case a server writes them, and a ``/`` it serves
    only without a key."""

    def __init__(self):
        self.seen: list[dict] = []

    async def root(self, request: web.Request) -> web.Response:
        self.seen.append(dict(request.headers))
        if "Authorization" in request.headers:
            return web.json_response({"error": "no key wanted here"}, status=400)
        return web.Response(text="<html>web ui</html>", content_type="text/html")

    async def props(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True}, headers={"Process-Start-Time-Unix": "1796130000",
                                                        "Access-Control-Allow-Origin": "http://x",
                                                        "X-Mixed-Case-Header": "kept"})


async def test_header_case_and_a_public_root():
    port = free_port()
    stub = Stub()
    app = web.Application()
    app.router.add_get("/", stub.root)
    app.router.add_get("/props", stub.props)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    client = LlamaClient(f"http://127.0.0.1:{port}", api_key="upstream-key")
    proxy = ProxyServer(client, api_key="proxy-key")
    await proxy.start("127.0.0.1", 0)
    try:
        async with httpx.AsyncClient(base_url=proxy.url) as h:
            r = await h.get("/props", headers={"Authorization": "Bearer proxy-key"})
            names = [k for k, _ in r.headers.raw]
            assert b"Process-Start-Time-Unix" in names and b"Access-Control-Allow-Origin" in names
            assert b"X-Mixed-Case-Header" in names
            assert (await h.get("/props")).status_code == 401  # the rest still needs the key
            r = await h.get("/")  # no key: the web UI loads, as it does from llama-server
            assert r.status_code == 200 and "web ui" in r.text
            assert "Authorization" not in stub.seen[-1]  # nor was the upstream's key sent for it
            assert (await h.post("/", content=b"")).status_code == 401  # only a GET is public
    finally:
        await proxy.stop()
        await client.aclose()
        await runner.cleanup()


async def test_metrics_without_the_servers_own(profile):
    """A server without --metrics: the proxy's /metrics answers as the server does (its 501: the
    profile said no metrics, llama.cpp's own metrics tests expect it); /kv-valet/metrics serves KV
    Valet's families alone (with the vLLM-named ones a gateway reads), parsed by prometheus_client's
    own parser, its request counter the proxy's records."""
    from prometheus_client.parser import text_string_to_metric_families

    async with Proxied(profile) as p:
        await p.ask(chat("A", "hello"))
        async with httpx.AsyncClient(base_url=p.proxy.http.url) as h:
            off = await h.get("/metrics")
            assert off.status_code == 501 and "--metrics" in off.text and "kvvalet_" not in off.text
            assert (await h.get("/kv-valet/metrics")).status_code == 200
            text = (await h.get("/kv-valet/metrics")).text
        names = {f.name for f in text_string_to_metric_families(text)}
        assert names and all(n.startswith(("kvvalet_", "vllm:")) for n in names)  # KV Valet's, and a gateway's
        [req] = [s for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == "kvvalet_proxy_requests_total"]
        assert req.value == 1 and req.labels["verdict"] == "NEW"


async def test_no_slots_is_kept_for_the_clients_while_the_proxy_reads_them(profile):
    """A profile with ``--no-slots``: the proxy's server keeps /slots for the proxy (it could not lease
    slots otherwise), and the proxy answers the clients' ``GET /slots`` as llama-server answers it
    under --no-slots; chats go on and are judged."""
    async with Proxied(profile.replace(slots_endpoint=False)) as p:
        assert len(await p.handle.client.slots()) >= 1  # the server behind serves them to the proxy
        async with httpx.AsyncClient(base_url=p.proxy.http.url) as h:
            r = await h.get("/slots")
        assert r.status_code == 501 and r.json() == {"error": {
            "code": 501, "message": "This server does not support slots endpoint. Start it with `--slots`",
            "type": "not_supported_error"}}
        _, rec = await p.ask(chat("A", "hello"))
        assert rec.verdict is VerdictKind.NEW
        _, rec = await p.ask(chat("A", "hello", "hi", "more"))
        assert rec.verdict is VerdictKind.HIT, rec
