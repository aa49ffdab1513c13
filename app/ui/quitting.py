"""How the window closes: never an orphan server, and the chats parked first when asked.

The quit dialog, SIGTERM/SIGHUP, the desktop session's end and a quit from outside all end in
the server service's one park-then-stop (:meth:`app.ui.servers.controller.ServerController.park_then_stop`),
each with its :class:`app.core.lifecycle.StopTrigger`. Mixed into the main window.
"""

from __future__ import annotations

from PySide6.QtGui import QCloseEvent
from PySide6.QtWidgets import QMessageBox, QSystemTrayIcon

from app.core.background import track
from app.core.lifecycle import StopTrigger


class QuitsInOrder:
    # -- closing ----------------------------------------------------------
    def closeEvent(self, event: QCloseEvent) -> None:
        """Normal quit never leaves an orphan server, and offers to park the chats first."""
        task = getattr(self, "_quit_task", None)
        if task is not None and not task.done():
            event.ignore()  # parking and stopping (a quit, a logout): the window closes when that is done
            return
        if self.keep_in_tray and self.tray is not None and not getattr(self, "_closing", False) \
                and QSystemTrayIcon.isSystemTrayAvailable():
            event.ignore()
            self.save_layout()
            self.hide()
            self.tray.notify("KV Valet keeps running", "The server and its chats go on; quit from the tray icon.")
            return
        if self.controller.owned_running() and not getattr(self, "_closing", False):
            event.ignore()
            if not getattr(self, "confirm_quit", True):
                self._quit(park=False)
            elif self.quit_box is None:
                self._ask_quit()
            return
        self.save_layout()
        self.sig_closed.emit()
        event.accept()

    def _ask_quit(self) -> None:
        """Park all & quit / Quit / Cancel, asked without a nested event loop (open(), not exec())."""
        box = QMessageBox(QMessageBox.Question, "Quit KV Valet",
                          "Quitting stops the server. Slots that are not parked lose their chats; "
                          "\"Park all & quit\" saves every slot that holds tokens first, and the next start "
                          "offers to resume them.", QMessageBox.NoButton, self)
        self.quit_park_button = box.addButton("Park all && quit", QMessageBox.AcceptRole)
        self.quit_button = box.addButton("Quit", QMessageBox.DestructiveRole)
        box.addButton(QMessageBox.Cancel)
        box.setDefaultButton(self.quit_park_button)

        def answered(_result) -> None:
            clicked = box.clickedButton()
            self.quit_box = None
            box.deleteLater()
            if clicked is self.quit_park_button:
                self._quit(park=True)
            elif clicked is self.quit_button:
                self._quit(park=False)

        box.finished.connect(answered)
        self.quit_box = box
        box.open()

    def _quit(self, park: bool, trigger: StopTrigger = StopTrigger.QUIT) -> None:
        if getattr(self, "_closing", False):
            return
        self._closing = True
        work = self.park_then_shutdown(trigger) if park else self.shutdown()
        self._quit_task = task = track(work, f"quitting ({trigger})")
        task.add_done_callback(lambda t: self.close())

    def park_and_quit(self) -> None:
        """SIGTERM / SIGHUP (a logout, a reboot): park every slot, then quit. A second one quits at once."""
        if getattr(self, "_closing", False):
            if getattr(self, "_session_ending", False):
                self._session_ending = False  # the logout's own SIGTERM, after its commit-data request: same park
                return
            self.controller.service.interrupt_park()
            return
        self._quit(park=True, trigger=StopTrigger.SIGNAL)

    def session_ending(self, manager=None) -> None:
        """The desktop session ends (Qt's commitDataRequest, before the logout goes on): park every
        slot and stop the server, as for SIGTERM. The SIGTERM that usually follows joins this park
        instead of cutting it short; another one after that quits at once."""
        if manager is not None:
            from PySide6.QtGui import QSessionManager

            manager.setRestartHint(QSessionManager.RestartNever)  # the user starts KV Valet, not the session
        if getattr(self, "_closing", False):
            return
        self._session_ending = True
        self._quit(park=True, trigger=StopTrigger.SESSION_END)

    async def park_then_shutdown(self, trigger: StopTrigger = StopTrigger.QUIT) -> None:
        """The server service's one park-then-stop (bounded by the preferences' park timeout and
        by a second signal), then the panels close."""
        for report in await self.controller.park_then_stop_all(trigger):  # every server launched here
            if report.interrupted or report.error:
                self.show_message(f"Parking before quitting was cut short by {report.interrupted}"
                              if report.interrupted else f"Could not park before quitting: {report.error}")
        await self.shutdown()

    async def shutdown(self) -> None:
        guard = getattr(self, "shutdown_guard", None)
        if guard is not None:
            guard.close()  # the lock, its signals and its bus connection: nothing of the window left on D-Bus
        for name in ("loadcheck_dialog", "build_dialog"):  # a build in progress is cancelled (nothing cached)
            dialog = getattr(self, name, None)
            if dialog is not None:
                await dialog.aclose()
        for panel in self.extra_panels:
            closer = getattr(panel, "aclose", None)
            if closer:
                await closer()
        await self.controller.aclose()
