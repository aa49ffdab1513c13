"""The conversation proxy on the real server, driven by the real `openai` client: more
conversations than slots rotate through their parks, every request is judged from the server's
own timings, and a conversation comes back after the server (and the app) restarted.

The stock llama-server keeps no context checkpoints across a restore, so on Gemma 3 (SWA) a
conversation restored from its park re-processes its prompt: DISCARDED, and the proxy says why. The
sidecar-writing build (v2) brings them back: the same conversation is a HIT."""

from __future__ import annotations

import asyncio

import openai
import pytest

from app.core.conversation import Cause

from app.core.verdict import VerdictKind, tolerance
from app.servers.service import ServerService
from app.proxy.front import ProxyFront
from app.servers.launch import launch_profile
from app.core.lifecycle import StopTrigger
from tests.conftest import free_port
from tests.real.helpers import TEXT
from tests.real.sidecar_bin import sidecar_server_bin  # noqa: F401  (fixture)

pytestmark = pytest.mark.real_server

SYSTEMS = {name: f"You are assistant {name}. Remember this manual word for word. " + TEXT[:900]
           for name in ("A", "B", "C")}


class Proxied:
    """A server behind the proxy, as `kv-valet serve PROFILE --proxy` runs it; each judged request."""

    def __init__(self, profile):
        self.profile = profile
        self.records = []

    async def __aenter__(self):
        self.servers = ServerService(front=ProxyFront())
        self.handle, self.proxy = await launch_profile(self.servers, self.profile)
        assert self.proxy is not None, "the server did not start"
        self.judged = asyncio.Queue()  # each judged request, as the proxy records it
        self.proxy.on_record(self.judged.put_nowait)
        self.client = openai.AsyncOpenAI(base_url=self.proxy.http.url + "/v1", api_key="not-needed")
        return self

    async def __aexit__(self, *exc):
        await self.client.close()
        await self.servers.aclose()

    async def stop(self):
        """The one park-then-stop (serve's Ctrl-C): the proxy saves its conversations first."""
        return await self.servers.park_then_stop(self.handle.id, StopTrigger.SERVE)

    async def ask(self, messages, **extra):
        reply = await self.client.chat.completions.create(model="gemma", messages=messages, max_tokens=4,
                                                          temperature=0, **extra)
        rec = await asyncio.wait_for(self.judged.get(), 120)  # judged once the response is through (a hang guard)
        assert self.judged.empty()
        return reply.choices[0].message.content or "", rec


def turn(system: str, *exchanges: tuple[str, str], question: str) -> list[dict]:
    msgs = [{"role": "system", "content": system}]
    for q, a in exchanges:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return msgs + [{"role": "user", "content": question}]


async def rotate(p: Proxied, *, restores: bool = True):
    """A, B, C on two slots, then A again: A was parked to make room for C and comes back (``restores``:
    from its park; else the proxy leaves the park, as the resume matrix says a restore buys nothing)."""
    first = {}
    for name in ("A", "B", "C"):
        reply, rec = await p.ask(turn(SYSTEMS[name], question="What is the first word?"))
        assert rec.verdict is VerdictKind.NEW
        first[name] = (reply, rec)
    assert first["C"][1].slot == first["A"][1].slot  # C took the least recently used slot: A's
    reply_a, _ = first["A"]
    again, rec = await p.ask(turn(SYSTEMS["A"], ("What is the first word?", reply_a), question="And the second?"))
    assert rec.conversation == first["A"][1].conversation  # the same conversation, found by its messages
    if restores:
        assert rec.restored_from == f"proxy-{rec.conversation}"  # brought back from its park
    else:
        assert rec.restored_from is None, rec
        assert p.proxy.conversations[rec.conversation].parked_as == f"proxy-{rec.conversation}"  # the park stays
    reply_c, _ = first["C"]
    c2, rec_c = await p.ask(turn(SYSTEMS["C"], ("What is the first word?", reply_c), question="And the second?"))
    return first, rec, rec_c


def test_conversations_rotate_through_their_parks_on_the_stock_server(real_profile):
    async def go():
        async with Proxied(real_profile.replace(proxy=True)) as p:
            first, back, c_again = await rotate(p, restores=False)
            # the stock build restores the tokens but not the checkpoints, and Gemma's SWA would re-process
            # them all (the resume matrix's cell, as the Sessions tab says of its park): the proxy does not
            # restore. The server's RAM prompt cache still holds A (saved there when C took its slot), and
            # a slot that holds a prompt looks there: A comes back whole, which a restore would have thrown
            # away (before the proxy asked the matrix, this turn was DISCARDED)
            assert back.verdict is VerdictKind.HIT, back
            assert back.cache_n >= back.expected_reuse - tolerance(back.expected_reuse), back
            assert back.slot not in p.proxy._backend.checkpoints_loaded  # no restore was made
            assert c_again.verdict is VerdictKind.HIT, c_again  # C stayed in its slot (B went)
            assert c_again.cache_n >= c_again.expected_reuse - tolerance(c_again.expected_reuse)
            convs = {c.id: c for c in p.proxy.list()}
            assert len(convs) == 3 and convs[back.conversation].requests == 2

    asyncio.run(go())


