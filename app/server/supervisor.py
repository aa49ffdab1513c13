"""Launch and watch one llama-server process (Qt-free, asyncio).

States: Stopped → Starting → Loading → Ready → Stopping → Stopped, or Crashed
with an ``Outcome``. The server runs in its own process group (session) so a
stop can take down anything it spawned, and so that Ctrl-C in the terminal that
ran ``kv-valet serve`` reaches the app first, which then stops the server in
order. Stop = SIGTERM to the group, wait, SIGKILL (as Vorta does).

A pid record (pid + process start time, never pid alone: pids are recycled)
lets the next start of the app find a server that outlived an app crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import signal
import select
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil

from app.core.background import TaskGroup
from app.core.observers import Observers
from app.core.states import ServerState
from app.serverbuild import MODE_ENV
from app.server.client import LlamaClient
from app.server.logfile import ServerLogFile
from app.server.logparse import Kind, LogEvent, SidecarMode, parse_line
from app.server.outcome import Cause, Outcome, classify

log = logging.getLogger(__name__)


#: The reader thread hands parsed lines to the event loop in batches of at most
#: this many lines or this many seconds (a line never waits longer).
READ_BATCH_LINES = 256
READ_BATCH_S = 0.03
#: How long a stopping server may stay after it said "cleaning up before exit" (its loop has ended)
#: before the second SIGTERM, which llama-server answers with "Received second interrupt, terminating
#: immediately.": a request that was running at the first one (a client's generation, a /slots read)
#: keeps one of its HTTP threads waiting for a loop that is gone, and the process with it, for ever.
CLEANUP_GRACE_S = 2.0


class LaunchError(Exception):
    """Refused before launching (nothing was started)."""


class StartFailed(Exception):
    def __init__(self, outcome: Outcome):
        self.outcome = outcome
        super().__init__(outcome.summary())


@dataclass(frozen=True)
class LogLine:
    seq: int
    at: float
    event: LogEvent


class LogBuffer:
    """Bounded ring buffer of parsed log lines; readers poll by sequence number."""

    def __init__(self, capacity: int = 20000):
        self._lines: deque[LogLine] = deque(maxlen=capacity)
        self.seq = 0

    def append(self, text: str) -> LogLine:
        return self.append_event(parse_line(text), time.time())

    def append_event(self, event: LogEvent, at: float) -> LogLine:
        """A line parsed elsewhere (the supervisor's reader thread)."""
        self.seq += 1
        item = LogLine(self.seq, at, event)
        self._lines.append(item)
        return item

    def since(self, seq: int) -> list[LogLine]:
        """The lines after ``seq``, oldest first; costs the new lines only (read from the end)."""
        if not self._lines or seq >= self.seq:
            return []
        out = []
        for item in reversed(self._lines):
            if item.seq <= seq:
                break
            out.append(item)
        out.reverse()
        return out

    def read_since(self, at: float, limit: int = 4096) -> list[LogLine]:
        """The lines read at ``at`` (``time.time()``) or later, oldest first; read from the end, at most
        ``limit`` of them."""
        out = []
        for item in reversed(self._lines):
            if item.at < at or len(out) >= limit:
                break
            out.append(item)
        out.reverse()
        return out

    def tail(self, n: int) -> list[str]:
        return [item.event.line for item in list(self._lines)[-n:]]

    def __len__(self) -> int:
        return len(self._lines)


def check_port_free(host: str, port: int) -> None:
    """Raise LaunchError naming the port (and its owner, if known) when taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    addr = host.strip("[]")
    if addr in ("", "localhost"):
        addr = "127.0.0.1"
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, port))
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            owner = port_owner(port)
            raise LaunchError(
                f"port {port} on {addr} is already in use" + (f" by {owner}" if owner else "")
                + ": stop that program or choose another port"
            ) from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise LaunchError(f"host {host} is not an address of this machine") from None
        raise LaunchError(f"cannot use {addr}:{port}: {e.strerror}") from None
    finally:
        s.close()


def port_owner(port: int) -> str:
    try:
        for c in psutil.net_connections(kind="tcp"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                try:
                    return f"pid {c.pid} ({psutil.Process(c.pid).name()})"
                except psutil.Error:
                    return f"pid {c.pid}"
    except (psutil.Error, OSError):
        pass
    return ""


# -- pid records -------------------------------------------------------------

@dataclass(frozen=True)
class PidRecord:
    pid: int
    create_time: float
    url: str
    profile: str
    argv: tuple[str, ...]
    started_at: float

    def is_alive(self) -> bool:
        """The same process (pid *and* start time), still running."""
        try:
            p = psutil.Process(self.pid)
            return abs(p.create_time() - self.create_time) < 0.05 and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False


def write_pid_record(path: Path, rec: PidRecord) -> None:
    from app import files

    files.write_private(path, json.dumps(rec.__dict__ | {"argv": list(rec.argv)}))


def read_pid_record(path: Path) -> PidRecord | None:
    try:
        d = json.loads(path.read_text())
        return PidRecord(int(d["pid"]), float(d["create_time"]), d["url"], d["profile"], tuple(d["argv"]),
                         float(d["started_at"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def find_leftover_server(path: Path) -> PidRecord | None:
    """A server this app launched that outlived the app; stale records are removed."""
    rec = read_pid_record(path)
    if rec is None:
        return None
    if rec.is_alive():
        return rec
    with contextlib.suppress(OSError):
        path.unlink()
    return None


def terminate_leftover(rec: PidRecord, timeout: float = 10.0) -> None:
    if not rec.is_alive():
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(rec.pid, signal.SIGTERM)
    try:
        psutil.Process(rec.pid).wait(timeout)
    except psutil.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(rec.pid, signal.SIGKILL)
    except psutil.Error:
        pass


# -- the supervisor ----------------------------------------------------------

StateCallback = Callable[[ServerState, "Outcome | None"], None]
LineCallback = Callable[[LogLine], None]


#: the first /health poll's delay after a start; each next one 1.5x longer, up to ``health_interval_s``
HEALTH_FIRST_POLL_S = 0.02


class Supervisor:
    def __init__(
        self,
        argv: list[str],
        *,
        url: str,
        env: dict[str, str] | None = None,
        api_key: str | None = None,
        profile_name: str = "",
        pid_record_path: Path | None = None,
        auto_restart: bool = False,
        max_restarts: int = 3,
        restart_window_s: float = 300.0,
        backoff_s: tuple[float, ...] = (1.0, 2.0, 5.0, 10.0),
        load_timeout_s: float = 900.0,
        stop_timeout_s: float = 10.0,
        health_interval_s: float = 0.2,
        log_capacity: int = 20000,
        check_port: tuple[str, int] | None = None,
        log_file: Path | None = None,
        log_file_bytes: int = 20 * 1024 * 1024,
        log_backups: int = 3,
        client: LlamaClient | None = None,
    ):
        self.argv = list(argv)
        self.url = url
        self.env = env
        self.launch_sidecar_mode: str | None = None  # $KVV_SIDECAR_MODE of its last start (see start())
        self.profile_name = profile_name
        self.pid_record_path = pid_record_path
        self.auto_restart = auto_restart
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.backoff_s = backoff_s
        self.load_timeout_s = load_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.health_interval_s = health_interval_s
        self.check_port = check_port
        self.log = LogBuffer(log_capacity)
        # every line, also those the ring buffer drops (app.server.logfile)
        self.log_file_path = log_file
        self._log_file = (ServerLogFile(log_file, max_bytes=log_file_bytes, backups=log_backups)
                          if log_file is not None else None)
        self.state = ServerState.STOPPED
        self.outcome: Outcome | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self.started_at: float | None = None
        self.restart_times: list[float] = []
        # the server's one HTTP client, shared with whoever else talks to it (app.servers.service)
        self._owns_client = client is None
        self._client = client if client is not None else LlamaClient(url, api_key)
        self._state_cbs: Observers[[ServerState, Outcome | None]] = Observers(f"the state of the server at {url}")
        self._line_cbs: Observers[[LogLine]] = Observers(f"the log of the server at {url}")
        self._tasks = TaskGroup(f"the supervisor of {url}")
        self._ready: asyncio.Future | None = None
        self._stopping_by_user = False
        self._start_lock = asyncio.Lock()
        self._exited = asyncio.Event()
        self._exited.set()
        self._cleaning_up = asyncio.Event()  # the running process said "cleaning up before exit"
        self.forced_after_cleanup = False  # the last stop needed the second SIGTERM (CLEANUP_GRACE_S)
        self._restart_task: asyncio.Future | None = None
        self.sidecar_mode: str | None = None  # "checkpoint sidecars: MODE" of the running process

    # -- observers --------------------------------------------------------
    def on_state(self, cb: StateCallback) -> None:
        self._state_cbs.add(cb)

    def on_line(self, cb: LineCallback) -> None:
        self._line_cbs.add(cb)

    def _set_state(self, state: ServerState) -> None:
        if state == self.state:
            return
        self.state = state
        self._state_cbs.emit(state, self.outcome)  # an observer that fails is logged: supervision goes on

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc and self.proc.returncode is None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    # -- start ------------------------------------------------------------
    async def start(self) -> None:
        """Start and return once Ready. Raises LaunchError (refused, nothing
        started) or StartFailed (the process ended during start). Idempotent:
        a second call while starting awaits the same start."""
        async with self._start_lock:
            if self.state == ServerState.READY and self.running:
                return
            if not self.running:
                self._spawn_checks()
                await self._spawn()
            fut = self._ready
        assert fut is not None
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.load_timeout_s)
        except asyncio.TimeoutError:
            await self.stop()
            raise StartFailed(Outcome(None, None, Cause.EXITED,
                                      f"not ready after {self.load_timeout_s:.0f} s; stopped",
                                      tuple(self.log.tail(40)))) from None

    def _spawn_checks(self) -> None:
        exe = self.argv[0]
        if not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
            raise LaunchError(f"server binary not found or not executable: {exe}")
        if self.check_port:
            check_port_free(*self.check_port)

    async def _spawn(self) -> None:
        self.outcome = None
        self.sidecar_mode = None
        self._stopping_by_user = False
        self._exited.clear()
        self._cleaning_up.clear()
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self._set_state(ServerState.STARTING)
        env = dict(os.environ)
        if self.env is not None:
            env.update(self.env)
            if "LLAMA_API_KEY" not in self.env:
                env.pop("LLAMA_API_KEY", None)
        # the sidecar mode a KV Valet build was started in (its start line says it too, once read)
        self.launch_sidecar_mode = env.get(MODE_ENV)
        # The server's output goes to a pipe that a thread of ours reads and parses
        # (a flood of -lv 4 lines must not cost the GUI thread anything but batches).
        read_fd, write_fd = os.pipe()
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=write_fd,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        except OSError as e:
            os.close(read_fd)
            os.close(write_fd)
            self._exited.set()
            self.outcome = Outcome(None, None, Cause.EXITED, f"could not run {self.argv[0]}: {e.strerror or e}")
            self._set_state(ServerState.CRASHED)
            raise LaunchError(self.outcome.detail) from None
        self.started_at = time.time()
        if self._log_file is not None:
            with contextlib.suppress(OSError):
                from app.core.argv import masked_argv

                self._log_file.close()
                self._log_file.open(f"pid {self.proc.pid}: {' '.join(masked_argv(self.argv))}")
        os.close(write_fd)  # the server holds the write end now: EOF when it exits
        self._write_pid_record()
        self._start_reader(read_fd, loop)
        self._tasks.start(self._watch_exit(self.proc), "watching the server process exit")
        self._tasks.start(self._watch_health(self.proc), "watching the server's health")

    def _write_pid_record(self) -> None:
        if not self.pid_record_path or not self.proc:
            return
        try:
            ct = psutil.Process(self.proc.pid).create_time()
        except psutil.Error:
            return
        from app.core.argv import masked_argv

        write_pid_record(self.pid_record_path, PidRecord(self.proc.pid, ct, self.url, self.profile_name,
                                                         tuple(masked_argv(self.argv)), time.time()))

    # -- the server's output ------------------------------------------------------
    def _start_reader(self, fd: int, loop: asyncio.AbstractEventLoop) -> None:
        self._reader_eof = asyncio.Event()
        self.lines_read = 0
        thread = threading.Thread(target=self._read_output, args=(fd, loop), name=f"log {self.profile_name}",
                                  daemon=True)
        self._reader_thread = thread
        thread.start()

    def _read_output(self, fd: int, loop: asyncio.AbstractEventLoop) -> None:
        """Reader thread: split, parse, write the log file; hand batches to the loop.

        A batch goes every READ_BATCH_S or READ_BATCH_LINES, whichever comes
        first, and at once when the server goes quiet, so a line never waits."""
        batch: list[tuple[float, LogEvent]] = []
        partial = b""
        last = time.monotonic()

        def flush() -> None:
            nonlocal batch, last
            if batch:
                try:
                    loop.call_soon_threadsafe(self._deliver, batch)
                except RuntimeError:  # the loop is closed: nobody is listening any more
                    pass
                batch = []
            last = time.monotonic()

        try:
            while True:
                ready, _, _ = select.select([fd], [], [], READ_BATCH_S)
                if not ready:
                    flush()
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                lines = (partial + chunk).split(b"\n")
                partial = lines.pop()
                if len(partial) > 1 << 20:  # a line over 1 MiB: take what is there
                    lines.append(partial)
                    partial = b""
                now = time.time()
                for raw in lines:
                    text = raw.decode("utf-8", "replace")
                    if self._log_file is not None:
                        self._log_file.write(text)
                    batch.append((now, parse_line(text)))
                if len(batch) >= READ_BATCH_LINES or time.monotonic() - last >= READ_BATCH_S:
                    flush()
            if partial:
                text = partial.decode("utf-8", "replace")
                if self._log_file is not None:
                    self._log_file.write(text)
                batch.append((time.time(), parse_line(text)))
            flush()
        except OSError:
            log.exception("reading the server's output failed")
        finally:
            os.close(fd)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._reader_eof.set)

    def _deliver(self, batch: list[tuple[float, LogEvent]]) -> None:
        """On the loop: into the ring buffer, then to the observers (watcher, health, …)."""
        for at, event in batch:
            item = self.log.append_event(event, at)
            self.lines_read += 1
            if isinstance(event, SidecarMode):
                self.sidecar_mode = event.mode  # KV Valet's build says it at start
            elif event.kind is Kind.CLEANING_UP:
                self._cleaning_up.set()
            self._line_cbs.emit(item)

    async def _watch_health(self, proc: asyncio.subprocess.Process) -> None:
        # the first polls come quickly (a small model loads in tens of ms: a flat 0.2 s would hold Ready
        # back by up to that much, at each start), then every health_interval_s
        interval = min(HEALTH_FIRST_POLL_S, self.health_interval_s)
        while proc.returncode is None:
            h = await self._client.health(timeout=2.0)
            if proc.returncode is not None:
                return
            if h.ok:
                if self.state in (ServerState.STARTING, ServerState.LOADING):
                    self._set_state(ServerState.READY)
                    if self._ready and not self._ready.done():
                        self._ready.set_result(None)
                return
            if h.loading and self.state == ServerState.STARTING:
                self._set_state(ServerState.LOADING)
            await asyncio.sleep(interval)  # polling interval, not synchronisation
            interval = min(interval * 1.5, self.health_interval_s)

    async def _watch_exit(self, proc: asyncio.subprocess.Process) -> None:
        rc = await proc.wait()
        # Let the reader drain the pipe so the outcome sees the last lines.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._reader_eof.wait(), 2.0)
        by_user = self._stopping_by_user
        self.outcome = classify(rc, self.log.tail(40), by_user)
        if self._log_file is not None:
            self._log_file.write(f"===== exit: {self.outcome.summary()}")
            self._log_file.close()
        # Anything the server started in its group goes with it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if self.pid_record_path:
            with contextlib.suppress(OSError):
                self.pid_record_path.unlink()
        self._exited.set()
        if self._ready and not self._ready.done():
            self._ready.set_exception(StartFailed(self.outcome))
            self._ready.exception()  # mark retrieved: start() may not be waiting
        if by_user or self.outcome.cause == Cause.EXITED_CLEANLY:
            # Exit code 0 is an orderly shutdown (SIGTERM from another tool, e.g.
            # `kv-valet park --and-stop`): stopped, not crashed, and not restarted.
            self._set_state(ServerState.STOPPED)
            return
        self._set_state(ServerState.CRASHED)
        if self.auto_restart and self._may_restart():
            self._restart_task = self._tasks.start(self._auto_restart(), "restarting the crashed server")

    def _may_restart(self) -> bool:
        now = time.time()
        self.restart_times = [t for t in self.restart_times if now - t < self.restart_window_s]
        return len(self.restart_times) < self.max_restarts

    async def _auto_restart(self) -> None:
        delay = self.backoff_s[min(len(self.restart_times), len(self.backoff_s) - 1)]
        self.restart_times.append(time.time())
        log.warning("server crashed (%s); restarting in %.1f s", self.outcome and self.outcome.summary(), delay)
        await asyncio.sleep(delay)  # backoff, not synchronisation
        if self.state != ServerState.CRASHED:
            return  # the user did something meanwhile
        with contextlib.suppress(LaunchError, StartFailed):
            await self.start()

    # -- stop -------------------------------------------------------------
    async def stop(self) -> Outcome | None:
        """SIGTERM the process group, wait, then SIGKILL. Idempotent."""
        if self._restart_task and not self._restart_task.done():
            self._restart_task.cancel()
        proc = self.proc
        if proc is None or proc.returncode is not None:
            await self._exited.wait()
            if self.state == ServerState.CRASHED:
                self._set_state(ServerState.STOPPED)
            return self.outcome
        self._stopping_by_user = True
        self.forced_after_cleanup = False
        self._set_state(ServerState.STOPPING)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(self._exit_after_cleanup(proc), self.stop_timeout_s)
        except asyncio.TimeoutError:
            log.warning("the server at %s did not stop within %g s of SIGTERM: killed", self.url, self.stop_timeout_s)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            await self._exited.wait()
        return self.outcome

    async def _exit_after_cleanup(self, proc: asyncio.subprocess.Process) -> None:
        """Until the process has exited; once it says "cleaning up before exit" and is still there
        CLEANUP_GRACE_S later, a second SIGTERM ends it (see CLEANUP_GRACE_S)."""
        loop = asyncio.get_running_loop()  # both awaited or cancelled below, before this returns
        exited = loop.create_task(self._exited.wait())
        cleaning = loop.create_task(self._cleaning_up.wait())
        try:
            await asyncio.wait({exited, cleaning}, return_when=asyncio.FIRST_COMPLETED)
            if not exited.done():
                done, _ = await asyncio.wait({exited}, timeout=CLEANUP_GRACE_S)
                if not done and proc.returncode is None:
                    log.warning("the server at %s still runs %g s after it began cleaning up (a request was "
                                "running when it was told to stop): a second SIGTERM ends it",
                                self.url, CLEANUP_GRACE_S)
                    self.forced_after_cleanup = True
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(proc.pid, signal.SIGTERM)
            await exited
        finally:
            for t in (exited, cleaning):
                t.cancel()
            await asyncio.gather(exited, cleaning, return_exceptions=True)

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    async def aclose(self) -> None:
        """Stop the server and release everything (no orphan, no leaked task)."""
        await self.stop()
        await self._tasks.cancel_all()
        if self._owns_client:
            await self._client.aclose()

    async def wait_state(self, *states: ServerState, timeout: float = 60.0) -> ServerState:
        """Wait until the supervisor is in one of ``states`` (event-driven)."""
        if self.state in states:
            return self.state
        ev = asyncio.Event()
        cb = lambda s, o: ev.set() if s in states else None  # noqa: E731
        self._state_cbs.add(cb)
        try:
            await asyncio.wait_for(ev.wait(), timeout)
        finally:
            self._state_cbs.remove(cb)
        return self.state
