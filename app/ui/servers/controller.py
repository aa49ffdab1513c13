"""Qt face of the server service: its events as signals, for the server the window shows.

Every decision (which server, launch, attach, adopt or stop a leftover, the one HTTP
client, the session service, park-then-stop) is made in
:class:`app.servers.service.ServerService`; this class only follows the server the
window currently shows (``target_id``) and re-emits that server's events as Qt signals.
The service holds several servers at once; the window's server list picks the one shown
(:meth:`ServerController.select`), and every tab follows it: selecting re-emits the shown
server's state, session service and proxy, so a tab never needs to know there are others.
The service calls back on the asyncio loop (qasync runs it on the GUI thread), so
emitting is safe without locks.
"""

from __future__ import annotations

import asyncio
import logging

from PySide6.QtCore import QObject, Signal

from app.core.background import track
from app.core.lifecycle import StopTrigger
from app.core.profile import LaunchProfile
from app.servers.launch import launch_profile
from app.servers.service import ServerHandle, ServerService, profile_target_id
from app.servers.events import (LaunchPlanned, LaunchRefused, Notice, Parking, Progress, ProxyChanged, ServerEvent,
                                SessionsChanged, StateChanged)
from app.sessions.park_stop import ParkStopReport
from app.core.states import ServerState
from app.server.supervisor import LogBuffer

log = logging.getLogger(__name__)

RUNNING = (ServerState.STARTING, ServerState.LOADING, ServerState.READY)


