"""The Sessions tab's controller: the workflows, and typed signals of what they did.

A :class:`SessionsController` is a :class:`QObject` (no widget): it shows one server's
:class:`app.sessions.protocol.Sessions` (``sessions``: the window's server here, its
:class:`~app.sessions.service.SessionService` ``service``, or a host's), set through its one entry
point :meth:`~SessionsController.set_sessions`; it parks, resumes, checks, "Resume all" through
them, and says each outcome as a typed signal. Whoever wants to know (the table
widget :class:`~app.ui.sessions.panel.SessionsPanel`, the tray, the first-run guide, the
Monitor's wiring) subscribes to those, never to the text of a message:

* ``parked(ParkResult)``, ``resumed(ResumeResult)``: one per slot parked or resumed;
* ``judged(slot, session, Verdict)``: the verdict of a resumed slot's next query;
* ``failed(Operation, str)``: an operation that did not happen, and why;
* ``said(Operation | None, ok, text)``: every outcome as the message line shows it.

Rename / delete / "Delete older than…" (:class:`app.ui.sessions.housekeeping.Housekeeping`)
and "Check resume" / "A/B check" (:class:`app.ui.sessions.checks.Checks`) are helper objects
that go through this controller's public interface only.
"""

from __future__ import annotations

import logging
import weakref

from PySide6.QtCore import QObject, Signal

from app import paths
from app.core.verdict import Verdict, VerdictKind
from app.sessions.protocol import Sessions
from app.sessions.records import list_sessions
from app.core.confirmation import NeedsConfirmation
from app.sessions.resume import ResumeFailed, ResumeRefused
from app.sessions.service import ServiceError, SessionService
from app.store.catalog import Catalog
from app.store.profiles import ProfileStore
from app.ui.sessions.dialogs import answer, chosen_folder, folder_dialog
from app.ui.sessions.model import _size
from app.ui.sessions.slot_picture import SlotPicture
from app.ui.operations import Operation
from app.ui.widgets.questions import Questions
from app.ui.widgets.tasks import Tasks

log = logging.getLogger(__name__)


