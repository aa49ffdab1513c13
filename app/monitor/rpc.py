"""The RPC workers of a running server (``--rpc HOST:PORT,...``), watched. Qt-free.

llama.cpp's ``rpc-server`` serves **one client at a time** and listens with a
backlog of 1 (ggml/src/ggml-rpc/transport.cpp, build 11434): while llama-server
holds its connection, every other connection waits, unanswered, in the worker's
accept queue, and once two wait, new ones are not even accepted. So a worker the
server is connected to is never probed by a connection of ours; instead:

* the server's own TCP connection to the worker is looked up (psutil, by the
  server's pid): ``ESTABLISHED`` = connected; its round-trip time is the kernel's
  smoothed RTT of that very connection (``ss -ti``, iproute2), when ``ss`` is there;
* a worker the server is not connected to (before it connects, after the
  connection dropped, or no pid known) is probed with one TCP connect, closed at
  once: refused, timed out or unresolvable = unreachable; the connect time is the RTT.

What the server logged about its workers comes in through :meth:`RpcWatcher.feed`
(the supervisor's log lines); :func:`parse_rpc_line` reads only lines a real
capture shows (tests/fixtures/rpc-b11434/). An unreachable worker is a
:class:`~app.core.findings.Finding` with its remedies: start ``rpc-server`` there
with ``-p PORT``, or remove the worker from ``--rpc``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field, replace
from typing import Awaitable, Callable

import psutil

from app.core.observers import Observers
from app.core.background import stop_if_cancelled, track
from app.core.findings import Finding, Remedy, Severity
from app.core.profile import RpcWorker, parse_rpc_workers
from app.core.profile import BUILT_MARKER

__all__ = ["RpcWorker", "WorkerStatus", "RpcLogEvent", "RpcWatcher", "parse_rpc_workers", "parse_rpc_line",
           "probe_connect", "unreachable_finding", "parse_ss_rtt"]

log = logging.getLogger(__name__)

RULE_UNREACHABLE = "rpc-worker-unreachable"
#: A connect that takes longer than this is "timed out" (a worker across a LAN answers in milliseconds).
CONNECT_TIMEOUT_S = 3.0
INTERVAL_S = 5.0
LOG_LINES_KEPT = 20


# -- what the server logs about them (lines from a real capture) ----------------------------


@dataclass(frozen=True)
class RpcLogEvent:
    kind: str  # "unsupported" | "connect-failed" | "worker-crashed" | "memory" | "device" | "buffer"
    endpoint: str | None  # the worker it is about, when the line names it
    line: str
    mib: float | None = None  # "buffer": its size; "memory": the worker's total
    free_mib: float | None = None  # "memory": the worker's free memory
    what: str = ""  # "buffer": "model", "KV" or "compute"


_UNSUPPORTED = re.compile(r'error while handling argument "--rpc": (RPC not supported in this build)')
_CONNECT_FAILED = re.compile(r"Failed to connect to (\S+?)\s*$")
_CRASHED = re.compile(r"Remote RPC server crashed or returned malformed response")
# "common_param:   - RPC0    : 127.0.0.1:50052 (24105 MiB, 24105 MiB free)" (the device list at start)
_MEMORY = re.compile(r"- RPC\d+\s*:\s*(\S+) \((\d+) MiB, (\d+) MiB free\)")
# "llama_prepare_model_devices: using device RPC0 (127.0.0.1:50052) (unknown id) - 24105 MiB free"
_DEVICE = re.compile(r"using device (RPC\d+) \((\S+)\)")
# "load_tensors: RPC0[127.0.0.1:50052] model buffer size =   235.16 MiB" (and KV, compute)
_BUFFER = re.compile(r"\bRPC\d+\[(\S+?)\] (model|KV|compute) buffer size\s*=\s*([\d.]+) MiB")


def parse_rpc_line(line: str) -> RpcLogEvent | None:
    """The RPC meaning of one server log line, or None."""
    if "RPC" not in line and "rpc" not in line and "Failed to connect" not in line:
        return None  # the common case first: most lines say nothing about RPC
    m = _UNSUPPORTED.search(line)
    if m:
        return RpcLogEvent("unsupported", None, line)
    m = _CONNECT_FAILED.search(line)
    if m:
        return RpcLogEvent("connect-failed", m.group(1), line)
    if _CRASHED.search(line):
        return RpcLogEvent("worker-crashed", None, line)
    m = _MEMORY.search(line)
    if m:
        return RpcLogEvent("memory", m.group(1), line, float(m.group(2)), float(m.group(3)))
    m = _DEVICE.search(line)
    if m:
        return RpcLogEvent("device", m.group(2), line, what=m.group(1))
    m = _BUFFER.search(line)
    if m:
        return RpcLogEvent("buffer", m.group(1), line, float(m.group(3)), what=m.group(2))
    return None


# -- probes --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    ok: bool
    rtt_ms: float | None = None
    why: str = ""  # "refused", "timed out", "unresolved: …", the OS error


async def probe_connect(worker: RpcWorker, timeout: float = CONNECT_TIMEOUT_S) -> Probe:
    """One TCP connect to the worker, closed at once (no RPC message is sent)."""
    t0 = time.perf_counter()
    try:
        _reader, writer = await asyncio.wait_for(asyncio.open_connection(worker.host, worker.port), timeout)
    except asyncio.TimeoutError:
        return Probe(False, why=f"no answer within {timeout:g} s")
    except ConnectionRefusedError:
        return Probe(False, why="connection refused: nothing listens on that port")
    except socket.gaierror as e:
        return Probe(False, why=f"the host name does not resolve ({e.strerror or e})")
    except OSError as e:
        return Probe(False, why=e.strerror or str(e))
    rtt = (time.perf_counter() - t0) * 1000.0
    writer.close()
    try:
        await writer.wait_closed()
    except OSError as e:  # why: the probe's verdict is in; a reset at close changes nothing (debug log)
        log.debug("rpc probe %s: close: %s", worker.endpoint, e)
    return Probe(True, rtt)


def _addresses(host: str) -> set[str]:
    try:
        return {ai[4][0] for ai in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return set()


@dataclass(frozen=True)
class ServerConnection:
    status: str  # psutil's: "ESTABLISHED", "CLOSE_WAIT", ...
    local: tuple[str, int]
    remote: tuple[str, int]


def server_connections(pid: int, worker: RpcWorker, addresses: set[str]) -> list[ServerConnection]:
    """The server process's TCP connections to the worker (its threads share its sockets)."""
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except (psutil.Error, OSError) as e:
        log.debug("rpc watcher: connections of pid %s: %s", pid, e)
        return []
    return [ServerConnection(c.status, (c.laddr.ip, c.laddr.port), (c.raddr.ip, c.raddr.port)) for c in conns
            if c.raddr and c.raddr.port == worker.port and c.raddr.ip in addresses]


