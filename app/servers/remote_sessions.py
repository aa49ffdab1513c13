"""A remote host's server, Qt-free (issues #20, #27): its sessions behind the one Sessions protocol.

:class:`RemoteSessions` is the :class:`app.sessions.protocol.Sessions` of a host's server, as
:class:`app.sessions.service.SessionService` is of a server here: the Sessions tab drives both the
same way, and their :class:`~app.sessions.protocol.Capabilities` say what a host's cannot do.
The window's faces (app.ui.dialogs.host, app.ui.servers.remote_view, app.ui.sessions.move) only
paint what this module decides:

* :func:`check_host` — a host just added: connect (its key checked against known_hosts),
  log in, run its ``kv-valet --version`` and list its profiles; the outcome in one sentence,
  a refusal with its remedy (app.remote.host.RemoteError's message).
* :func:`session_records` / :func:`slot_rows_of` — the host's ``sessions list --json`` and
  ``status --json`` as the Sessions tab's records and the slot chooser's rows;
  :func:`snapshot_of` — that status as the Monitor tab's snapshot; :func:`remote_state` /
  :func:`state_text` — the status bar's "Ready on gpu-box".
* :meth:`RemoteSessions.park` / :meth:`RemoteSessions.resume` — through the host's own
  ``kv-valet park|resume --json``, answered as a server here answers (ParkResult, ResumeResult).
* :meth:`RemoteSessions.restore_judged` — after a move, the session restored at the host and judged
  by a first query there (its ``kv-valet check --json``), as ``SessionService.restore_judged`` here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from pathlib import PurePosixPath
from typing import Any, Callable

from app.core.observers import Observers
from app.core.states import Health, ServerState, SidecarStatus, health_text
from app.monitor.slots import SlotRow, held_count
from app.sessions.park import ParkResult
from app.sessions.protocol import REMOTE
from app.sessions.resume import ResumeResult
from app.store.catalog import SessionRecord

log = logging.getLogger(__name__)

#: exit status of ``kv-valet check`` when the resume bought nothing (app.cli.errors.Exit.DISCARDED)
CHECK_DISCARDED = 3
#: ... and when its output differed from a cold prefill (app.cli.errors.Exit.DIFFERS): a verdict too
CHECK_DIFFERS = 4
#: what the Log tab says for a remote server: its host's kv-valet has no command that prints a log
NO_REMOTE_LOG = ("The log of a server on {host} is not shown here: its kv-valet has no command that prints it. "
                 "On {host}: journalctl --user -u kv-valet-{profile} (systemd), or the file `kv-valet status "
                 "{profile}` names.")

_RECORD_FIELDS = {f.name for f in dataclasses.fields(SessionRecord)}
_SLOT_FIELDS = [f.name for f in dataclasses.fields(SlotRow)]


async def check_host(host) -> tuple[bool, str]:
    """Connect to ``host`` (app.remote.host.RemoteHost), run its kv-valet and list its
    profiles: (ok, what to tell the user). A refused key or login is said with its remedy."""
    from app.remote.host import RemoteError

    try:
        version = (await host.run_cli_text(["--version"], timeout=60)).strip()
        profiles = await host.profiles()
    except RemoteError as e:
        return False, str(e)
    names = ", ".join(str(p.get("name", "?")) for p in profiles) or "none yet"
    return True, (f"{host.name}: host key verified, logged in, {version or 'kv-valet'}; "
                  f"{len(profiles)} profile(s): {names}")


def session_records(entries: list[dict]) -> list[SessionRecord]:
    """A host's ``kv-valet sessions list --json`` as catalog records (most recent first, as listed)."""
    out = []
    for e in entries or ():
        try:
            out.append(SessionRecord(**{k: v for k, v in e.items() if k in _RECORD_FIELDS}))
        except TypeError as err:  # a field this version needs is missing: an older kv-valet there
            log.warning("a session listed by the host could not be read: %s (%s)", e.get("name"), err)
    return out


