"""A remote row of the server list drives the tabs (issue #20).

Selecting a host's server (a row whose target id is ``HOST:PROFILE``) shows in the Sessions
tab that host's parked sessions (its ``kv-valet sessions list --json``) and in its slot
chooser the server's slots (``kv-valet status --json`` there); Park and Resume then act on the
host through its own ``kv-valet park|resume --json``; the Log tab says where that server's log is.
The Monitor tab shows the host's slots and GPUs from its ``kv-valet status PROFILE --json``, asked
again every few seconds while the tab is seen (one call at a time; it stops when another row is
selected), and the status bar says the remote server's state ("Ready on gpu-box").
Everything runs as a task of the Sessions tab: the window never waits on SSH, a busy bar shows
while the host answers, and a failure is said in the status bar and on the tab's message line.
What is decided (records, slot rows, the status line) is app.servers.remote_view's.
"""

from __future__ import annotations

import asyncio
import logging
import time

from PySide6.QtCore import QObject, Signal

from app.core.states import ServerState
from app.servers import remote_view as rv
from app.servers.server_list import STATE_ROLES
from app.ui.sessions.controller import Operation
from app.ui.widgets import theme

log = logging.getLogger(__name__)


class RemoteSessions:
    """The Sessions tab's view of one host's server, set as ``panel.remote`` while it is shown."""

    def __init__(self, view: "RemoteView", source, row):
        self.view = view
        self.source = source  # app.servers.server_list.RemoteServerSource
        self.host = source.host
        self.host_name = source.name
        self.profile = row.profile
        self.target_id = row.target_id
        self.records = []
        self.status: dict = {}
        self.loaded = False

    def endpoint(self):
        """This server's profile as a move's endpoint (app.move.move.RemoteEndpoint)."""
        return self.source.move_endpoint(self.view.servers.row(self.target_id) or _Row(self.profile))

    def usage(self) -> str:
        if not self.loaded:
            return f"Asking {self.host_name} for its parked sessions…"
        total = sum((r.state_size or 0) + (r.sidecar_size or 0) for r in self.records)
        from app.core.units import fmt_bytes

        return f"{len(self.records)} parked session(s) of '{self.profile}' on {self.host_name}: {fmt_bytes(total)}"

    def show_controls(self) -> None:
        """Park and Resume act on the host; the checks and the folder stay this machine's."""
        self.view.panel.set_remote_controls(self.status.get("health") == "ok",
                                            rv.status_line(self.host_name, self.profile, self.status) if self.loaded
                                            else f"'{self.profile}' on {self.host_name}: asking the host…")

    def on_park(self) -> None:
        panel = self.view.panel
        self.view.act(self, "Park", rv.park(self.host, self.profile, panel.slot.currentData(),
                                            panel.name.text().strip() or None))

    def on_resume(self) -> None:
        panel = self.view.panel
        rec = panel.selected()
        if rec is None:
            panel.say("Select a session to resume.", ok=False)
            return
        self.view.act(self, "Resume", rv.resume(self.host, self.profile, rec.name, panel.slot.currentData()))


