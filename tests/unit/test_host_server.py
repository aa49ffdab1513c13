"""A host's server as the server service's handle (app.servers.host_server): one per HOST:PROFILE, its
sessions and its one sampler; every status the sampler reads is its sessions' slots too. A stand-in
host answers ``kv-valet status --json`` (tests/unit/test_server_list.STATUS)."""

from __future__ import annotations

import asyncio

from app.core.states import ServerState
from app.servers.service import ServerService
from tests.unit.test_server_list import STATUS


class Host:
    name = "gpu-box"

    def __init__(self):
        self.asked: asyncio.Queue = asyncio.Queue()

    async def status(self, profile):
        await self.asked.put(profile)
        return dict(STATUS)


async def test_one_handle_per_server_its_sampler_feeds_its_sessions():
    service = ServerService(connect_sessions=False)
    host = Host()
    try:
        hs = service.host_server(host, "big")
        assert hs.target_id == "gpu-box:big" and service.host_server(host, "big") is hs  # kept
        assert hs.snapshot() is None and hs.state(ServerState.READY) is ServerState.READY  # the row's, until asked
        seen: asyncio.Queue = asyncio.Queue()
        hs.watch(seen.put_nowait)
        assert hs.sampler.paused and host.asked.empty()  # nobody sees it yet: nothing asked
        hs.resume()
        snap = await asyncio.wait_for(seen.get(), 60)
        assert await host.asked.get() == "big"
        assert len(snap.slots) == 2 and [r.id for r in await hs.sessions.slot_rows()] == [0, 1]  # one picture
        assert hs.state_text() == "Ready on gpu-box" and hs.snapshot() is not None
        hs.unwatch(seen.put_nowait)
        assert hs.sampler.paused  # nobody watches
        other = Host()
        assert service.host_server(other, "big") is not hs  # the host reached by another connection: a new one
    finally:
        await service.aclose()
    assert service.hosts == {}
