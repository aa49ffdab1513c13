"""The proxy in front of a server that caches prompts by itself, on the fake llama-server.

The same cases run on the real build 11434 in tests/real/test_real_proxy_modes.py (started through
the app's launcher, which avoids the AMX kernels on this VM). Here the fake, which models the same
code paths from tools/server/server-context.cpp (idle-slot caching that clears the idle slots of a
unified KV cache when a task starts, [TAG_IDLE_SLOT_CLEAR]; a pinned request to an emptied slot not
looking in the RAM cache, one to a slot holding another prompt loading from it), runs them in
seconds. A disk prompt cache exists in no build the tests have: a wrapper binary adds one to the
fake's --help (the proxy reads the help text, not the flag alone)."""

from __future__ import annotations

import asyncio
import os
import stat
import sys

import openai
import pytest

from app import settings
from app.core.conversation import Cause
from app.core.verdict import VerdictKind
from app.servers.service import ServerService
from tests.fake_server.profiles import fake_profile
from tests.fake_server.test_proxy_service import Proxied as ServiceProxied
from tests.fake_server.test_proxy_service import chat, system
from tests.fake_server.test_supervisor_fake import FAKE


class Proxied(ServiceProxied):
    """The proxy service test's server behind the proxy, with a client's own chat id and raw completions."""

    async def ask(self, messages, **extra):
        reply = await self.client.chat.completions.create(model="m", messages=messages, max_tokens=2, **extra)
        return reply.choices[0].message.content or "", await asyncio.wait_for(self.judged.get(), 120)

    async def complete(self, prompt: str, session: str):
        await self.client.completions.create(model="m", prompt=prompt, max_tokens=2,
                                             extra_headers={"X-Session-Id": session})
        return await asyncio.wait_for(self.judged.get(), 120)


@pytest.fixture
def unified(tmp_path, monkeypatch):
    """Two slots in one unified KV cache, idle-slot caching on (its default), the RAM cache on."""
    monkeypatch.setenv("FAKE_SIDECAR", "1")
    return fake_profile(tmp_path, kv_unified=True).replace(proxy=True)


async def abab(p: Proxied):
    reply_a, first_a = await p.ask(chat(system("A"), "hello"))
    _, first_b = await p.ask(chat(system("B"), "hello"))
    assert first_b.slot != first_a.slot
    assert p.proxy.watch.cleared_seen >= 1  # b's task made the server clear a's idle slot: seen in /slots
    _, back = await p.ask(chat(system("A"), "hello", reply_a, "again"))
    assert back.conversation == first_a.conversation
    return back


async def test_idle_slots_the_server_clears_are_saved_first_and_come_back(unified):
    async with Proxied(unified) as p:
        assert p.proxy.caching.idle_slots_cleared  # read from the binary's --help and the argv (-kvu)
        back = await abab(p)
        assert back.restored_from == f"proxy-{back.conversation}"  # saved before b ran, restored now
        assert back.verdict is VerdictKind.HIT, back


async def test_without_the_save_first_the_ram_cache_brings_it_back(unified):
    """Not saved first, the cleared conversation's only copy is in the server's RAM cache: the proxy pins
    it to the other idle slot (which holds a prompt: only there does the server look in its RAM cache)."""
    settings.update(proxy_save_before_idle_clear=False)
    async with Proxied(unified) as p:
        assert "--no-cache-idle-slots" in p.proxy.notice()
        back = await abab(p)
        assert back.restored_from is None and p.proxy.leases.ram_chosen == 1
        assert back.verdict is VerdictKind.HIT, back


async def test_without_the_save_first_a_ram_cache_too_small_is_explained_by_the_clearing(tmp_path, monkeypatch):
    settings.update(proxy_save_before_idle_clear=False)
    monkeypatch.setenv("FAKE_SIDECAR", "1")
    monkeypatch.setenv("FAKE_STATE_BYTES_PER_TOKEN", "4096")  # a conversation's state over 1 MiB
    async with Proxied(fake_profile(tmp_path, kv_unified=True, cache_ram=1).replace(proxy=True)) as p:
        back = await abab(p)
        assert back.restored_from is None
        assert back.verdict is VerdictKind.MISS, back
        assert back.explanation.cause is Cause.IDLE_SLOT_CLEARED, back.explanation
        assert "RAM prompt cache" in back.explanation.detail