class _Row:  # a move endpoint needs only the profile of a row that is no longer listed
    def __init__(self, profile: str):
        self.profile = profile


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
        self.panel.remote = None
        self._poll_task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        window.controller.sig_selected.connect(self._on_selected)
        window.controller.sig_state.connect(lambda *_: self.show_state())  # after the window's "Server Stopped"
        window.tabs.currentChanged.connect(lambda _i: self._wake.set())  # the Monitor seen: ask at once

    def _on_selected(self, target_id: str) -> None:
        row = self.servers.row(target_id)
        panel = self.panel
        if row is None or row.kind != "remote":
            if panel.remote is not None:
                self._stop_polling()
                panel.show_local()
                state = self.window.controller.state
                self.window._show_state(state, "")
                if state is not ServerState.READY:  # else its sampler starts again and shows it
                    self.monitor.clear_shown(f"Not sampling: the server is {state.lower()}.")
            return
        source = next((s for s in self.servers.sources if s.name == row.host), None)
        if source is None:
            return
        remote = RemoteSessions(self, source, row)
        panel.show_remote(remote)
        self.window.log_panel.view.setPlainText(rv.NO_REMOTE_LOG.format(host=row.host, profile=row.profile))
        panel.controller.spawn(self.load(remote, time.perf_counter()), f"listing the sessions of {target_id}")
        self._stop_polling()
        self.show_state()
        self.monitor.clear_shown(f"Asking {row.host} for the status of '{row.profile}'…")
        self._poll_task = panel.controller.spawn(self.poll(remote), f"the Monitor of {target_id}")

    async def load(self, remote: RemoteSessions, clicked: float | None = None) -> bool:
        """Ask the host for the server's sessions and status (at once); show them if still shown."""
        from app.remote.host import RemoteError

        panel = self.panel
        panel.set_busy(True)
        try:
            sessions, status = await asyncio.gather(remote.host.sessions(remote.profile),
                                                    remote.host.status(remote.profile))
        except RemoteError as e:
            self._fail(remote, f"{remote.host_name} did not answer: {e}")
            return False
        finally:
            panel.set_busy(False)
        remote.records, remote.status, remote.loaded = rv.session_records(sessions), status, True
        if panel.remote is not remote or panel.controller.closed:
            return False
        panel.refresh()
        panel.set_slot_rows(rv.slot_rows_of(status))
        remote.show_controls()
        self.show_state()
        self.sig_loaded.emit(remote.target_id, time.perf_counter() - clicked if clicked is not None else 0.0)
        return True

    # -- the Monitor tab and the status bar -------------------------------------------------------
    def show_state(self) -> None:
        """The status bar says the shown remote server's state ("Ready on gpu-box")."""
        remote = self.panel.remote
        if remote is None:
            return
        row = self.servers.row(remote.target_id)
        state = rv.remote_state(remote.status if remote.loaded else None,
                                row.state if row is not None else ServerState.STOPPED)
        colour = theme.hex_of(STATE_ROLES.get(state, "muted"))
        self.window.state_label.setText(f"<b style='color:{colour}'>● {rv.state_text(state, remote.host_name)}</b>")
        self.window.url_label.setText(f"'{remote.profile}' on {remote.host_name}" + (f" ({row.url})" if row and row.url
                                                                                      else ""))

    async def poll(self, remote: RemoteSessions) -> None:
        """While ``remote`` is shown: its host's status in the Monitor tab, asked when the tab is
        seen and every MONITOR_EVERY_S seconds after the last answer (never two calls at once)."""
        from app.remote.host import RemoteError

        while self.panel.remote is remote and not self.panel.controller.closed:
            if self.monitor.isVisible():
                try:
                    status = await remote.host.status(remote.profile)
                except RemoteError as e:
                    if self.panel.remote is remote:
                        self.monitor.clear_shown(f"{remote.host_name} did not answer: {e}")
                else:
                    if self.panel.remote is not remote:
                        return
                    remote.status = status
                    self.monitor.apply_snapshot(rv.snapshot_of(status, host=remote.host_name, profile=remote.profile,
                                                               taken_at=time.time()))
                    self.show_state()
                    self.sig_monitor.emit(remote.target_id)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), MONITOR_EVERY_S)
            except (asyncio.TimeoutError, TimeoutError):
                pass

    def _stop_polling(self) -> None:
        if self._poll_task is not None:
            self._poll_task.cancel()
            self._poll_task = None

    async def reload(self) -> None:
        if self.panel.remote is not None:
            await self.load(self.panel.remote)

    def act(self, remote: RemoteSessions, label: str, coro) -> None:
        self.panel.controller.spawn(self._act(remote, label, coro), f"{label.lower()} on {remote.target_id}")

    async def _act(self, remote: RemoteSessions, label: str, coro) -> None:
        from app.remote.host import RemoteError

        self.panel.set_busy(True)
        try:
            text = await coro
        except RemoteError as e:
            self.panel.set_busy(False)
            self._fail(remote, f"{label} on {remote.host_name} failed: {e}", label)
            return
        self.panel.say(text or f"{label}: done on {remote.host_name}.", ok=True, op=Operation(label))
        await self.load(remote)

    def _fail(self, remote: RemoteSessions, text: str, label: str = "") -> None:
        log.warning("%s", text)
        if self.panel.remote is remote:
            self.panel.say(text, ok=False, op=Operation(label) if label else None)
        self.window.show_message(text)
