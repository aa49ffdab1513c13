"""The conversation proxy's service on the fake llama-server, for the cases the real server
cannot produce on demand: a restore the server refuses (the slot is emptied), and the app
killed with dirty slots then started again. The rotation, verdicts and restarts themselves
run on the real server in tests/real/test_real_proxy.py."""

from __future__ import annotations

import asyncio

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.core.conversation import Cause

from app.core.verdict import VerdictKind
from app.core.lifecycle import StopTrigger
from app.servers.service import ServerService
from app.proxy.front import ProxyFront
from app.servers.launch import launch_profile
from app.store import sqlite_file
from tests.fake_server.profiles import fake_profile

def system(name: str) -> str:
    """A system prompt of its own per conversation (no common prefix with another's)."""
    return " ".join(f"{name}word{i}" for i in range(300))


def chat(system: str, *turns: str) -> list[dict]:
    msgs = [{"role": "system", "content": system}]
    for i, t in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return msgs


class Proxied:
    def __init__(self, profile):
        self.profile, self.records = profile, []

    async def __aenter__(self):
        self.servers = ServerService(front=ProxyFront())
        self.handle, self.proxy = await launch_profile(self.servers, self.profile)
        assert self.proxy is not None
        self.judged = asyncio.Queue()  # each judged request, as the proxy records it
        self.proxy.on_record(self.judged.put_nowait)
        self.client = openai.AsyncOpenAI(base_url=self.proxy.http.url + "/v1", api_key="x")
        return self

    async def __aexit__(self, *exc):
        await self.client.close()
        await self.servers.aclose()

    async def ask(self, messages, **extra):
        reply = await self.client.chat.completions.create(model="m", messages=messages, max_tokens=2, **extra)
        rec = await asyncio.wait_for(self.judged.get(), 120)  # judged once the response is through
        return reply.choices[0].message.content or "", rec


