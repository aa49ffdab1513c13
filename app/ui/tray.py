"""The system tray: the server's state, Park all, Resume all, Open, Quit, and notifications.

Each menu entry calls the Sessions tab's public action, and the tray follows the Sessions
controller's typed signals (nothing is decided here, no label is read). Closing the window can
leave KV Valet in the tray (a setting, off by default), so a server and its chats keep going
while the window is away; a park or resume that finishes then, or a resume judged DISCARDED, is
told in a desktop notification.
"""

from __future__ import annotations

from PySide6.QtGui import QAction, QIcon
from PySide6.QtWidgets import QMenu, QSystemTrayIcon

from app.core.verdict import VerdictKind
from app.ui.operations import PARKS_AND_RESUMES


class Tray(QSystemTrayIcon):
    def __init__(self, window, icon: QIcon | None = None):
        super().__init__(icon or window.windowIcon(), window)
        self.window = window
        self.menu = QMenu()
        self.state_action = self.menu.addAction("Server Stopped")
        self.state_action.setEnabled(False)
        self.menu.addSeparator()
        self.park_all_action = self.menu.addAction("Park all")
        self.resume_all_action = self.menu.addAction("Resume all")
        self.menu.addSeparator()
        self.open_action = self.menu.addAction("Open KV Valet")
        self.quit_action = self.menu.addAction("Quit")
        self.setContextMenu(self.menu)
        self.setToolTip("KV Valet")
        self.notifications: list[tuple[str, str]] = []  # (title, text) shown, newest last
        self.notifications_on = True  # the preference "Desktop notifications"

        self.sessions = sessions = window.sessions_panel
        ctl = sessions.controller
        self.park_all_action.triggered.connect(self._park_all)
        self.resume_all_action.triggered.connect(self._resume_all)
        self.open_action.triggered.connect(self.open_window)
        self.quit_action.triggered.connect(self.quit)
        self.activated.connect(lambda reason: self.open_window() if reason == QSystemTrayIcon.Trigger else None)
        window.controller.sig_state.connect(self._on_state)
        ctl.said.connect(self._on_said)
        ctl.judged.connect(self._on_judged)
        ctl.connected.connect(lambda _on: self._on_state(window.controller.state, ""))
        ctl.service_changed.connect(lambda _svc: self._on_state(window.controller.state, ""))
        self._on_state(window.controller.state, "")

    def _park_all(self) -> None:
        if self.sessions.can_park_all():
            self.sessions.park_all()
        else:
            self.notify("KV Valet", "Park all: nothing to do now")

    def _resume_all(self) -> None:
        if self.sessions.controller.plan:
            self.sessions.resume_all()
        else:
            self.notify("KV Valet", "Resume all: nothing to do now")

    def _on_state(self, state, detail) -> None:
        self.state_action.setText(f"Server {state}")
        self.setToolTip(f"KV Valet — server {state}")
        self.park_all_action.setEnabled(self.sessions.can_park_all())
        self.resume_all_action.setEnabled(self.sessions.controller.service is not None)

    def _on_said(self, op, ok: bool, text: str) -> None:
        if op in PARKS_AND_RESUMES and not self.window.isVisible():  # else the window shows it
            self.notify("KV Valet: " + op.value, text, ok)

    def _on_judged(self, slot: int, session: str, verdict) -> None:
        if verdict.kind is VerdictKind.DISCARDED:
            self.notify(f"KV Valet: '{session}' re-prefilled", verdict.reason, ok=False)
        elif verdict.kind is VerdictKind.DIFFERS:
            self.notify(f"KV Valet: '{session}': output differs from a cold prefill", verdict.reason, ok=False)

    def notify(self, title: str, text: str, ok: bool = True) -> None:
        if not self.notifications_on:
            return
        self.notifications.append((title, text))
        if self.isVisible() and self.supportsMessages():
            self.showMessage(title, text, QSystemTrayIcon.Information if ok else QSystemTrayIcon.Warning, 8000)

    def open_window(self) -> None:
        self.window.showNormal()
        self.window.raise_()
        self.window.activateWindow()

    def quit(self) -> None:
        self.window.keep_in_tray = False
        self.open_window()
        self.window.close()


def tray_setting_action(window) -> QAction:
    """The checkable menu entry for "keep running in the tray when the window is closed"."""
    action = QAction("Keep running in the tray when closed", window)
    action.setCheckable(True)
    action.setChecked(bool(window.keep_in_tray))
    action.setToolTip("Closing the window hides it; the server and its chats keep going. Quit from the tray.")

    action.toggled.connect(window.preferences.set_keep_in_tray)
    return action
