"""Explicit conversation keys on the real server with the real `openai` client (issue #29 item 3):
OpenAI's ``prompt_cache_key`` and a conversation-id header name the conversation; an edited history
under the key stays the same conversation, with its miss explained, where the message hash chain
alone (no key) makes the edit a conversation of its own."""

from __future__ import annotations

import asyncio

import pytest

from app.core.conversation import Cause
from app.core.verdict import VerdictKind
from tests.real.test_real_proxy import SYSTEMS, Proxied, turn

pytestmark = pytest.mark.real_server

Q1, Q1_EDITED, Q2 = "What is the first word?", "What is the very first word?", "And the second?"


def test_explicit_keys_name_the_conversation(real_profile):
    async def go():
        async with Proxied(real_profile.replace(proxy=True)) as p:
            r1, first = await p.ask(turn(SYSTEMS["A"], question=Q1), prompt_cache_key="chat-1")
            assert first.verdict is VerdictKind.NEW
            # the client edited its first question: under its key, the same conversation, the miss said
            _, edited = await p.ask(turn(SYSTEMS["A"], (Q1_EDITED, r1), question=Q2), prompt_cache_key="chat-1")
            assert edited.conversation == first.conversation
            assert edited.verdict in (VerdictKind.PARTIAL, VerdictKind.MISS), edited
            assert edited.explanation is not None and edited.explanation.cause is Cause.EARLIER_MESSAGE_EDITED
            assert p.proxy.conversations[first.conversation].hint == "chat-1"

            # the same edit with no key: the hash chain makes it a fork, a conversation of its own
            r3, plain = await p.ask(turn(SYSTEMS["B"], question=Q1))
            _, fork = await p.ask(turn(SYSTEMS["B"], (Q1_EDITED, r3), question=Q2))
            assert fork.conversation != plain.conversation and fork.verdict is VerdictKind.NEW

            # a conversation-id header of the x-…-conv-id kind names it too
            _, named = await p.ask(turn(SYSTEMS["C"], question=Q1), extra_headers={"X-Acme-Conv-Id": "acme-7"})
            assert p.proxy.conversations[named.conversation].hint == "acme-7"

    asyncio.run(go())
