"""The server list: one row per server the window shows, here and on other hosts (issue #20).

Qt-free: the window's list (:mod:`app.ui.servers.list_model`) only paints what this module
decides. A row comes from a :class:`ServerListSource`:

* :class:`LocalServerSource` — every server of the window's
  :class:`app.servers.service.ServerService`: the profiles launched here (several at
  once), the servers attached by URL and the leftovers of an earlier KV Valet. Its state
  follows the service's events at once; its figures (slots, VRAM per GPU, the process's
  RSS and CPU) are each server's one sampler's snapshot (app.monitor.sampler.Samplers,
  ``service.samplers``), the same the Monitor tab shows: :meth:`LocalServerSource.refresh`
  reads the last one, or asks a paused sampler for one.
* a remote host's source (its servers through that host's ``kv-valet`` over SSH) is the
  same protocol, with the host's name in the rows' ``host``.

:class:`ServerList` holds the sources in order (this machine first) and answers the rows
to show (:func:`shown_rows`), what each cell says (:func:`cells`) and where a parked
session may go (:func:`move_targets`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

from app.core.observers import Observers
from app.core.states import Health, ServerState, health_text
from app.core.units import fmt_bytes, fmt_pct, is_na
from app.monitor.gpu import NO_GPU_PREFIX, GpuSnapshot
from app.monitor.slots import SlotsUnavailable, held_count
from app.monitor.snapshot import Snapshot
from app.servers.service import sampler_for
from app.servers.remote_sessions import slot_rows_of

log = logging.getLogger(__name__)

THIS_MACHINE = "this machine"
NOT_SAMPLED = "not sampled yet"

#: app.ui.widgets.theme roles of a server's state: light or dark as the system is
STATE_ROLES = {
    ServerState.STOPPED: "muted", ServerState.STARTING: "accent", ServerState.LOADING: "accent",
    ServerState.READY: "ok", ServerState.STOPPING: "warn", ServerState.CRASHED: "crit",
}

#: the columns of the list, in order
COLUMNS = ("Server", "State", "Host", "Slots", "VRAM per GPU", "Process")
COL_NAME, COL_STATE, COL_HOST, COL_SLOTS, COL_VRAM, COL_PROCESS = range(len(COLUMNS))


# -- what a row holds -----------------------------------------------------------------------


@dataclass(frozen=True)
class GpuUse:
    """One GPU as a row shows it: the card's memory, and this server's share of it (bytes)."""

    index: int
    name: str
    used: int | None
    total: int | None
    server: int | None = None  # this server's own memory on the card (its pid and children), when known
    lost: bool = False


@dataclass(frozen=True)
class SlotUse:
    total: int
    held: int  # slots that hold a chat (tokens) or run a task
    busy: int  # slots processing a task now


@dataclass(frozen=True)
class ProcessUse:
    pid: int
    rss: int | None  # bytes, the server and its children
    cpu_pct: float | None


@dataclass(frozen=True)
class ServerRow:
    target_id: str  # "profile:NAME", "url:URL", or a remote source's "HOST:PROFILE"
    name: str  # the profile's name, or the URL
    state: ServerState
    kind: str = "profile"  # "profile" (launched here), "attached" (a URL, or an earlier KV Valet's), "remote"
    host: str = THIS_MACHINE
    url: str = ""
    detail: str = ""  # the last state's detail (a crash's cause, "attaching to …")
    profile: str | None = None  # the profile it runs, where there is one (a move's target names it)
    slots: SlotUse | None = None
    slots_error: str | None = None
    gpus: tuple[GpuUse, ...] = ()
    gpu_message: str = ""  # "no NVIDIA GPU found", "not sampled yet"
    process: ProcessUse | None = None


@runtime_checkable
class ServerListSource(Protocol):
    """Where rows come from: this machine's server service, or one remote host."""

    name: str  # THIS_MACHINE, or the host's name

    def rows(self) -> list[ServerRow]:
        """The rows as known now (no I/O)."""

    async def refresh(self) -> None:
        """Sample the figures again (bounded; failures become the rows' errors, never raised)."""

    def on_change(self, cb: Callable[[], None]) -> None:
        """Call ``cb`` when a row's state changes between refreshes (a server starts, stops)."""

    async def aclose(self) -> None:
        """Let go of what the source holds (monitors, connections)."""