class SessionsController(QObject):
    parked = Signal(object)  # ParkResult
    resumed = Signal(object)  # ResumeResult
    judged = Signal(int, str, object)  # slot, session ("" if none), Verdict
    failed = Signal(object, str)  # Operation, why
    said = Signal(object, bool, str)  # Operation (None: a hint), ok, text: every outcome, as the message line says it
    changed = Signal()  # the catalog changed (parked, resumed, renamed, deleted, judged)
    restored = Signal(int, object)  # slot, RestoredSlot
    service_changed = Signal(object)  # the local SessionService once connected (None when gone)
    connected = Signal(bool)  # the sessions shown, or their server's state, changed (False: none shown)
    queue_changed = Signal(list)  # the labels of the slot operations running and waiting
    slots_changed = Signal(list)  # SlotRows of the server: its one slot picture (its sampler's), or a host's status
    plan_offered = Signal(list)  # the resume plan "Resume all" would resume ([]: none)
    checked = Signal(object, object)  # a check's or A/B's report, the session's history (or None)

    def __init__(self, *, catalog: Catalog | None = None, store: ProfileStore | None = None, confirm=None):
        super().__init__()
        self.owns_catalog = catalog is None
        self.catalog = catalog or Catalog(paths.catalog_path())
        self.store = store or ProfileStore()
        self.service: SessionService | None = None  # the session service of the server followed here
        self.sessions: Sessions | None = None  # what the tab shows and acts on: that service, or a host's
        self.servers = None  # the window's ServerController, once attached
        self.closed = False
        self.questions = Questions(None, confirm)  # its parent: the panel that shows the tab (set_dialog_parent)
        self.tasks = Tasks("SessionsController", lambda exc: self.say(f"Failed: {exc}", ok=False))
        self.plan: list = []
        self.folder_dialog = None
        self._bound: weakref.WeakSet = weakref.WeakSet()  # the session services this tab hooked
        self.slot_picture = SlotPicture(self)  # the slots shown: the server's one picture
        self._hashing = False
        self._hash_tried: set = set()
        self._profile = None

    def set_dialog_parent(self, widget) -> None:
        """The widget the questions and dialogs open over (the panel)."""
        self.questions.parent = widget

    def spawn(self, coro, what: str = ""):
        return self.tasks.spawn(coro, what)

    @property
    def profile_name(self) -> str | None:
        return self.sessions.profile_name if self.sessions else None

    def say(self, text: str, ok: bool = True, op: Operation | None = None) -> None:
        """Say an outcome: ``said`` always, ``failed`` too when it is an operation's failure."""
        if self.closed:
            return
        self.said.emit(op, ok, text)
        if not ok and op is not None:
            self.failed.emit(op, text)

    def records(self) -> list:
        """The sessions listed: the server's profile's when connected (each sidecar looked at again), else all."""
        records = self.sessions.sessions() if self.sessions else list_sessions(self.catalog)
        self._verify_hashes_later(records)
        return records

    def notify_changed(self) -> None:
        if not self.closed:
            self.changed.emit()

    # -- the server --------------------------------------------------------
    def attach(self, servers) -> None:
        """Follow the server the window's ServerController shows: its session service is connected
        (and closed) by the server service, and shared with the quit and logind paths."""
        self.servers = servers
        servers.sig_sessions.connect(self._on_sessions)
        self.slot_picture.attach(servers)
        servers.sig_notice.connect(lambda text, ok: None if ok else self.say(text, ok=False))

    def _on_sessions(self, svc) -> None:
        if self.closed:
            return
        if svc is None:
            self._drop_service()
        else:
            self.spawn(self.bind_service(svc))

    def _drop_service(self) -> None:
        gone, self.service = self.service, None  # the server service closes it
        self.plan = []
        if self.sessions is None or self.sessions is gone:  # a host's server shown stays shown
            self.set_sessions(None)
        if gone is not None:
            self.service_changed.emit(None)

    def set_sessions(self, sessions: Sessions | None) -> None:
        """Show ``sessions`` (a server here, or a host's; None: no server): its records, its slots,
        the controls its capabilities allow. The tab's one entry point: nothing else sets them."""
        if self.closed:
            return
        self.sessions = sessions
        if sessions is not None and sessions not in self._bound:  # shown again after another server: hooked once
            self._bound.add(sessions)
            sessions.on_queue(lambda s=sessions: self.sessions is s and self._on_queue())
            sessions.on_change(lambda s=sessions: self.sessions is s and self._on_sessions_changed())
            sessions.on_restored(lambda slot, entry, s=sessions: self.sessions is s and self.restored.emit(slot, entry))
            sessions.on_verdict(lambda *a, s=sessions: self.sessions is s and self._on_verdict(*a))
        self._on_queue()
        self.connected.emit(sessions is not None)
        self.changed.emit()

    def _on_sessions_changed(self) -> None:
        if not self.closed:
            self.connected.emit(self.sessions is not None)  # a host's server may have started or stopped
            if self.sessions is not self.service:  # a host's answer: its slots as it said them (no SSH;
                self.spawn(self.read_slots())  # a server here's follow its one picture: app.ui.sessions.slot_picture)
            self.changed.emit()

    async def connect_service(self) -> SessionService | None:
        """The session service of the server the window runs or watches (connected once)."""
        c = self.servers
        if c is None or c.handle is None:
            return None
        try:
            svc = await c.service.sessions(c.target_id)
        except ServiceError as e:
            self.say(f"Cannot connect the Sessions tab: {e}", ok=False, op=Operation.CONNECT)
            return None
        return await self.bind_service(svc)

    async def bind_service(self, svc: SessionService) -> SessionService | None:
        """Show ``svc``'s server in the tab: its sessions, its slots, its verdicts."""
        if self.closed:
            return None
        if self.service is svc:
            return svc
        self.service = svc
        first = svc not in self._bound  # shown again after another server (the server list)
        self.slot_picture.bind(svc, first)
        self.set_sessions(svc)
        if first:
            self.spawn(svc.warm_model_identity())
        await self.read_slots()
        if self.service is not svc:
            return None  # it went while the slots were read
        self.service_changed.emit(svc)
        if svc.recovery_messages:
            self.say("Recovered after an interruption: " + "; ".join(svc.recovery_messages), ok=True)
        self._profile = svc.profile
        self._offer_resume_all(svc.resume_plan(), auto=first)  # shown again: offered, never resumed unasked
        return svc

    def _on_queue(self) -> None:
        if not self.closed:
            self.queue_changed.emit(self.sessions.queue_labels() if self.sessions else [])

    async def read_slots(self) -> None:
        """The slots as they are now, said by ``slots_changed`` (app.ui.sessions.slot_picture)."""
        await self.slot_picture.read()

    def _verify_hashes_later(self, records) -> None:
        """PKCL v2 sidecars: hash their state files off the GUI thread, once per change."""
        from app.sessions.sidecar_check import needs_hash

        if self.sessions is None or not self.sessions.capabilities.local_files or self._hashing:
            return
        todo = [r for r in records if (r.id, r.state_size, r.updated_at) not in self._hash_tried and needs_hash(r)]
        if not todo:
            return
        self._hash_tried.update((r.id, r.state_size, r.updated_at) for r in todo)
        self._hashing = True

        async def run():
            try:
                await self.sessions.verify_sidecar_hashes(todo)
            finally:
                self._hashing = False

        self.spawn(run())

    async def ensure_save_dir(self) -> bool:
        """The folder to park into: an attached server's is asked once."""
        if self.sessions is None:
            self.say("Start or attach to a server first.", ok=False)
            return False
        if self.sessions.save_dir is None and self.sessions.capabilities.choose_save_dir:
            self.folder_dialog = dlg = folder_dialog(self.questions.parent)
            try:
                folder = await answer(dlg, lambda r: chosen_folder(dlg, r))
            finally:
                self.folder_dialog = None
            if not folder or self.service is None:
                return False
            self.service.set_save_dir(folder)
            self.connected.emit(True)
        return True

    # -- park ----------------------------------------------------------------
    async def park(self, slot_id: int | None, name: str | None = None):
        if not await self.ensure_save_dir():
            return None
        what = "Park" + (f" slot {slot_id}" if slot_id is not None else "")
        try:
            result = await self.sessions.park(slot_id, name, on_progress=lambda text: self.say(f"{what}: {text}…"))
        except ServiceError as e:
            self.say(f"{what}: {e}", ok=False, op=Operation.PARK)
            return None
        rec = result.record
        text = (f"Parked slot {result.slot_id} as '{rec.name}': {rec.n_tokens:,} tokens, "
                f"{_size(rec.state_size + rec.sidecar_size)} in {rec.save_ms:,.0f} ms. "
                f"Sidecar: {result.sidecar.reason if result.sidecar else '-'}")
        self.parked.emit(result)
        return await self._done(result, text, Operation.PARK)  # the slots: as the park's one read saw them

    async def _done(self, result, text: str, op: Operation):
        """Say a park's or resume's result with its warnings; after a resume, the slots as they are now."""
        if result.warnings:
            text += "\n⚠ " + "\n⚠ ".join(result.warnings)
        self.say(text, ok=True, op=op)
        if op is not Operation.PARK:
            await self.read_slots()
        return result

    async def park_all(self, remember: bool = False):
        """Park all; ``remember`` (before a suspend) also writes the resume plan."""
        if not await self.ensure_save_dir():
            return []
        try:
            results = await self.sessions.park_all(remember=remember)
        except ServiceError as e:
            self.say(f"Park all: {e}", ok=False, op=Operation.PARK_ALL)
            return []
        self._report_parks(Operation.PARK_ALL, results)  # the slots: as its one read saw them
        return results

    async def park_all_and_stop(self):
        if self.sessions is None or not await self.ensure_save_dir():
            return None
        op = Operation.PARK_ALL_AND_STOP
        try:
            outcome = await self.sessions.park_all_and_stop()
        except ServiceError as e:
            self.say(f"{op.value}: {e}", ok=False, op=op)
            return None
        self._report_parks(op, outcome.results,
                           "" if outcome.stopped else "\nThe server keeps running: a slot could not be parked.")
        return outcome

    def _report_parks(self, op: Operation, results, tail: str = "") -> None:
        for r in results:
            if r.ok:
                self.parked.emit(r)
        lines = [(f"slot {r.slot_id}: '{r.record.name}' {r.record.n_tokens:,} tokens, sidecar {r.record.sidecar_status}"
                  if r.ok else f"slot {r.slot_id}: failed: {r.error}") for r in results]
        self.say(f"{op.value}: " + ("; ".join(lines) if lines else "no slot holds tokens") + tail,
                 ok=all(r.ok for r in results) and not tail, op=op)

    # -- resume --------------------------------------------------------------
    async def resume(self, name: str, slot_id: int | None = None, force: bool = False):
        what, op = f"Resume '{name}'", Operation.RESUME
        if self.sessions is None:
            self.say(f"{what}: start or attach to a server first.", ok=False, op=op)
            return None
        rec = self.catalog.get(self.sessions.profile_name, name)
        if rec is not None:  # one restore call: say what it reads while it runs (2.5 GB took 1.2 s in the seeds)
            self.say(f"{what}: restoring {rec.n_tokens:,} tokens ({_size(rec.state_size + rec.sidecar_size)})…")
        try:
            result = await self.sessions.resume(name, slot_id, force=force)
        except ResumeRefused as e:
            self.say(f"{what}: cannot resume: " + "; ".join(e.reasons), ok=False, op=op)
            return None
        except NeedsConfirmation as e:
            if not await self.questions.confirmed("Resume session", "\n\n".join(e.warnings) + "\n\nResume anyway?"):
                self.say(f"{what}: cancelled.", ok=True, op=op)
                return None
            return await self.resume(name, slot_id, force=True)
        except ResumeFailed as e:
            self.say(f"{what}: {e}", ok=False, op=op)
            return None
        text = (f"Resumed '{result.record.name}' into slot {result.slot_id}: {result.n_restored:,} tokens in "
                f"{result.restore_ms:,.0f} ms. The verdict comes with the next query on that slot.")
        self.resumed.emit(result)
        return await self._done(result, text, op)

    async def resume_planned(self):
        """"Resume all": the resume plan's sessions back into their slots."""
        if self.sessions is None:
            return []
        outcomes = await self.sessions.resume_all()
        for o in outcomes:
            if o.ok and o.result is not None:
                self.resumed.emit(o.result)
        if all(o.ok for o in outcomes):
            self.plan = []
            self.plan_offered.emit([])
        self.say("Resume all: " + "; ".join(
            f"{o.entry.session} → slot {o.entry.slot}: " + ("ok" if o.ok else o.error) for o in outcomes),
            ok=all(o.ok for o in outcomes), op=Operation.RESUME_ALL)
        await self.read_slots()
        return outcomes

    def _on_verdict(self, slot_id: int, session: str | None, verdict: Verdict) -> None:
        self.judged.emit(slot_id, session or "", verdict)
        self.say(f"Slot {slot_id} ('{session}'): {verdict.kind} — {verdict.reason}",
                 ok=verdict.kind not in (VerdictKind.DISCARDED, VerdictKind.DIFFERS), op=Operation.VERDICT)

    # -- after a restart or a sleep ---------------------------------------------
    def _offer_resume_all(self, plan, auto: bool = True) -> None:
        """Offer "Resume all (N)" for a resume plan, or resume at once where the preferences
        or the profile say so (app.settings.auto_resumes) and ``auto``."""
        from app.settings import auto_resumes, load_or_defaults

        self.plan = list(plan or [])
        if plan and auto and auto_resumes(load_or_defaults()[0].auto_resume,
                                          bool(self._profile and self._profile.resume_on_start)):
            self.plan_offered.emit([])
            self.spawn(self.resume_planned())
            return
        self.plan_offered.emit(self.plan)

    async def after_wake(self) -> None:
        """Back from a suspend that parked the slots: nothing to do if the chats are still in
        their slots; else offer (or do) "Resume all" for the slots that lost theirs."""
        if self.service is None:
            return  # the server is gone: its next start offers the plan (a host's server did not sleep)
        op = Operation.WAKE
        try:
            lost = await self.service.check_after_wake()
        except ServiceError as e:
            self.say(f"{op.value}: {e}", ok=False, op=op)
            return
        self._offer_resume_all(lost)
        if lost:
            self.say(f"{op.value}: {len(lost)} slot(s) lost their chat while the computer slept; they were parked "
                     "before it: " + ", ".join(f"'{e.session}' → slot {e.slot}" for e in lost), ok=False, op=op)
        else:
            self.say(f"{op.value}: every slot still holds its chat; nothing to resume.", ok=True, op=op)

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.servers is not None:
            self.servers.sig_sessions.disconnect(self._on_sessions)
            self.slot_picture.detach(self.servers)
        await self.tasks.end()
        self.service = self.sessions = None  # the server service closes it with its server
        if self.owns_catalog:
            self.catalog.close()
