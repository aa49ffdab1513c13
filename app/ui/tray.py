"""The system tray: the server's state, Park all, Resume all, Open, Quit, and notifications.

Each menu entry presses the same button the window has (nothing is decided
here). Closing the window can leave KV Valet in the tray (a setting, off by
default), so a server and its chats keep going while the window is away; a
park or resume that finishes then, or a resume judged DISCARDED, is told in a
desktop notification.
"""

from __future__ import annotations

from PySide6.QtGui import QAction, QIcon
from PySide6.QtWidgets import QMenu, QSystemTrayIcon


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

        sessions = window.sessions_panel
        self.park_all_action.triggered.connect(lambda: self._press(sessions.park_all_button))
        self.resume_all_action.triggered.connect(lambda: self._press(sessions.resume_all_button))
        self.open_action.triggered.connect(self.open_window)
        self.quit_action.triggered.connect(self.quit)
        self.activated.connect(lambda reason: self.open_window() if reason == QSystemTrayIcon.Trigger else None)
        window.controller.sig_state.connect(self._on_state)
        sessions.sig_done.connect(self._on_done)
        sessions.sig_verdict.connect(self._on_verdict)
        sessions.sig_service.connect(lambda _svc: self._on_state(window.controller.state, ""))
        self._on_state(window.controller.state, "")

    def _press(self, button) -> None:
        if button.isEnabled() and (button.isVisibleTo(button.parentWidget()) or button.text() != "Resume all"):
            button.click()
        else:
            self.notify("KV Valet", f"{button.text()}: nothing to do now")

    def _on_state(self, state, detail) -> None:
        self.state_action.setText(f"Server {state}")
        self.setToolTip(f"KV Valet — server {state}")
        sessions = self.window.sessions_panel
        self.park_all_action.setEnabled(sessions.park_all_button.isEnabled())
        self.resume_all_action.setEnabled(sessions.service is not None)

    def _on_done(self, label: str, ok: bool, text: str) -> None:
        if not label or self.window.isVisible():
            return  # the window shows it
        if label.startswith(("Park", "Resume")):
            self.notify("KV Valet: " + label, text, ok)

    def _on_verdict(self, slot: int, session: str, verdict) -> None:
        if str(verdict.kind) == "DISCARDED":
            self.notify(f"KV Valet: '{session}' re-prefilled", verdict.reason, ok=False)

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

    action.toggled.connect(window.set_keep_in_tray)
    return action
