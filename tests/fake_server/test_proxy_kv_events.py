"""The proxy's KV events (``serve --proxy --kv-events``) read by a real ZMQ SUB socket and decoded with
vLLM's own struct layout (tests/vllm_kv_events.py), in front of the fake llama-server (2 slots): a
late subscriber gets the whole state, each conversation's blocks follow it from its slot to its park
on disk and back, and a server restart clears everything but the parks. The token ids a consumer is
told are checked against the server's own tokenisation of each prompt."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import zmq
import zmq.asyncio

from app.servers.launch import launch_profile
from app.servers.service import ServerService
from app.proxy.front import ProxyFront
from tests import vllm_kv_events as vllm
from tests.fake_server.profiles import fake_profile


def prompt(name: str, turns: int = 1) -> str:
    """A text conversation's prompt after ``turns`` turns (each continues the last)."""
    return " ".join(f"{name}word{i}" for i in range(60 * turns))


class Subscribed:
    """The proxy with KV events on a port of the system's choice, and a SUB socket reading them."""

    def __init__(self, profile):
        self.profile = profile

    async def __aenter__(self):
        self.servers = ServerService(front=ProxyFront(kv_events="tcp://127.0.0.1:*"))
        self.handle, self.proxy = await launch_profile(self.servers, self.profile)
        assert self.proxy is not None and self.proxy.kv is not None
        self.judged = asyncio.Queue()
        self.proxy.on_record(self.judged.put_nowait)
        self.http = httpx.AsyncClient(base_url=self.proxy.url, timeout=60)
        self.sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(self.proxy.kv.publisher.bound)
        self.view = vllm.View()
        # a subscriber's arrival is answered with the whole state, from scratch (a batch published while
        # the subscription was on its way may come first: the state after it says all of it again)
        for _ in range(100):
            frames = await asyncio.wait_for(self.sub.recv_multipart(), 60)
            if isinstance(vllm.decode(frames[2]).events[0], vllm.AllBlocksCleared):
                self.view.apply(frames)
                return self
        raise AssertionError("no AllBlocksCleared after subscribing")

    async def __aexit__(self, *exc):
        self.sub.close()
        await self.http.aclose()
        await self.servers.aclose()

    async def ask(self, text: str):
        r = await self.http.post("/completion", json={"prompt": text, "n_predict": 2})
        assert r.status_code == 200, r.text
        rec = await asyncio.wait_for(self.judged.get(), 60)
        await self.caught_up()
        return rec

    async def caught_up(self) -> None:
        """Read every batch the proxy has published so far (after its tokenisations ended)."""
        await self.proxy.kv.settle()
        while self.view.seqs[-1] < self.proxy.kv.publisher.sent - 1:  # seq counts from 0, one per batch
            self.view.apply(await asyncio.wait_for(self.sub.recv_multipart(), 60))

    async def tokens(self, text: str) -> list[int]:
        """The prompt as the server tokenises it for a completion (its BOS first)."""
        async with httpx.AsyncClient(base_url=self.handle.url) as direct:
            r = await direct.post("/tokenize", json={"content": text, "add_special": True})
        return r.json()["tokens"]


@pytest.fixture
def profile(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SIDECAR", "1")
    return fake_profile(tmp_path).replace(proxy=True, cache_ram=0)


async def test_a_conversation_is_in_its_slot_then_on_disk_then_back_and_a_restart_keeps_only_parks(profile):
    async with Subscribed(profile) as s:
        a, b, c = [await s.tokens(prompt(n)) for n in "ABC"]
        rec_a = await s.ask(prompt("A"))
        full = len(a) // 16 * 16
        assert s.view.prefix("GPU", a) == full > 0 and s.view.prefix("DISK", a) == 0
        await s.ask(prompt("B"))
        assert s.view.prefix("GPU", b) == len(b) // 16 * 16
        await s.ask(prompt("C"))  # two slots: A (least recently used) is parked for C
        assert s.view.prefix("GPU", a) == 0, "A left its slot"
        assert s.view.prefix("DISK", a) == full, "A's park is on disk"
        assert s.view.prefix("GPU", c) == len(c) // 16 * 16
        # a router matching A's next turn finds its prefix on this server's disk, as many blocks as it had
        a2 = await s.tokens(prompt("A", 2))
        assert s.view.prefix("DISK", a2) == full
        back = await s.ask(prompt("A", 2))
        assert back.conversation == rec_a.conversation and back.restored_from is not None
        assert s.view.prefix("GPU", a2) == len(a2) // 16 * 16  # restored, and its new turn stored after it
        assert s.view.prefix("DISK", a) == full  # its park is still on disk

        cleared = s.view.cleared
        await s.handle.supervisor.restart()
        await s.caught_up()
        assert s.view.cleared == cleared + 1  # the restart is AllBlocksCleared ...
        assert s.view.blocks.get("GPU", {}) == {}  # ... no slot holds anything ...
        parked = [conv for conv in s.proxy.list() if conv.parked_as]
        assert parked and s.view.prefix("DISK", a) == full  # ... and the parks are said again
        assert s.view.seqs == list(range(s.view.seqs[0], s.view.seqs[-1] + 1))  # no batch lost


@pytest.mark.parametrize("warm", [False, True], ids=["no-warm-start", "warm-start"])
async def test_a_new_proxy_says_the_parks_of_an_earlier_run(profile, warm):
    """The app stopped (its proxy parked A first) and started again: the new proxy reads A's park from
    its state file and a router hears of it on disk, before A's next turn. With the warm start (the
    setting's default) A is also restored into a slot before anyone asks, and the router hears that too."""
    from app import settings
    from app.core.lifecycle import StopTrigger

    settings.update(proxy_warm_start=warm)
    async with Subscribed(profile) as s:
        a = await s.tokens(prompt("A"))
        await s.ask(prompt("A"))
        await s.servers.park_then_stop(s.handle.id, StopTrigger.SERVE)
    async with Subscribed(profile) as s2:
        if warm:
            assert await asyncio.wait_for(s2.proxy.warming, 120)  # A restored into a free slot
        await s2.caught_up()
        assert s2.view.prefix("DISK", a) == len(a) // 16 * 16 > 0
        if warm:
            assert s2.view.prefix("GPU", a) == len(a) // 16 * 16
        else:
            assert s2.view.blocks.get("GPU", {}) == {}


async def test_kv_events_are_off_unless_asked(profile):
    servers = ServerService(front=ProxyFront())
    try:
        _handle, proxy = await launch_profile(servers, profile)
        assert proxy is not None and proxy.kv is None and proxy.leases.on_change is None
    finally:
        await servers.aclose()