# -- this machine ----------------------------------------------------------------------------


@dataclass
class _Figures:
    slots: SlotUse | None = None
    slots_error: str | None = None
    gpus: tuple[GpuUse, ...] = ()
    gpu_message: str = NOT_SAMPLED
    process: ProcessUse | None = None


class LocalServerSource:
    """Every server of one :class:`app.servers.service.ServerService`, as rows; their figures
    from the service's samplers (``service.samplers``: one per server)."""

    def __init__(self, service):
        from app.servers.events import StateChanged

        self.name = THIS_MACHINE
        self.service = service
        self._details: dict[str, str] = {}
        self._figures: dict[str, _Figures] = {}
        self._cbs: Observers[[]] = Observers("the server list changed")
        self._state_changed = StateChanged
        service.on_event(self._on_event)

    def on_change(self, cb: Callable[[], None]) -> None:
        self._cbs.add(cb)

    def _on_event(self, ev) -> None:
        if isinstance(ev, self._state_changed):
            self._details[ev.target_id] = ev.detail
            if ev.state not in (ServerState.READY, ServerState.LOADING):
                self._figures.pop(ev.target_id, None)  # a stopped server holds no slots, no VRAM
        self._cbs.emit()

    def rows(self) -> list[ServerRow]:
        out = []
        for tid, h in list(self.service.servers.items()):
            fig = self._figures.get(tid, _Figures())
            profile = h.profile
            kind = "profile" if h.supervisor is not None else "attached"
            out.append(ServerRow(tid, h.spec.name if profile is None else profile.name, h.state, kind, THIS_MACHINE,
                                 h.url, self._details.get(tid, ""), profile.name if profile is not None else None,
                                 fig.slots, fig.slots_error, fig.gpus, fig.gpu_message, fig.process))
        return out

    async def refresh(self) -> None:
        """Each running server's figures from its one sampler: the last snapshot while it ticks (the
        Monitor shows it), else one asked now (all at once, each sampler one tick at a time)."""
        live = {tid: h for tid, h in list(self.service.servers.items())
                if h.state in (ServerState.READY, ServerState.LOADING) and h.url}
        for gone in set(self._figures) - set(live):
            self._figures.pop(gone, None)
        samplers = [sampler_for(self.service.samplers, tid, h) for tid, h in live.items()]
        snaps = await asyncio.gather(*(s.sample_once() for s in samplers))
        for tid, snap in zip(live, snaps):
            if tid in self.service.servers:  # still listed after the tick
                self._figures[tid] = figures_of(snap)

    async def sessions_of(self, row: ServerRow, service=None):
        """The Sessions of ``row``'s server (the service's session service of it)."""
        return await (service or self.service).sessions(row.target_id)

    async def aclose(self) -> None:
        self._figures.clear()  # the samplers are the service's: it stops them with their servers


def figures_of(snap: Snapshot) -> _Figures:
    """A row's figures from a server's snapshot (app.monitor.snapshot.Snapshot)."""
    p = snap.process
    process = ProcessUse(p.pid, p.rss, p.cpu_pct) if p is not None and p.alive else None
    gpus, message = gpu_uses(snap.gpu)
    if snap.slots_error:
        return _Figures(None, snap.slots_error, gpus, message, process)
    return _Figures(slot_use(snap.slots), None, gpus, message, process)


def slot_use(rows) -> SlotUse:
    """How many of a server's slots hold a chat or run a task (app.monitor.slots.SlotRow)."""
    rows = list(rows)
    return SlotUse(len(rows), held_count(rows), sum(1 for r in rows if r.busy))


def gpu_uses(snap: GpuSnapshot) -> tuple[tuple[GpuUse, ...], str]:
    """The GPUs of a monitor snapshot as a row's figures, and the message when there are none."""
    uses = tuple(GpuUse(g.index, "" if is_na(g.name) else str(g.name), None if is_na(g.mem_used) else int(g.mem_used),
                        None if is_na(g.mem_total) else int(g.mem_total), g.server_mem, g.lost) for g in snap.gpus)
    return uses, ("" if uses else (snap.message or NO_GPU_PREFIX))


