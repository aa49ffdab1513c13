"""Qt face of one supervised server: signals for the window, asyncio inside.

The supervisor calls back from the asyncio loop (qasync runs it on the GUI
thread), so re-emitting as Qt signals is safe without locks.
"""

from __future__ import annotations

import asyncio
import logging

from PySide6.QtCore import QObject, Signal

from app.core.profile import LaunchProfile, ProfileError
from app.server.attach import AttachedServer
from app.server.launcher import LaunchPlan, make_supervisor, plan_launch
from app.server.outcome import Outcome
from app.server.supervisor import LaunchError, LogBuffer, ServerState, StartFailed, Supervisor

log = logging.getLogger(__name__)


class ServerController(QObject):
    sig_state = Signal(object, str)  # ServerState, detail (outcome summary for Crashed)
    sig_crashed = Signal(object)  # Outcome
    sig_error = Signal(str)  # refused before launch, with the reason
    sig_progress = Signal(str, int)  # what, percent (model assembly)
    sig_plan = Signal(object)  # LaunchPlan once a launch is planned

    def __init__(self, parent=None):
        super().__init__(parent)
        self.supervisor: Supervisor | None = None
        self.plan: LaunchPlan | None = None
        self.profile: LaunchProfile | None = None
        self.attached: AttachedServer | None = None
        self._task: asyncio.Task | None = None
        self._empty_log = LogBuffer(1)

    @property
    def log_buffer(self) -> LogBuffer:
        return self.supervisor.log if self.supervisor else self._empty_log

    @property
    def state(self) -> ServerState:
        if self.attached:
            return self.attached.state
        return self.supervisor.state if self.supervisor else ServerState.STOPPED

    @property
    def url(self) -> str | None:
        if self.attached:
            return self.attached.url
        return self.plan.url if self.plan else None

    @property
    def pid(self) -> int | None:
        if self.attached:
            return self.attached.pid
        return self.supervisor.pid if self.supervisor else None

    @property
    def owned(self) -> bool:
        """True when the app launched the server (and so may stop it)."""
        return self.attached is None and self.supervisor is not None

    async def attach_async(self, url: str, api_key: str | None = None, leftover=None) -> ServerState:
        """Watch a server at ``url`` without owning it."""
        await self.detach_async()
        if self.supervisor and self.supervisor.running:
            await self.supervisor.stop()
        self.attached = AttachedServer(url, api_key, leftover=leftover)
        self.attached.on_state(self._on_state)
        self.sig_state.emit(ServerState.STARTING, f"attaching to {url}…")
        return await self.attached.start()

    async def detach_async(self) -> None:
        if self.attached:
            att, self.attached = self.attached, None
            await att.aclose()
            self.sig_state.emit(ServerState.STOPPED, "detached")

    def start(self, profile: LaunchProfile) -> asyncio.Task:
        self._task = asyncio.ensure_future(self.start_async(profile))
        self._task.add_done_callback(_log_failure)
        return self._task

    def stop(self) -> asyncio.Task:
        self._task = asyncio.ensure_future(self.stop_async())
        self._task.add_done_callback(_log_failure)
        return self._task

    def restart(self, profile: LaunchProfile) -> asyncio.Task:
        async def _restart():
            await self.stop_async()
            await self.start_async(profile)

        self._task = asyncio.ensure_future(_restart())
        self._task.add_done_callback(_log_failure)
        return self._task

    async def start_async(self, profile: LaunchProfile) -> bool:
        await self.detach_async()
        if self.supervisor and self.supervisor.running:
            if self.profile == profile:
                await self.supervisor.start()
                return True
            await self.stop_async()
        self.profile = profile
        self.sig_state.emit(ServerState.STARTING, "checking the profile…")

        def progress(done: int, total: int) -> None:
            pct = int(done * 100 / max(total, 1))
            loop.call_soon_threadsafe(self.sig_progress.emit, "Assembling the default model", pct)

        loop = asyncio.get_running_loop()
        try:
            plan = await asyncio.to_thread(plan_launch, profile, on_model_progress=progress)
        except ProfileError as e:
            self.sig_error.emit("\n".join(str(x) for x in e.errors))
            self.sig_state.emit(ServerState.STOPPED, "refused")
            return False
        except Exception as e:
            self.sig_error.emit(str(e))
            self.sig_state.emit(ServerState.STOPPED, "refused")
            return False
        if self.supervisor:
            await self.supervisor.aclose()
        self.plan = plan
        self.supervisor = make_supervisor(plan)
        self.supervisor.on_state(self._on_state)
        self.sig_plan.emit(plan)
        try:
            await self.supervisor.start()
        except LaunchError as e:
            self.sig_error.emit(str(e))
            self.sig_state.emit(ServerState.STOPPED, "refused")
            return False
        except StartFailed:
            return False  # reported through the state callback (Crashed + outcome)
        return True

    async def stop_async(self) -> None:
        if self.attached:
            if self.attached.leftover is not None:
                await self.attached.stop_server()
            await self.detach_async()
            return
        if self.supervisor:
            await self.supervisor.stop()

    async def aclose(self) -> None:
        if self._task and not self._task.done():
            self._task.cancel()
        await self.detach_async()
        if self.supervisor:
            await self.supervisor.aclose()

    def _on_state(self, state: ServerState, outcome: Outcome | None) -> None:
        detail = ""
        if state == ServerState.CRASHED and outcome is not None:
            detail = outcome.summary()
        elif state == ServerState.READY and self.url:
            detail = self.url + (" (attached)" if self.attached else "")
        self.sig_state.emit(state, detail)
        if state == ServerState.CRASHED and outcome is not None:
            self.sig_crashed.emit(outcome)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("server task failed", exc_info=task.exception())
