"""Two causes of a re-processed prompt on the real server, one cause per assert.

* SLOT_TAKEN: the slot save folder is gone (a disk unmounted, a folder deleted), so no park can be
  saved; a third chat on two slots takes A's slot with A's tokens dropped, and A, back, re-processes
  its prompt because C used its slot. No RAM prompt cache (``--cache-ram 0``): it would bring A back.
* PARK_NOT_ITS_OWN: A's park holds other tokens than A's (the file replaced by one the real server
  saved from another chat's slot) while A's messages only grew: the final check does not restore it,
  and nothing in the messages explains the re-processing, so the cause is the park.
"""

from __future__ import annotations

import asyncio
import shutil

import pytest

from app.core.conversation import Cause
from app.core.verdict import VerdictKind
from tests.real.test_real_proxy import SYSTEMS, Proxied, turn

pytestmark = pytest.mark.real_server

Q = "What is the first word?"


async def abc(p: Proxied, **extra):
    """A, B, C on two slots: C takes the least recently used slot, A's."""
    first = {name: await p.ask(turn(SYSTEMS[name], question=Q), **extra) for name in "ABC"}
    assert first["C"][1].slot == first["A"][1].slot, first
    return first


def test_a_chat_whose_slot_another_took_without_a_park_is_explained_slot_taken(real_profile):
    async def go():
        async with Proxied(real_profile.replace(proxy=True, cache_ram=0)) as p:
            shutil.rmtree(p.handle.save_dir)  # no park can be saved from here on
            first = await abc(p)
            reply_a, rec_a = first["A"]
            a = {c.id: c for c in p.proxy.list()}[rec_a.conversation]
            assert a.parked_as is None and a.slot is None, a  # dropped, not parked
            _, back = await p.ask(turn(SYSTEMS["A"], (Q, reply_a), question="And the second?"))
            assert back.conversation == rec_a.conversation and back.restored_from is None, back
            assert back.verdict is VerdictKind.MISS, back
            assert back.explanation is not None and back.explanation.cause is Cause.SLOT_TAKEN, back.explanation
            assert first["C"][1].conversation in back.explanation.detail  # names the chat that took it

    asyncio.run(go())


def test_a_park_holding_another_chats_tokens_is_explained_park_not_its_own(real_profile):
    async def go():
        async with Proxied(real_profile.replace(proxy=True, cache_ram=0)) as p:
            first = await abc(p)
            reply_a, rec_a = first["A"]
            a = {c.id: c for c in p.proxy.list()}[rec_a.conversation]
            assert a.parked_as == f"proxy-{rec_a.conversation}", a
            park = p.handle.sessions.session(a.parked_as).state_path
            # the real server saves B's slot (B shares only the template's first tokens with A) over A's park
            await p.handle.client.save_slot(first["B"][1].slot, "other.bin")
            shutil.copyfile(p.handle.save_dir / "other.bin", park)

            _, back = await p.ask(turn(SYSTEMS["A"], (Q, reply_a), question="And the second?"))
            assert back.conversation == rec_a.conversation and back.restored_from is None, back
            assert back.verdict is VerdictKind.MISS, back
            assert back.explanation is not None and back.explanation.cause is Cause.PARK_NOT_ITS_OWN, back.explanation
            assert "did not restore" in back.explanation.detail

    asyncio.run(go())


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
TOOL_2 = {"type": "function", "function": {"name": "get_time", "description": "The time in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}


#: a chat template that renders the tools ahead of the messages, as Qwen's and Llama 3.1's do (Gemma 3's
#: own leaves them out, so a tool change costs Gemma nothing)
TOOLS_FIRST = ("{% if tools %}<start_of_turn>tools\n{% for t in tools %}{{ t.function.name }}: "
               "{{ t.function.description }}\n{% endfor %}<end_of_turn>\n{% endif %}"
               "{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n{% endfor %}"
               "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def test_changed_tool_definitions_are_explained_tools_changed(real_profile, tmp_path):
    """A client that adds a tool between two turns: the template renders the tools ahead of the messages,
    so the server re-processes what follows; the messages only grew, so the cause is the tools."""
    template = tmp_path / "tools-first.jinja"
    template.write_text(TOOLS_FIRST)

    async def go():
        async with Proxied(real_profile.replace(proxy=True, extra_args=("--chat-template-file", str(template)))) as p:
            reply, first = await p.ask(turn(SYSTEMS["A"], question=Q), tools=[TOOL])
            _, same = await p.ask(turn(SYSTEMS["A"], (Q, reply), question="And the second?"), tools=[TOOL])
            assert same.conversation == first.conversation and same.verdict is VerdictKind.HIT, same
            _, more = await p.ask(turn(SYSTEMS["A"], (Q, reply), ("And the second?", "x"), question="And then?"),
                                  tools=[TOOL, TOOL_2])
            assert more.conversation == first.conversation, more
            assert more.verdict in (VerdictKind.MISS, VerdictKind.PARTIAL), more
            assert more.explanation is not None and more.explanation.cause is Cause.TOOLS_CHANGED, more.explanation
            assert more.explanation.cause.client_words == "tools_changed"
            assert "get_weather before, get_weather, get_time now" in more.explanation.detail, more.explanation

    asyncio.run(go())