# -- a remote host ---------------------------------------------------------------------------


class RemoteServerSource:
    """One SSH host's servers as rows: its profiles and each server's figures through that host's
    ``kv-valet`` (``host.servers()``: app.remote.host.RemoteHost, or anything with ``name`` and
    that coroutine). Its rows' target ids are ``HOST:PROFILE``, as a move names them."""

    def __init__(self, host, *, owns_host: bool = True, service=None):
        """``service``: the app.servers.service.ServerService whose handles of this host's servers
        each refresh's statuses feed (:meth:`~app.servers.service.ServerService.feed_host_statuses`)."""
        self.host = host
        self.name = host.name
        self._owns_host = owns_host
        self._service = service
        self._answer: list[dict] = []
        self.error: str | None = None  # the last refresh failed: why (the rows keep their last figures)
        self._cbs: Observers[[]] = Observers("the server list changed")

    def on_change(self, cb: Callable[[], None]) -> None:
        self._cbs.add(cb)

    def rows(self) -> list[ServerRow]:
        out = []
        for entry in self._answer:
            row = remote_row(self.name, entry)
            if self.error:
                row = ServerRow(**{**row.__dict__, "detail": f"{self.name} does not answer: {self.error}"})
            out.append(row)
        return out

    async def refresh(self) -> None:
        try:
            self._answer = list(await asyncio.wait_for(self.host.servers(), 60))
            self.error = None
            if self._service is not None:
                self._service.feed_host_statuses(self.host, {
                    str((e.get("profile") or {}).get("name")): dict(e.get("status") or {})
                    for e in self._answer if (e.get("profile") or {}).get("name")})
        except asyncio.CancelledError:
            raise
        except Exception as e:  # report: the host's rows say it (a refused key, a dropped link), logged
            log.warning("server list: host %s: %s", self.name, e)
            self.error = str(e) or type(e).__name__

    async def sessions_of(self, row: ServerRow, service):
        """The Sessions of ``row``'s server: the handle ``service`` (app.servers.service.ServerService)
        keeps of it, the one the window shows when the row is clicked."""
        return service.host_server(self.host, row.profile, row.target_id).sessions

    def move_endpoint(self, row: ServerRow):
        """Where a move to ``row`` goes: that host's profile (app.move.endpoints.RemoteEndpoint)."""
        from app.move.endpoints import RemoteEndpoint

        return RemoteEndpoint(self.host, self.name, row.profile)

    async def aclose(self) -> None:
        if self._owns_host:
            await self.host.close()


def remote_row(host: str, entry: dict) -> ServerRow:
    """A row from one entry of a host's ``servers()``: its profile and ``kv-valet status --json``."""
    profile = dict(entry.get("profile") or {})
    st = dict(entry.get("status") or {})
    name = str(profile.get("name") or "?")
    health, why = Health.parse(st.get("health"))
    state = health.state()
    slots = None
    if isinstance(st.get("slots"), list) and state is ServerState.READY and not st.get("slots_error"):
        slots = slot_use(slot_rows_of(st))
    gpu = dict(st.get("gpu") or {})
    gpus = tuple(GpuUse(int(g.get("index", i)), str(g.get("name") or ""), g.get("mem_used"), g.get("mem_total"),
                        g.get("server_mem"), bool(g.get("lost"))) for i, g in enumerate(gpu.get("gpus") or ()))
    p = st.get("process") or None
    process = (ProcessUse(int(p["pid"]), p.get("rss"), p.get("cpu_pct"))
               if isinstance(p, dict) and p.get("alive") and p.get("pid") is not None else None)
    return ServerRow(f"{host}:{name}", name, state, "remote", host, str(st.get("url") or profile.get("url") or ""),
                     "" if state is not ServerState.STOPPED else health_text(health, why), name, slots,
                     st.get("slots_error") if state is ServerState.READY else None, gpus,
                     "" if gpus else str(gpu.get("message") or ""), process)


# -- all sources together --------------------------------------------------------------------


