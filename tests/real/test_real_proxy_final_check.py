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

from app.core.verdict import VerdictKind, tolerance
from app.proxy.session_backend import shared_prefix
from tests.real.test_real_proxy import SYSTEMS, Proxied, sidecar_proxy_profile, turn  # noqa: F401 (fixture)
from tests.real.sidecar_bin import sidecar_server_bin  # noqa: F401  (fixture)

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


def test_a_continuing_chats_park_is_restored_unchecked(sidecar_proxy_profile, server_asked):  # noqa: F811
    """The check is not made when the request's messages continue the request whose render the park holds
    (app.proxy.session_backend.RestoreFor): A comes back with its history plus a turn, and the server is asked
    to restore it without rendering the chat first. What the check would have found, on Gemma 3's own
    template and tokenizer: the park's tokens are the start of the request's prompt, all but a few."""
    asked = server_asked  # each chat the server renders, each restore

    async def go():
        async with Proxied(sidecar_proxy_profile) as p:
            first = {}
            for name in ("A", "B", "C"):  # two slots: A is parked to make room for C
                first[name] = await p.ask(turn(SYSTEMS[name], question="What is the first word?"))
            reply_a, rec_a = first["A"]
            park = f"proxy-{rec_a.conversation}"
            saved = await p.handle.sessions.parked_tokens(park)
            assert saved, "A was not parked"
            messages = turn(SYSTEMS["A"], ("What is the first word?", reply_a), question="And the second?")
            asked.clear()
            _, back = await p.ask(messages)
            assert back.conversation == rec_a.conversation and back.restored_from == park, back
            assert asked == ["restore"]  # restored without the chat rendered first
            assert back.verdict is VerdictKind.HIT, back
            prompt = await p.handle.client.token_ids(await p.handle.client.apply_template({"messages": messages}))
            shared = shared_prefix(saved, prompt)
            assert shared > tolerance(len(saved)), (shared, len(saved))
            assert len(saved) - shared <= 8, (shared, len(saved))  # the park's tokens, but for its answer's end

    asyncio.run(go())
