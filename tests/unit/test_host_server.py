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


async def test_a_move_restores_through_the_rows_one_door_here_or_on_a_host(tmp_path):
    """The restore after a move asks the target row's Sessions (ServerList.sessions_of): a host's row
    the handle the window shows (its ``kv-valet check --json``), this machine's its session service;
    no switch on the endpoint's kind (issue #37)."""
    from app.servers.restore_after_move import restore_and_judge, verdict_text
    from app.servers.server_list import LocalServerSource, RemoteServerSource, ServerList, ServerRow
    from app.sessions.service import ServiceError

    class CheckingHost(Host):
        def __init__(self):
            super().__init__()
            self.argv = []

        async def run_cli(self, argv, *, timeout=60, ok_exits=(0,)):
            self.argv.append(list(argv))
            assert 3 in ok_exits and 4 in ok_exits  # a discarded or differing restore is a report, not a failure
            return {"type": "check", "slot_id": 1, "n_restored": 900, "verdict": {"kind": "DISCARDED", "reason": "x"}}

    service = ServerService(connect_sessions=False)
    host = CheckingHost()
    servers = ServerList([LocalServerSource(service), RemoteServerSource(host, owns_host=False)])
    try:
        row = ServerRow("gpu-box:big", "big", ServerState.READY, "remote", "gpu-box", profile="big")
        sessions = await servers.sessions_of(row, service)
        assert sessions is service.host_server(host, "big", "gpu-box:big").sessions  # the shown handle's
        restored = await restore_and_judge(sessions, "chat", output_check=False)
        assert host.argv == [["check", "big", "chat", "--yes", "--json", "--no-output-check"]]
        assert verdict_text(restored) == "Restored into slot 1 (900 tokens); first query: DISCARDED — x."
        await restore_and_judge(sessions, "chat", 0)
        assert host.argv[-1] == ["check", "big", "chat", "--yes", "--json", "--slot", "0"]

        here = ServerRow("profile:gone", "gone", ServerState.STOPPED, profile="gone")  # this machine's
        try:
            await servers.sessions_of(here, service)
        except ServiceError as e:  # this machine's row: its session service, which says why there is none
            assert "no server profile:gone" in str(e)
        else:
            raise AssertionError("a server that is not listed has no sessions")
    finally:
        await servers.aclose()
        await service.aclose()


async def test_the_server_lists_poll_of_a_host_feeds_its_handle_one_ssh_poll_per_server():
    """The list asks the host every 2 s for every profile's status; the handle of a server the window
    shows takes it (its Sessions tab's slots) and its sampler uses a status younger than
    MONITOR_EVERY_S instead of asking the host again (issue #37: one poller of a server)."""
    from app.servers import host_server
    from app.servers.server_list import RemoteServerSource

    class ListedHost(Host):
        def __init__(self):
            super().__init__()
            self.listings = 0

        async def servers(self):
            self.listings += 1
            return [{"profile": {"name": "big"}, "status": dict(STATUS), "running": True},
                    {"profile": {"name": "small"}, "status": {"health": "unreachable: refused"}, "running": False}]

    service = ServerService(connect_sessions=False)
    host = ListedHost()
    source = RemoteServerSource(host, owns_host=False, service=service)
    try:
        hs = service.host_server(host, "big")
        other = service.host_server(Host(), "big", "elsewhere:big")  # another host's server of that name
        await source.refresh()
        assert host.listings == 1 and hs.sessions.loaded and hs.sessions.statuses == 1
        assert [r.id for r in await hs.sessions.slot_rows()] == [0, 1] and not other.sessions.loaded
        seen: asyncio.Queue = asyncio.Queue()
        hs.watch(seen.put_nowait)
        hs.resume()
        snap = await asyncio.wait_for(seen.get(), 60)
        assert len(snap.slots) == 2 and host.asked.empty()  # the list's status, younger than MONITOR_EVERY_S
        hs.pause()
        hs.sessions.status_at -= host_server.MONITOR_EVERY_S  # older now: the sampler asks the host itself
        await hs.sampler.refresh()
        assert await asyncio.wait_for(host.asked.get(), 60) == "big"
    finally:
        await service.aclose()
