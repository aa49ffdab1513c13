"""A remote row of the server list drives the tabs (issues #20, #27, #37).

Selecting a host's server (a row whose target id is ``HOST:PROFILE``) shows that server's handle in
the server service (:meth:`app.servers.service.ServerService.host_server`,
:class:`app.servers.host_server.HostServer`): its sessions in the Sessions tab, through the tab's one
entry point (its controller's ``set_sessions``) as a server here is shown: its parked sessions, its
slots, Park and Resume through the host's own ``kv-valet``, the controls its capabilities allow. The
Log tab says where that server's log is. The Monitor tab shows the snapshots of the handle's one
sampler (its ``kv-valet status PROFILE --json``, asked while the tab is seen), which also feed its
sessions' slots; the status bar says the remote server's state ("Ready on gpu-box"). This view decides
nothing: it only shows the handle. Everything runs as a task of the Sessions tab: the window never
waits on SSH; a failure is said in the status bar and on the tab's hint line (the sessions' ``describe``).
"""

from __future__ import annotations

import logging
import time

from PySide6.QtCore import QObject, Signal

from app.core.states import ServerState
from app.monitor.snapshot import Snapshot
from app.servers import remote_sessions as rs
from app.servers.host_server import HostServer
from app.servers.server_list import STATE_ROLES
from app.ui.widgets import theme

log = logging.getLogger(__name__)


class RemoteView(QObject):
    sig_loaded = Signal(str, float)  # the target id whose sessions are listed now, seconds since the click
    sig_monitor = Signal(str)  # the target id whose status the Monitor tab shows now

    def __init__(self, window):
        super().__init__(window)
        self.window = window
        self.panel = window.sessions_panel
        self.servers = window.server_list.servers
        self.monitor = window.monitor_panel
        self.shown: HostServer | None = None  # the host's server the tabs show
        self._hooked: set[str] = set()  # the handles whose sessions' changes this view hears (once each)
        self._listed = 0  # the shown sessions' listings seen (sig_loaded once per listing)
        self._clicked: float | None = None
        window.controller.sig_selected.connect(self._on_selected)
        window.controller.sig_state.connect(lambda *_: self.show_state())  # after the window's "Server Stopped"
        window.tabs.currentChanged.connect(lambda _i: self._update_pause())  # the Monitor seen: asked at once

    @property
    def sampler(self):
        """The shown host server's one sampler (None: none shown)."""
        return self.shown.sampler if self.shown is not None else None

    def _on_selected(self, target_id: str) -> None:
        row = self.servers.row(target_id)
        if row is None or row.kind != "remote":
            if self.shown is not None:
                self._let_go()
                self.panel.controller.set_sessions(self.panel.controller.service)
                state = self.window.controller.state
                self.window.show_state(state, "")
                if state is not ServerState.READY:  # else its sampler starts again and shows it
                    self.monitor.clear_shown(f"Not sampling: the server is {state.lower()}.")
            return
        source = next((s for s in self.servers.sources if s.name == row.host), None)
        if source is None:
            return
        hs = self.window.controller.service.host_server(source.host, row.profile, row.target_id)
        self._let_go()
        self.shown = hs
        remote = hs.sessions
        self._listed, self._clicked = remote.listings, time.perf_counter()
        if hs.target_id not in self._hooked:
            self._hooked.add(hs.target_id)
            remote.on_change(lambda h=hs: self._on_changed(h))
        self.panel.controller.set_sessions(remote)
        self.window.log_panel.view.setPlainText(rs.NO_REMOTE_LOG.format(host=row.host, profile=row.profile))
        self.panel.controller.spawn(self._load(hs), f"listing the sessions of {target_id}")
        self.show_state()
        self.monitor.clear_shown(f"Asking {row.host} for the status of '{row.profile}'…")
        hs.watch(self._on_snapshot)
        self._update_pause()

    def _let_go(self) -> None:
        """The shown host server is shown no more: its sampler pauses (the service keeps the handle)."""
        hs, self.shown = self.shown, None
        if hs is not None:
            hs.unwatch(self._on_snapshot)

    async def _load(self, hs: HostServer) -> None:
        if not await hs.sessions.load() and self.shown is hs:
            self.window.show_message(hs.sessions.describe())

    def _on_changed(self, hs: HostServer) -> None:
        """The shown host's sessions or status changed: the status bar, and sig_loaded once per listing."""
        if hs is not self.shown:
            return
        self.show_state()
        snap = hs.snapshot()
        if snap is not None:
            self.window.snapshot_label.show_snapshot(snap)
        remote = hs.sessions
        if remote.listings > self._listed:
            self._listed = remote.listings
            clicked, self._clicked = self._clicked, None
            self.sig_loaded.emit(hs.target_id, time.perf_counter() - clicked if clicked is not None else 0.0)

    async def reload(self) -> None:
        if self.shown is not None:
            await self.shown.sessions.load()

    # -- the Monitor tab and the status bar -------------------------------------------------------
    def show_state(self) -> None:
        """The status bar says the shown remote server's state ("Ready on gpu-box")."""
        hs = self.shown
        if hs is None:
            return
        row = self.servers.row(hs.target_id)
        state = hs.state(row.state if row is not None else ServerState.STOPPED)
        colour = theme.hex_of(STATE_ROLES.get(state, "muted"))
        self.window.state_label.setText(f"<b style='color:{colour}'>● {rs.state_text(state, hs.host)}</b>")
        self.window.url_label.setText(f"'{hs.profile}' on {hs.host}" + (f" ({row.url})" if row and row.url else ""))

    def _on_snapshot(self, snap: Snapshot) -> None:
        """A snapshot of the shown host server's sampler: the Monitor tab and the status bar."""
        hs = self.shown
        if hs is None or self.panel.controller.closed:
            return
        if snap.error:
            self.monitor.clear_shown(snap.error)
        else:
            self.monitor.apply_snapshot(snap)
        self.window.snapshot_label.show_snapshot(snap)
        self.sig_monitor.emit(hs.target_id)

    def _update_pause(self) -> None:
        """The shown host server's sampler asks while the Monitor tab is seen, and pauses while not."""
        if self.shown is None:
            return
        if self.monitor.isVisible():
            self.shown.resume()
        else:
            self.shown.pause()