_SS_RTT = re.compile(r"\brtt:([\d.]+)/([\d.]+)")


def parse_ss_rtt(text: str) -> float | None:
    """The smoothed RTT (ms) in ``ss -ti`` output (``rtt:0.024/0.01``: srtt/rttvar)."""
    m = _SS_RTT.search(text)
    return float(m.group(1)) if m else None


def kernel_rtt_ms(conn: ServerConnection) -> float | None:
    """The kernel's smoothed RTT of one established connection, read with ``ss -ti``; None without ss."""
    ss = shutil.which("ss")
    if not ss:
        return None
    argv = [ss, "-tinH", "state", "established", "src", f"{conn.local[0]}:{conn.local[1]}",
            "dst", f"{conn.remote[0]}:{conn.remote[1]}"]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=5, check=False).stdout
    except (OSError, subprocess.SubprocessError) as e:
        log.debug("rpc watcher: %s: %s", argv, e)
        return None
    return parse_ss_rtt(out)


# -- status and findings ------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerStatus:
    worker: RpcWorker
    reachable: bool | None = None  # None: not checked yet
    state: str = "not checked yet"  # "connected" (the server's connection is up), "listening", "unreachable"
    rtt_ms: float | None = None
    rtt_source: str = ""  # "connection" (the kernel's RTT of the server's connection) or "connect"
    why: str = ""  # an unreachable worker: why
    checked_at: float | None = None
    device: str | None = None  # "RPC0", from the server's log
    memory_mib: tuple[float, float] | None = None  # (total, free) the worker reported when the server started
    buffers_mib: dict[str, float] = field(default_factory=dict)  # "model"/"KV"/"compute" -> MiB on the worker
    log_lines: tuple[str, ...] = ()  # the server's lines about it, the newest last

    @property
    def endpoint(self) -> str:
        return self.worker.endpoint

    def to_dict(self) -> dict:
        return {"endpoint": self.endpoint, "reachable": self.reachable, "state": self.state,
                "rtt_ms": None if self.rtt_ms is None else round(self.rtt_ms, 3), "rtt_source": self.rtt_source,
                "why": self.why, "checked_at": self.checked_at, "device": self.device,
                "memory_mib": list(self.memory_mib) if self.memory_mib else None,
                "buffers_mib": dict(self.buffers_mib), "log_lines": list(self.log_lines)}

    def describe(self) -> str:
        rtt = f", RTT {self.rtt_ms:.2f} ms" if self.rtt_ms is not None else ""
        if self.reachable is False:
            return f"{self.endpoint}: unreachable ({self.why})"
        held = ", ".join(f"{k} {v:,.0f} MiB" for k, v in self.buffers_mib.items())
        return f"{self.endpoint}: {self.state}{rtt}" + (f" (holds {held})" if held else "")