class ServerList:
    """The sources of the window's list, this machine first, each remote host after it."""

    def __init__(self, sources=()):
        self.sources: list[ServerListSource] = []
        self._cbs: Observers[[]] = Observers("the server list changed")
        for s in sources:
            self.add(s)

    def add(self, source: ServerListSource) -> None:
        if any(s.name == source.name for s in self.sources):
            raise ValueError(f"a source named {source.name!r} is listed already")
        self.sources.append(source)
        source.on_change(self._changed)
        self._changed()

    async def remove(self, name: str) -> None:
        for s in [s for s in self.sources if s.name == name]:
            self.sources.remove(s)
            await s.aclose()
        self._changed()

    def on_change(self, cb: Callable[[], None]) -> None:
        self._cbs.add(cb)

    def _changed(self) -> None:
        self._cbs.emit()

    def rows(self) -> list[ServerRow]:
        return [r for s in self.sources for r in s.rows()]

    def row(self, target_id: str | None) -> ServerRow | None:
        return next((r for r in self.rows() if r.target_id == target_id), None)

    async def sessions_of(self, row: ServerRow, service):
        """The one door to ``row``'s server's slots and parks (app.sessions.protocol.Sessions), here or
        on a host, through ``service`` (app.servers.service.ServerService). Raises LookupError for a
        row whose source is gone."""
        source = next((s for s in self.sources if s.name == row.host), None)
        if source is None or not hasattr(source, "sessions_of"):
            raise LookupError(f"no server list source for {row.host}")
        return await source.sessions_of(row, service)

    async def refresh(self) -> None:
        """Every source's figures, at once; one that fails is logged and keeps its last rows."""
        results = await asyncio.gather(*(s.refresh() for s in self.sources), return_exceptions=True)
        for s, r in zip(self.sources, results):
            if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                log.warning("server list: refreshing %s failed: %s", s.name, r)

    async def aclose(self) -> None:
        for s in list(self.sources):
            await s.aclose()
        self.sources.clear()


# -- what the list shows ------------------------------------------------------------------------


def shown_rows(rows: list[ServerRow], selected: str | None = None) -> list[ServerRow]:
    """The rows to list: every server that runs, starts, stops or crashed (its cause is worth
    seeing), and a stopped one only while it is the selected one (stopped on purpose: gone)."""
    return [r for r in rows if r.state is not ServerState.STOPPED or r.target_id == selected or r.kind == "remote"]


@dataclass(frozen=True)
class RowCells:
    text: tuple[str, ...]
    tips: tuple[str, ...]
    state_role: str  # app.ui.widgets.theme role of the State cell
    sort: tuple = field(default=())


def cells(row: ServerRow) -> RowCells:
    """What each column of ``row`` says, and its tooltip."""
    running = row.state in (ServerState.READY, ServerState.LOADING)
    name_tip = {"profile": f"Profile '{row.name}', launched by KV Valet", "remote": f"Profile '{row.profile}' on "
                f"{row.host}", "attached": "A server KV Valet watches (attached by URL, or left by an earlier "
                "KV Valet)"}.get(row.kind, "")
    name_tip += f"\n{row.url}" if row.url else ""
    state_tip = row.detail or str(row.state)
    host_tip = ("Runs on this machine" if row.host == THIS_MACHINE
                else f"Runs on {row.host}, reached over SSH")
    slots, slots_tip = _slots_cell(row, running)
    vram, vram_tip = _vram_cell(row, running)
    proc, proc_tip = _process_cell(row, running)
    return RowCells((row.name, str(row.state), row.host, slots, vram, proc),
                    (name_tip, state_tip, host_tip, slots_tip, vram_tip, proc_tip),
                    STATE_ROLES.get(row.state, "muted"))


def _slots_cell(row: ServerRow, running: bool) -> tuple[str, str]:
    if not running:
        return "–", ""
    if row.slots is None:
        if row.slots_error == SlotsUnavailable.ROUTER:
            return "router", row.slots_error
        return ("unavailable", f"GET /slots: {row.slots_error}") if row.slots_error else ("…", "not sampled yet")
    s = row.slots
    text = f"{s.held} / {s.total} in use"
    return text, (f"{s.busy} processing now, {s.held} holding a chat or running a task, of {s.total} "
                  f"slot{'s' if s.total != 1 else ''}")


