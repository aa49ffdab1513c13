"""The final check before a conversation's park is restored: the park's own tokens (its state file)
against the request's prompt as the real server renders and tokenises it (/apply-template, /tokenize).

The case: a client names its chat (`user`), the chat is parked to make room for two others, then the
client sends, under the same name, a chat that shares nothing with it (a new system prompt and
question: a client that reuses its id for another chat). The hint finds the conversation and its park
would be restored, but the park's tokens share nothing with the prompt: restoring it buys nothing and
costs a restore, so the proxy does not restore it, says so, and keeps the conversation going.
"""

from __future__ import annotations

import asyncio

import pytest

from app.core.conversation import Cause

from app.core.verdict import VerdictKind
from tests.real.test_real_proxy import SYSTEMS, Proxied, turn

pytestmark = pytest.mark.real_server

OTHER = ("Translate the following list of fruit names into French and keep their order: apple, pear, "
         "plum, cherry, apricot, peach, quince, fig, grape, melon, lemon, orange, lime, date. ") * 3


def test_a_park_whose_tokens_are_not_the_requests_is_not_restored(real_profile):
    async def go():
        async with Proxied(real_profile.replace(proxy=True)) as p:
            _, first = await p.ask(turn(SYSTEMS["A"], question="What is the first word?"), user="chat-x")
            for name in ("B", "C"):  # two slots: the named chat is parked to make room
                await p.ask(turn(SYSTEMS[name], question="What is the first word?"))
            named = {c.id: c for c in p.proxy.list()}[first.conversation]
            assert named.parked_as == f"proxy-{first.conversation}" and named.slot is None, named

            _, rec = await p.ask([{"role": "system", "content": OTHER}, {"role": "user", "content": "Go."}],
                                 user="chat-x")
            assert rec.conversation == first.conversation  # the client's name wins over the messages
            assert rec.restored_from is None, rec  # the park was not restored over the slot
            assert rec.verdict is VerdictKind.MISS, rec
            assert rec.explanation is not None and "did not restore" in rec.explanation.detail, rec.explanation
            assert "share" in rec.explanation.detail and "tokens with the prompt" in rec.explanation.detail
            # what the messages say changed stays the cause
            assert rec.explanation.cause is Cause.SYSTEM_PROMPT_CHANGED, rec.explanation

            # the conversation goes on from here, in its slot
            _, nxt = await p.ask([{"role": "system", "content": OTHER}, {"role": "user", "content": "Go."},
                                  {"role": "assistant", "content": "Pomme"}, {"role": "user", "content": "Next?"}],
                                 user="chat-x")
            assert nxt.conversation == first.conversation and nxt.verdict is VerdictKind.HIT, nxt

    asyncio.run(go())
