"""The Sessions tab's proofs: "Check resume…" (two probes) and "A/B check…" (the sidecar hidden).

A :class:`Checks` is a helper object of the
:class:`~app.ui.sessions.controller.SessionsController` (``panel.checks``): it goes through
the controller's public interface only, and the controller's ``checked`` signal carries the
report (the panel opens it in :class:`app.ui.dialogs.check.CheckDialog`).
"""

from __future__ import annotations

from app.core.confirmation import NeedsConfirmation
from app.core.verdict import VerdictKind
from app.sessions.service import ServiceError
from app.ui.operations import Operation
from app.ui.sessions.controller import SessionsController


class Checks:
    def __init__(self, controller: SessionsController):
        self.controller = controller

    async def check(self, name: str, slot_id: int | None = None, *, ab: bool = False, baseline: bool = False,
                    force: bool = False):
        """'Check resume' (two probes) or the A/B with the sidecar hidden; ``checked`` carries the report."""
        c = self.controller
        op = Operation.AB_CHECK if ab else Operation.CHECK
        what = f"{op.value} of '{name}'"
        if c.sessions is None:
            c.say(f"{what}: start or attach to a server first.", ok=False, op=op)
            return None
        rec = c.catalog.get(c.sessions.profile_name, name)
        n = f"{rec.n_tokens:,}" if rec else "all the"
        c.say(f"{what}: running… (a re-prefill of {n} tokens can take a while)")
        try:
            def progress(text: str) -> None:  # where it is: restarts, restores, "prefilling 12,288 of 32,768 tokens"
                c.say(f"{what}: {text}…")

            report = await (c.sessions.ab(name, slot_id, force=force, baseline=baseline, on_progress=progress) if ab
                            else c.sessions.check(name, slot_id, force=force, on_progress=progress))
        except NeedsConfirmation as e:
            if not await c.questions.confirmed(op.value, "\n\n".join(e.warnings) + "\n\nGo on?"):
                c.say(f"{what}: cancelled.", ok=True, op=op)
                return None
            return await self.check(name, slot_id, ab=ab, baseline=baseline, force=True)
        except ServiceError as e:
            c.say(f"{what}: {e}", ok=False, op=op)
            return None
        verdict = report.row("with sidecar").verdict if ab else report.verdict
        if ab:  # an arm whose output differs from a cold prefill is the news
            verdict = next((r.verdict for r in report.rows if r.verdict.kind is VerdictKind.DIFFERS), verdict)
        c.say(f"{what} in slot {report.slot_id}: done — {verdict.kind}: {verdict.reason}",
              ok=verdict.kind is not VerdictKind.DIFFERS, op=op)
        rec = c.catalog.get(c.sessions.profile_name, name)
        c.checked.emit(report, c.catalog.history(rec.id) if rec else None)
        await c.read_slots()
        return report
