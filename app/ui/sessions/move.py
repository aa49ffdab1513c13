"""Move to… / Copy to… on a session row of the Sessions tab, and drag and drop (issue #20).

The menu lists the other servers of the server list that run from a profile
(:func:`app.servers.server_list.move_targets`); a session row dragged onto a server row asks
how (app.ui.dialogs.move.MoveDialog: move or copy, then restore there and judge). The
source is this machine's catalog, or the host whose server the Sessions tab shows
(app.ui.servers.remote_view). The move itself is
:func:`app.move.transfer.move_session` (the compatibility rules first, then the copy with its
SHA-256 check and the atomic rename at the target), with a progress bar that can cancel it
and the outcome said on the tab's message line (:func:`app.servers.server_list.move_verdict`),
with the restore's verdict when asked (app.servers.restore_after_move.restore_and_judge).
"""

from __future__ import annotations

import logging

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtWidgets import QMenu, QProgressDialog

from app.core.states import ServerState
from app.servers.server_list import THIS_MACHINE, ServerRow, move_cancelled, move_targets, move_verdict
from app.store.catalog import SessionRecord
from app.ui.dialogs.move import MoveDialog, ServerDropTarget, SessionDragger, session_mime
from app.ui.sessions.dialogs import answer
from app.ui.sessions.controller import Operation

log = logging.getLogger(__name__)