@pytest.fixture
def profile(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SIDECAR", "1")
    return fake_profile(tmp_path).replace(proxy=True)


async def test_a_chat_is_one_conversation_pinned_to_its_slot(profile):
    async with Proxied(profile) as p:
        reply, first = await p.ask(chat(system("A"), "hello"))
        assert first.verdict is VerdictKind.NEW and first.slot is not None
        _, second = await p.ask(chat(system("A"), "hello", reply, "and then?"))
        assert second.conversation == first.conversation and second.slot == first.slot
        assert second.verdict is VerdictKind.HIT, second
        [conv] = p.proxy.list()
        assert conv.requests == 2 and conv.slot == first.slot
        path = {s.labels["turn"]: s.value for fam in text_string_to_metric_families(p.proxy.metrics.exposition().decode())
                if fam.name == "kvvalet_proxy_path_seconds" for s in fam.samples if s.name.endswith("_count")}
        assert path == {"other_slot": 1, "kept": 1}  # the proxy's own time on each one's path, by how it got its slot


async def test_between_requests_the_proxy_checkpoints_its_store_then_runs_the_idle_work(profile, monkeypatch):
    """The journal's commits sit on a request's path; their WAL checkpoint waits for the idle moment after
    the answer is judged, where ``kv-valet serve`` also collects garbage (ProxyService.on_idle)."""
    monkeypatch.setattr(sqlite_file, "CHECKPOINT_EVERY_COMMITS", 1)  # every idle moment has one due
    async with Proxied(profile) as p:
        idle, ran = [], asyncio.Event()

        def at_idle():
            idle.append(p.proxy.store.commits)
            ran.set()
        p.proxy.on_idle(at_idle)
        await p.ask(chat(system("A"), "hello"))
        await asyncio.wait_for(ran.wait(), 30)
    assert idle == [0]  # the request's commits were checkpointed before the idle work ran


async def test_more_conversations_than_slots_rotate_through_their_parks(profile):
    async with Proxied(profile) as p:
        firsts = {}
        for name in "ABC":
            firsts[name] = await p.ask(chat(system(name), "hello"))
        reply_a, rec_a = firsts["A"]
        assert firsts["C"][1].slot == rec_a.slot  # the least recently used slot went to C
        _, back = await p.ask(chat(system("A"), "hello", reply_a, "again"))
        assert back.conversation == rec_a.conversation and back.restored_from == f"proxy-{rec_a.conversation}"
        assert back.verdict is VerdictKind.HIT, back  # the fake keeps what it restored


def parks_by_conversation(proxy) -> dict[str, float]:
    """kvvalet_proxy_parks_total of each conversation, as a scrape of the proxy's /metrics reads it."""
    return {s.labels["conversation"]: s.value
            for fam in text_string_to_metric_families(proxy.metrics.exposition().decode())
            if fam.name == "kvvalet_proxy_parks" for s in fam.samples if s.name.endswith("_total")}


@pytest.mark.parametrize("ahead", [True, False], ids=["park-ahead", "no-park-ahead"])
async def test_the_next_conversation_to_leave_its_slot_is_parked_between_requests(profile, ahead):
    """Three conversations over two slots: once one had to leave its slot, the least recently used one
    is parked while no request runs, and the conversation that comes back takes its slot without a save
    on its path. With the setting off, that save happens on the returning request's path."""
    from app import settings
    from app.proxy.lease_table import SlotState

    settings.update(proxy_park_ahead=ahead)
    async with Proxied(profile) as p:
        firsts = {name: await p.ask(chat(system(name), "hello")) for name in "ABC"}
        await p.proxy.settle()  # the work that follows the answers, the park ahead with it
        b = firsts["B"][1].conversation
        state = {v.conversation: v.state for v in p.proxy.leases.snapshot()}
        park_b = p.handle.save_dir / p.handle.sessions.session(f"proxy-{b}").state_file if ahead else None
        if ahead:
            assert state[b] is SlotState.IDLE_CLEAN and park_b.is_file()
        else:
            assert state[b] is SlotState.IDLE_DIRTY
        before = parks_by_conversation(p.proxy)
        reply_a, rec_a = firsts["A"]
        _, back = await p.ask(chat(system("A"), "hello", reply_a, "again"))
        assert back.restored_from == f"proxy-{rec_a.conversation}" and back.slot == firsts["B"][1].slot
        assert back.verdict is VerdictKind.HIT, back
        on_path = {k: v - before.get(k, 0) for k, v in parks_by_conversation(p.proxy).items()
                   if v != before.get(k, 0)}
        assert on_path == ({} if ahead else {b: 1})


async def test_a_chat_that_continues_what_its_park_holds_is_restored_without_its_prompt_rendered(
        profile, server_asked):
    """The token check before a restore (the server renders the chat and tokenises it) is not made when the
    messages prove the park is the request's own: they continue the request whose render and answer the park
    holds. A chat the client's name ties to the conversation, whose messages do not continue it, is checked
    (the fake has no /apply-template: the check ends at its 404 and the restore goes on)."""
    asked = server_asked  # each chat the server renders (its last message), each restore
    async with Proxied(profile.replace(cache_ram=0)) as p:
        firsts = {name: await p.ask(chat(system(name), "hello"), user=f"chat-{name}") for name in "ABC"}
        reply_a, rec_a = firsts["A"]
        asked.clear()
        _, back = await p.ask(chat(system("A"), "hello", reply_a, "again"), user="chat-A")
        assert back.restored_from == f"proxy-{rec_a.conversation}", back
        assert back.verdict is VerdictKind.HIT, back
        assert asked == ["restore"]  # its messages continue what the park holds: no check

        # B was parked to make room for A; the client sends another chat under B's name
        _, rec_b = firsts["B"]
        asked.clear()
        _, other = await p.ask(chat(system("D"), "something else"), user="chat-B")
        assert other.conversation == rec_b.conversation and other.restored_from == f"proxy-{rec_b.conversation}"
        assert asked[:2] == ["something else", "restore"]  # checked before the restore


async def test_a_park_is_proven_by_the_request_that_filled_its_slot_not_by_the_conversations_last(
        profile, server_asked):
    """What proves a park is the request whose render its slot held when it was parked. Here the client,
    under its chat's name, sends other messages to a slot of its own choosing (passed through untouched,
    elsewhere): the conversation's slot still holds its first chat, and so does the park made of it. The
    next request continues the other messages, not the park's: it is checked before the restore."""
    asked = server_asked  # each chat the server renders (its last message), each restore
    async with Proxied(profile.replace(cache_ram=0)) as p:
        _, first = await p.ask(chat(system("A"), "hello"), user="chat-A")
        other_slot = 1 - first.slot
        elsewhere = chat(system("D"), "another chat")
        reply, rec = await p.ask(elsewhere, user="chat-A", extra_body={"id_slot": other_slot})
        assert rec.conversation == first.conversation and rec.slot == other_slot
        for name in "BC":  # the conversation's slot, still holding its first chat, is parked to make room
            await p.ask(chat(system(name), "hello"))
        assert p.proxy.conversations[first.conversation].parked_as == f"proxy-{first.conversation}"
        asked.clear()
        _, back = await p.ask(elsewhere + [{"role": "assistant", "content": reply},
                                           {"role": "user", "content": "and now?"}], user="chat-A")
        assert back.conversation == first.conversation and back.restored_from == f"proxy-{first.conversation}"
        assert asked[:2] == ["and now?", "restore"]  # checked before the restore


async def test_a_park_of_a_slot_whose_last_request_was_cut_short_is_checked_before_its_restore(
        profile, monkeypatch, server_asked):
    """A streamed request the client left before its end has no final timings: the server may not have
    processed it at all, so what its slot holds is not known to follow its messages, and the park made of
    that slot is checked before it is restored, even when the next request continues the conversation."""
    monkeypatch.setenv("FAKE_COMPLETION_DELAY", "1")  # each answer takes a second: the client leaves one early
    asked = server_asked  # each chat the server renders (its last message), each restore
    async with Proxied(profile.replace(cache_ram=0)) as p:
        idle = asyncio.Event()
        p.proxy.on_idle(idle.set)
        reply, first = await p.ask(chat(system("A"), "hello"))
        story = chat(system("A"), "hello", reply, "tell me a long story")
        idle.clear()
        stream = await p.client.chat.completions.create(model="m", messages=story, max_tokens=400, stream=True)
        async for _ in stream:
            break  # the first chunk, then the client goes
        await stream.close()
        await asyncio.wait_for(idle.wait(), 120)  # the proxy has seen it end (no verdict: no timings)
        assert p.judged.empty()  # not judged: it has no final timings
        for name in "BC":  # A's slot is parked to make room
            await p.ask(chat(system(name), "hello"))
        assert p.proxy.conversations[first.conversation].parked_as == f"proxy-{first.conversation}"
        asked.clear()
        _, back = await p.ask(story + [{"role": "assistant", "content": "Once"}, {"role": "user", "content": "go on"}])
        assert back.conversation == first.conversation and back.restored_from == f"proxy-{first.conversation}"
        assert asked[:2] == ["go on", "restore"]  # checked before the restore


async def test_a_restores_bookkeeping_is_done_once_its_request_is_sent_before_the_answer(profile, monkeypatch):
    """What a restore writes after it (its catalog note, the verdict's watch, the journal's "restored") is held
    off the request's path until the request is sent upstream (issue #38), and done then, while the server
    works: what was written is looked at right after, in the same turn of the loop, before any answer."""
    async with Proxied(profile.replace(cache_ram=0)) as p:
        firsts = {name: await p.ask(chat(system(name), "hello")) for name in "ABC"}
        reply_a, rec_a = firsts["A"]
        park = f"proxy-{rec_a.conversation}"
        sessions = p.handle.sessions
        rec = sessions.catalog.get(sessions.profile_name, park)
        assert rec is not None and "resume" not in [e.kind for e in sessions.catalog.history(rec.id)]
        seen = []
        told = p.proxy.sent

        def telling(ctx):
            told(ctx)
            asyncio.get_running_loop().call_soon(lambda: seen.append((  # right after what ``sent`` scheduled
                [e.kind for e in sessions.catalog.history(rec.id)],
                [e.event for e in p.proxy.store.journal_entries(p.proxy.profile)], asking.done())))
        monkeypatch.setattr(p.proxy, "sent", telling)
        asking = asyncio.ensure_future(p.ask(chat(system("A"), "hello", reply_a, "again")))
        _, back = await asking
    assert back.restored_from == park
    kinds, journal, answered = seen[-1]
    assert kinds.count("resume") == 1 and journal[-1] == "restored" and not answered


async def test_a_restore_the_server_refuses_is_said_and_the_request_re_prefills(profile, monkeypatch):
    # no RAM prompt cache: it would bring the conversation back by itself (as llama-server's does)
    async with Proxied(profile.replace(cache_ram=0)) as p:
        firsts = {name: await p.ask(chat(system(name), "hello")) for name in "ABC"}
        reply_a, rec_a = firsts["A"]
        park = p.handle.save_dir / f"{p.handle.sessions.session(f'proxy-{rec_a.conversation}').state_file}"
        park.write_bytes(b"not a state file")  # the server refuses it: the slot is emptied
        _, back = await p.ask(chat(system("A"), "hello", reply_a, "again"))
        assert back.conversation == rec_a.conversation
        assert back.verdict is VerdictKind.MISS, back
        assert back.explanation is not None and back.explanation.cause is Cause.RESTORE_FAILED, back


@pytest.mark.parametrize("warm", [True, False], ids=["warm-start", "no-warm-start"])
async def test_an_app_restart_finds_the_conversations_again(profile, warm):
    """After a restart the conversation comes back from its park: restored by the warm start before
    its request (the setting's default), or, with the warm start off, by its request."""
    from app import settings
    from app.proxy.lease_table import SlotState

    settings.update(proxy_warm_start=warm)
    async with Proxied(profile) as p:
        reply, first = await p.ask(chat(system("A"), "hello"))
        await p.servers.park_then_stop(p.handle.id, StopTrigger.SERVE)  # serve's Ctrl-C: the proxy saves first
    async with Proxied(profile) as p2:
        if warm:
            assert await asyncio.wait_for(p2.proxy.warming, 120) == [first.conversation]
            held = [(v.state, v.conversation) for v in p2.proxy.leases.snapshot()]
            assert (SlotState.IDLE_CLEAN, first.conversation) in held  # before any request asked
        else:
            assert p2.proxy.warming is None
            assert all(v.state is SlotState.FREE for v in p2.proxy.leases.snapshot())
        _, again = await p2.ask(chat(system("A"), "hello", reply, "and then?"))
        assert again.conversation == first.conversation
        assert again.restored_from == f"proxy-{first.conversation}"
        assert again.verdict is VerdictKind.HIT, again
