"""The proxy's KV events on the real server (Gemma 3 270M): the token ids a router is told of a chat's
slot are the ones the server itself counted for that prompt (its own /apply-template and /tokenize with
its BOS, as many as ``cache_n + prompt_n``), read through a real ZMQ SUB socket and decoded with vLLM's
struct layout (tests/vllm_kv_events.py)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import zmq
import zmq.asyncio

from app.proxy.front import ProxyFront
from app.servers.launch import launch_profile
from app.servers.service import ServerService
from tests import vllm_kv_events as vllm
from tests.real.helpers import TEXT

pytestmark = pytest.mark.real_server


def test_a_chats_blocks_carry_the_servers_own_tokens(real_profile):
    async def go():
        servers = ServerService(front=ProxyFront(kv_events="tcp://127.0.0.1:*"))
        sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
        try:
            handle, proxy = await launch_profile(servers, real_profile.replace(proxy=True))
            assert proxy is not None and proxy.kv is not None
            judged = asyncio.Queue()
            proxy.on_record(judged.put_nowait)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(proxy.kv.publisher.bound)
            view = vllm.View()
            view.apply(await asyncio.wait_for(sub.recv_multipart(), 60))  # the state, on subscribing
            messages = [{"role": "system", "content": "Remember this manual. " + TEXT[:600]},
                        {"role": "user", "content": "What is the first word?"}]
            async with openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="x") as client:
                await client.chat.completions.create(model="gemma", messages=messages, max_tokens=4, temperature=0)
            rec = await asyncio.wait_for(judged.get(), 120)
            await proxy.kv.settle()
            while view.seqs[-1] < proxy.kv.publisher.sent - 1:
                view.apply(await asyncio.wait_for(sub.recv_multipart(), 60))
            async with httpx.AsyncClient(base_url=handle.url, timeout=60) as direct:
                text = (await direct.post("/apply-template", json={"messages": messages})).json()["prompt"]
                tokens = (await direct.post("/tokenize", json={"content": text, "add_special": True,
                                                               "parse_special": True})).json()["tokens"]
            assert len(tokens) == rec.cache_n + rec.prompt_n  # the server's own count of that prompt
            full = len(tokens) // 16 * 16
            assert full >= 160 and view.prefix("GPU", tokens) == full
        finally:
            sub.close(linger=0)
            await servers.aclose()

    asyncio.run(go())