async def test_a_server_without_unified_kv_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SIDECAR", "1")
    async with Proxied(fake_profile(tmp_path).replace(proxy=True)) as p:
        assert p.proxy.caching.idle_slots_saved and not p.proxy.caching.idle_slots_cleared
        assert p.proxy.notice() is None
        reply_a, _ = await p.ask(chat(system("A"), "hello"))
        await p.ask(chat(system("B"), "hello"))
        _, back = await p.ask(chat(system("A"), "hello", reply_a, "again"))
        assert back.verdict is VerdictKind.HIT and back.restored_from is None and p.proxy.watch.cleared_seen == 0


async def test_an_edited_prompt_gets_its_first_divergent_token_from_the_server(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SIDECAR", "1")
    async with Proxied(fake_profile(tmp_path).replace(proxy=True)) as p:
        head, tail = " ".join(f"w{i}" for i in range(100)), " ".join(f"v{i}" for i in range(200))
        first = await p.complete(f"{head} alpha {tail}", "s1")
        edited = await p.complete(f"{head} gamma {tail} and more", "s1")  # edited half way
        assert edited.conversation == first.conversation
        assert edited.verdict in (VerdictKind.PARTIAL, VerdictKind.MISS), edited
        await p.proxy.settle()  # the token comparison runs after the answer went out
        [stored, _] = p.proxy.store.requests(edited.conversation)
        shared = await p.handle.client.tokenize(f"{head} ")  # the unchanged prefix, tokenised by the server
        assert stored.explanation.first_divergent_token == len(shared)
        assert "alpha" in stored.explanation.held_token and "gamma" in stored.explanation.sent_token


async def test_a_chat_on_a_server_without_apply_template_keeps_the_message_explanation(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SIDECAR", "1")
    async with Proxied(fake_profile(tmp_path).replace(proxy=True)) as p:
        # the client names its chat: an edited earlier message stays the same conversation (not a fork)
        question = "first question " + " ".join(f"w{i}" for i in range(100))  # past the tolerance after the edit
        reply, _ = await p.ask(chat(system("A"), "hello", "x", question), user="chat-1")
        _, edited = await p.ask(chat(system("A"), "hello", "y", question, reply, "next"), user="chat-1")
        assert edited.verdict is VerdictKind.PARTIAL, edited
        assert edited.explanation.cause is Cause.EARLIER_MESSAGE_EDITED
        await p.proxy.settle()
        [stored, _] = p.proxy.store.requests(edited.conversation)
        assert stored.explanation.first_divergent_token is None  # the fake has no /apply-template
        assert stored.explanation.cause is Cause.EARLIER_MESSAGE_EDITED


@pytest.fixture
def disk_cache_binary(tmp_path):
    """The fake server, with a disk prompt cache in its --help (as a fork would have it)."""
    from tests.fake_server.fake_llama_server import FIXTURES

    help_file = tmp_path / "help.txt"
    help_file.write_text((FIXTURES / "help.txt").read_text() + "\n--cache-disk PATH                       "
                         "directory where the server persists prompt caches on disk (default: disabled)\n")
    wrapper = tmp_path / "llama-server-disk"
    wrapper.write_text(f"#!{sys.executable}\nimport os, sys\n"
                       f"if '--help' in sys.argv:\n    sys.stdout.write(open({str(help_file)!r}).read())\n"
                       f"    sys.exit(0)\nargv = sys.argv[1:]\nif '--cache-disk' in argv:\n"
                       f"    i = argv.index('--cache-disk')\n    del argv[i:i + 2]\n"
                       f"os.execv(sys.executable, [sys.executable, {FAKE!r}, *argv])\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return str(wrapper)


async def test_a_server_that_persists_prompts_itself_gets_requests_unchanged(tmp_path, disk_cache_binary,
                                                                             monkeypatch):
    assert os.access(disk_cache_binary, os.X_OK)
    profile = fake_profile(tmp_path, extra_args=("--cache-disk", str(tmp_path / "disk"))).replace(
        proxy=True, server_binary=disk_cache_binary)
    async with Proxied(profile) as p:
        assert p.proxy.steps_aside and "steps aside" in p.proxy.notice()
        reply, first = await p.ask(chat(system("A"), "hello"))
        _, second = await p.ask(chat(system("A"), "hello", reply, "again"))
        assert second.conversation == first.conversation  # still judged, per conversation
        assert second.verdict is VerdictKind.HIT, second  # the server found its slot by itself
        assert first.slot is None and second.slot is None  # nothing pinned
        assert all(v.conversation is None for v in p.proxy.leases.snapshot())  # nothing leased, nothing parked
        assert [c.parked_as for c in p.proxy.list()] == [None]
