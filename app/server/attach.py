"""Attach mode: watch a llama-server that KV Valet did not launch (or that
outlived an earlier KV Valet) without owning it.

The same states as the supervisor, from ``/health`` alone: Ready while it
answers 200, Loading on 503, Crashed ("unreachable") when it stops answering.
Stopping an attached server is not offered unless it is one of ours (a pid
record with a matching start time).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from app.core.observers import Observers
from app.core.background import track
from app.server.client import LlamaClient
from app.server.outcome import Cause, Outcome
from app.core.states import ServerState
from app.server.supervisor import PidRecord, terminate_leftover

log = logging.getLogger(__name__)


class AttachedServer:
    def __init__(self, url: str, api_key: str | None = None, *, interval_s: float = 1.0,
                 leftover: PidRecord | None = None, client: LlamaClient | None = None):
        self.url = url.rstrip("/")
        self.interval_s = interval_s
        self.leftover = leftover
        self.state = ServerState.STOPPED
        self.outcome: Outcome | None = None
        self._owns_client = client is None  # else the server's shared client (app.servers.service)
        self.client = client if client is not None else LlamaClient(self.url, api_key)
        self._cbs: Observers[[ServerState, Outcome | None]] = Observers(f"the state of {self.url}")
        self._task: asyncio.Task | None = None
        self._first = asyncio.Event()

    @property
    def pid(self) -> int | None:
        return self.leftover.pid if self.leftover and self.leftover.is_alive() else None

    def on_state(self, cb) -> None:
        self._cbs.add(cb)

    def _set(self, state: ServerState) -> None:
        if state != self.state:
            self.state = state
            self._cbs.emit(state, self.outcome)

    async def start(self) -> ServerState:
        """Begin watching; returns the first observed state."""
        if self._task is None:
            self._task = track(self._watch(), f"watching {self.url}")
        await self._first.wait()
        return self.state

    async def _watch(self) -> None:
        while True:
            h = await self.client.health()
            if h.ok:
                self.outcome = None
                self._set(ServerState.READY)
            elif h.loading:
                self._set(ServerState.LOADING)
            else:
                self.outcome = Outcome(None, None, Cause.EXITED, f"{self.url} does not answer: {h.message}")
                self._set(ServerState.CRASHED)
            self._first.set()
            await asyncio.sleep(self.interval_s)  # polling interval

    async def stop_server(self) -> None:
        """Stop the server, only if it is one KV Valet launched (pid + start time match)."""
        if self.leftover is None:
            raise PermissionError("this server was not started by KV Valet; stop it where it was started")
        await asyncio.to_thread(terminate_leftover, self.leftover)

    async def aclose(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._owns_client:
            await self.client.aclose()
