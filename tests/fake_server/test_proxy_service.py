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

    async def ask(self, messages):
        reply = await self.client.chat.completions.create(model="m", messages=messages, max_tokens=2)
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