class ServerController(QObject):
    sig_state = Signal(object, str)  # ServerState, detail (outcome summary for Crashed)
    sig_crashed = Signal(object)  # Outcome
    sig_error = Signal(str)  # refused before launch, with the reason
    sig_progress = Signal(str, int)  # what, percent (model assembly)
    sig_plan = Signal(object)  # LaunchPlan once a launch is planned
    sig_sessions = Signal(object)  # the shown server's SessionService, or None when it went
    sig_notice = Signal(str, bool)  # a message for the status line, ok
    sig_proxy = Signal(object)  # the conversation proxy in front of the shown server (app.proxy.service), or None
    sig_selected = Signal(str)  # the target id of the server shown now (app.servers.service)
    sig_event = Signal(object)  # every ServerEvent of every server (the server list follows them all)

    def __init__(self, parent=None, *, service: ServerService | None = None):
        super().__init__(parent)
        if service is None:
            from app.proxy.front import ProxyFront  # the proxy in front when a profile says so

            service = ServerService(front=ProxyFront())
        self.service = service
        self.service.on_event(self._on_event)
        self.target_id: str | None = None
        self._task: asyncio.Task | None = None
        self._empty_log = LogBuffer(1)
        self._details: dict[str, str] = {}  # each server's last state detail, said again when it is selected

    # -- the shown server ------------------------------------------------------------
    @property
    def handle(self) -> ServerHandle | None:
        return self.service.get(self.target_id)

    @property
    def supervisor(self):
        h = self.handle
        return h.supervisor if h is not None else None

    @property
    def plan(self):
        h = self.handle
        return h.plan if h is not None else None

    @property
    def profile(self) -> LaunchProfile | None:
        h = self.handle
        return h.profile if h is not None else None

    @property
    def attached(self):
        h = self.handle
        return h.attached if h is not None else None

    @property
    def sessions(self):
        h = self.handle
        return h.sessions if h is not None else None

    @property
    def client(self):
        h = self.handle
        return h.client if h is not None else None

    @property
    def log_buffer(self) -> LogBuffer:
        h = self.handle
        return h.log if h is not None and h.log is not None else self._empty_log

    @property
    def state(self) -> ServerState:
        h = self.handle
        return h.state if h is not None else ServerState.STOPPED

    @property
    def url(self) -> str | None:
        h = self.handle
        return h.url if h is not None else None

    @property
    def pid(self) -> int | None:
        h = self.handle
        return h.pid if h is not None else None

    @property
    def owned(self) -> bool:
        """True when the app launched the server (and so may stop it)."""
        h = self.handle
        return h is not None and h.owned

    def owned_running(self) -> list[ServerHandle]:
        """The servers launched here that run (a quit, a logout or a shutdown parks them all)."""
        return [h for h in list(self.service.servers.values()) if h.owned and h.state in RUNNING]

    # -- which server the tabs show --------------------------------------------------------
    def select(self, target_id: str | None) -> None:
        """Show ``target_id``'s server (a row of the server list, or a profile not running yet):
        its state, its session service and its proxy are emitted as if they had just changed."""
        if target_id == self.target_id:
            return
        before = self._shown()
        self.target_id = target_id
        state, sessions, proxy = after = self._shown()
        self.sig_selected.emit(target_id or "")
        if after[0] != before[0]:  # only what differs: two servers that are not there look alike
            self.sig_state.emit(*state)
        if sessions is not before[1]:
            self.sig_sessions.emit(sessions)
        if proxy is not before[2]:
            self.sig_proxy.emit(proxy)

    def _shown(self) -> tuple:
        h = self.handle
        if h is None:
            return (ServerState.STOPPED, ""), None, None
        return (h.state, self._details.get(h.id, "")), h.sessions, h.proxy

    # -- what the user does ------------------------------------------------------------
    async def attach_async(self, url: str, api_key: str | None = None, leftover=None) -> ServerState:
        """Watch a server at ``url`` without owning it; the servers shown before go on, in the list."""
        self.select(self.service.attach_id(url, leftover))  # its events from the first one on
        h = await self.service.attach(url, api_key, leftover=leftover)
        return h.state

    async def detach_async(self) -> None:
        h = self.handle
        if h is not None and h.attached is not None:
            await self.service.remove(h.id)

    def start(self, profile: LaunchProfile) -> asyncio.Task:
        self._task = track(self.start_async(profile), f"starting the server of '{profile.name}'")
        return self._task

    def stop(self) -> asyncio.Task:
        self._task = track(self.stop_async(), "stopping the server")
        return self._task

    def restart(self, profile: LaunchProfile) -> asyncio.Task:
        async def _restart():
            await self.service.stop(profile_target_id(profile.name))
            await self.start_async(profile)

        self._task = track(_restart(), f"restarting the server of '{profile.name}'")
        return self._task

    async def start_async(self, profile: LaunchProfile) -> bool:
        """Start ``profile``'s server and show it; the servers that run already go on."""
        self.select(profile_target_id(profile.name))
        handle, _proxy = await launch_profile(self.service, profile)
        return handle is not None

    async def stop_async(self) -> None:
        h = self.handle
        if h is not None:
            await self.service.stop(h.id)

    async def park_then_stop(self, trigger: StopTrigger) -> ParkStopReport | None:
        """The service's one park-then-stop, for the server shown (None: there is none)."""
        h = self.handle
        if h is None:
            return None
        return await self.service.park_then_stop(h.id, trigger)

    async def park_then_stop_all(self, trigger: StopTrigger) -> list[ParkStopReport]:
        """The one park-then-stop of every server launched here that runs, at once (a quit, a
        logout, logind's shutdown or sleep): each parks into its own profile's folder."""
        handles = self.owned_running()
        return list(await asyncio.gather(*(self.service.park_then_stop(h.id, trigger) for h in handles)))

    async def aclose(self) -> None:
        if self._task and not self._task.done():
            self._task.cancel()
        await self.service.aclose()

    # -- the service's events ----------------------------------------------------------
    def _on_event(self, ev: ServerEvent) -> None:
        if isinstance(ev, StateChanged):
            self._details[ev.target_id] = ev.detail
        self.sig_event.emit(ev)
        if ev.target_id != self.target_id:
            return
        if isinstance(ev, StateChanged):
            self.sig_state.emit(ev.state, ev.detail)
            if ev.state == ServerState.CRASHED and ev.outcome is not None:
                self.sig_crashed.emit(ev.outcome)
        elif isinstance(ev, LaunchPlanned):
            self.sig_plan.emit(ev.plan)
        elif isinstance(ev, LaunchRefused):
            self.sig_error.emit(ev.message)
        elif isinstance(ev, Progress):
            self.sig_progress.emit(ev.what, ev.percent)
        elif isinstance(ev, SessionsChanged):
            self.sig_sessions.emit(ev.sessions)
        elif isinstance(ev, ProxyChanged):
            self.sig_proxy.emit(ev.proxy)
        elif isinstance(ev, (Parking, Notice)):
            self.sig_notice.emit(ev.message, getattr(ev, "ok", True))
