"""The conversation proxy here, in front of a host's server (``kv-valet serve HOST:PROFILE --proxy``).

A chat client on this machine talks to ``127.0.0.1:PORT``; the proxy sends every request through SSH
``direct-tcpip`` channels of the host's one connection (app.remote.tunnel) to the host's server on
the host's own loopback. Nothing listens on the host, and nothing here but the proxy.

* **Parks and restores happen on the host**, by the host's own ``kv-valet park|resume --json`` (its
  catalog, its ``--slot-save-path``, its sidecar checks): :class:`HostBackend` is the leases' slot
  operations over SSH. A parked conversation's files never cross the network.
* **Conversations and verdicts are kept here** (this machine's conversation store, under the name
  ``HOST:PROFILE``): the Conversations tab and ``kv-valet conversations`` show them as for a server
  launched here.
* The host's server is started through the host's kv-valet (``service start``: its user unit, or a
  detached ``kv-valet serve``) when it is not running, and left running when the proxy stops: the
  proxy first parks the conversations it holds, on the host.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

from app.core.background import TaskGroup
from app.core.lifecycle import TargetKind
from app.core.park_files import NOT_PARKED_FILES
from app.core.states import Health
from app.server.targets import TargetSpec
from app.servers.remote_sessions import _json_of, park_result, resume_result
from app.servers.service import ServerService
from app.proxy.lease_parks import RestoreAvoided
from app.proxy.service import ProxyService
from app.proxy.session_backend import SessionBackend
from app.remote.host import RemoteError

log = logging.getLogger(__name__)


class RemoteProxyError(Exception):
    """Why the proxy cannot front the host's server, with the remedy."""


class HostBackend(SessionBackend):
    """The leases' slot operations on a host's server, by the host's own kv-valet over SSH: a
    conversation's park is a session of the host's catalog (``proxy-<id>``), private there."""

    def __init__(self, handle: ServerHandle, host, profile: str, tasks: TaskGroup):
        super().__init__(handle, servers=None)  # type: ignore[arg-type]  (no local session service)
        self.host, self.profile = host, profile
        self._tasks = tasks
        self._sizes: dict[str, int] = {}

    async def save(self, slot: int, name: str) -> int:
        async def park() -> int:
            d = await _json_of(self.host, ["park", self.profile, "--slot", str(slot), "--name", name, "--json"])
            parked = [x for x in d.get("sessions") or () if isinstance(x, dict)]
            if not parked:
                raise RuntimeError(f"the host parked nothing of slot {slot}")
            rec = park_result(parked[0], self.profile).record
            self._sizes[name] = rec.state_size + rec.sidecar_size
            return rec.n_tokens
        return await self._observed("park", name, park())

    async def restore(self, slot: int, name: str) -> int:
        async def resume():
            try:
                d = await _json_of(self.host, ["resume", self.profile, name, "--slot", str(slot), "--yes",
                                               "--unless-files-changed", "--json"])
            except RemoteError as e:
                out = e.output if isinstance(e.output, dict) else {}
                if str(out.get("error", "")).startswith(NOT_PARKED_FILES):  # the host's own park-files check
                    raise RestoreAvoided(f"{NOT_PARKED_FILES}: {'; '.join(map(str, out.get('details') or ()))}") \
                        from None
                raise
            return resume_result(d, self.profile)
        result = await self._observed("restore", name, resume())
        self.checkpoints_loaded[slot] = None  # the host checked its sidecar; not known here
        self.hazards[slot] = result.hazard
        return result.n_restored

    def parked_size(self, name: str) -> int:
        return self._sizes.get(name, 0)

    def delete_park(self, name: str) -> None:
        """Deleted on the host in the background (the leases' call is synchronous); a failure is logged."""
        self._sizes.pop(name, None)

        async def rm() -> None:
            status, _out, err = await self.host.run_cli_as_is(["sessions", "rm", name, "--profile", self.profile])
            if status != 0 and "no session" not in err.lower():
                log.warning("the park %s on %s was not deleted: %s", name, self.host.name, err)
        self._tasks.start(rm(), f"deleting the park {name} on {self.host.name}")