def remaining_rpc(value: str, worker: RpcWorker) -> str | None:
    """The ``--rpc`` value without this worker (None: no worker left, the flag goes)."""
    left = [e.strip() for e in value.split(",") if e.strip() and e.strip() != worker.endpoint]
    return ",".join(left) or None


def unreachable_finding(status: WorkerStatus, rpc_value: str, at: float | None = None) -> Finding:
    w = status.worker
    return Finding(
        RULE_UNREACHABLE, Severity.ERROR,
        f"RPC worker {w.endpoint} is unreachable ({status.why}). llama-server aborts at start when a worker "
        "does not answer (\"Failed to connect to …\"), and a running server aborts at its next request to a "
        f"worker that went away. Start rpc-server on {w.host} with -p {w.port}, or remove it from --rpc.",
        remedies=(Remedy(f"Start rpc-server on {w.host} with -p {w.port} (on that machine: "
                         f"rpc-server -H <its address> -p {w.port})", {}),
                  Remedy(f"Remove {w.endpoint} from --rpc", {"rpc": remaining_rpc(rpc_value, w)})),
        source="llama.cpp tools/rpc (rpc-server), ggml-rpc.cpp (build 11434)", at=at,
        details={"endpoint": w.endpoint, "why": status.why})


def log_finding(ev: RpcLogEvent, rpc_value: str, at: float | None = None) -> Finding | None:
    """What a server line about its workers means for the user (None: nothing to act on)."""
    if ev.kind == "unsupported":
        return Finding(
            "rpc-not-in-build", Severity.ERROR,
            f"This llama-server was built without RPC: it refuses --rpc {rpc_value} and does not start. "
            "KV Valet's own build has RPC on (kv-valet build-server: it builds rpc-server from the same "
            "sources too); or remove --rpc.",
            remedies=(Remedy("Run KV Valet's built server (RPC on)", {"server_binary": BUILT_MARKER}),
                      Remedy("Remove --rpc", {"rpc": None})),
            source="common/arg.cpp --rpc (build 11434)", at=at, details={"line": ev.line})
    if ev.kind == "worker-crashed":
        return Finding(
            "rpc-worker-lost", Severity.ERROR,
            "llama-server aborted: \"Remote RPC server crashed or returned malformed response\": an RPC worker "
            "went away (stopped, crashed, or its machine or network dropped) while the server used it. Start "
            "the worker again, then the server; or remove the worker from --rpc.",
            source="ggml-rpc.cpp RPC_STATUS_ASSERT (build 11434)", at=at, details={"line": ev.line})
    if ev.kind == "connect-failed":
        return Finding(
            "rpc-worker-connect-failed", Severity.ERROR,
            f"llama-server aborted at start: it could not connect to the RPC worker {ev.endpoint}. Start "
            f"rpc-server there with -p {ev.endpoint.rsplit(':', 1)[-1] if ev.endpoint else 'PORT'}, or remove "
            "it from --rpc.",
            remedies=tuple(r for r in (_remove_remedy(rpc_value, ev.endpoint),) if r is not None),
            source="ggml-rpc.cpp (build 11434)", at=at, details={"line": ev.line, "endpoint": ev.endpoint})
    return None