def test_an_edited_system_prompt_is_explained(real_profile):
    async def go():
        async with Proxied(real_profile.replace(proxy=True)) as p:
            # the client names its chat (OpenAI's "user"): an edited system prompt stays the same conversation
            reply, first = await p.ask(turn(SYSTEMS["A"], question="What is the first word?"), user="chat-42")
            edited = "You are a different assistant now. " + SYSTEMS["A"]
            _, rec = await p.ask(turn(edited, ("What is the first word?", reply), question="And the second?"),
                                 user="chat-42")
            assert rec.conversation == first.conversation
            assert rec.verdict in (VerdictKind.MISS, VerdictKind.PARTIAL)
            assert rec.explanation.cause is Cause.SYSTEM_PROMPT_CHANGED, rec.explanation

    asyncio.run(go())


@pytest.fixture
def sidecar_proxy_profile(real_profile, sidecar_server_bin, monkeypatch):
    monkeypatch.setenv("KVV_SIDECAR_MODE", "v2")
    return real_profile.replace(name="sidecar", server_binary=str(sidecar_server_bin), proxy=True)


def test_with_sidecars_a_conversation_comes_back_warm_after_the_server_and_the_app_restart(sidecar_proxy_profile):
    async def go():
        async with Proxied(sidecar_proxy_profile) as p:
            sessions = p.handle.sessions
            watched: dict[str, asyncio.Future] = {}  # the Sessions tab's verdicts, by park

            def told(slot, name, v):
                fut = watched.setdefault(name, asyncio.get_running_loop().create_future())
                if not fut.done():
                    fut.set_result(v)
            sessions.on_verdict(told)
            first, back, _ = await rotate(p)
            assert back.verdict is VerdictKind.HIT, back  # restored with its checkpoints
            # the restore's catalog note and its verdict's watch are done once the request is sent (issue #38):
            # the watch reads the same query in the server's log and says the same
            park = back.restored_from
            resume = await asyncio.wait_for(watched.setdefault(park, asyncio.get_running_loop().create_future()),
                                            120)
            assert resume.kind is VerdictKind.HIT, resume.reason
            rec = sessions.catalog.get(sessions.profile_name, park)
            assert [e.kind for e in sessions.catalog.history(rec.id)].count("resume") == 1
            reply_b, rec_b = first["B"]
            report = await p.stop()
            assert report.stopped and report.complete
        # a new app and a new server process: the proxy finds the conversations in its store
        port = free_port()
        async with Proxied(sidecar_proxy_profile.replace(port=port)) as p2:
            _, rec = await p2.ask(turn(SYSTEMS["B"], ("What is the first word?", reply_b), question="And then?"))
            assert rec.conversation == rec_b.conversation
            assert rec.restored_from == f"proxy-{rec.conversation}"
            assert rec.verdict is VerdictKind.HIT, rec

    asyncio.run(go())


def parks_total(proxy) -> float:
    """kvvalet_proxy_parks_total over its conversations, as a scrape of the proxy's /metrics reads it."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for fam in text_string_to_metric_families(proxy.metrics.exposition().decode())
               if fam.name == "kvvalet_proxy_parks" for s in fam.samples if s.name.endswith("_total"))


def test_the_next_conversation_to_leave_its_slot_is_parked_between_requests(sidecar_proxy_profile):
    """Once C pushed A out, B (the least recently used) is parked while no request runs: A comes back into
    B's slot with no save on its path, and B comes back from the park made ahead, warm."""
    from app.proxy.lease_table import SlotState

    async def go():
        async with Proxied(sidecar_proxy_profile) as p:
            first = {}
            for name in ("A", "B", "C"):
                first[name] = await p.ask(turn(SYSTEMS[name], question="What is the first word?"))
            await p.proxy.settle()  # the work after C's answer: the park ahead with it
            (reply_a, rec_a), (reply_b, rec_b) = first["A"], first["B"]
            held = {v.conversation: v.state for v in p.proxy.leases.snapshot()}
            assert held[rec_b.conversation] is SlotState.IDLE_CLEAN  # B's slot holds its park
            park = p.handle.sessions.session(f"proxy-{rec_b.conversation}")
            assert park is not None and park.n_tokens >= rec_b.prompt_n

            parks = parks_total(p.proxy)
            _, back = await p.ask(turn(SYSTEMS["A"], ("What is the first word?", reply_a), question="And the second?"))
            assert back.conversation == rec_a.conversation and back.slot == rec_b.slot
            assert back.restored_from == f"proxy-{rec_a.conversation}" and back.verdict is VerdictKind.HIT, back
            assert parks_total(p.proxy) == parks  # no save on A's path: B was parked before A asked

            await p.proxy.settle()  # C is parked ahead now
            _, b_back = await p.ask(turn(SYSTEMS["B"], ("What is the first word?", reply_b), question="And the second?"))
            assert b_back.restored_from == f"proxy-{rec_b.conversation}", b_back  # from the park made ahead
            assert b_back.verdict is VerdictKind.HIT, b_back
            assert b_back.cache_n >= b_back.expected_reuse - tolerance(b_back.expected_reuse), b_back

    asyncio.run(go())
