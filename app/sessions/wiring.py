"""The one wiring of a server's log to a session service: verdicts, time saved, prefill rate.

The window's Sessions tab and ``kv-valet serve`` both run a server and both hook its
log to a :class:`app.sessions.service.SessionService` the same way:
``SessionService.connect(..., supervisor=...)`` calls :func:`attach_verdicts`, and
from then on every log line goes through ``SessionService.feed_log``: the verdict
watcher, the time-saved ledger (written with the verdict), the profile's prefill-rate
samples and each slot's last task.

Verdicts across processes: ``kv-valet resume`` runs in a process of its own that ends
long before the next query comes, from whatever client. So every resume leaves a
:class:`PendingVerdict` note in the catalog (keyed by the session's id: a rename while
it waits keeps it). Whichever process watches that server's log arms its watcher from
the note when a task starts on the slot (the log's ``new prompt`` line, before the
task's timing line), and the first to reach the verdict writes it and removes the note
in one transaction (:meth:`Catalog.settle_pending_verdict`): a second watcher of the
same restore finds the note gone and writes nothing. A note older than the server's
start (it restarted since: the restored tokens are gone) or replaced by a newer
restore on the same slot is dropped, with a log line.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Protocol

from app.core.park_files import parked_positions
from app.core.verdict import Verdict, time_saved
from app.server.logparse import Kind
from app.server.supervisor import LogBuffer
from app.sessions.resume import ResumeResult
from app.sessions.target import ServerTarget
from app.sessions.watch import ResumeWatcher
from app.store.catalog import Catalog, PendingVerdict

log = logging.getLogger(__name__)


class VerdictOwner(Protocol):
    """What the relay uses of its session service (:class:`app.sessions.service.SessionService`,
    which builds its relay and imports this module): named here so the arrow goes one way."""

    catalog: Catalog
    target: ServerTarget
    watcher: ResumeWatcher
    relay: VerdictRelay

    @property
    def profile_name(self) -> str: ...

    @property
    def persists_checkpoints(self) -> bool | None: ...

    def feed_log(self, item) -> None: ...


def attach_verdicts(service: VerdictOwner, supervisor) -> None:
    """Feed every line of ``supervisor``'s log (the server this process runs) to
    ``service``: its verdicts, including those of resumes other processes did, the
    time-saved ledger and the prefill-rate samples. Notes older than the server's
    start are dropped now."""
    service.relay.server_started_at = lambda: getattr(supervisor, "started_at", None)
    service.relay.fed = getattr(supervisor, "log", None)
    service.relay.drop_stale()
    supervisor.on_line(service.feed_log)


class VerdictRelay:
    """One service's side of the catalog's pending verdicts (see the module doc)."""

    def __init__(self, service: VerdictOwner):
        self._svc = service
        # Set by attach_verdicts: when the server whose log this service reads started.
        # None: this service reads no log (a CLI command) and only leaves notes.
        self.server_started_at: Callable[[], float | None] | None = None
        self._armed: dict[int, PendingVerdict] = {}  # slot -> the note its watcher expectation judges
        self._trace_lines = False  # the log shows "new prompt" lines (-lv 4)
        # The lines the service was fed (the supervisor's LogBuffer), set by attach_verdicts: what a watch armed
        # after its query ran takes from there (see note_restore)
        self.fed: LogBuffer | None = None

    @property
    def _profile(self) -> str:
        return self._svc.profile_name

    # -- the resuming process ----------------------------------------------------
    def note_restore(self, result: ResumeResult) -> PendingVerdict | None:
        """A resume of this service: its note for whoever watches the log (written with the resume's own record,
        :func:`app.sessions.resume.pending_verdict`), and this service's own watcher armed too (it judges when it
        watches the log)."""
        svc, rec = self._svc, result.record
        persists, ctx = svc.persists_checkpoints, svc.target.ctx_checkpoints
        note = result.noted.pending if result.noted is not None else None
        for old in result.noted.replaced if result.noted is not None else ():
            self._dropped(old, "a newer restore into the same slot replaced it")
        svc.watcher.expect(result.slot_id, result.n_restored, rec.name, rec.sidecar_status, build_persists=persists,
                           ctx_checkpoints=ctx, sidecar_count=rec.sidecar_count or None,
                           behaviour=svc.target.behaviour, prediction=getattr(result, "prediction", None),
                           note=("resumed into a slot that held another chat's checkpoints"
                                 if getattr(result, "hazard", None) else None),
                           parked_positions=parked_positions(rec.parked_files),
                           # its log lines since the restore (this may run once the next request was sent)
                           since=getattr(result, "restored_at", 0.0) or None)
        if note is not None:
            self._armed[result.slot_id] = note
        else:
            self._armed.pop(result.slot_id, None)
        since = getattr(result, "restored_at", 0.0)
        if since and self.fed is not None:
            # Armed once the query was sent (the proxy, issue #38), a quick server may have run it already and
            # its lines been fed before this: the watcher takes the slot's lines read since the restore ended.
            for line in self.fed.read_since(since):
                if line.event.slot == result.slot_id:
                    svc.watcher.feed(line)
                    if result.slot_id not in svc.watcher.pending():
                        break  # judged
        return note

    # -- the process that watches the log -----------------------------------------
    def before_feed(self, ev) -> None:
        """A log event, before the watcher sees it: when a task starts on a slot, arm the
        watcher from the newest note for that slot (another process's resume)."""
        if self.server_started_at is None or ev.slot is None or ev.task is None or ev.task < 0:
            return
        if ev.kind is Kind.NEW_PROMPT:
            self._trace_lines = True
        elif (ev.kind not in (Kind.PROMPT_EVAL, Kind.RELEASE) or self._trace_lines
              or ev.slot in self._svc.watcher.pending()):
            return  # without trace lines a task's first line is its timing line: arm there
        try:
            self._arm_from_catalog(ev.slot)
        except Exception:  # log handling goes on; this task goes unjudged
            log.exception("slot %d: cannot read the restores waiting for a verdict of profile '%s'", ev.slot,
                          self._profile)

    def _arm_from_catalog(self, slot: int) -> None:
        catalog, watcher = self._svc.catalog, self._svc.watcher
        started = self.server_started_at() if self.server_started_at else None
        live = []
        for note in catalog.pending_verdicts(self._profile, slot, server_url=self._svc.target.url):
            if started is not None and note.created_at < started:
                self._drop(note, "the server restarted since (the restored tokens are gone)")
            else:
                live.append(note)
        for note in live[1:]:
            self._drop(note, "a newer restore into the same slot replaced it")
        armed = self._armed.get(slot)
        if not live:
            if armed is not None:  # judged by another watcher, dropped, or its session deleted
                self._armed.pop(slot, None)
                watcher.cancel(slot)
            return
        note = live[0]
        if armed is not None and armed.id == note.id:
            return
        rec = catalog.get_by_id(note.session_id)
        if rec is None:
            return
        prediction = None
        try:  # what this server's loader does with the session's sidecar (headers; a cached v2 hash)
            from app.sessions.behaviour import predict_for_target

            prediction = predict_for_target(self._svc.target, Path(rec.save_dir) / rec.state_file, note.n_restored,
                                            compute_hash=False)
        except OSError as exc:
            log.info("slot %d: no sidecar prediction for '%s': %s", slot, rec.name, exc)
        exp = watcher.expect(slot, note.n_restored, rec.name, note.sidecar_status or None,
                             build_persists=note.build_persists, ctx_checkpoints=note.ctx_checkpoints,
                             sidecar_count=note.sidecar_count, behaviour=self._svc.target.behaviour,
                             prediction=prediction, parked_positions=parked_positions(rec.parked_files))
        exp.since = note.created_at  # lines read after the restore belong to the query being judged
        self._armed[slot] = note
        log.debug("slot %d: judging the next task for the restore of '%s' (%d tokens)", slot, rec.name,
                  note.n_restored)

    def drop_stale(self) -> list[PendingVerdict]:
        """Drop the notes of this profile older than the server's start."""
        started = self.server_started_at() if self.server_started_at else None
        if started is None:
            return []
        try:
            stale = [n for n in self._svc.catalog.pending_verdicts(self._profile, server_url=self._svc.target.url)
                     if n.created_at < started]
            for note in stale:
                self._drop(note, "the server restarted since (the restored tokens are gone)")
        except Exception:
            log.exception("cannot drop the stale restores waiting for a verdict of profile '%s'", self._profile)
            return []
        return stale

    def _drop(self, note: PendingVerdict, why: str) -> None:
        if self._svc.catalog.drop_pending_verdict(note.id):
            self._dropped(note, why)

    def _dropped(self, note: PendingVerdict, why: str) -> None:
        rec = self._svc.catalog.get_by_id(note.session_id)
        name = f"'{rec.name}'" if rec else f"#{note.session_id}"
        log.warning("no verdict for the restore of session %s into slot %d of '%s' (%s): %s", name, note.slot_id,
                    note.profile, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(note.created_at)), why)

    def settle(self, slot: int, verdict: Verdict) -> str | None:
        """The watcher judged ``slot``'s task: write the verdict and the time saved, once.
        Returns the session's current name (None when this service armed no note)."""
        note = self._armed.pop(slot, None)
        if note is None:
            return None
        catalog = self._svc.catalog
        try:
            saved = time_saved(verdict, catalog.prefill_rate(self._profile))
            if not catalog.settle_pending_verdict(note.id, verdict.kind, verdict.reason, saved):
                log.info("slot %d: the verdict of this restore was written already (another watcher judged it)",
                         slot)
            rec = catalog.get_by_id(note.session_id)
        except Exception:
            log.exception("slot %d: cannot write the verdict %s of session %s", slot, verdict.kind, note.session_id)
            return None
        return rec.name if rec else None
