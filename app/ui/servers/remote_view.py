"""A remote row of the server list drives the tabs (issues #20, #27).

Selecting a host's server (a row whose target id is ``HOST:PROFILE``) shows in the Sessions tab
that server's :class:`app.servers.remote_sessions.RemoteSessions`, through the tab's one entry
point (its controller's ``set_sessions``) as a server here is shown: its parked sessions, its slots, Park and Resume
through the host's own ``kv-valet``, the controls its capabilities allow. The Log tab says where that
server's log is. The Monitor tab shows the host's slots and GPUs from the one sampler of that server
(:class:`app.monitor.sampler.Sampler` over its ``kv-valet status PROFILE --json``, one call at a
time, paused while the tab is not seen; it stops when another row is selected), and the status bar
says the remote server's state ("Ready on gpu-box").
Everything runs as a task of the Sessions tab: the window never waits on SSH; a failure is said in
the status bar and on the tab's hint line (the sessions' ``describe``).
"""

from __future__ import annotations

import logging
import time

from PySide6.QtCore import QObject, Signal

from app.core.states import ServerState
from app.monitor.sampler import Sampler
from app.monitor.snapshot import Snapshot, error_snapshot
from app.servers import remote_sessions as rs
from app.servers.remote_sessions import RemoteSessions
from app.servers.server_list import STATE_ROLES
from app.ui.widgets import theme

log = logging.getLogger(__name__)

#: seconds between two ``kv-valet status --json`` of the host while its row is selected and the Monitor seen
MONITOR_EVERY_S = 3.0


class RemoteView(QObject):
    sig_loaded = Signal(str, float)  # the target id whose sessions are listed now, seconds since the click
    sig_monitor = Signal(str)  # the target id whose status the Monitor tab shows now

    def __init__(self, window):
        super().__init__(window)
        self.window = window
        self.panel = window.sessions_panel
        self.servers = window.server_list.servers
        self.monitor = window.monitor_panel
        self.shown: RemoteSessions | None = None  # the host's server the tabs show
        self.sampler: Sampler | None = None  # its one sampler
        self._poll_task = None  # the task that runs it (a task of the Sessions tab: it ends with the window)
        self._listed = 0  # the shown sessions' listings seen (sig_loaded once per listing)
        self._clicked: float | None = None
        window.controller.sig_selected.connect(self._on_selected)
        window.controller.sig_state.connect(lambda *_: self.show_state())  # after the window's "Server Stopped"
        window.tabs.currentChanged.connect(lambda _i: self._update_pause())  # the Monitor seen: asked at once

    def _on_selected(self, target_id: str) -> None:
        row = self.servers.row(target_id)
        if row is None or row.kind != "remote":
            if self.shown is not None:
                self.shown = None
                self._stop_sampling()
                self.panel.controller.set_sessions(self.panel.controller.service)
                state = self.window.controller.state
                self.window.show_state(state, "")
                if state is not ServerState.READY:  # else its sampler starts again and shows it
                    self.monitor.clear_shown(f"Not sampling: the server is {state.lower()}.")
            return
        source = next((s for s in self.servers.sources if s.name == row.host), None)
        if source is None:
            return
        self.shown = remote = RemoteSessions(source.host, row.profile, row.target_id)
        self._listed, self._clicked = 0, time.perf_counter()
        remote.on_change(lambda r=remote: self._on_changed(r))
        self.panel.controller.set_sessions(remote)
        self.window.log_panel.view.setPlainText(rs.NO_REMOTE_LOG.format(host=row.host, profile=row.profile))
        self.panel.controller.spawn(self._load(remote), f"listing the sessions of {target_id}")
        self._stop_sampling()
        self.show_state()
        self.monitor.clear_shown(f"Asking {row.host} for the status of '{row.profile}'…")
        self._start_sampling(remote)

    async def _load(self, remote: RemoteSessions) -> None:
        if not await remote.load() and self.shown is remote:
            self.window.show_message(remote.describe())

    def _on_changed(self, remote: RemoteSessions) -> None:
        """The shown host's sessions or status changed: the status bar, and sig_loaded once per listing."""
        if remote is not self.shown:
            return
        self.show_state()
        if remote.loaded:
            self.window.snapshot_label.show_snapshot(rs.snapshot_of(remote.status, host=remote.host,
                                                                    profile=remote.profile_name, taken_at=time.time()))
        if remote.listings > self._listed:
            self._listed = remote.listings
            clicked, self._clicked = self._clicked, None
            self.sig_loaded.emit(remote.target_id, time.perf_counter() - clicked if clicked is not None else 0.0)

    async def reload(self) -> None:
        if self.shown is not None:
            await self.shown.load()

    # -- the Monitor tab and the status bar -------------------------------------------------------
    def show_state(self) -> None:
        """The status bar says the shown remote server's state ("Ready on gpu-box")."""
        remote = self.shown
        if remote is None:
            return
        row = self.servers.row(remote.target_id)
        state = rs.remote_state(remote.status if remote.loaded else None,
                                row.state if row is not None else ServerState.STOPPED)
        colour = theme.hex_of(STATE_ROLES.get(state, "muted"))
        self.window.state_label.setText(f"<b style='color:{colour}'>● {rs.state_text(state, remote.host)}</b>")
        self.window.url_label.setText(f"'{remote.profile_name}' on {remote.host}" + (f" ({row.url})" if row and row.url
                                                                                       else ""))

    def _start_sampling(self, remote: RemoteSessions) -> None:
        """The one sampler of the host's server: its ``status --json`` as the Monitor's snapshot,
        one call at a time, MONITOR_EVERY_S after the last answer; paused while the Monitor is not seen."""

        async def take() -> Snapshot:
            from app.remote.host import RemoteError

            label = f"{remote.profile_name} on {remote.host}"
            try:
                status = await remote.remote.status(remote.profile_name)
            except RemoteError as e:
                return error_snapshot(label, f"{remote.host} did not answer: {e}")
            if remote is self.shown:
                remote.set_status(status)
            return rs.snapshot_of(status, host=remote.host, profile=remote.profile_name, taken_at=time.time())

        def shown(snap: Snapshot) -> None:
            if remote is not self.shown or self.panel.controller.closed:
                return
            if snap.error:
                self.monitor.clear_shown(snap.error)
            else:
                self.monitor.apply_snapshot(snap)
            self.window.snapshot_label.show_snapshot(snap)
            self.sig_monitor.emit(remote.target_id)

        self.sampler = Sampler(take, on_snapshot=shown, interval=MONITOR_EVERY_S, busy_interval=MONITOR_EVERY_S,
                               tick_timeout=120.0, url=f"{remote.profile_name} on {remote.host}")
        self.sampler.pause()  # until the Monitor is seen
        self._poll_task = self.panel.controller.spawn(self.sampler.run(), f"the Monitor of {remote.target_id}")
        self._update_pause()

    def _update_pause(self) -> None:
        if self.sampler is None:
            return
        if self.monitor.isVisible():
            self.sampler.resume()
        else:
            self.sampler.pause()

    def _stop_sampling(self) -> None:
        task, self._poll_task, self.sampler = self._poll_task, None, None
        if task is not None:
            task.cancel()  # the sampler stops with it
