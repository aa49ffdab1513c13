"""The session service: every park / resume / check workflow of one server.

The window's Sessions tab and the ``kv-valet`` commands are two faces of this
one Qt-free class. Each workflow decision lives here, once:

* how to reach the server (profile, URL, or a server an earlier KV Valet left
  running) and with which API key (:func:`app.server.launcher.resolve_api_key`);
* ``/slots`` read into typed rows, with what only the app knows: the tokens it
  restored into a slot (``/slots`` cannot show them) and each slot's last task
  from the log (``/slots`` zeroes its figures at release);
* which slot when the user names none (:mod:`app.sessions.slots`);
* what a resume does to the catalog: the session's verdict goes back to UNKNOWN
  and the next query on that slot is judged (:class:`ResumeWatcher`);
* park all & stop: stop only when every slot was parked; the resume plan;
* recovery of interrupted parks and A/B hides at connect.

Front ends subscribe to :meth:`on_change`, :meth:`on_restored` and
:meth:`on_verdict`; the window re-emits them as Qt signals. It is the
:class:`app.sessions.protocol.Sessions` of a server here, launched or attached.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

from app.core.observers import Observers
from app.core.confirmation import NeedsConfirmation
from app.core.profile import LaunchProfile
from app.core.sidecar_behaviour import Behaviour
from app.core.verdict import Verdict
from app.sessions import ab as ab_job
from app.sessions import check as check_job
from app.sessions import files_check
from app.sessions.behaviour import (LogEvidence, identify_target, memory_kind_from_log, memory_kind_from_log_file,
                                    mode_from_log, mode_from_log_file)
from app.sessions.check_report import (DEFAULT_QUESTION, PROTOCOL_ONE_PROCESS, PROTOCOL_RESTARTS, ABReport, CheckError,
                                       CheckReport)
from app.sessions.sidecar_hide import recover_hidden_sidecars
from app.sessions.journal import Recovery, recover
from app.sessions.move_in import recover_moves
from app.sessions.protocol import Capabilities
from app.sessions.model_identity import model_identity
from app.sessions.park import ParkError, ParkResult, park_all, park_slot
from app.sessions.park_commit import known_save_dirs, recover_parks
from app.sessions.park_stop import ParkStopReport
from app.sessions.resume import ResumeRefused, ResumeResult, find_session, resume_session
from app.sessions.resume_plan import (PlanEntry, clear_resume_plan, load_resume_plan, write_resume_plan,
                                  write_resume_plan_entries)
from app.sessions.records import delete_session, list_sessions, rename_session
from app.sessions.slots import Purpose, SlotError, default_slot, find_row, no_default_reason
from app.sessions.target import ServerTarget
from app.sessions.watch import ResumeWatcher
from app.sessions.wiring import VerdictRelay, attach_verdicts
from app.monitor.slots import LastTask, RestoredSlot, SlotRow, SlotsUnavailable, held_tokens
from app.server.client import LlamaClient, ServerError, ServerUnreachable
from app.server.launcher import resolve_api_key
from app.server.logparse import Kind, PromptEval, SidecarMode
from app.server.statefile import read_state_tokens
from app.store.catalog import Catalog, SessionRecord

log = logging.getLogger(__name__)

Stopper = Callable[[], Awaitable[None]]


class ServiceError(Exception):
    """A workflow that cannot run; the message is for the user."""


@dataclass
class ResumeAllOutcome:
    entry: PlanEntry
    result: ResumeResult | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.result is not None


_CACHED = re.compile(r"cached n_tokens =\s*(\d+)")


class SessionService:
    host = None  # app.sessions.protocol.Sessions: a server of this machine

    def __init__(self, target: ServerTarget, *, stopper: Stopper | None = None,
                 restarter: Stopper | None = None):
        self.target = target
        self._restarter = restarter  # a fresh server process: only for a server KV Valet runs
        self.restarting = False  # front ends keep the service through a restart the service asked for
        self.catalog: Catalog = target.catalog
        self.stopper = stopper  # stops the server: only for a server KV Valet launched
        self.watcher = ResumeWatcher(self._on_verdict)
        self.relay = VerdictRelay(self)  # resumes of any process, judged by whoever reads the log
        self.recovery_messages: list[str] = []
        self._changed: Observers[[]] = Observers("the sessions changed")
        self._restored: Observers[[int, RestoredSlot]] = Observers("a slot was restored")
        self._verdicts: Observers[[int, str | None, Verdict]] = Observers("a resume's verdict")
        self._first_cached: dict[int, int] = {}  # slot -> first "cached n_tokens" of its current task
        self._load_lines: list[str] = []  # the print_info lines of the last model load the log showed
        self._log_evidence = LogEvidence()  # what the log said of the build, read on from park to park
        self._closed = False
        self._owns_client = True
        # the server service's park-then-stop for this server (set by app.servers.service)
        self.park_then_stop: Callable[[str | None], Awaitable[ParkStopReport]] | None = None
        self._closers: list[Callable[[], Awaitable[None]]] = []

    # -- connecting ------------------------------------------------------------
    @classmethod
    async def connect(cls, catalog: Catalog, *, url: str | None = None, profile: LaunchProfile | None = None,
                      save_dir: str | Path | None = None, api_key: str | None = None, log_buffer=None,
                      build: str | None = None, supervisor=None, stopper: Stopper | None = None,
                      recover: bool = True, restarter: Stopper | None = None,
                      client: LlamaClient | None = None) -> "SessionService":
        """Connect to a running server: ``url`` (default: the profile's) with the
        key :func:`resolve_api_key` gives. ``supervisor``: the server the app runs,
        whose log feeds the verdict watcher. ``client``: the server's shared HTTP client
        (app.servers.service; not closed with this service). Raises ServiceError
        when the server is down."""
        if url is None:
            if profile is None:
                raise ServiceError("give a profile or a server URL")
            url = profile.url
        shared = client is not None
        if client is None:
            key = api_key if api_key is not None else resolve_api_key(profile)
            client = LlamaClient(url, key)
        try:
            health = await client.health()
            if not health.ok:
                what = f"the server of profile '{profile.name}' ({url})" if profile else f"the server at {url}"
                state = "is still loading its model" if health.loading else f"is not running ({health.message})"
                raise ServiceError(f"{what} {state}")
            try:
                target = await ServerTarget.connect(client, catalog, profile=profile, save_dir=save_dir,
                                                    log=log_buffer, build=build)
            except ServerError as e:
                if e.status == 401:
                    raise ServiceError(f"the server at {url} refused the API key (HTTP 401): set the profile's "
                                       "key or key file, or $LLAMA_API_KEY") from None
                raise ServiceError(f"cannot read the server's properties: {e.message}") from None
            except ServerUnreachable as e:
                raise ServiceError(f"the server at {url} stopped answering ({e.reason})") from None
        except BaseException:
            if not shared:
                await client.aclose()
            raise
        # which sidecar behaviour this build has (app.sessions.behaviour): the server's own start line,
        # a KV Valet build's build-info.json, what its parks wrote
        mode = getattr(supervisor, "sidecar_mode", None) if supervisor is not None else None
        if mode is None and supervisor is not None and getattr(supervisor, "log_file_path", None):
            # its start line may still wait in the reader's batch: the log file has it already
            mode = mode_from_log_file(supervisor.log_file_path, pid=supervisor.pid)
        if mode is None and log_buffer is not None:
            path = getattr(log_buffer, "path", None)
            mode = mode_from_log_file(path) if path else mode_from_log(log_buffer.since(0))
        binary = (supervisor.argv[0] if supervisor is not None and getattr(supervisor, "argv", None)
                  else _profile_binary(profile))
        if supervisor is not None and getattr(supervisor, "log_file_path", None):
            kind = memory_kind_from_log_file(supervisor.log_file_path, pid=supervisor.pid)
        elif log_buffer is not None:
            path = getattr(log_buffer, "path", None)
            kind = memory_kind_from_log_file(path) if path else memory_kind_from_log(log_buffer.since(0))
        else:
            kind = None
        target.model_kind_from_log = kind.value if kind is not None else None
        if mode:
            target.build = f"{target.build} +sidecars-{mode}"  # KV Valet's build: not the stock one's key
        # a start line the reader has not reached yet (a loaded machine): the mode it was launched in
        env_mode = getattr(supervisor, "launch_sidecar_mode", None) if supervisor is not None else None
        target.behaviour = identify_target(target, mode_line=mode, binary=binary, env_mode=env_mode)
        if restarter is None and supervisor is not None and stopper is not None:
            async def restarter() -> None:
                await supervisor.restart()
        svc = cls(target, stopper=stopper, restarter=restarter)
        svc._owns_client = not shared
        if supervisor is not None:
            attach_verdicts(svc, supervisor)
        if recover:
            svc.recovery_messages = await asyncio.to_thread(svc.recover)
        return svc

    def recover(self) -> list[str]:
        """Finish or undo parks, A/B hides and moves into here a crash interrupted (never running ones)."""
        extra = [self.target.save_dir] if self.target.save_dir else []
        run = Recovery(self.catalog, tuple(known_save_dirs(self.catalog, extra)))
        return recover([r.kind for r in (recover_hidden_sidecars, recover_moves, recover_parks)], run)

    async def warm_model_identity(self) -> None:
        """Read the memory kind now and hash the whole model in the background (minutes
        for a big one): parks never wait for it, and when it is done every session parked
        from this model meanwhile gets its full SHA-256."""
        if self.target.model_path and Path(self.target.model_path).is_file():
            ident = await model_identity(self.target.model_path, full=True)
            if ident.sha256 and ident.quick_id and not self._closed:
                await asyncio.to_thread(self.catalog.fill_model_sha256, ident.quick_id, ident.size, ident.sha256)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owns_client:
            await self.target.client.aclose()
        for closer in self._closers:
            await closer()

    def close_with(self, closer: Callable[[], Awaitable[None]]) -> None:
        """Also run ``closer`` at :meth:`aclose` (a command's server service)."""
        self._closers.append(closer)

    # -- what the server holds ---------------------------------------------------
    @property
    def profile_name(self) -> str:
        return self.target.profile_name

    @property
    def save_dir(self) -> Path | None:
        return self.target.save_dir

    @property
    def profile(self) -> LaunchProfile | None:
        return self.target.profile

    @property
    def capabilities(self) -> Capabilities:
        """Everything, but stopping (a server KV Valet launched) and an A/B across restarts
        (a server KV Valet runs): app.sessions.protocol."""
        return Capabilities(park_and_stop=self.stopper is not None, check_across_restarts=self.can_restart)

    def describe(self) -> str:
        """Where this server's sessions are parked, or that the first park asks for the folder."""
        if self.save_dir:
            return f"Sessions of '{self.profile_name}' are parked in {self.save_dir}"
        return "Attached to a server KV Valet did not start: the first Park asks for its --slot-save-path folder."

    @property
    def running(self) -> bool:
        """A session service lives as long as its server runs (the server service closes it)."""
        return not self._closed

    def queue_labels(self) -> list[str]:
        return self.target.queue.labels()

    def on_queue(self, cb: Callable[[], None]) -> None:
        self.target.queue.on_change(cb)

    def set_save_dir(self, folder: str | Path) -> None:
        """Attach mode: the user told us the server's --slot-save-path folder."""
        self.target.save_dir = Path(folder)

    async def slot_rows(self) -> list[SlotRow]:
        return await self.target.slot_rows()

    def on_slots(self, cb: Callable[[list[SlotRow]], None]) -> None:
        """Call ``cb`` with the rows of every ``/slots`` a workflow reads for its decision (the window
        feeds them to the server's one slot picture, its sampler: app.monitor.sampler.Sampler.feed_slots)."""
        self.target.slots_read.add(cb)

    async def default_slot(self, purpose: Purpose, record: SessionRecord | None = None) -> int | None:
        rows = await self.slot_rows()
        return default_slot(rows, purpose, record.slot_id if record else None)

    def sessions(self, *, verify_hash: bool = False) -> list[SessionRecord]:
        """This server's sessions, each sidecar re-checked on disk (headers and sizes;
        a PKCL v2 state hash only with ``verify_hash``: it reads the whole state file)."""
        return list_sessions(self.catalog, self.profile_name, verify_hash=verify_hash)

    async def verify_sidecar_hashes(self, records: list[SessionRecord] | None = None) -> bool:
        """Hash the state files whose PKCL v2 sidecar is not checked yet, off the
        event loop's thread; True when a record changed."""
        from app.sessions.sidecar_check import needs_hash, recheck

        todo = [r for r in (records if records is not None else self.catalog.list(self.profile_name))
                if needs_hash(r)]
        changed = False
        for rec in todo:
            after = await asyncio.to_thread(recheck, self.catalog, rec, verify_hash=True)
            changed |= after.sidecar_reason != rec.sidecar_reason
        if changed:
            self._changed.emit()
        return changed

    def on_this_server(self, rec: SessionRecord) -> str | None:
        """What this server's own loader will do with ``rec``'s sidecar, as a sentence
        (None for a dense model, or when this build's sidecar behaviour is not known)."""
        from app.core.restore_needs import effective_kind
        from app.core.sidecar_behaviour import SHORT
        from app.sessions.behaviour import predict_for_target

        if (effective_kind(rec.memory_kind, swa_full=self.target.swa_full) == "dense"
                or self.target.behaviour is Behaviour.UNKNOWN):
            return None
        try:
            p = predict_for_target(self.target, Path(rec.save_dir) / rec.state_file, rec.n_tokens,
                                   compute_hash=False)
        except OSError as e:
            return f"On this server: cannot read the sidecar ({e.strerror or e})."
        from app.sessions.behaviour import resume_prediction

        rp = resume_prediction(self.target, sidecar_usable=not p.rolls_back_nowhere)
        after = f" {rp.sentence[0].upper()}{rp.sentence[1:]}." if rp.known else ""
        return f"On this server ({SHORT[self.target.behaviour]}): {p.sentence}.{after}"

    def session(self, name: str) -> SessionRecord:
        try:
            return find_session(self.catalog, self.profile_name, name)
        except ResumeRefused as e:
            raise ServiceError(e.reasons[0]) from None

    def resume_plan(self) -> list[PlanEntry]:
        return load_resume_plan(self.profile_name)

    @property
    def persists_checkpoints(self) -> bool | None:
        return self.catalog.build_persists_checkpoints(self.target.build)

    # -- observers ---------------------------------------------------------------
    def on_change(self, cb: Callable[[], None]) -> None:
        """The catalog or the slots changed (park, resume, rename, delete, verdict)."""
        self._changed.add(cb)

    async def reload(self) -> None:
        """The records were changed from outside (a move): tell the observers."""
        self._changed.emit()

    def on_restored(self, cb: Callable[[int, RestoredSlot], None]) -> None:
        self._restored.add(cb)

    def on_verdict(self, cb: Callable[[int, str | None, Verdict], None]) -> None:
        self._verdicts.add(cb)

    # -- park --------------------------------------------------------------------
    def _refuse_router(self) -> None:
        """A router's slots are its child servers': nothing here parks, resumes or checks them."""
        if self.target.router:
            raise ServiceError(SlotsUnavailable.ROUTER)

    async def park(self, slot_id: int | None = None, name: str | None = None, *, on_progress=None,
                   budget_bytes: int | None = None) -> ParkResult:
        """Park ``slot_id`` (None: the default slot) as ``name``; raises ServiceError. ``budget_bytes``:
        the most the park may take (refused before it runs when predicted larger)."""
        self._refuse_router()
        try:  # its one read of /slots: the id checked, the default slot picked (app.sessions.park)
            result = await park_slot(self.target, slot_id, name, on_progress=on_progress, budget_bytes=budget_bytes)
        except (ParkError, SlotError) as e:
            raise ServiceError(str(e)) from None
        except ServerUnreachable as e:
            raise ServiceError(f"the server stopped answering ({e.reason})") from None
        except ServerError as e:
            raise ServiceError(f"the server refused: {e.message}") from None
        if self.target.behaviour is Behaviour.UNKNOWN:  # what this park wrote tells the build apart
            self.target.behaviour = identify_target(self.target, log=self._log_evidence)
        self._changed.emit()
        return result

    async def park_all(self, prefix: str | None = None, *, remember: bool = False) -> list[ParkResult]:
        """Park every slot that holds tokens; a failing slot is reported in its
        result (``error``) and the others go on. ``remember`` writes the resume
        plan too (before a suspend: if the server does not survive it, the next
        start offers "Resume all")."""
        if self.target.router:
            return []  # nothing of a router's is parked: its stop goes on
        try:
            results = await park_all(self.target, prefix=prefix)
        except (ServerError, ServerUnreachable) as e:
            raise ServiceError(f"cannot read the slots: {e}") from None
        if remember:
            write_resume_plan(self.profile_name, results)
        self._changed.emit()
        return results

    async def check_after_wake(self) -> list[PlanEntry]:
        """Back from a suspend that parked the slots: the plan entries whose slot lost its
        chat (the server was restarted, a slot was cleared) stay planned and are returned;
        when every slot still holds its tokens there is nothing to resume and the plan goes."""
        plan = self.resume_plan()
        if not plan or self.target.router:
            return []
        try:
            held = {r.id: held_tokens(r) for r in await self.slot_rows()}
        except (ServerError, ServerUnreachable) as e:
            raise ServiceError(f"cannot read the slots: {e}") from None
        lost = [e for e in plan if held.get(e.slot, 0) <= 0]
        if not lost:
            clear_resume_plan(self.profile_name)
        elif len(lost) < len(plan):
            write_resume_plan_entries(self.profile_name, lost)
        return lost

    async def park_all_and_stop(self, prefix: str | None = None) -> ParkStopReport:
        """Park every slot, write the resume plan, stop the server: the server service's one
        park-then-stop (app.servers.service), which the server's handle wires in here. A slot
        that failed to park keeps the server running (its tokens would be lost)."""
        if self.park_then_stop is None:
            raise ServiceError("only a server that KV Valet launched can be stopped from here")
        return await self.park_then_stop(prefix)

    # -- resume ------------------------------------------------------------------
    async def resume(self, name: str, slot_id: int | None = None, *, force: bool = False,
                     avoid_hazard: bool = False, avoid_useless: str | None = None,
                     avoid_mismatch: bool = False, leased: bool = False,
                     later: Callable[[Callable[[], None]], None] | None = None) -> ResumeResult:
        """Restore session ``name`` into ``slot_id`` (None: the default slot).

        Raises ResumeRefused (cannot work), NeedsConfirmation (works, with
        costs: pass force=True), ResumeFailed (the server refused). On success the
        session's verdict is UNKNOWN until the next query on the slot is judged.
        ``later`` (the proxy, issue #38): the restore's catalog note and the verdict's watch are handed
        to it, run once the request the restore is for is sent (app.sessions.protocol.Sessions.resume).
        """
        self._refuse_router()
        noted: list[Callable[[], None]] = []
        result = await resume_session(self.target, name, slot_id, force=force, avoid_hazard=avoid_hazard,
                                      avoid_useless=avoid_useless, avoid_mismatch=avoid_mismatch, leased=leased,
                                      later=noted.append if later is not None else None)
        restored = self.target.restored[result.slot_id]

        def told() -> None:
            for note in noted:
                note()  # the catalog's note first: the relay arms the watcher from it
            self.relay.note_restore(result)  # the verdict: this service's watcher, or another process's
            self._restored.emit(result.slot_id, restored)
            self._changed.emit()
        if later is None:
            told()
        else:
            later(told)
        return result

    async def resume_all(self) -> list[ResumeAllOutcome]:
        """Resume the sessions of the resume plan into their slot ids. The plan is
        cleared once every entry is back; a failed entry does not stop the others."""
        from app.sessions.resume import ResumeFailed

        out: list[ResumeAllOutcome] = []
        for entry in self.resume_plan():
            try:
                # a park whose files are not the ones it wrote stays parked: its own resume asks first
                out.append(ResumeAllOutcome(entry, await self.resume(entry.session, entry.slot, force=True,
                                                                     avoid_mismatch=True)))
            except ResumeRefused as e:
                out.append(ResumeAllOutcome(entry, error="; ".join(e.reasons)))
            except (NeedsConfirmation, ResumeFailed, ServerError, ServerUnreachable, OSError) as e:
                out.append(ResumeAllOutcome(entry, error=str(e)))
        if out and all(o.ok for o in out):
            clear_resume_plan(self.profile_name)
        return out

    # -- check -------------------------------------------------------------------
    async def check_slot(self, record: SessionRecord, slot_id: int | None, *, force: bool = False,
                         rows: list[SlotRow] | None = None) -> int:
        """The slot a check restores into: the chosen one (asking first when it
        holds tokens), else the default slot. ``rows``: the ``/slots`` the caller just read."""
        rows = rows if rows is not None else await self.slot_rows()
        if slot_id is None:
            slot_id = default_slot(rows, Purpose.CHECK, record.slot_id)
            if slot_id is None:
                raise ServiceError(no_default_reason(rows, Purpose.CHECK))
            return slot_id
        try:
            row = find_row(rows, slot_id)
        except SlotError as e:
            raise ServiceError(str(e)) from None
        if held_tokens(row) > 0 and not force:
            raise NeedsConfirmation([f"slot {slot_id} holds {held_tokens(row):,} tokens; the check restores "
                                     "the session over them"])
        return slot_id

    async def _restart_for_check(self) -> None:
        """A fresh server process between probes (the A/B's protocol): the front ends keep
        this service through it, and what the app knew of the old process goes."""
        assert self._restarter is not None
        self.restarting = True
        try:
            await self._restarter()
        finally:
            self.restarting = False
        self.target.restored.clear()
        self.target.held_as.clear()
        self.target.parked_here.clear()
        self.target.last_rows = None
        self.target.last_tasks.clear()
        self.target.checkpoint_owners.clear()

    @property
    def can_restart(self) -> bool:
        return self._restarter is not None

    def protocol_for(self, protocol: str | None, *, check: bool = False) -> str:
        """The A/B runs across restarts when KV Valet runs the server, else in one process
        (its arms labelled when they confound). A check restarts only on a build that keeps
        a slot's checkpoints across restores (the fork): elsewhere one process is the same."""
        if protocol is not None:
            if protocol == PROTOCOL_RESTARTS and not self.can_restart:
                raise ServiceError("the A/B across restarts needs a server KV Valet runs (it restarts it between "
                                   "arms, as the seed's A/B did); this one is not: run it in one process")
            return protocol
        if not self.can_restart:
            return PROTOCOL_ONE_PROCESS
        if check and self.target.behaviour is not Behaviour.FORK:
            return PROTOCOL_ONE_PROCESS
        return PROTOCOL_RESTARTS

    @staticmethod
    def _confirm_restarts(slot: int, force: bool, rows: list[SlotRow]) -> None:
        if force:
            return
        others = [r for r in rows if r.id != slot and held_tokens(r) > 0]
        if others:
            what = ", ".join(f"slot {r.id} ({held_tokens(r):,} tokens)" for r in others)
            raise NeedsConfirmation([f"the check restarts the server between probes: the chats in {what} are "
                                     "lost unless you park them first"])

    async def check(self, name: str, slot_id: int | None = None, *, force: bool = False,
                    question: str = DEFAULT_QUESTION, protocol: str | None = None,
                    output_check: bool = True, on_progress=None) -> CheckReport:
        """Restore ``name`` and judge a first query twice (exact tokens, text); ``output_check``:
        each probe's output compared with a cold prefill's (DIFFERS when it differs)."""
        self._refuse_router()
        rec = self.session(name)
        files = await asyncio.to_thread(files_check.confirm, self.catalog, rec, force, "the check")
        rows = await self.slot_rows()  # one read: the slot, and the chats a restart would lose
        slot = await self.check_slot(rec, slot_id, force=force, rows=rows)
        protocol = self.protocol_for(protocol, check=True)
        restart = self._restart_for_check if protocol == PROTOCOL_RESTARTS else None
        if restart is not None:
            self._confirm_restarts(slot, force, rows)
        try:
            report = await check_job.check_resume(self.target, rec, slot, question=question, restart=restart,
                                                  output_check=output_check, on_progress=on_progress)
        except CheckError as e:
            raise ServiceError(str(e)) from None
        if files.refuses:
            report = check_job.not_its_own_files(report, list(files.problems))
            if rec.id is not None:
                self.catalog.update_verdict(rec.id, report.verdict.kind.value, report.verdict.reason)
        self._changed.emit()
        return report

    async def restore_judged(self, name: str, slot_id: int | None = None, *,
                             output_check: bool = True) -> dict[str, Any]:
        """The Sessions protocol's judged restore: :meth:`check` whatever the slot holds, as JSON."""
        from app.sessions.check_export import report_dict

        return report_dict(await self.check(name, slot_id, force=True, output_check=output_check))

    async def ab(self, name: str, slot_id: int | None = None, *, force: bool = False, baseline: bool = False,
                 question: str = DEFAULT_QUESTION, between_arms=None,
                 protocol: str | None = None, output_check: bool = True, exact_probes: bool = True,
                 chat_probe: str = "text", on_progress=None) -> ABReport:
        """The A/B: the same state file with its sidecar and with it hidden, across restarts
        when KV Valet runs the server (``protocol`` None), else in one process; ``output_check``:
        both arms' outputs compared with a cold prefill's; ``on_progress(text)``: where it is."""
        self._refuse_router()
        rec = self.session(name)
        await asyncio.to_thread(files_check.confirm, self.catalog, rec, force, "the A/B")
        rows = await self.slot_rows()  # one read: the slot, and the chats a restart would lose
        slot = await self.check_slot(rec, slot_id, force=force, rows=rows)
        protocol = self.protocol_for(protocol)
        restart = self._restart_for_check if protocol == PROTOCOL_RESTARTS else None
        if restart is not None:
            self._confirm_restarts(slot, force, rows)
        try:
            report = await ab_job.ab_check(self.target, rec, slot, baseline=baseline, question=question,
                                              between_arms=between_arms, restart=restart, protocol=protocol,
                                              output_check=output_check, exact_probes=exact_probes,
                                              chat_probe=chat_probe, on_progress=on_progress)
        except CheckError as e:
            raise ServiceError(str(e)) from None
        self._changed.emit()
        return report

    # -- catalog -----------------------------------------------------------------
    def rename(self, old: str, new: str, profile: str | None = None) -> SessionRecord:
        rec = rename_session(self.catalog, old, new, profile or self.profile_name)
        self._changed.emit()
        return rec

    def delete(self, name: str, profile: str | None = None) -> list[Path]:
        removed = delete_session(self.catalog, name, profile or self.profile_name)
        self._changed.emit()
        return removed

    def park_bytes(self, name: str) -> int:
        rec = self.catalog.get(self.profile_name, name)
        return rec.state_size + rec.sidecar_size if rec is not None else 0

    def discard(self, name: str) -> None:
        self.delete(name)

    async def parked_tokens(self, name: str) -> list[int] | None:
        rec = self.catalog.get(self.profile_name, name)
        return None if rec is None else await asyncio.to_thread(read_state_tokens, rec.state_path)

    # -- the server's log -------------------------------------------------------
    def feed_log(self, item) -> None:
        """Every log line of the server: verdicts, prefill rate, last tasks."""
        if self._closed:
            return
        ev = getattr(item, "event", item)
        self.relay.before_feed(ev)  # a task starts on a slot another process resumed: judge it too
        self.watcher.feed(item)  # the LogLine: its read time tells an earlier task's late lines apart
        record_prefill_sample(self.catalog, self.profile_name, ev)
        self._track_checkpoints(ev)
        if ev.slot is None or ev.task is None or ev.task < 0:
            return
        if ev.kind is Kind.NEW_PROMPT:
            self._first_cached.pop(ev.slot, None)
        elif ev.kind is Kind.RAW and ev.slot not in self._first_cached and "cached n_tokens" in ev.text:
            m = _CACHED.search(ev.text)
            if m:
                self._first_cached[ev.slot] = int(m.group(1))
        elif isinstance(ev, PromptEval):
            n = ev.n_tokens
            cached = self._first_cached.get(ev.slot)
            self.target.last_tasks[ev.slot] = LastTask(ev.task, (cached or 0) + n, cached, n)

    def _track_checkpoints(self, ev) -> None:
        """Whose context checkpoints each slot holds, and what the log says of the build."""
        t = self.target
        if "print_info:" in ev.line:  # a (re)load says what it made of the model
            self._load_lines = [] if "print_info: arch" in ev.line else self._load_lines
            self._load_lines.append(ev.line)
            kind = memory_kind_from_log(self._load_lines)
            if kind is not None:
                t.model_kind_from_log = kind.value
        if ev.kind in (Kind.MODEL_LOADED, Kind.LISTENING):  # a new server process: nothing survives it
            t.checkpoint_owners.clear()
            t.parked_here.clear()
            t.last_rows = None  # its slots are read anew
        elif isinstance(ev, SidecarMode):
            mode = ev.mode
            if mode and not t.build.endswith(f"+sidecars-{mode}"):
                t.build = f"{t.build.split(' +sidecars-')[0]} +sidecars-{mode}"
            t.behaviour = identify_target(t, mode_line=mode)
        elif ev.kind is Kind.CHECKPOINT_CREATED and ev.slot is not None and ev.task is not None and ev.task >= 0:
            restored = t.restored.get(ev.slot)
            t.checkpoint_owners[ev.slot] = (restored.session if restored is not None and restored.session
                                            else f"the chat of task {ev.task}")

    def _on_verdict(self, slot_id: int, session: str | None, verdict: Verdict) -> None:
        # the verdict and the time saved, written once whoever else judged it (app.sessions.wiring)
        session = self.relay.settle(slot_id, verdict) or session
        entry = self.target.restored.get(slot_id)
        if entry is not None:
            entry.verdict = verdict
        self._verdicts.emit(slot_id, session, verdict)
        self._changed.emit()


def _profile_binary(profile: LaunchProfile | None) -> str | None:
    """The binary a profile launches (its own path, the built server, or the one discovery finds)."""
    from app.server.discovery import DiscoveryError, find_server_binary

    if profile is None:
        return None
    try:
        return find_server_binary(profile.server_binary).path
    except DiscoveryError:
        return None


def record_prefill_sample(catalog: Catalog, profile: str, ev) -> None:
    """Keep the profile's measured prefill rate from every prompt the server
    processes, whoever sent it (the re-prefill estimate on resume uses it)."""
    if isinstance(ev, PromptEval):
        n, ms = ev.n_tokens, ev.ms
        if n >= 32 and ms > 0:
            try:
                catalog.record_prefill(profile, n, ms)
            except Exception:  # report: a sample not kept must not break log handling (logged)
                log.warning("cannot keep a prefill sample of profile %s (%d tokens, %.0f ms)", profile, n, ms,
                            exc_info=True)