def slot_rows_of(status: dict) -> list[SlotRow]:
    """The slots in a host's ``kv-valet status --json`` as the slot chooser's rows."""
    rows = []
    for s in status.get("slots") or ():
        if isinstance(s, dict):
            rows.append(SlotRow(**{k: s.get(k) for k in _SLOT_FIELDS}))
    return rows


def status_line(host: str, profile: str, status: dict) -> str:
    """One line of what a host's server does now: health, slots in use, VRAM per GPU."""
    health, why = Health.parse(status.get("health"))
    slots = slot_rows_of(status)
    parts = [f"'{profile}' on {host}: {'Ready' if health is Health.OK else health_text(health, why)}"]
    if slots:
        parts.append(f"{held_count(slots)} / {len(slots)} slots in use")
    gpus = (status.get("gpu") or {}).get("gpus") or ()
    for g in gpus:
        used, total = g.get("mem_used"), g.get("mem_total")
        if used is not None and total:
            parts.append(f"GPU{g.get('index', '?')} {used / 2**30:.1f}/{total / 2**30:.1f} GiB")
    if not gpus and (status.get("gpu") or {}).get("message"):
        parts.append(str(status["gpu"]["message"]))
    return " · ".join(parts)


def remote_state(status: dict | None, row_state) -> ServerState:
    """The state of a host's server: Ready when its ``status --json`` says health ok, Loading
    while it loads, else Stopped; ``row_state`` (the server list's) until the host answered."""
    if not status:
        return row_state
    return Health.parse(status.get("health"))[0].state()


def state_text(state, host: str) -> str:
    """The status bar's words for a host's server: "Ready on gpu-box", "Stopped on gpu-box"."""
    return f"{state} on {host}"


def snapshot_of(status: dict, *, host: str, profile: str, taken_at: float):
    """A host's ``kv-valet status PROFILE --json`` (app.monitor.snapshot.snapshot_to_dict) as the
    Monitor tab's Snapshot: its slots (fill, tokens, state), its GPUs (VRAM used/total, the
    server's share), its process and host RAM. Fields an older kv-valet lacks stay empty."""
    from app.monitor.gpu import GpuSample, GpuSnapshot
    from app.monitor.process import HostSample, ProcessSample
    from app.monitor.snapshot import Snapshot
    from app.monitor.warnings import MonitorWarning

    g = status.get("gpu") or {}
    gpus = tuple(GpuSample(**_known(GpuSample, d)) for d in g.get("gpus") or () if isinstance(d, dict))
    gpu = GpuSnapshot(bool(g.get("available")), str(g.get("message") or ""), gpus, g.get("driver_version"))
    p = status.get("process")
    proc = ProcessSample(**{**_known(ProcessSample, p), "children_pids": tuple(p.get("children_pids") or ())}) \
        if isinstance(p, dict) and "pid" in p else None
    h = status.get("host") if isinstance(status.get("host"), dict) else {}
    warnings = tuple(MonitorWarning(**_known(MonitorWarning, w)) for w in status.get("warnings") or ()
                     if isinstance(w, dict))
    health, why = Health.parse(status.get("health"))
    return Snapshot(taken_at=taken_at, url=f"{profile} on {host}", health=health, health_detail=why,
                    slots=tuple(slot_rows_of(status)), slots_error=status.get("slots_error"), gpu=gpu, process=proc,
                    host=HostSample(h.get("ram_total"), h.get("ram_used"), h.get("ram_available")),
                    cache_ram_mib=status.get("cache_ram_mib"), warnings=warnings, error=status.get("error"))


def _known(cls, d: dict) -> dict:
    """``d``'s entries that are fields of dataclass ``cls``, the others absent: their defaults (or None)."""
    missing = dataclasses.MISSING
    return {f.name: d.get(f.name) for f in dataclasses.fields(cls)
            if f.name in d or (f.default is missing and f.default_factory is missing)}


