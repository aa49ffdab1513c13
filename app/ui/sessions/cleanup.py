"""The Sessions tab's housekeeping: rename, delete, "Delete older than…", show in folder.

A :class:`~app.ui.sessions.panel.SessionsPanel` mixes :class:`SessionCleanup` in.
With a server connected these go through the session service (one slot
operation at a time); without one, straight to the catalog.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from pathlib import Path

from PySide6.QtCore import QUrl
from PySide6.QtGui import QDesktopServices

from app.sessions.records import cutoff, delete_older_than, older_than, usage_of
from app.store.catalog import CatalogError, SessionRecord
from app.ui.sessions.dialogs import answer, ask_new_name, chosen_days, days_dialog
from app.ui.sessions.model import _size, _when


class SessionCleanup:
    """Rename, delete, delete older, show in folder (a mixin of the panel)."""

    # -- rename, delete, folder ---------------------------------------------
    def _on_rename(self) -> None:
        rec = self.selected()
        if rec is None:
            return
        new = ask_new_name(self, rec.name)
        if new is not None:
            self.rename(rec.name, new, rec.profile)

    def rename(self, old: str, new: str, profile: str | None = None) -> bool:
        from app.sessions.records import rename_session

        try:
            if self.service is not None:
                self.service.rename(old, new, profile)
            else:
                rename_session(self.catalog, old, new, profile)
                self._on_service_changed()
        except (CatalogError, LookupError, ValueError) as e:
            self._say(f"Rename: {e}", ok=False, label="Rename")
            return False
        self.select(new)
        return True

    def _on_delete(self) -> None:
        rec = self.selected()
        if rec is None:
            return

        async def confirm_then_delete():
            if await self._confirmed("Delete session", f"Delete '{rec.name}' ({rec.n_tokens:,} tokens) and its "
                                                       "files?"):
                self.delete(rec.name, rec.profile)

        self.spawn(confirm_then_delete())

    def delete(self, name: str, profile: str | None = None) -> bool:
        from app.sessions.records import delete_session

        try:
            if self.service is not None:
                removed = self.service.delete(name, profile)
            else:
                removed = delete_session(self.catalog, name, profile)
                self._on_service_changed()
        except (CatalogError, LookupError, ValueError, OSError) as e:
            self._say(f"Delete: {e}", ok=False, label="Delete")
            return False
        self._say(f"Deleted '{name}' ({len(removed)} files).", label="Delete")
        return True

    async def delete_older(self) -> list[SessionRecord] | None:
        """'Delete older than…': ask the days, confirm with the count and the space, delete.

        The sessions listed (this server's profile when connected, else all)
        last parked before the cutoff go, each as a single delete does it.
        Returns those deleted; None when the user cancelled.
        """
        self.delete_old_button.setEnabled(False)  # one clean-up at a time
        try:
            return await self._delete_older()
        finally:
            if not self._closed:
                self.delete_old_button.setEnabled(True)

    async def _delete_older(self) -> list[SessionRecord] | None:
        label = "Delete older"
        days = self.ask_days()
        if inspect.isawaitable(days):
            days = await days
        if days is None or self._closed:
            return None
        profile, now = self.profile_name, time.time()
        before = _when(cutoff(days, now))
        doomed = older_than(self.catalog, days, profile, now=now)
        if not doomed:
            self._say(f"No session was parked before {before}: nothing to delete.", label=label)
            return []
        u = usage_of(doomed)
        plural = "s" if u.sessions != 1 else ""
        if not await self._confirmed("Delete older sessions", f"Delete {u.sessions:,} session{plural} "
                                     f"({_size(u.total_bytes)}) parked before {before}?\n\nTheir state files "
                                     "and sidecars are removed from disk."
                                     + ("\n\nThe filter does not apply: this counts every session listed."
                                        if self.filter.text().strip() else "")):
            self._say(f"{label}: cancelled.", label=label)
            return None
        try:
            # off the GUI thread: unlinking a thousand multi-GB files takes a while on some filesystems
            removed = await asyncio.to_thread(delete_older_than, self.catalog, days, profile, now=now)
        except (CatalogError, OSError) as e:
            self._on_service_changed()
            self._say(f"{label}: {e}", ok=False, label=label)
            return None
        self._on_service_changed()
        freed = usage_of(removed)
        kept = len(doomed) - len(removed)
        self._say(f"Deleted {freed.sessions:,} session{'s' if freed.sessions != 1 else ''} parked before {before} "
                  f"({_size(freed.total_bytes)} freed)."
                  + (f" {kept} changed meanwhile and were kept." if kept else ""), label=label)
        return removed

    async def _ask_days(self) -> int | None:
        """The number of days for 'Delete older than…' (None: cancelled), without a nested event loop."""
        self.days_dialog = dlg = days_dialog(self)
        try:
            return await answer(dlg, lambda r: chosen_days(dlg, r))
        finally:
            self.days_dialog = None

    def _on_folder(self) -> None:
        rec = self.selected()
        folder = Path(rec.save_dir) if rec else (self.service.save_dir if self.service else None)
        if folder:
            QDesktopServices.openUrl(QUrl.fromLocalFile(str(folder)))
