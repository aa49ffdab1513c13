"""The Sessions tab's housekeeping: rename, delete, "Delete older than…".

A :class:`Housekeeping` is a helper object of the
:class:`~app.ui.sessions.controller.SessionsController` (``controller.housekeeping``):
it goes through the controller's public interface only (``service``, ``catalog``,
``profile_name``, ``say``, ``questions``, ``notify_changed``). With a server
connected these go through the session service (one slot operation at a time);
without one, straight to the catalog.
"""

from __future__ import annotations

import asyncio
import inspect
import time

from app.sessions.records import cutoff, delete_older_than, delete_session, older_than, rename_session, usage_of
from app.store.catalog import CatalogError, SessionRecord
from app.ui.operations import Operation
from app.ui.sessions.controller import SessionsController
from app.ui.sessions.dialogs import answer, chosen_days, days_dialog
from app.ui.sessions.model import _size, _when


class Housekeeping:
    def __init__(self, controller: SessionsController):
        self.controller = controller
        # ask_days() -> int or None (or awaitable): "Delete older than…"'s first question; a test may replace it.
        self.ask_days = self._ask_days
        self.days_dialog = None

    def rename(self, old: str, new: str, profile: str | None = None) -> bool:
        c = self.controller
        try:
            if c.service is not None:
                c.service.rename(old, new, profile)
            else:
                rename_session(c.catalog, old, new, profile)
                c.notify_changed()
        except (CatalogError, LookupError, ValueError) as e:
            c.say(f"Rename: {e}", ok=False, op=Operation.RENAME)
            return False
        return True

    async def confirm_then_delete(self, rec: SessionRecord) -> bool:
        if not await self.controller.questions.confirmed(
                "Delete session", f"Delete '{rec.name}' ({rec.n_tokens:,} tokens) and its files?"):
            return False
        return self.delete(rec.name, rec.profile)

    def delete(self, name: str, profile: str | None = None) -> bool:
        c = self.controller
        try:
            if c.service is not None:
                removed = c.service.delete(name, profile)
            else:
                removed = delete_session(c.catalog, name, profile)
                c.notify_changed()
        except (CatalogError, LookupError, ValueError, OSError) as e:
            c.say(f"Delete: {e}", ok=False, op=Operation.DELETE)
            return False
        c.say(f"Deleted '{name}' ({len(removed)} files).", op=Operation.DELETE)
        return True

    async def delete_older(self, filtered: bool = False) -> list[SessionRecord] | None:
        """'Delete older than…': ask the days, confirm with the count and the space, delete.

        The sessions listed (this server's profile when connected, else all) last parked
        before the cutoff go, each as a single delete does it (``filtered``: the user has a
        filter typed, which does not apply). Returns those deleted; None when cancelled."""
        c, op = self.controller, Operation.DELETE_OLDER
        days = self.ask_days()
        if inspect.isawaitable(days):
            days = await days
        if days is None or c.closed:
            return None
        profile, now = c.profile_name, time.time()
        before = _when(cutoff(days, now))
        doomed = older_than(c.catalog, days, profile, now=now)
        if not doomed:
            c.say(f"No session was parked before {before}: nothing to delete.", op=op)
            return []
        u = usage_of(doomed)
        plural = "s" if u.sessions != 1 else ""
        if not await c.questions.confirmed("Delete older sessions", f"Delete {u.sessions:,} session{plural} "
                                           f"({_size(u.total_bytes)}) parked before {before}?\n\nTheir state files "
                                           "and sidecars are removed from disk."
                                           + ("\n\nThe filter does not apply: this counts every session listed."
                                              if filtered else "")):
            c.say(f"{op.value}: cancelled.", op=op)
            return None
        try:
            # off the GUI thread: unlinking a thousand multi-GB files takes a while on some filesystems
            removed = await asyncio.to_thread(delete_older_than, c.catalog, days, profile, now=now)
        except (CatalogError, OSError) as e:
            c.notify_changed()
            c.say(f"{op.value}: {e}", ok=False, op=op)
            return None
        c.notify_changed()
        freed = usage_of(removed)
        kept = len(doomed) - len(removed)
        c.say(f"Deleted {freed.sessions:,} session{'s' if freed.sessions != 1 else ''} parked before {before} "
              f"({_size(freed.total_bytes)} freed)." + (f" {kept} changed meanwhile and were kept." if kept else ""),
              op=op)
        return removed

    async def _ask_days(self) -> int | None:
        """The number of days for 'Delete older than…' (None: cancelled), without a nested event loop."""
        self.days_dialog = dlg = days_dialog(self.controller.questions.parent)
        try:
            return await answer(dlg, lambda r: chosen_days(dlg, r))
        finally:
            self.days_dialog = None