class RemoteSessions:
    """A host's server's sessions (app.sessions.protocol.Sessions) through that host's own
    ``kv-valet`` over SSH: ``sessions list --json`` for the records, ``status --json`` for the
    slots, ``park|resume --json`` to act. ``host``: app.remote.host.RemoteHost (or a stand-in
    with ``name``, ``sessions()``, ``status()`` and ``run_cli()``). Call :meth:`load` to list."""

    capabilities = REMOTE

    def __init__(self, host, profile: str, target_id: str | None = None):
        self.remote = host
        self.host = host.name
        self._profile = profile
        self.target_id = target_id or f"{host.name}:{profile}"
        self.records: list[SessionRecord] = []
        self.status: dict = {}
        self.loaded = False
        self.error: str | None = None  # the last load failed: why
        self.recovery_messages: list[str] = []
        self._changed: Observers[[]] = Observers(f"the sessions of {host.name}")
        self._queue_cbs: Observers[[]] = Observers(f"the queue of {host.name}")
        self.listings = 0  # how many times the host listed the sessions (each load that got an answer)
        self.statuses = 0  # how many of its server's statuses were read (a load's, its sampler's, the list's)
        self.status_at: float | None = None  # time.monotonic() when the last one was read
        self._doing: list[str] = []  # what the host is asked now, in order (the tab's queue line)
        self._sizes: dict[str, int] = {}  # park -> bytes, as the host's park said
        self._discarding: set[asyncio.Future] = set()  # deletions asked of the host, still running

    # -- what is known -------------------------------------------------------------------------
    @property
    def profile_name(self) -> str:
        return self._profile

    @property
    def profile(self):
        return None  # the host's profile is the host's: nothing of it is read here

    @property
    def save_dir(self) -> PurePosixPath | None:
        dirs = {r.save_dir for r in self.records if r.save_dir}
        return PurePosixPath(dirs.pop()) if len(dirs) == 1 else None

    @property
    def health(self) -> Health:
        return Health.parse(self.status.get("health"))[0] if self.loaded else Health.NOT_RUNNING

    @property
    def running(self) -> bool:
        return self.health is Health.OK

    def describe(self) -> str:
        if self.error:
            return f"{self.host} did not answer: {self.error}"
        if not self.loaded:
            return f"'{self._profile}' on {self.host}: asking the host…"
        return status_line(self.host, self._profile, self.status)

    def sessions(self) -> list[SessionRecord]:
        return list(self.records)

    def on_this_server(self, rec: SessionRecord) -> str | None:
        return None

    def resume_plan(self) -> list:
        return []

    def queue_labels(self) -> list[str]:
        return list(self._doing)

    @contextlib.asynccontextmanager
    async def _asking(self, what: str):
        """``what`` is listed in :meth:`queue_labels` while the host is asked."""
        self._doing.append(what)
        self._queue_cbs.emit()
        try:
            yield
        finally:
            self._doing.remove(what)
            self._queue_cbs.emit()

    # -- observers -----------------------------------------------------------------------------
    def on_change(self, cb: Callable[[], None]) -> None:
        self._changed.add(cb)

    def on_queue(self, cb: Callable[[], None]) -> None:
        self._queue_cbs.add(cb)

    def on_restored(self, cb) -> None:
        pass  # its restores are the host's: not announced here

    def on_verdict(self, cb) -> None:
        pass  # its verdicts are judged from its log, on the host

    async def warm_model_identity(self) -> None:
        return None

    async def verify_sidecar_hashes(self, records=None) -> bool:
        return False  # the files are the host's; its kv-valet checks them

    # -- asking the host -----------------------------------------------------------------------
    async def load(self) -> bool:
        """The host's sessions of this profile and its server's status, asked at once (two SSH
        channels). The records are announced as soon as the host lists them, before its status
        comes (that command asks the host's server, so it starts an HTTP client there: a few
        hundred ms more); the status is announced when it comes. False (and ``error`` set, logged)
        when the host did not answer either; the observers hear it."""
        from app.remote.host import RemoteError

        async with self._asking(f"asking {self.host}"):
            status = asyncio.create_task(self.remote.status(self._profile))
            try:
                entries = await self.remote.sessions(self._profile)
                self.records, self.error = session_records(entries), None
                self.listings += 1
                self._changed.emit()  # the list is shown now; the server's state follows
                answer = await status
            except RemoteError as e:
                log.warning("%s did not answer: %s", self.host, e)
                self.error = str(e)
                self._changed.emit()
                return False
            finally:
                if not status.done():
                    status.cancel()
                    await asyncio.gather(status, return_exceptions=True)
                elif not status.cancelled() and status.exception() is not None:
                    status.exception()  # read, so an unheard failure is not logged twice
        self.status, self.loaded = answer, True
        self.statuses += 1
        self.status_at = time.monotonic()
        self._changed.emit()
        return True

    def status_age(self) -> float | None:
        """Seconds since its server's last status was read, by anyone (None: never)."""
        return None if self.status_at is None else time.monotonic() - self.status_at

    async def slot_rows(self) -> list[SlotRow]:
        """The slots of the host's server as its last ``status --json`` said (no SSH call: the host
        is asked by :meth:`load` and by whoever samples it, :meth:`set_status`)."""
        return slot_rows_of(self.status)

    def set_status(self, status: dict) -> None:
        """The host's server's ``status --json`` asked by someone else (its sampler, the server list):
        the observers hear it when it changed."""
        self.statuses += 1
        self.status_at = time.monotonic()
        if status != self.status or not self.loaded:
            self.status, self.loaded = status, True
            self._changed.emit()

    async def _listed_again(self) -> None:
        """After a park or a resume, the host's list again, for whoever shows it (the tab observes these
        sessions); nobody does (the conversation proxy's door to the host's slots): no SSH round trip."""
        if len(self._changed):
            await self.load()

    def park_bytes(self, name: str) -> int:
        """Bytes the park ``name`` takes on the host (its sidecar included), as its last listing or the
        park that made it said; 0 if not known."""
        if name in self._sizes:
            return self._sizes[name]
        rec = next((r for r in self.records if r.name == name), None)
        return rec.state_size + rec.sidecar_size if rec is not None else 0

    async def parked_tokens(self, name: str) -> list[int] | None:
        return None  # the park's state file is on the host

    def discard(self, name: str) -> None:
        """Delete the park ``name`` on the host (its ``kv-valet sessions rm``), in the background: a
        failure is logged (a park already gone is no failure)."""
        from app.core.background import track

        self._sizes.pop(name, None)
        self.records = [r for r in self.records if r.name != name]

        async def rm() -> None:
            status, _out, err = await self.remote.run_cli_as_is(["sessions", "rm", name, "--profile", self._profile])
            if status != 0 and "no session" not in err.lower():
                log.warning("the park %s on %s was not deleted: %s", name, self.host, err)
        self._discarding.add(track(rm(), f"deleting the park {name} on {self.host}"))

    async def settled(self) -> None:
        """Until the deletions asked so far have run on the host."""
        while self._discarding:
            done = list(self._discarding)
            self._discarding.clear()
            await asyncio.gather(*done, return_exceptions=True)

    async def park(self, slot_id: int | None = None, name: str | None = None, *,
                   on_progress=None, budget_bytes: int | None = None) -> ParkResult:
        """Park through the host's ``kv-valet park --json`` (None: the host's default slot). The host's
        steps are not relayed: ``on_progress`` hears that the park runs there. ``budget_bytes`` is this
        machine's budget: the host's disk is the host's, so a park there is not refused for it (the
        proxy deletes its oldest parks after the fact, by :meth:`park_bytes`)."""
        from app.remote.host import RemoteError
        from app.sessions.service import ServiceError

        if on_progress is not None:
            on_progress(f"parking on {self.host}")

        argv = ["park", self._profile, "--json"] + (["--slot", str(slot_id)] if slot_id is not None else []) + \
            (["--name", name] if name else [])
        try:
            async with self._asking(f"park on {self.host}"):
                d = await _json_of(self.remote, argv)
        except RemoteError as e:
            raise ServiceError(str(e)) from None
        parked = [x for x in d.get("sessions") or () if isinstance(x, dict)]
        if not parked:
            raise ServiceError(f"no slot of '{self._profile}' on {self.host} holds tokens: nothing to park")
        result = park_result(parked[0], self._profile)
        if result.record is not None:
            self._sizes[result.record.name] = result.record.state_size + result.record.sidecar_size
        await self._listed_again()
        return result

    async def resume(self, name: str, slot_id: int | None = None, *, force: bool = False,
                     avoid_hazard: bool = False, avoid_useless: str | None = None,
                     avoid_mismatch: bool = False, leased: bool = False,
                     later: Callable[[Callable[[], None]], None] | None = None) -> ResumeResult:
        """Resume through the host's ``kv-valet resume --json``; what it asks to confirm is asked
        here (NeedsConfirmation), and ``force`` answers it (``--yes``). The ``avoid_…`` refusals are
        the host's own checks (``--unless-hazard``, ``--unless-useless``, ``--unless-files-changed``),
        raised here as a server here raises them (ResumeHazard, ResumeUseless, ResumeMismatch).
        ``leased`` and ``later`` change nothing here: the host's kv-valet reads its own /slots and notes
        the restore in its own catalog before it answers."""
        from app.remote.host import RemoteError
        from app.core.confirmation import NeedsConfirmation
        from app.sessions.resume import ResumeFailed, ResumeHazard, ResumeMismatch, ResumeUseless

        argv = ["resume", self._profile, name, "--json"] + (["--yes"] if force else []) + \
            (["--slot", str(slot_id)] if slot_id is not None else []) + \
            (["--unless-hazard"] if avoid_hazard else []) + \
            (["--unless-useless", avoid_useless] if avoid_useless else []) + \
            (["--unless-files-changed"] if avoid_mismatch else [])
        try:
            async with self._asking(f"resume on {self.host}"):
                d = await _json_of(self.remote, argv)
        except RemoteError as e:
            out = e.output if isinstance(e.output, dict) else {}
            details = [str(x) for x in out.get("details") or ()]
            refused = out.get("refused")
            if refused == "files-changed":
                raise ResumeMismatch(details) from None
            if refused == "hazard":
                raise ResumeHazard(details[0] if details else str(out.get("error"))) from None
            if refused == "useless":
                raise ResumeUseless(reason=details[0] if details else None) from None
            if "needs confirmation" in str(out.get("error") or ""):
                raise NeedsConfirmation(details) from None
            raise ResumeFailed(str(e)) from None
        result = resume_result(d, self._profile)
        await self._listed_again()
        return result

    async def park_all(self, prefix: str | None = None, *, remember: bool = False) -> list[ParkResult]:
        """Park every slot that holds tokens through the host's ``kv-valet park --all --json``: one
        result per slot, a slot that failed with its error (``remember``: a plan is this machine's)."""
        from app.remote.host import RemoteError
        from app.sessions.service import ServiceError

        argv = ["park", self._profile, "--all", "--json"] + (["--name", prefix] if prefix else [])
        try:
            async with self._asking(f"park all on {self.host}"):
                d = await _json_of(self.remote, argv)
        except RemoteError as e:
            if not (isinstance(e.output, dict) and e.output.get("sessions")):
                raise ServiceError(str(e)) from None
            d = e.output  # some slots parked, some not: each says which
        results = [park_result(x, self._profile) if x.get("ok", True) else
                   ParkResult(None, None, [str(w) for w in x.get("warnings") or ()], x.get("slot"),
                              str(x.get("error") or "failed"))
                   for x in d.get("sessions") or () if isinstance(x, dict)]
        await self.load()
        return results

    async def park_all_and_stop(self, prefix: str | None = None):
        raise self._not_here("park all and stop", "kv-valet park --all --and-stop")

    async def resume_all(self) -> list:
        return []  # no resume plan is kept here for a host's server

    async def check(self, name: str, slot_id: int | None = None, *, force: bool = False):
        raise self._not_here("a check", f"kv-valet check {self._profile} {name}")

    async def restore_judged(self, name: str, slot_id: int | None = None, *,
                             output_check: bool = True) -> dict[str, Any]:
        """The host's ``kv-valet check --yes --json``: its report as the host printed it (a discarded
        or a differing restore is a report too, exit status 3 or 4; a refusal is RemoteError)."""
        argv = ["check", self._profile, name, "--yes", "--json"] + \
            (["--slot", str(slot_id)] if slot_id is not None else []) + ([] if output_check else ["--no-output-check"])
        async with self._asking(f"checking '{name}'"):
            d = await self.remote.run_cli(argv, timeout=600, ok_exits=(0, CHECK_DISCARDED, CHECK_DIFFERS))
        if not isinstance(d, dict):
            from app.remote.host import RemoteError

            raise RemoteError(f"`kv-valet check --json` on {self.host} answered no JSON object", kind="output",
                              host=self.host)
        return d

    async def ab(self, name: str, slot_id: int | None = None, *, force: bool = False, baseline: bool = False):
        raise self._not_here("an A/B check", f"kv-valet check {self._profile} {name} --ab")

    def _not_here(self, what: str, command: str) -> Exception:
        from app.sessions.service import ServiceError

        return ServiceError(f"{what} of a session on {self.host} runs there ({command}): its report stays there")

    async def reload(self) -> None:
        await self.load()