def _remove_remedy(rpc_value: str, endpoint: str | None) -> Remedy | None:
    workers, _ = parse_rpc_workers(endpoint or "")
    if not workers:
        return None
    return Remedy(f"Remove {endpoint} from --rpc", {"rpc": remaining_rpc(rpc_value, workers[0])})


def _learn(st: WorkerStatus, ev: RpcLogEvent) -> WorkerStatus:
    """What a line about this worker tells: its device name, memory, and the buffers it holds."""
    if ev.kind == "device":
        return replace(st, device=ev.what)
    if ev.kind == "memory" and ev.mib is not None and ev.free_mib is not None:
        return replace(st, memory_mib=(ev.mib, ev.free_mib))
    if ev.kind == "buffer" and ev.mib is not None:  # one KV buffer per cache (a sliding-window model has two)
        return replace(st, buffers_mib={**st.buffers_mib, ev.what: st.buffers_mib.get(ev.what, 0.0) + ev.mib})
    return st


# -- the watcher ---------------------------------------------------------------------------

ProbeFn = Callable[[RpcWorker, float], Awaitable[Probe]]


class RpcWatcher:
    """Watches the workers of one ``--rpc`` value while its server runs.

    ``pid()`` gives the server's pid (None: not known, then every worker is probed by
    connect). :meth:`check` runs one round; :meth:`start` runs rounds every
    ``interval`` seconds (through :func:`app.core.background.track`). After every round
    ``changed`` is set and ``on_change`` listeners get the statuses; ``findings`` holds
    one unreachable-worker finding per worker that is unreachable now, after what the
    server's log said (built without RPC, a worker lost, a failed connect at start)."""

    def __init__(self, rpc_value: str, *, pid: Callable[[], int | None] = lambda: None,
                 interval: float = INTERVAL_S, connect_timeout: float = CONNECT_TIMEOUT_S,
                 probe: ProbeFn = probe_connect, rtt_of: Callable[[ServerConnection], float | None] = kernel_rtt_ms,
                 clock: Callable[[], float] = time.time):
        self.rpc_value = rpc_value or ""
        self.workers, self.problems = parse_rpc_workers(self.rpc_value)
        self.pid = pid
        self.interval = interval
        self.connect_timeout = connect_timeout
        self._probe = probe
        self._rtt_of = rtt_of
        self.clock = clock
        self.statuses: dict[str, WorkerStatus] = {w.endpoint: WorkerStatus(w) for w in self.workers}
        self.probe_findings: list[Finding] = []  # unreachable workers, from the last round
        self.log_findings: list[Finding] = []  # what the server's log said (kept)
        self.log_events: list[RpcLogEvent] = []  # every RPC line the server logged (the newest LOG_LINES_KEPT)
        self.unsupported = False  # the server said its build has no RPC
        self.changed = asyncio.Event()
        self.rounds = 0
        self._listeners: Observers[[list[WorkerStatus]]] = Observers("the RPC workers' status")
        self._addresses: dict[str, set[str]] = {}
        self._task: asyncio.Future | None = None

    # -- the server's log ------------------------------------------------------------------
    def feed(self, item) -> RpcLogEvent | None:
        """One log line: a raw line, a parsed LogEvent or a supervisor LogLine (its ``event``)."""
        if isinstance(item, str):
            text = item
        else:
            ev = getattr(item, "event", item)
            text = str(getattr(ev, "line", None) or getattr(ev, "text", None) or ev)
        ev = parse_rpc_line(text)
        if ev is None:
            return None
        self.log_events = (self.log_events + [ev])[-LOG_LINES_KEPT:]
        if ev.kind == "unsupported":
            self.unsupported = True
        finding = log_finding(ev, self.rpc_value, self.clock())
        if finding is not None and all(f.rule_id != finding.rule_id for f in self.log_findings):
            self.log_findings.append(finding)
        targets = [ev.endpoint] if ev.endpoint in self.statuses else list(self.statuses)
        for ep in targets:
            st = self.statuses[ep]
            lines = (st.log_lines + (text.strip(),))[-LOG_LINES_KEPT:]
            if ev.endpoint == ep:
                st = _learn(st, ev)
            self.statuses[ep] = replace(st, log_lines=lines)
        return ev

    # -- rounds ----------------------------------------------------------------------------
    def on_change(self, cb: Callable[[list[WorkerStatus]], None]) -> None:
        self._listeners.add(cb)

    async def check(self) -> list[WorkerStatus]:
        """One round over every worker; the statuses, in ``--rpc`` order."""
        pid = self.pid()
        found = await asyncio.gather(*(self._check_one(w, pid) for w in self.workers))
        results = []
        for w, changes in zip(self.workers, found):  # onto the status as it is now: lines fed meanwhile stay
            self.statuses[w.endpoint] = replace(self.statuses[w.endpoint], **changes)
            results.append(self.statuses[w.endpoint])
        now = self.clock()
        self.probe_findings = [unreachable_finding(st, self.rpc_value, now) for st in results
                               if st.reachable is False]
        self.rounds += 1
        self.changed.set()
        self._listeners.emit(list(results))  # a broken display is logged: the watch goes on
        return list(results)

    async def _check_one(self, w: RpcWorker, pid: int | None) -> dict:
        """The probe fields of the worker's status (the log's fields are not touched here)."""
        now = self.clock()
        conns: list[ServerConnection] = []
        if pid:
            if w.endpoint not in self._addresses or not self._addresses[w.endpoint]:
                self._addresses[w.endpoint] = await asyncio.to_thread(_addresses, w.host)
            conns = await asyncio.to_thread(server_connections, pid, w, self._addresses[w.endpoint])
        up = next((c for c in conns if c.status == psutil.CONN_ESTABLISHED), None)
        if up is not None:
            rtt = await asyncio.to_thread(self._rtt_of, up)
            if rtt is not None:
                return dict(reachable=True, state="connected", rtt_ms=rtt, rtt_source="connection", why="",
                            checked_at=now)
            return dict(reachable=True, state="connected", why="", checked_at=now)  # the last RTT stays
        probe = await self._probe(w, self.connect_timeout)
        if probe.ok:
            state = "listening" if not conns else "listening (the server's connection to it was closed)"
            return dict(reachable=True, state=state, rtt_ms=probe.rtt_ms, rtt_source="connect", why="",
                        checked_at=now)
        why = probe.why + ("; the server's connection to it was closed" if conns else "")
        return dict(reachable=False, state="unreachable", rtt_ms=None, rtt_source="", why=why, checked_at=now)

    @property
    def findings(self) -> list[Finding]:
        """The log's findings, then one per worker unreachable in the last round."""
        return self.log_findings + self.probe_findings

    async def wait_for(self, predicate: Callable[["RpcWatcher"], bool]) -> None:
        """Until ``predicate(self)`` holds after a round (the caller bounds it with a timeout)."""
        while not predicate(self):
            self.changed.clear()
            await self.changed.wait()

    # -- the loop --------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        if self.is_running or not self.workers:
            return
        self._task = track(self._run(), f"RPC workers watch ({self.rpc_value})")

    async def _run(self) -> None:
        while True:
            stop_if_cancelled()  # a cancel a wait_for in the round swallowed still ends the watch
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception:  # report: one failed round is logged; the watch goes on
                log.exception("rpc watcher: a round failed")
            await asyncio.sleep(self.interval)  # the watch's period, not a synchronisation

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task})  # its own CancelledError stays in it; a cancel of ours goes on

    def to_list(self) -> list[dict]:
        return [self.statuses[w.endpoint].to_dict() for w in self.workers]


#: The end of a server log read for its RPC lines (they come at start and at an abort: the tail has the newest run).
LOG_TAIL_BYTES = 4 << 20


def feed_log_file(watcher: RpcWatcher, path) -> int:
    """Feed the RPC lines of a server log file's last run (its tail) to ``watcher``; how many."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - LOG_TAIL_BYTES))
            text = f.read().decode("utf-8", errors="replace")
    except OSError as e:
        log.debug("rpc watcher: cannot read %s: %s", path, e)
        return 0
    return sum(1 for line in text.splitlines() if watcher.feed(line) is not None)
