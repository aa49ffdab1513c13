"""The conversation proxy here, in front of a host's server (``kv-valet serve HOST:PROFILE --proxy``).

A chat client on this machine talks to ``127.0.0.1:PORT``; the proxy sends every request through SSH
``direct-tcpip`` channels of the host's one connection (app.remote.tunnel) to the host's server on
the host's own loopback. Nothing listens on the host, and nothing here but the proxy.

* **Parks and restores happen on the host**, by the host's own ``kv-valet park|resume --json`` (its
  catalog, its ``--slot-save-path``, its sidecar checks): the leases reach the host's slots through
  the one door to a server's slots, :class:`app.proxy.session_backend.SessionBackend` over that
  server's :class:`app.servers.remote_sessions.RemoteSessions`, as the Sessions tab reaches them.
  A parked conversation's files never cross the network.
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

from app.core.lifecycle import TargetKind
from app.core.states import Health
from app.server.targets import TargetSpec
from app.servers.remote_sessions import RemoteSessions
from app.servers.service import ServerService
from app.proxy.service import ProxyService
from app.proxy.session_backend import SessionBackend

log = logging.getLogger(__name__)


class RemoteProxyError(Exception):
    """Why the proxy cannot front the host's server, with the remedy."""


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
    sessions: RemoteSessions  # the host's server's sessions: the proxy's door to its slots

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
            await self.sessions.settled()  # parks deleted meanwhile
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
    sessions = RemoteSessions(host, profile, name)
    client = host.llama_client(url)
    servers.reach_through(TargetSpec(name, TargetKind.URL, url), client)
    proxy = ProxyService(servers, name, store=store, profile_name=name,
                         backend=lambda h: SessionBackend.of(h, sessions))
    try:
        await proxy.start(listen, port if port is not None else _port_of(url))
    except BaseException:
        await proxy.stop()
        await servers.aclose()
        raise
    return RemoteFront(proxy, servers, host, name, url, started, sessions)


def _port_of(url: str) -> int:
    from urllib.parse import urlsplit

    return urlsplit(url).port or 8080
