"""A server on an SSH host as this machine knows it (issue #37, one server model): the server
service's handle of a host's server, beside its :class:`app.servers.service.ServerHandle` of a
server here.

:class:`HostServer` owns what the window shows of it: its sessions (the one door to its slots and
parks, :class:`app.servers.remote_sessions.RemoteSessions`), its one sampler (the host's ``kv-valet
status PROFILE --json``, one call at a time, ``MONITOR_EVERY_S`` after the last answer; paused
until someone watches; a status someone else read less than ``MONITOR_EVERY_S`` ago is used
instead: the server list's poll of the host feeds it, :meth:`ServerService.feed_host_statuses`),
and its state from that status. Every status the sampler reads feeds its
sessions, so the Sessions tab's slots and the Monitor tab's snapshot are the same picture. Qt-free:
the window's remote view (app.ui.servers.remote_view) only shows it. The server service keeps one per
``HOST:PROFILE`` (:meth:`app.servers.service.ServerService.host_server`).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from app.core.background import TaskGroup
from app.core.observers import Observers
from app.core.states import ServerState
from app.monitor.sampler import Sampler
from app.monitor.snapshot import Snapshot, error_snapshot
from app.servers import remote_sessions as rs
from app.servers.remote_sessions import RemoteSessions

log = logging.getLogger(__name__)

#: seconds between two ``kv-valet status --json`` of the host while its server is watched
MONITOR_EVERY_S = 3.0


class HostServer:
    """One server on a host (``host``: app.remote.host.RemoteHost), ``HOST:PROFILE``."""

    def __init__(self, host, profile: str, target_id: str | None = None):
        self.sessions = RemoteSessions(host, profile, target_id)
        self.target_id = self.sessions.target_id
        self.sampler: Sampler | None = None
        self._snapshots: Observers[[Snapshot]] = Observers(f"the snapshots of {self.target_id}")
        self._tasks = TaskGroup(f"the sampler of {self.target_id}")

    @property
    def host(self) -> str:
        return self.sessions.host

    @property
    def profile(self) -> str:
        return self.sessions.profile_name

    def state(self, row_state: ServerState = ServerState.STOPPED) -> ServerState:
        """Its state from its last status (``row_state``, the server list's, until one is known)."""
        return rs.remote_state(self.sessions.status if self.sessions.loaded else None, row_state)

    def state_text(self, row_state: ServerState = ServerState.STOPPED) -> str:
        """The status bar's line: "Ready on gpu-box"."""
        return rs.state_text(self.state(row_state), self.host)

    def snapshot(self) -> Snapshot | None:
        """Its last status as the Monitor's snapshot (None: not asked yet)."""
        if not self.sessions.loaded:
            return None
        return rs.snapshot_of(self.sessions.status, host=self.host, profile=self.profile, taken_at=time.time())

    # -- the one sampler --------------------------------------------------------------------------
    async def _take(self) -> Snapshot:
        """The host's ``status --json``, or the one read less than ``MONITOR_EVERY_S`` ago by someone
        else (the click's listing, the server list's poll of the host): one SSH poll of a server."""
        from app.remote.host import RemoteError

        age = self.sessions.status_age()
        if age is not None and age < MONITOR_EVERY_S and self.sessions.loaded:
            return rs.snapshot_of(self.sessions.status, host=self.host, profile=self.profile,
                                  taken_at=time.time() - age)
        try:
            status = await self.sessions.remote.status(self.profile)
        except RemoteError as e:
            return error_snapshot(f"{self.profile} on {self.host}", f"{self.host} did not answer: {e}")
        self.sessions.set_status(status)  # the Sessions tab's slots: the same picture
        return rs.snapshot_of(status, host=self.host, profile=self.profile, taken_at=time.time())

    def watch(self, on_snapshot: Callable[[Snapshot], None]) -> None:
        """Hear every snapshot its sampler takes (the sampler made and started, paused, when it is
        the first watcher: :meth:`resume` asks for them)."""
        self._snapshots.add(on_snapshot)
        if self.sampler is None:
            self.sampler = Sampler(self._take, on_snapshot=self._snapshots.emit, interval=MONITOR_EVERY_S,
                                   busy_interval=MONITOR_EVERY_S, tick_timeout=120.0,
                                   url=f"{self.profile} on {self.host}")
            self.sampler.pause()
            self._tasks.start(self.sampler.run(), "sampling its status")

    def unwatch(self, on_snapshot: Callable[[Snapshot], None]) -> None:
        """Stop hearing its snapshots; with nobody left watching, the sampler pauses."""
        self._snapshots.remove(on_snapshot)
        if not len(self._snapshots) and self.sampler is not None:
            self.sampler.pause()

    def resume(self) -> None:
        """Sample now and every ``MONITOR_EVERY_S`` (someone sees its snapshots)."""
        if self.sampler is not None:
            self.sampler.resume()

    def pause(self) -> None:
        if self.sampler is not None:
            self.sampler.pause()

    async def aclose(self) -> None:
        """Its sampler stops (the server service's close)."""
        self.sampler = None
        await self._tasks.cancel_all()
