"""Move to… / Copy to… on a session row of the Sessions tab (issue #20).

The menu lists the other servers of the server list that run from a profile
(:func:`app.jobs.server_list.move_targets`); the move itself is
:func:`app.jobs.move.move_session` (the compatibility rules first, then the copy with its
SHA-256 check and the atomic rename at the target), with a progress bar that can cancel it
and the outcome said on the tab's message line (:func:`app.jobs.server_list.move_verdict`).
"""

from __future__ import annotations

import logging

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtWidgets import QMenu, QProgressDialog

from app.jobs.server_list import THIS_MACHINE, ServerRow, move_targets, move_verdict
from app.store.catalog import SessionRecord

log = logging.getLogger(__name__)


class SessionMoves(QObject):
    sig_done = Signal(bool, str)  # ok, the outcome as said to the user

    def __init__(self, sessions_panel, server_list_panel):
        super().__init__(sessions_panel)
        self.panel = sessions_panel
        self.servers = server_list_panel.servers
        self.progress: QProgressDialog | None = None
        self.menu: QMenu | None = None
        table = sessions_panel.table
        table.setContextMenuPolicy(Qt.CustomContextMenu)
        table.customContextMenuRequested.connect(self._on_menu)

    def targets(self, rec: SessionRecord) -> list[ServerRow]:
        """Where ``rec`` may go: every other server of the list that runs from a profile."""
        return [r for r in move_targets(self.servers.rows(), None)
                if not (r.host == THIS_MACHINE and r.profile == rec.profile)]

    def menu_for(self, rec: SessionRecord) -> QMenu:
        menu = QMenu(self.panel)
        for title, copy in (("Move to…", False), ("Copy to…", True)):
            sub = menu.addMenu(title)
            targets = self.targets(rec)
            for row in targets:
                label = row.name if row.host == THIS_MACHINE else f"{row.name} on {row.host}"
                action = sub.addAction(f"{label} ({row.state})")
                action.triggered.connect(lambda _=False, row=row, copy=copy: self.panel.spawn(
                    self.move_or_copy(rec, row, copy=copy), f"{'copying' if copy else 'moving'} '{rec.name}'"))
            if not targets:
                sub.addAction("no other server runs from a profile").setEnabled(False)
        return menu

    def _on_menu(self, pos) -> None:
        index = self.panel.table.indexAt(pos)
        if not index.isValid():
            return
        self.panel.table.selectRow(index.row())
        rec = self.panel.selected()
        if rec is None:
            return
        self.menu = self.menu_for(rec)
        self.menu.popup(self.panel.table.viewport().mapToGlobal(pos))

    def endpoint(self, row: ServerRow):
        """The move's endpoint for a row: a profile here; a remote host's source gives its own."""
        from app.jobs.move import LocalEndpoint, MoveError

        if row.host == THIS_MACHINE:
            return LocalEndpoint(self.panel.catalog, row.profile)
        source = next((s for s in self.servers.sources if s.name == row.host), None)
        make = getattr(source, "move_endpoint", None)
        if make is None:
            raise MoveError(f"moving to {row.host} is not possible from the window yet")
        return make(row)

    async def move_or_copy(self, rec: SessionRecord, row: ServerRow, *, copy: bool) -> tuple[bool, str]:
        """Move (or copy) ``rec`` to ``row``'s profile, with a progress bar; the outcome is said."""
        from app.jobs.move import LocalEndpoint, MoveCancelled, MoveError, move_session

        verb = "Copying" if copy else "Moving"
        self.progress = dialog = QProgressDialog(f"{verb} '{rec.name}' to '{row.name}'…", "Cancel", 0, 1000,
                                                 self.panel)
        dialog.setWindowTitle(f"{verb} a parked session")
        dialog.setWindowModality(Qt.NonModal)
        dialog.setMinimumDuration(0)
        dialog.setAutoClose(False)
        dialog.setAutoReset(False)
        dialog.show()

        def on_progress(done: int, total: int) -> None:
            if dialog.wasCanceled():
                raise MoveCancelled("cancelled")
            dialog.setValue(int(done * 1000 / max(total, 1)))

        try:
            result = await move_session(LocalEndpoint(self.panel.catalog, rec.profile), rec.name, self.endpoint(row),
                                        keep_source=copy, on_progress=on_progress)
        except MoveError as e:
            ok, text = move_verdict(rec.name, row, copy=copy, error=e)
        else:
            ok, text = move_verdict(rec.name, row, copy=copy, result=result)
        finally:
            dialog.close()
            dialog.deleteLater()
            self.progress = None
        self.panel._say(text, ok=ok, label="Move")
        self.panel.refresh()
        self.panel.sig_changed.emit()
        self.sig_done.emit(ok, text)
        return ok, text