def _vram_cell(row: ServerRow, running: bool) -> tuple[str, str]:
    if not running:
        return "–", ""
    if not row.gpus:
        message = row.gpu_message
        text = ("…" if message == NOT_SAMPLED else "no GPU" if message.startswith(NO_GPU_PREFIX)
                else "unavailable" if message else "–")
        return text, message
    parts, tips = [], []
    for g in row.gpus:
        if g.lost:
            parts.append(f"GPU{g.index} lost")
            tips.append(f"GPU {g.index} ({g.name}): lost (a driver reset or an Xid)")
            continue
        parts.append(f"GPU{g.index} {_gib(g.used)}/{_gib(g.total)} GiB")
        tip = f"GPU {g.index} ({g.name}): {fmt_bytes(g.used)} used of {fmt_bytes(g.total)}"
        if g.server is not None:
            tip += f", of which this server {fmt_bytes(g.server)}"
        tips.append(tip)
    return " · ".join(parts), "\n".join(tips)


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:,.1f}"


def _process_cell(row: ServerRow, running: bool) -> tuple[str, str]:
    if not running:
        return "–", ""
    p = row.process
    if p is None:
        return "–", ("Not a process of this machine that KV Valet can see" if row.host == THIS_MACHINE
                     else "Not reported by the host")
    cpu = "…" if p.cpu_pct is None else fmt_pct(p.cpu_pct)
    return f"RSS {fmt_bytes(p.rss)} · CPU {cpu}", f"pid {p.pid} (with its children): resident memory and CPU"


def move_targets(rows: list[ServerRow], source_target_id: str | None) -> list[ServerRow]:
    """Where a session parked on ``source_target_id`` can be moved or copied: every other
    server that runs from a profile (a folder KV Valet knows and a catalog to list it in)."""
    return [r for r in rows if r.target_id != source_target_id and r.profile is not None]



def move_verdict(name: str, target: ServerRow, *, copy: bool, result=None, error: BaseException | None = None,
                 ) -> tuple[bool, str]:
    """What a move or copy of session ``name`` to ``target`` ended in, for the user: the
    result (app.move.values.MoveResult) or the error it raised (a refusal names its rules)."""
    verb, where = ("Copied" if copy else "Moved"), f"'{target.name}'" + (
        f" on {target.host}" if target.host != THIS_MACHINE else "")
    if error is not None:
        reasons = getattr(error, "reasons", None)
        why = "; ".join(reasons) if reasons else (str(error) or type(error).__name__)
        # a refusal, or a move error that says itself what became of the session (a commit cut: app.move.transfer)
        kept = "" if reasons or " is kept at " in why else " The session is where it was; nothing was added there."
        return False, f"Not {verb.lower()} '{name}' to {where}: {why}.{kept}"
    text = f"{verb} '{name}' to {where} as '{result.record.name}' ({fmt_bytes(result.bytes)}, SHA-256 checked)."
    if result.source_kept:
        text += f" {result.source_kept[:1].upper()}{result.source_kept[1:]}."
    if result.warnings:
        text += " Note: " + "; ".join(result.warnings) + "."
    return not result.source_kept, text


def move_cancelled(name: str, target: ServerRow, *, copy: bool, committed=None) -> tuple[bool, str]:
    """What a move or copy of ``name`` to ``target`` that the user cancelled left. ``committed``:
    the result (app.move.values.MoveResult) ``move_session`` passed to ``on_committed`` when the
    target had listed the session before the cancel landed (then both copies exist), else None."""
    verb, where = ("copy" if copy else "move"), f"'{target.name}'" + (
        f" on {target.host}" if target.host != THIS_MACHINE else "")
    if committed is None:
        return False, (f"Not {'copied' if copy else 'moved'} '{name}' to {where}: cancelled. "
                       "The session is where it was; nothing was added there.")
    done = (f"The {verb} of '{name}' was cancelled after it was copied to {where} as '{committed.record.name}' "
            "(listed there, SHA-256 checked): ")
    if copy:
        return True, done + "the copy is complete."
    return False, done + "both copies remain (delete one from the Sessions tab)."