class SessionMoves(QObject):
    sig_done = Signal(bool, str)  # ok, the outcome as said to the user
    sig_asking = Signal(object)  # the MoveDialog of a drop, open now

    def __init__(self, sessions_panel, server_list_panel):
        super().__init__(sessions_panel)
        self.panel = sessions_panel
        self.list_panel = server_list_panel
        self.servers = server_list_panel.servers
        self.progress: QProgressDialog | None = None
        self.menu: QMenu | None = None
        self.move_dialog: MoveDialog | None = None
        table = sessions_panel.table
        table.setContextMenuPolicy(Qt.CustomContextMenu)
        table.customContextMenuRequested.connect(self._on_menu)
        self.dragger = SessionDragger(table, sessions_panel.selected, self.mime_of)
        self.drop_target = ServerDropTarget(server_list_panel.table, self._target_at)
        self.drop_target.sig_dropped.connect(self.on_drop)

    def _source_host(self) -> str:
        """Where the sessions the tab shows are: this machine, or the host of the server shown."""
        shown = self.panel.controller.sessions
        return shown.host if shown is not None and shown.host is not None else THIS_MACHINE

    def targets(self, rec: SessionRecord) -> list[ServerRow]:
        """Where ``rec`` may go: every other server of the list that runs from a profile."""
        here = self._source_host()
        return [r for r in move_targets(self.servers.rows(), None)
                if not (r.host == here and r.profile == rec.profile)]

    # -- drag and drop ----------------------------------------------------------------------
    def mime_of(self, rec: SessionRecord):
        return session_mime(rec.name, rec.profile, self._source_host())

    def _target_at(self, pos) -> str | None:
        index = self.list_panel.table.indexAt(pos)
        if not index.isValid():
            return None
        return self.list_panel.model.rows[index.row()].target_id

    def on_drop(self, session: dict, target_id: str) -> None:
        """A session row dropped on a server row: ask how, then move (or copy) it there."""
        rec = next((r for r in self.panel.source_model.records if r.name == session.get("name")
                    and r.profile == session.get("profile")), None)
        row = self.servers.row(target_id)
        if rec is None or row is None or session.get("host") != self._source_host():
            self.panel.say("That session is no longer listed here: drop it again from the Sessions tab.", ok=False)
            return
        if row.target_id not in {r.target_id for r in self.targets(rec)}:
            self.panel.say(f"'{rec.name}' cannot go to '{row.name}': it is there already, or that server "
                           "does not run from a profile.", ok=False)
            return
        self.panel.controller.spawn(self.ask_and_move(rec, row), f"moving '{rec.name}' to {target_id}")

    async def ask_and_move(self, rec: SessionRecord, row: ServerRow) -> tuple[bool, str] | None:
        self.move_dialog = dlg = MoveDialog(self.panel, rec.name, row)
        self.sig_asking.emit(dlg)  # answered after this task's next step opened it
        try:
            choice = await answer(dlg, dlg.choice)
        finally:
            self.move_dialog = None
        if choice is None:
            return None
        copy, restore, output_check = choice
        return await self.move_or_copy(rec, row, copy=copy, restore=restore, output_check=output_check)

    def menu_for(self, rec: SessionRecord) -> QMenu:
        menu = QMenu(self.panel)
        for title, copy in (("Move to…", False), ("Copy to…", True)):
            sub = menu.addMenu(title)
            targets = self.targets(rec)
            for row in targets:
                label = row.name if row.host == THIS_MACHINE else f"{row.name} on {row.host}"
                action = sub.addAction(f"{label} ({row.state})")
                action.triggered.connect(lambda _=False, row=row, copy=copy: self.panel.controller.spawn(
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
        return self._endpoint_at(row)

    def source_endpoint(self, rec: SessionRecord):
        """Where ``rec`` is: this machine's catalog, or the host whose server the tab shows."""
        host = self._source_host()
        return self._endpoint_at(ServerRow(f"{host}:{rec.profile}", rec.profile, ServerState.READY, host=host,
                                           profile=rec.profile))

    def _endpoint_at(self, row: ServerRow):
        from app.move.endpoints import LocalEndpoint
        from app.move.values import MoveError

        if row.host == THIS_MACHINE:
            return LocalEndpoint(self.panel.controller.catalog, row.profile)
        source = next((s for s in self.servers.sources if s.name == row.host), None)
        make = getattr(source, "move_endpoint", None)
        if make is None:
            raise MoveError(f"moving to {row.host} is not possible from the window yet")
        return make(row)

    async def move_or_copy(self, rec: SessionRecord, row: ServerRow, *, copy: bool,
                           restore: bool = False, output_check: bool = True) -> tuple[bool, str]:
        """Move (or copy) ``rec`` to ``row``'s profile, with a progress bar whose Cancel stops it; the
        outcome is said, with the verdict of a restore there when ``restore``. A cancel that lands
        after the target listed the session says that both copies remain (``on_committed``)."""
        import asyncio

        from app.move.transfer import move_session
        from app.move.values import MoveCancelled, MoveError

        verb = "Copying" if copy else "Moving"
        self.progress = dialog = QProgressDialog(f"{verb} '{rec.name}' to '{row.name}'…", "Cancel", 0, 1000,
                                                 self.panel)
        dialog.setWindowTitle(f"{verb} a parked session")
        dialog.setWindowModality(Qt.NonModal)
        dialog.setMinimumDuration(0)
        dialog.setAutoClose(False)
        dialog.setAutoReset(False)
        task, committed, cancel = asyncio.current_task(), [], {"asked": False, "moving": True}

        def on_cancel() -> None:  # Cancel, Escape or the close box, while the move runs: stop it
            if not cancel["moving"] or cancel["asked"]:
                return
            cancel["asked"] = True
            if not committed:  # landing in the commit, the move waits for its outcome: on_committed says it
                task.cancel()  # (once listed there, the source's deletion runs on: stopping it could lie)

        dialog.canceled.connect(on_cancel)
        dialog.show()

        def on_progress(done: int, total: int) -> None:
            if dialog.wasCanceled():
                raise MoveCancelled("cancelled")
            dialog.setValue(int(done * 1000 / max(total, 1)))

        result, target = None, None
        try:
            target = self.endpoint(row)
            result = await move_session(self.source_endpoint(rec), rec.name, target, keep_source=copy,
                                        on_progress=on_progress, on_committed=committed.append)
        except MoveError as e:
            ok, text = move_verdict(rec.name, row, copy=copy, error=e)
        except asyncio.CancelledError:
            if not cancel["asked"]:
                raise  # the window closes: not the user's Cancel
            task.uncancel()
            ok, text = move_cancelled(rec.name, row, copy=copy, committed=committed[0] if committed else None)
        else:
            ok, text = move_verdict(rec.name, row, copy=copy, result=result)
            if cancel["asked"]:
                text += " (Cancel came after the session was listed there: too late to stop.)"
        finally:
            cancel["moving"] = False  # closing the dialog emits canceled: not a cancel any more
            dialog.close()
            dialog.deleteLater()
            self.progress = None
        if result is not None and restore and not cancel["asked"]:
            text += " " + await self._restore(result.record.name, row, output_check=output_check)
        self.panel.say(text, ok=ok, op=Operation.MOVE)
        self.panel.refresh()
        if self.panel.controller.sessions is not None:
            await self.panel.controller.sessions.reload()  # the list without the session moved away (a host's too)
        self.panel.controller.notify_changed()
        self.sig_done.emit(ok, text)
        return ok, text

    async def _restore(self, name: str, row: ServerRow, *, output_check: bool = True) -> str:
        """Restore ``name`` at ``row``'s server and judge a first query: the verdict, or why not."""
        from app.servers.restore_after_move import restore_and_judge, verdict_text

        self.panel.set_busy(True)
        try:
            sessions = await self.servers.sessions_of(row, self.list_panel.controller.service)
            restored = await restore_and_judge(sessions, name, output_check=output_check)
        except Exception as e:  # report: the move stands; the restore's failure is said and logged
            log.warning("restore of %r at %s after the move failed", name, row.target_id, exc_info=True)
            return f"The restore there failed: {e}"
        finally:
            self.panel.set_busy(False)
        self.last_restore = restored
        return verdict_text(restored)