def park_result(d: dict, profile: str) -> ParkResult:
    """One entry of a host's ``park --json`` (app.cli.sessions.park_json) as a ParkResult."""
    side = d.get("sidecar") if isinstance(d.get("sidecar"), dict) else {}
    status = side.get("status")
    rec = SessionRecord(name=str(d.get("session") or ""), profile=str(d.get("profile") or profile),
                        slot_id=int(d.get("slot") or 0), n_tokens=int(d.get("tokens") or 0),
                        state_size=int(d.get("state_size", d.get("size")) or 0),
                        sidecar_size=int(d.get("sidecar_size") or 0), save_ms=float(d.get("save_ms") or 0.0),
                        sidecar_status=SidecarStatus(status) if status in set(SidecarStatus) else
                        SidecarStatus.NOT_NEEDED, sidecar_reason=str(side.get("reason") or ""),
                        sidecar_count=int(side.get("checkpoints") or 0))
    return ParkResult(rec, None, [str(w) for w in d.get("warnings") or ()], d.get("slot"),
                      unchanged=bool(d.get("unchanged")))


def resume_result(d: dict, profile: str) -> ResumeResult:
    """A host's ``resume --json`` as a ResumeResult."""
    rec = SessionRecord(name=str(d.get("session") or ""), profile=str(d.get("profile") or profile),
                        state_size=int(d.get("state_size") or 0), sidecar_size=int(d.get("sidecar_size") or 0))
    return ResumeResult(rec, int(d.get("slot") or 0), int(d.get("tokens") or 0), float(d.get("restore_ms") or 0.0),
                        [str(w) for w in d.get("warnings") or ()], hazard=d.get("hazard"))


async def _json_of(host, argv: list[str]) -> dict:
    """What the host's ``kv-valet … --json`` answered; its refusal (``"ok": false``) as RemoteError."""
    from app.remote.host import RemoteError

    d = await host.run_cli(argv, timeout=600, ok_exits=(0, 1))
    if not isinstance(d, dict):
        raise RemoteError(f"`kv-valet {argv[0]} --json` on {host.name} answered no JSON object",
                          kind="output", host=host.name)
    if not d.get("ok", False):
        reasons = [str(x) for x in d.get("details") or ()]
        failed = [str(s.get("error")) for s in d.get("sessions") or () if s.get("error")]
        raise RemoteError(" ".join([str(d.get("error") or "; ".join(failed) or "failed"), *reasons]),
                          kind="command", host=host.name, exit_status=d.get("exit", 1), output=d)
    return d
