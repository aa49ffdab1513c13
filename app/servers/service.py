"""The server service: every server KV Valet runs, watches or reaches, in one place.

The window (through :class:`app.ui.servers.controller.ServerController`, which only
re-emits its events as Qt signals) and every ``kv-valet`` command are faces of this
Qt-free class. Each server-lifecycle decision is made here, once:

* **which server** a profile name or a URL means (:func:`resolve_target`): the
  profile's own server, or the one an earlier KV Valet left running (its pid
  record), with which API key, which ``--slot-save-path`` and which log file;
* **launch, attach, adopt or stop** a leftover server, stop, detach;
* **one HTTP client per server**, shared by the health watch, the Monitor's
  sampling, the session service, the load check and the verdicts;
* **one sampler per server** (:meth:`ServerService.sampler`: health, slots, its process,
  the GPUs through this machine's one NVML handle), whose snapshots the Monitor tab, the
  server list and the status bar read (app.monitor.sampler.Samplers);
* **one session service per server**, connected when it is Ready and closed when
  it goes (kept through a restart the session service asked for itself);
* **the one bounded park-then-stop** (:meth:`ServerService.park_then_stop`) that
  every trigger ends in (:class:`app.core.lifecycle.StopTrigger`), with the one
  timeout of the preferences, and what it names each park
  (:func:`app.sessions.park_choice.choose_parks`).

It holds several servers at once: everything it returns carries the server's
target id (``profile:NAME`` or ``url:URL``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable

from app.core.observers import Observers
from app.core.background import track
from app.core.lifecycle import DEFAULT_PARK_TIMEOUT_S, POLICY, StopTrigger, TargetKind
from app.core.profile import LaunchProfile, ProfileError
from app.core.states import ServerState
from app.monitor.process import ProcessMonitor
from app.monitor.sampler import Sampler, Samplers
from app.monitor.snapshot import take_snapshot
from app.sessions.park_stop import ParkStopReport
from app.sessions.service import ServiceError, SessionService
from app.server.attach import AttachedServer
from app.server.client import LlamaClient
from app.paths import default_model_path  # noqa: F401  (the faces' seam: __all__)
from app.server.discovery import DiscoveryError, binary_info, find_server_binary  # noqa: F401
from app.server.launcher import (CACHE_EVENTS_VERBOSITY, LaunchPlan, make_supervisor,  # noqa: F401
                                 pid_record_path, plan_launch, resolve_api_key, slot_save_path_for)
from app.server.outcome import Outcome
from app.server.supervisor import (LaunchError, LogBuffer, PidRecord, StartFailed, Supervisor,
                                   find_leftover_server, terminate_leftover)
from app.server.targets import (TargetSpec, client_for, free_loopback_port, listening_pid,  # noqa: F401
                                load_profile, profile_target_id, resolve_target, url_target_id)
from app.servers.host_server import HostServer
from app.servers.events import (LaunchPlanned, LaunchRefused, Notice, Parking, Progress, ProxyChanged,
                                ServerEvent, SessionsChanged, StateChanged)
from app.store.catalog import Catalog

if TYPE_CHECKING:
    from app.servers.launch import Front

log = logging.getLogger(__name__)

#: What the window and the commands may ask of the server layer, through this service only:
#: which binary serves a profile (and what it can do), where a profile's sessions are saved.
__all__ = ["ServerService", "ServerHandle", "TargetSpec", "resolve_target", "load_profile", "listening_pid",
           "DiscoveryError", "binary_info", "default_model_path", "find_server_binary", "slot_save_path_for",
           "CACHE_EVENTS_VERBOSITY", "client_for", "import_command_line",
           "profile_name_from_model"]

#: States in which a server has nothing left to park.
GONE = (ServerState.STOPPED, ServerState.CRASHED, ServerState.STOPPING)


# -- one server --------------------------------------------------------------------------


class ServerHandle:
    """One server: launched here (a supervisor), watched (attached), or only reached (the CLI)."""

    def __init__(self, spec: TargetSpec, client: LlamaClient, *, supervisor: Supervisor | None = None,
                 attached: AttachedServer | None = None, plan: LaunchPlan | None = None):
        self.spec = spec
        self.client = client  # the one HTTP client of this server
        self.supervisor = supervisor
        self.attached = attached
        self.plan = plan
        self.sessions: SessionService | None = None
        self._connecting: asyncio.Task | None = None
        # run first by park_then_stop, inside its one timeout: the proxy saves its conversations
        # under their own names, after which the parks find those slots already parked
        self.before_park: list[Callable[[], Awaitable[None]]] = []
        self.proxy = None  # the conversation proxy in front of it (app.proxy.service), when there is one

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def profile(self) -> LaunchProfile | None:
        return self.plan.profile if self.plan is not None else self.spec.profile

    @property
    def url(self) -> str:
        return self.plan.url if self.plan is not None else self.spec.url

    @property
    def owned(self) -> bool:
        """KV Valet launched it in this process (and stops it when it quits)."""
        return self.supervisor is not None

    @property
    def leftover(self) -> PidRecord | None:
        return self.spec.leftover

    @property
    def stoppable(self) -> bool:
        """KV Valet may stop it: launched here, or by an earlier KV Valet (pid + start time)."""
        return self.owned or self.spec.leftover is not None

    @property
    def state(self) -> ServerState:
        if self.supervisor is not None:
            return self.supervisor.state
        if self.attached is not None:
            return self.attached.state
        return ServerState.READY  # only reached (a CLI command): its requests say whether it answers

    @property
    def pid(self) -> int | None:
        if self.supervisor is not None:
            return self.supervisor.pid
        rec = self.spec.leftover
        return rec.pid if rec is not None and rec.is_alive() else None

    @property
    def started_at(self) -> float | None:
        """When the server process started: parks and restores recorded since describe its slots."""
        if self.supervisor is not None:
            return self.supervisor.started_at
        if self.spec.leftover is not None:
            return self.spec.leftover.create_time
        return None

    @property
    def log(self) -> LogBuffer | None:
        return self.supervisor.log if self.supervisor is not None else None

    @property
    def save_dir(self) -> Path | None:
        if self.plan is not None:
            return Path(self.plan.slot_save_path)
        return self.spec.save_dir

    async def stop(self) -> None:
        if self.supervisor is not None:
            await self.supervisor.stop()
        elif self.spec.leftover is not None:
            await asyncio.to_thread(terminate_leftover, self.spec.leftover)
            if self.attached is not None:
                await self.attached.aclose()
        else:
            raise ServiceError("only a server that KV Valet launched can be stopped from here")


# -- the service ---------------------------------------------------------------------------


class ServerService:
    def __init__(self, catalog: Catalog | None = None, *, store=None, park_timeout_s: float | None = None,
                 connect_sessions: bool = True, front: "Front | None" = None):
        """``catalog``: the session catalog (default: the data folder's); ``park_timeout_s``:
        how long a park-then-stop may take (default: the preferences' ``park_timeout_s``);
        ``connect_sessions``: connect a session service to every server once it is Ready;
        ``front``: what stands before a server whose profile asks for it (the conversation proxy,
        :class:`app.proxy.front.ProxyFront`; :func:`app.servers.launch.launch_profile` uses it)."""
        self._catalog = catalog
        self._owns_catalog = catalog is None  # opened on first use, closed with the service
        self._store = store
        self._park_timeout_s = park_timeout_s  # None: the preferences', read at each park
        self.connect_sessions = connect_sessions
        self.front = front
        self.servers: dict[str, ServerHandle] = {}
        self._cbs: Observers[[ServerEvent]] = Observers("server events")
        self._interrupt = asyncio.Event()
        self._parking: dict[str, asyncio.Task] = {}
        self.samplers = Samplers()  # one per server, one NVML handle for them all
        self.hosts: dict[str, HostServer] = {}  # the servers of SSH hosts, by HOST:PROFILE (host_server)
        self._closed = False

    @property
    def catalog(self) -> Catalog:
        if self._catalog is None:
            from app import paths

            self._catalog = Catalog(paths.catalog_path())
        return self._catalog

    @property
    def park_timeout_s(self) -> float:
        """How long a park-then-stop's parks may take: the one timeout setting (``park_timeout_s``)."""
        if self._park_timeout_s is not None:
            return float(self._park_timeout_s)
        from app.settings import load_or_defaults

        return float(load_or_defaults()[0].park_timeout_s or DEFAULT_PARK_TIMEOUT_S)

    @property
    def store(self):
        if self._store is None:
            from app.store.profiles import ProfileStore

            self._store = ProfileStore()
        return self._store

    # -- events ----------------------------------------------------------------------
    def on_event(self, cb: Callable[[ServerEvent], None]) -> None:
        self._cbs.add(cb)

    def notify(self, event: ServerEvent) -> None:
        """Tell every subscriber ``event`` (the launch path and the front say their notices here)."""
        self._cbs.emit(event)  # an observer that fails is logged: a server's lifecycle goes on

    def get(self, target_id: str | None) -> ServerHandle | None:
        return self.servers.get(target_id) if target_id else None

    # -- launch ------------------------------------------------------------------------
    async def launch(self, profile: LaunchProfile) -> ServerHandle | None:
        """Start ``profile``'s server and return once it is Ready (None: refused or it did not
        start; the reason went out as LaunchRefused / StateChanged(Crashed))."""
        tid = profile_target_id(profile.name)
        old = self.servers.get(tid)
        if old is not None and old.supervisor is not None and old.supervisor.running and old.profile == profile:
            await old.supervisor.start()
            return old
        if old is not None:
            await self.remove(tid)
        self.notify(StateChanged(tid, ServerState.STARTING, "checking the profile…"))
        loop = asyncio.get_running_loop()

        def progress(done: int, total: int) -> None:
            pct = int(done * 100 / max(total, 1))
            loop.call_soon_threadsafe(self.notify, Progress(tid, "Assembling the default model", pct))

        try:
            plan = await asyncio.to_thread(plan_launch, profile, on_model_progress=progress)
        except ProfileError as e:
            return self._refused(tid, "\n".join(str(x) for x in e.errors))
        except Exception as e:  # report: a launch that cannot be planned (disk, model assembly) is said, not raised
            log.exception("planning the launch of '%s' failed", profile.name)
            return self._refused(tid, str(e))
        client = LlamaClient(plan.url, resolve_api_key(plan.profile, environ={}))
        sup = make_supervisor(plan, client=client)
        spec = TargetSpec(tid, TargetKind.PROFILE, plan.url, plan.profile, resolve_api_key(plan.profile, environ={}),
                          Path(plan.slot_save_path), sup.log_file_path)
        handle = ServerHandle(spec, client, supervisor=sup, plan=plan)
        self.servers[tid] = handle
        sup.on_state(lambda state, outcome: self._on_state(handle, state, outcome))
        self.notify(LaunchPlanned(tid, plan))
        try:
            await sup.start()
        except LaunchError as e:
            return self._refused(tid, str(e))
        except StartFailed:
            return None  # said through the state callback (Crashed + its outcome)
        return handle

    def _refused(self, tid: str, message: str) -> None:
        self.notify(LaunchRefused(tid, message))
        self.notify(StateChanged(tid, ServerState.STOPPED, "refused"))
        return None

    # -- attach, leftovers ----------------------------------------------------------------
    async def attach(self, url: str, api_key: str | None = None, *, leftover: PidRecord | None = None) -> ServerHandle:
        """Watch a server at ``url`` without owning it; ``leftover``: one an earlier KV Valet
        launched (its profile says where it parks, and it may be stopped)."""
        profile = self._leftover_profile(leftover)
        url = url.rstrip("/")
        key = api_key if api_key is not None else resolve_api_key(profile)
        tid = self.attach_id(url, leftover)
        if tid in self.servers:
            await self.remove(tid)
        spec = TargetSpec(tid, TargetKind.LEFTOVER if leftover else TargetKind.URL, url, profile, key,
                          Path(slot_save_path_for(profile)) if profile is not None else None, None, leftover)
        client = LlamaClient(url, key)
        attached = AttachedServer(url, key, leftover=leftover, client=client)
        handle = ServerHandle(spec, client, attached=attached)
        self.servers[tid] = handle
        attached.on_state(lambda state, outcome: self._on_state(handle, state, outcome))
        self.notify(StateChanged(tid, ServerState.STARTING, f"attaching to {url}…"))
        await attached.start()
        return handle

    def _leftover_profile(self, leftover: PidRecord | None) -> LaunchProfile | None:
        if leftover is None:
            return None
        try:
            return self.store.load(leftover.profile)
        except ProfileError:
            return None  # its profile was deleted since: attach mode

    def attach_id(self, url: str, leftover: PidRecord | None = None) -> str:
        """The target id :meth:`attach` gives: the profile's for a leftover server, else the URL's."""
        profile = self._leftover_profile(leftover)
        return profile_target_id(profile.name) if profile is not None else url_target_id(url)

    def leftovers(self, names=None) -> list[PidRecord]:
        """Servers launched by an earlier KV Valet that is gone (pid + start time match)."""
        names = self.store.names() if names is None else names
        return [rec for rec in (find_leftover_server(pid_record_path(n)) for n in names) if rec is not None]

    async def stop_leftover(self, rec: PidRecord) -> None:
        await asyncio.to_thread(terminate_leftover, rec)

    # -- reach (the CLI) ------------------------------------------------------------------
    def reach(self, arg: str | LaunchProfile, *, save_dir=None, api_key: str | None = None,
              log_file=None) -> ServerHandle:
        """A server as a command names it, without watching it: its handle (and client)."""
        spec = resolve_target(arg, store=self._store, save_dir=save_dir, api_key=api_key, log_file=log_file)
        old = self.servers.get(spec.id)
        if old is not None:
            return old
        handle = ServerHandle(spec, LlamaClient(spec.url, spec.api_key))
        self.servers[spec.id] = handle
        return handle

    def reach_through(self, spec: TargetSpec, client: LlamaClient) -> ServerHandle:
        """A server reached through a client of the caller's (a host's server through SSH channels,
        app.proxy.remote): its handle, not watched, with no session service here."""
        handle = ServerHandle(spec, client)
        self.servers[spec.id] = handle
        return handle

    # -- sessions --------------------------------------------------------------------------
    async def sessions(self, target_id: str, *, recover: bool = True, log_buffer=None) -> SessionService:
        """The server's session service (connected once, shared by every face). Raises ServiceError."""
        h = self.servers.get(target_id)
        if h is None:
            raise ServiceError(f"no server {target_id}")
        if h.sessions is not None:
            return h.sessions
        if h._connecting is not None and not h._connecting.done() and h._connecting is not asyncio.current_task():
            await asyncio.wait({h._connecting})  # the connection the server's Ready started
            if h.sessions is not None:
                return h.sessions
        sup = h.supervisor
        svc = await SessionService.connect(
            self.catalog, url=h.url, profile=h.profile, save_dir=h.save_dir, log_buffer=log_buffer or h.log,
            build=h.plan.build if h.plan is not None else None, supervisor=sup,
            stopper=h.stop if h.stoppable else None, recover=recover, client=h.client)
        svc.target.started_at = h.started_at
        svc.park_then_stop = lambda prefix=None: self.park_then_stop(target_id, StopTrigger.USER, prefix=prefix)
        if self.servers.get(target_id) is not h or self._closed:
            await svc.aclose()
            raise ServiceError(f"the server {h.url} went away while connecting")
        h.sessions = svc
        self.notify(SessionsChanged(target_id, svc))
        return svc

    def sampler(self, target_id: str | None) -> Sampler | None:
        """The one sampler of a server that runs (paused until someone resumes it), None for none."""
        h = self.servers.get(target_id) if target_id is not None else None
        if h is None or h.state in GONE or not h.url:
            return None
        return sampler_for(self.samplers, target_id, h)

    def _on_state(self, h: ServerHandle, state: ServerState, outcome: Outcome | None) -> None:
        if self.servers.get(h.id) is not h:
            return
        if state in GONE:
            self.samplers.stop_soon(h.id)
        detail = ""
        if state == ServerState.CRASHED and outcome is not None:
            detail = outcome.summary()
        elif state == ServerState.READY:
            detail = h.url + (" (attached)" if h.attached is not None else "")
        self.notify(StateChanged(h.id, state, detail, outcome))
        svc = h.sessions
        if svc is not None and svc.restarting:
            return  # the A/B restarts the server between probes: the session service goes on through it
        if state == ServerState.READY and self.connect_sessions and svc is None:
            h._connecting = track(self._connect_quietly(h), f"connecting the sessions of {h.url}")
        elif state in GONE and svc is not None:
            h.sessions = None
            self.notify(SessionsChanged(h.id, None))
            track(svc.aclose(), f"closing the sessions of {h.url}")

    async def _connect_quietly(self, h: ServerHandle) -> None:
        try:
            await self.sessions(h.id)
        except ServiceError as e:  # report: the window and serve say it; the server itself is fine
            log.warning("cannot connect the sessions of %s: %s", h.url, e)
            self.notify(Notice(h.id, f"Cannot connect the Sessions tab: {e}", ok=False))

    # -- park, then stop --------------------------------------------------------------------
    def interrupt_park(self) -> None:
        """A second signal: the park-then-stop running now stops waiting for its parks."""
        self._interrupt.set()

    @property
    def parking(self) -> bool:
        return any(not t.done() for t in self._parking.values())

    async def park_then_stop(self, target_id: str, trigger: StopTrigger, *, prefix: str | None = None) -> ParkStopReport:
        """The one bounded park-then-stop, whatever asked for it: park every slot that holds
        tokens (:func:`app.sessions.park_choice.choose_parks` names them), write the resume plan, then stop
        the server as the trigger's policy says (:data:`app.core.lifecycle.POLICY`). The parks
        take at most ``park_timeout_s`` and end at :meth:`interrupt_park`."""
        policy = POLICY[trigger]
        report = ParkStopReport(trigger, target_id)
        h = self.servers.get(target_id)
        if h is None:
            return report
        if trigger is StopTrigger.USER and not h.stoppable:
            raise ServiceError("only a server that KV Valet launched can be stopped from here")
        if h.state not in GONE:
            self.notify(Parking(target_id, trigger, policy.doing + "…"))
            self._interrupt = asyncio.Event()
            timeout = self.park_timeout_s
            work = asyncio.get_running_loop().create_task(self._park_every_slot(h, prefix, report))
            self._parking[target_id] = work
            interrupt = asyncio.get_running_loop().create_task(self._interrupt.wait())
            try:
                done, _ = await asyncio.wait({work, interrupt}, timeout=timeout,
                                             return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in (work, interrupt):
                    t.cancel()
                await asyncio.gather(work, interrupt, return_exceptions=True)
                self._parking.pop(target_id, None)
            if work not in done:
                report.interrupted = "a second signal" if interrupt in done else f"the {timeout:g} s limit"
            elif not work.cancelled() and work.exception() is not None:
                e = work.exception()
                report.error = str(e) if isinstance(e, ServiceError) else repr(e)
                if not isinstance(e, ServiceError):
                    log.error("parking before the stop (%s) of %s failed", trigger, h.url, exc_info=e)
        if policy.stop and h.stoppable and (report.complete or policy.stop_if_failed):
            await h.stop()
            report.stopped = True
        return report

    async def _park_every_slot(self, h: ServerHandle, prefix: str | None, report: ParkStopReport) -> None:
        from app.sessions.resume_plan import load_resume_plan

        svc = await self.sessions(h.id, recover=False)
        for hook in list(h.before_park):
            await hook()
        report.results = await svc.park_all(prefix, remember=True)
        report.plan = load_resume_plan(svc.profile_name)

    # -- stop, detach, close ---------------------------------------------------------------
    async def stop(self, target_id: str) -> None:
        """Stop a server KV Valet launched (or an earlier one did); detach from any other."""
        h = self.servers.get(target_id)
        if h is None:
            return
        if h.stoppable:
            await h.stop()
        if h.attached is not None:
            await self.remove(target_id)

    async def remove(self, target_id: str) -> None:
        """Forget a server: its session service and client close; a server launched here stops."""
        h = self.servers.pop(target_id, None)
        if h is None:
            return
        await self.samplers.stop(target_id)
        if h.proxy is not None:
            proxy, h.proxy = h.proxy, None
            await proxy.stop()
            self.notify(ProxyChanged(target_id, None))
        if h._connecting is not None and not h._connecting.done():
            h._connecting.cancel()
            await asyncio.gather(h._connecting, return_exceptions=True)
        if h.sessions is not None:
            svc, h.sessions = h.sessions, None
            await svc.aclose()
            self.notify(SessionsChanged(target_id, None))
        if h.supervisor is not None:
            await h.supervisor.aclose()
        if h.attached is not None:
            await h.attached.aclose()
            self.notify(StateChanged(target_id, ServerState.STOPPED, "detached"))
        await h.client.aclose()

    def host_server(self, host, profile: str, target_id: str | None = None) -> HostServer:
        """The handle of the server of ``profile`` on ``host`` (app.remote.host.RemoteHost), made at the
        first ask and kept until this service closes: its sessions and its one sampler
        (app.servers.host_server). A host reached by another connection now gets a new one."""
        tid = target_id or f"{host.name}:{profile}"
        hs = self.hosts.get(tid)
        if hs is None or hs.sessions.remote is not host:
            if hs is not None:
                track(hs.aclose(), f"closing the old handle of {tid}")
            hs = self.hosts[tid] = HostServer(host, profile, tid)
        return hs

    def feed_host_statuses(self, host, statuses: dict[str, dict]) -> None:
        """Statuses of ``host``'s servers read by someone else (the server list's poll of the host:
        ``{profile: status --json}``) given to the handles kept of them: their Sessions tab's slots and
        their sampler's next snapshot without another SSH call."""
        for hs in list(self.hosts.values()):
            if hs.sessions.remote is host and hs.profile in statuses:
                hs.sessions.set_status(statuses[hs.profile])

    async def aclose(self) -> None:
        self._closed = True
        for tid in list(self.servers):
            await self.remove(tid)
        for hs in list(self.hosts.values()):
            await hs.aclose()
        self.hosts.clear()
        await self.samplers.aclose()
        if self._owns_catalog and self._catalog is not None:
            self._catalog.close()


def sampler_for(samplers: Samplers, target_id: str, h) -> Sampler:
    """The sampler of server ``h`` (a ServerHandle) in ``samplers``: its health and /slots through its
    one HTTP client, its process (pid and children) and the GPUs, the restored tokens and last tasks
    its session service knows (which /slots cannot show)."""
    url, pid = h.url, h.pid
    cache_ram = getattr(h.profile, "effective_cache_ram", None)

    def take_for(gpu):
        proc = ProcessMonitor(pid) if pid else None  # primed: its CPU % counts from the first tick

        async def take():
            target = getattr(getattr(h, "sessions", None), "target", None)
            return await take_snapshot(h.client.health, h.client.slots, gpu, proc,
                                       dict(target.restored) if target is not None else {}, cache_ram, url,
                                       last_tasks=dict(target.last_tasks) if target is not None else {})
        return take

    return samplers.ensure(target_id, (url, pid), _once(take_for), url=url, cache_ram_mib=cache_ram)


def _once(take_for):
    """``take_for(gpu)`` made once (its process monitor kept from tick to tick)."""
    made: dict = {}

    def get(gpu):
        if made.get("gpu") is not gpu:
            made.update(gpu=gpu, take=take_for(gpu))
        return made["take"]
    return get


def park_name_prefix(now: float | None = None) -> str:
    """The one prefix of the sessions a park of every slot writes: the date and time."""
    return time.strftime("%Y-%m-%d %H-%M", time.localtime(now))


def import_command_line(line: str, name: str | None = None, *, overwrite: bool = False,
                        store=None) -> tuple[LaunchProfile, Path]:
    """A llama-server command line, as a user pastes it, saved as a profile: ``(profile, its file)``.

    The one import of ``kv-valet profiles import`` and ``kv-valet serve --command-line``: the words
    are read with what the installed llama-server says of its flags (which take a value), the name is
    ``name`` or the model file's, the profile is checked (not its files: they are checked at launch),
    and a profile of that name is replaced only with ``overwrite``. Raises
    :class:`app.core.argv.CommandLineError` (a line that cannot be split) or ProfileError (a refused
    value, a name taken)."""
    from app.core.argv import parse_command_line
    from app.core.profile_check import check
    from app.store.profiles import ProfileStore

    takes_value = None
    try:
        caps, _ = binary_info(find_server_binary("").path)
        takes_value = caps.takes_value
    except (DiscoveryError, OSError):
        pass
    prof = parse_command_line(line, "imported", takes_value=takes_value)
    prof = check(prof.replace(name=name or profile_name_from_model(prof.model) or "imported"), check_files=False)
    store = store or ProfileStore()
    return prof, store.save(prof, overwrite=overwrite)


def profile_name_from_model(model: str) -> str:
    """The name an imported command line's profile takes from its model file ("" without one)."""
    import re

    stem = Path(model).name.removesuffix(".gguf") if model else ""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-.")[:64]