@dataclass
class RemoteFront:
    """The proxy here and what it fronts: :meth:`stop` parks its conversations on the host and stops
    listening; the host's server keeps running."""
    proxy: ProxyService
    servers: ServerService
    host: object
    name: str  # "HOST:PROFILE"
    server_url: str  # the server's URL as the host sees it
    started_server: bool  # the host's server was started for this proxy
    tasks: TaskGroup

    async def stop(self, *, park: bool = True, timeout: float | None = None) -> tuple[list[str], str | None]:
        """Park the conversations the proxy holds on the host (for at most ``timeout`` s), then stop
        listening. The conversations parked, and what kept the parks from finishing (None: they did,
        or none were asked)."""
        parked: list[str] = []
        why = None
        try:
            if park and self.proxy.leases is not None:
                try:
                    parked = await asyncio.wait_for(self.proxy.leases.save_dirty(), timeout)
                except (asyncio.TimeoutError, TimeoutError):
                    why = f"the parks on the host took over {timeout:g} s"
            await self.tasks.wait()  # parks deleted meanwhile
        finally:
            await self.proxy.stop()
            await self.servers.aclose()
        return parked, why


async def start_remote_proxy(host, host_name: str, profile: str, *, listen: str = "127.0.0.1",
                             port: int | None = None, say: Callable[[str], None] = lambda _t: None,
                             store=None) -> RemoteFront:
    """Front the server of ``profile`` on ``host`` (app.remote.host.RemoteHost, connected on first use)
    with the conversation proxy here, on ``listen:port`` (default: the host profile's own port).
    Starts the host's server first when it is down. Raises RemoteProxyError (and the host's
    RemoteError) with the remedy."""
    profiles = await host.profiles()
    entry = next((p for p in profiles if p.get("name") == profile), None)
    if entry is None:
        known = ", ".join(str(p.get("name")) for p in profiles) or "none"
        raise RemoteProxyError(f"{host_name} has no profile '{profile}' (its profiles: {known}); "
                               f"see kv-valet hosts profiles {host_name}")
    if entry.get("has_api_key"):
        raise RemoteProxyError(
            f"the server of '{profile}' on {host_name} asks for an API key, and KV Valet does not carry keys "
            "between machines. Its server listens on the host's loopback, reached here only through SSH: remove "
            f"the key from that profile on {host_name}, or run the proxy there (kv-valet --host {host_name} serve "
            f"{profile} --proxy) and reach it with ssh -L.")
    url = str(entry.get("url") or "").rstrip("/")
    if not url:
        raise RemoteProxyError(f"the profile '{profile}' on {host_name} names no URL")
    started = False
    status = await host.status(profile)
    if Health.parse(status.get("health"))[0] is not Health.OK:
        say(f"the server of '{profile}' on {host_name} is not running: starting it there")
        data = await host.systemd("start", profile)
        if not data.get("ready"):
            from app.remote.unit import service_line

            raise RemoteProxyError(f"the server of '{profile}' on {host_name} did not come up: {service_line(data)}")
        started = True
    name = f"{host_name}:{profile}"
    servers = ServerService(connect_sessions=False)
    tasks = TaskGroup(f"the proxy of {name}")
    client = host.llama_client(url)
    servers.reach_through(TargetSpec(name, TargetKind.URL, url), client)
    proxy = ProxyService(servers, name, store=store, profile_name=name,
                         backend=lambda h: HostBackend(h, host, profile, tasks))
    try:
        await proxy.start(listen, port if port is not None else _port_of(url))
    except BaseException:
        await proxy.stop()
        await servers.aclose()
        raise
    return RemoteFront(proxy, servers, host, name, url, started, tasks)


def _port_of(url: str) -> int:
    from urllib.parse import urlsplit

    return urlsplit(url).port or 8080
