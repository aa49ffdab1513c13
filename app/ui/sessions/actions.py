"""The Sessions tab's workflows: park, resume, check and A/B, and "Resume all".

A :class:`~app.ui.sessions.panel.SessionsPanel` mixes :class:`SessionActions`
in. Each action asks the session service, asks the user when the service says
a workflow needs confirmation, and says the outcome on the panel's message line
(``_say``, which also emits ``sig_done``).
"""

from __future__ import annotations

from app.core.verdict import Verdict, VerdictKind
from app.sessions.resume import ResumeFailed, ResumeNeedsConfirmation, ResumeRefused
from app.sessions.service import NeedsConfirmation, ServiceError
from app.ui.sessions.dialogs import history_dialog
from app.ui.sessions.model import _size


class SessionActions:
    """Park, resume, check (a mixin of the panel)."""

    # -- park --------------------------------------------------------------
    def _on_park(self) -> None:
        self.spawn(self.park(self._chosen_slot(), self.name.text().strip() or None))

    async def park(self, slot_id: int | None, name: str | None = None):
        if not await self._ensure_save_dir():
            return None
        label = "Park" + (f" slot {slot_id}" if slot_id is not None else "")
        try:
            result = await self.sessions.park(slot_id, name)
        except ServiceError as e:
            self._say(f"{label}: {e}", ok=False, label=label)
            return None
        rec = result.record
        self.select(rec.name)
        text = (f"Parked slot {result.slot_id} as '{rec.name}': {rec.n_tokens:,} tokens, "
                f"{_size(rec.state_size + rec.sidecar_size)} in {rec.save_ms:,.0f} ms. "
                f"Sidecar: {result.sidecar.reason if result.sidecar else '-'}")
        return await self._done(result, text, label)

    async def _done(self, result, text: str, label: str):
        """Say a park's or resume's result with its warnings, then show the slots as they are now."""
        if result.warnings:
            text += "\n⚠ " + "\n⚠ ".join(result.warnings)
        self._say(text, ok=True, label=label)
        await self._read_slots()
        return result

    async def park_all(self, remember: bool = False):
        """Park all; ``remember`` (before a suspend) also writes the resume plan."""
        if not await self._ensure_save_dir():
            return []
        try:
            results = await self.sessions.park_all(remember=remember)
        except ServiceError as e:
            self._say(f"Park all: {e}", ok=False, label="Park all")
            return []
        self._report_parks("Park all", results)
        await self._read_slots()
        return results

    async def park_all_and_stop(self):
        if self.sessions is None or not await self._ensure_save_dir():
            return None
        label = "Park all & stop"
        try:
            outcome = await self.sessions.park_all_and_stop()
        except ServiceError as e:
            self._say(f"{label}: {e}", ok=False, label=label)
            return None
        self._report_parks(label, outcome.results,
                           "" if outcome.stopped else "\nThe server keeps running: a slot could not be parked.")
        return outcome

    def _report_parks(self, label: str, results, tail: str = "") -> None:
        lines = [(f"slot {r.slot_id}: '{r.record.name}' {r.record.n_tokens:,} tokens, sidecar {r.record.sidecar_status}"
                  if r.ok else f"slot {r.slot_id}: failed: {r.error}") for r in results]
        self._say(f"{label}: " + ("; ".join(lines) if lines else "no slot holds tokens") + tail,
                  ok=all(r.ok for r in results) and not tail, label=label)

    # -- resume ------------------------------------------------------------
    def _on_resume(self) -> None:
        rec = self.selected()
        if rec is None:
            self._say("Select a session to resume.", ok=False)
            return
        self.spawn(self.resume(rec.name, self._chosen_slot()))

    async def resume(self, name: str, slot_id: int | None = None, force: bool = False):
        label = f"Resume '{name}'"
        if self.sessions is None:
            self._say(f"{label}: start or attach to a server first.", ok=False, label=label)
            return None
        try:
            result = await self.sessions.resume(name, slot_id, force=force)
        except ResumeRefused as e:
            self._say(f"{label}: cannot resume: " + "; ".join(e.reasons), ok=False, label=label)
            return None
        except ResumeNeedsConfirmation as e:
            if not await self._confirmed("Resume session", "\n\n".join(e.warnings) + "\n\nResume anyway?"):
                self._say(f"{label}: cancelled.", ok=True, label=label)
                return None
            return await self.resume(name, slot_id, force=True)
        except ResumeFailed as e:
            self._say(f"{label}: {e}", ok=False, label=label)
            return None
        text = (f"Resumed '{result.record.name}' into slot {result.slot_id}: {result.n_restored:,} tokens in "
                f"{result.restore_ms:,.0f} ms. The verdict comes with the next query on that slot.")
        return await self._done(result, text, label)

    async def resume_planned(self):
        if self.sessions is None:
            return []
        outcomes = await self.sessions.resume_all()
        if all(o.ok for o in outcomes):
            self.resume_all_button.hide()
        self._say("Resume all: " + "; ".join(
            f"{o.entry.session} → slot {o.entry.slot}: " + ("ok" if o.ok else o.error) for o in outcomes),
            ok=all(o.ok for o in outcomes), label="Resume all")
        await self._read_slots()
        return outcomes

    def _on_verdict(self, slot_id: int, session: str | None, verdict: Verdict) -> None:
        self.sig_verdict.emit(slot_id, session or "", verdict)
        self._say(f"Slot {slot_id} ('{session}'): {verdict.kind} — {verdict.reason}",
                  ok=verdict.kind is not VerdictKind.DISCARDED, label="verdict")

    # -- check and A/B -----------------------------------------------------
    def _on_check(self, ab: bool = False) -> None:
        rec = self.selected()
        if rec is None or self.sessions is None:
            self._say("Select a session to check.", ok=False)
            return
        self.spawn(self.check(rec.name, self._chosen_slot(), ab=ab))

    async def check(self, name: str, slot_id: int | None = None, *, ab: bool = False, baseline: bool = False,
                    force: bool = False):
        """'Check resume' (two probes) or the A/B with the sidecar hidden; shows the report."""
        from app.ui.dialogs.check import CheckDialog

        what = "A/B check" if ab else "Check resume"
        label = f"{what} of '{name}'"
        if self.sessions is None:
            self._say(f"{label}: start or attach to a server first.", ok=False, label=label)
            return None
        rec = self.catalog.get(self.sessions.profile_name, name)
        n = f"{rec.n_tokens:,}" if rec else "all the"
        self._say(f"{label}: running… (a re-prefill of {n} tokens can take a while)", label=label)
        try:
            report = await (self.sessions.ab(name, slot_id, force=force, baseline=baseline) if ab
                            else self.sessions.check(name, slot_id, force=force))
        except NeedsConfirmation as e:
            if not await self._confirmed(what, "\n\n".join(e.warnings) + "\n\nGo on?"):
                self._say(f"{label}: cancelled.", ok=True, label=label)
                return None
            return await self.check(name, slot_id, ab=ab, baseline=baseline, force=True)
        except ServiceError as e:
            self._say(f"{label}: {e}", ok=False, label=label)
            return None
        verdict = report.row("with sidecar").verdict if ab else report.verdict
        self._say(f"{label} in slot {report.slot_id}: done — {verdict.kind}: {verdict.reason}", ok=True, label=label)
        rec = self.catalog.get(self.sessions.profile_name, name)
        self.report_dialog = CheckDialog(report, self, history=self.catalog.history(rec.id) if rec else None)
        self.report_dialog.show()
        await self._read_slots()
        return report

    def _on_history(self) -> None:
        rec = self.selected()
        if rec is None:
            return
        self.history_dialog = dlg = history_dialog(self, rec.name, self.catalog.history(rec.id))
        dlg.show()

    # -- after a restart or a sleep -------------------------------------------
    def _offer_resume_all(self, plan, auto: bool = True) -> None:
        """Show "Resume all (N)" for a resume plan, or resume at once where the
        preferences or the profile say so (app.settings.auto_resumes) and ``auto``."""
        from app.settings import auto_resumes, load_or_defaults

        if not plan:
            self.resume_all_button.hide()
            return
        profile = getattr(self, "_profile", None)
        if auto and auto_resumes(load_or_defaults()[0].auto_resume, bool(profile and profile.resume_on_start)):
            self.spawn(self.resume_planned())
            return
        self.resume_all_button.setText(f"Resume all ({len(plan)})")
        self.resume_all_button.setToolTip("Parked before the server went away: " + ", ".join(
            f"{e.session} → slot {e.slot}" for e in plan))
        self.resume_all_button.show()

    async def after_wake(self) -> None:
        """Back from a suspend that parked the slots: nothing to do if the chats are still in
        their slots; else offer (or do) "Resume all" for the slots that lost theirs."""
        if self.service is None:
            return  # the server is gone: its next start offers the plan (a host's server did not sleep)
        label = "Back from sleep"
        try:
            lost = await self.service.check_after_wake()
        except ServiceError as e:
            self._say(f"{label}: {e}", ok=False, label=label)
            return
        self._offer_resume_all(lost)
        if lost:
            self._say(f"{label}: {len(lost)} slot(s) lost their chat while the computer slept; they were parked "
                      "before it: " + ", ".join(f"'{e.session}' → slot {e.slot}" for e in lost), ok=False, label=label)
        else:
            self._say(f"{label}: every slot still holds its chat; nothing to resume.", ok=True, label=label)
