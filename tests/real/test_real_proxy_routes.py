"""Every chat route the real server serves, judged by the proxy (issue #29 item 2): Anthropic's
``/v1/messages`` (its ``cache_read_input_tokens``) and OpenAI's ``/v1/responses`` (driven by the
``openai`` package's own Responses client), streamed and not, get the conversation identity, the slot
lease and the per-request verdict that ``/v1/chat/completions`` gets; the server answers them as it
would directly (Gemma 3 270M on llama-server 11434)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from app.core.conversation import Cause
from app.core.verdict import VerdictKind, tolerance
from tests.real.test_real_proxy import SYSTEMS, Proxied

pytestmark = pytest.mark.real_server


async def messages(p: Proxied, system: str, turns: list[dict], *, stream: bool = False) -> tuple[dict, object]:
    """One Anthropic Messages request through the proxy: the answer (its message, or a stream's
    ``message_start``), and the request's record."""
    body = {"model": "gemma", "max_tokens": 4, "temperature": 0, "system": system, "messages": turns, "stream": stream}
    async with httpx.AsyncClient(timeout=300) as h:
        r = await h.post(p.proxy.http.url + "/v1/messages", json=body)
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1]["type"] == "message_stop"
        answer = next(e["message"] for e in events if e["type"] == "message_start")
    else:
        answer = r.json()
    rec = await asyncio.wait_for(p.judged.get(), 120)
    return answer, rec


def test_anthropic_messages_are_one_conversation_judged_by_their_own_usage(real_profile):
    async def go():
        async with Proxied(real_profile.replace(proxy=True)) as p:
            q1 = [{"role": "user", "content": "What is the first word?"}]
            a1, r1 = await messages(p, SYSTEMS["A"], q1)
            assert a1["type"] == "message" and r1.path == "/v1/messages" and r1.verdict is VerdictKind.NEW, r1
            reply = a1["content"][0]["text"]
            q2 = q1 + [{"role": "assistant", "content": [{"type": "text", "text": reply}]},
                       {"role": "user", "content": [{"type": "text", "text": "And the second?"}]}]
            a2, r2 = await messages(p, SYSTEMS["A"], q2)
            assert r2.conversation == r1.conversation and r2.slot == r1.slot, r2
            assert r2.verdict is VerdictKind.HIT, r2
            # the verdict read the route's own usage: cache_read_input_tokens are the reused ones
            assert r2.cache_n == a2["usage"]["cache_read_input_tokens"] and r2.prompt_n == a2["usage"]["input_tokens"]
            assert r2.cache_n >= r2.expected_reuse - tolerance(r2.expected_reuse), r2
            # streamed: the usage is in message_start
            q3 = q2 + [{"role": "assistant", "content": a2["content"][0]["text"]},
                       {"role": "user", "content": "And the third?"}]
            start, r3 = await messages(p, SYSTEMS["A"], q3, stream=True)
            assert r3.conversation == r1.conversation and r3.stream and r3.verdict is VerdictKind.HIT, r3
            assert r3.cache_n == start["usage"]["cache_read_input_tokens"], (r3, start)
            # another conversation on the same route is another conversation, in the other slot
            _, rb = await messages(p, SYSTEMS["B"], q1)
            assert rb.conversation != r1.conversation and rb.slot != r1.slot and rb.verdict is VerdictKind.NEW

    asyncio.run(go())


def test_openai_responses_are_one_conversation_judged_by_their_own_usage(real_profile):
    async def go():
        async with Proxied(real_profile.replace(proxy=True)) as p:
            first = await p.client.responses.create(model="gemma", instructions=SYSTEMS["C"],
                                                    input="What is the first word?", max_output_tokens=4,
                                                    temperature=0)
            r1 = await asyncio.wait_for(p.judged.get(), 120)
            assert r1.path == "/v1/responses" and r1.verdict is VerdictKind.NEW, r1
            turns = [{"type": "message", "role": "user", "content": "What is the first word?"},
                     {"type": "message", "role": "assistant", "content": first.output_text},
                     {"type": "message", "role": "user", "content": "And the second?"}]
            second = await p.client.responses.create(model="gemma", instructions=SYSTEMS["C"], input=turns,
                                                     max_output_tokens=4, temperature=0)
            r2 = await asyncio.wait_for(p.judged.get(), 120)
            assert r2.conversation == r1.conversation and r2.slot == r1.slot, r2
            assert r2.verdict is VerdictKind.HIT, r2
            cached = second.usage.input_tokens_details.cached_tokens
            assert r2.cache_n == cached and r2.prompt_n == second.usage.input_tokens - cached, (r2, second.usage)
            # streamed, through the openai package's own stream
            turns += [{"type": "message", "role": "assistant", "content": second.output_text},
                      {"type": "message", "role": "user", "content": "And then?"}]
            stream = await p.client.responses.create(model="gemma", instructions=SYSTEMS["C"], input=turns,
                                                     max_output_tokens=4, temperature=0, stream=True)
            kinds = [event.type async for event in stream]
            assert kinds[-1] == "response.completed", kinds
            r3 = await asyncio.wait_for(p.judged.get(), 120)
            assert r3.conversation == r1.conversation and r3.stream and r3.verdict is VerdictKind.HIT, r3

    asyncio.run(go())


def test_a_request_with_an_image_is_passed_through_and_said_so(real_profile):
    """A model without a projector answers an image as it would directly (its own error); the proxy
    leases no slot for it and its record says why (llama-server does not save a slot holding media)."""
    async def go():
        async with Proxied(real_profile.replace(proxy=True)) as p:
            body = {"model": "gemma", "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}
            async with httpx.AsyncClient(timeout=300) as h:
                direct = await h.post(p.handle.url + "/v1/chat/completions", json=body)
                proxied = await h.post(p.proxy.http.url + "/v1/chat/completions", json=body)
            assert (proxied.status_code, proxied.json()) == (direct.status_code, direct.json())
            rec = await asyncio.wait_for(p.judged.get(), 120)
            assert rec.explanation is not None and rec.explanation.cause is Cause.MULTIMODAL, rec
            assert "an image" in rec.explanation.detail
            assert all(v.conversation != rec.conversation for v in p.proxy.leases.snapshot())

    asyncio.run(go())


def test_a_text_prompt_continued_is_one_conversation_judged_by_what_its_prompt_held(real_profile):
    """``/completion`` without a client key: a prompt that continues the last one (a script appending to
    its text) is the same conversation, in the same slot, expected to reuse what that prompt came to."""
    async def go():
        async with Proxied(real_profile.replace(proxy=True)) as p:
            async with httpx.AsyncClient(timeout=300) as h:
                async def complete(prompt: str):
                    r = await h.post(p.proxy.http.url + "/completion",
                                     json={"prompt": prompt, "n_predict": 4, "temperature": 0})
                    assert r.status_code == 200, r.text
                    return r.json(), await asyncio.wait_for(p.judged.get(), 120)

                first, r1 = await complete(SYSTEMS["A"])
                assert r1.verdict is VerdictKind.NEW
                _, r2 = await complete(SYSTEMS["A"] + " The knight finally reached the castle gates.")
                assert r2.conversation == r1.conversation and r2.slot == r1.slot, r2
                held = first["timings"]["cache_n"] + first["timings"]["prompt_n"]
                assert r2.expected_reuse == held and r2.verdict is VerdictKind.HIT, r2
                # another text is another conversation
                _, r3 = await complete("Hello")
                assert r3.conversation != r1.conversation and r3.verdict is VerdictKind.NEW

    asyncio.run(go())
