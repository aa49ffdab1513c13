"""The KV Valet window: profiles on the left, log / slots / GPUs / sessions on the right."""

from __future__ import annotations

import logging

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QInputDialog, QSizePolicy, QLabel, QMainWindow, QMessageBox, QProgressBar, QSplitter, QTabWidget,
                               QWidget)

from app.core.background import track
from app.core.profile import LaunchProfile, ProfileError
from app.core.states import ServerState
from app.servers.server_list import STATE_ROLES  # the server list colours states the same way
from app.servers.service import (CACHE_EVENTS_VERBOSITY, DiscoveryError, binary_info, find_server_binary,
                                     profile_target_id)
from app.server.outcome import Outcome
from app.store.profiles import ProfileStore
from app.ui.dialogs.preferences import WindowPreferences
from app.ui.panel_set import Panels
from app.ui.widgets import theme
from app.ui.servers.controller import ServerController
from app.ui.quitting import QuitsInOrder
from app.ui.widgets.status_bar import MessageStatusBar

log = logging.getLogger(__name__)

SERVER_LIFETIME = (
    "Quitting KV Valet stops the server it started (live slots that are not parked are lost; park them "
    "first, or use 'Park all & stop').\n\n"
    "If KV Valet itself is killed or crashes, the server keeps running, so a long chat is not lost with "
    "the app. At the next start KV Valet finds it again (by pid and start time) and offers to attach to "
    "it or stop it. A server you attached to, that KV Valet did not start, is never stopped by KV Valet."
)


class MainWindow(QuitsInOrder, QMainWindow):
    sig_closed = Signal()

    def __init__(self, store: ProfileStore, controller: ServerController, panels: Panels):
        """Built by app.ui.panels.build_window: the server controller and the panels come in made."""
        super().__init__()
        self.setWindowTitle("KV Valet")
        self.resize(1280, 820)
        self.store = store
        self.controller = controller
        controller.setParent(self)
        self.profiles = panels.profiles
        self.log_panel = panels.log
        self.tabs = QTabWidget()
        self.tabs.addTab(self.log_panel, "Log")
        self.server_list = panels.server_list  # every server; the selected one fills the tabs
        self.extra_panels: list[QWidget] = [self.server_list]
        self.sessions_panel, self.monitor_panel = panels.sessions, panels.monitor
        self.health_panel, self.conversations_panel = panels.health, panels.conversations
        for panel, title in ((panels.sessions, "Sessions"), (panels.monitor, "Monitor"),
                             (panels.health, "Cache health"), (panels.conversations, "Conversations")):
            if panel is not None:
                self.add_panel(panel, title)
        right = QSplitter(Qt.Vertical)
        right.addWidget(self.server_list)
        right.addWidget(self.tabs)
        right.setStretchFactor(1, 1)
        right.setSizes([150, 670])
        splitter = QSplitter(Qt.Horizontal)
        splitter.addWidget(self.profiles)
        splitter.addWidget(right)
        splitter.setStretchFactor(1, 1)
        splitter.setSizes([430, 850])
        self.splitter = splitter
        self.setCentralWidget(splitter)

        self.state_label = QLabel()
        self.state_label.setObjectName("state_label")
        self.url_label = QLabel()
        # A long crash summary must not widen the window past the screen: the label
        # takes the room the status bar has and shows the rest in its tooltip.
        self.url_label.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)
        self.url_label.setMinimumWidth(0)
        self.progress = QProgressBar()
        self.progress.setMaximumWidth(220)
        self.progress.hide()
        # messages wrap inside the window's width (app.ui.widgets.status_bar), whoever shows them
        sb = MessageStatusBar()
        sb.addWidget(self.state_label)
        sb.addWidget(self.url_label, 1)
        self.time_saved_label = QLabel("")
        self.time_saved_label.setObjectName("time_saved")
        sb.addPermanentWidget(self.time_saved_label)
        sb.addPermanentWidget(self.progress)
        self.setStatusBar(sb)
        self.show_state(ServerState.STOPPED, "")
        theme.watcher().sig_changed.connect(self._on_theme_changed)  # light ↔ dark

        self.profiles.sig_start.connect(self._on_start)
        self.profiles.sig_stop.connect(self.controller.stop)
        self.profiles.sig_restart.connect(self.controller.restart)
        self.profiles.sig_save.connect(self._on_save_profile)
        self.profiles.sig_build_server.connect(self._on_build_server)
        self.profiles.sig_selected.connect(lambda name: self.controller.select(profile_target_id(name)))
        self.controller.sig_selected.connect(self._on_selected)
        self.controller.sig_state.connect(self.show_state)
        self.controller.sig_error.connect(self._on_refused)
        self.controller.sig_crashed.connect(self._on_crashed)
        self.controller.sig_progress.connect(self._on_progress)
        self.controller.sig_plan.connect(self._on_plan)
        self.controller.sig_notice.connect(lambda text, _ok: self.show_message(text))  # "Parking every slot…"
        self.last_message = ""
        self.quit_box: QMessageBox | None = None
        self.tray = None  # app.ui.tray.Tray, set by the wiring
        from app import settings

        # the preferences (app.settings); the dialog and `kv-valet settings` change them
        self.prefs, problem = settings.load_or_defaults()
        self.keep_in_tray = self.prefs.keep_in_tray  # closing the window hides it while the tray shows KV Valet
        self.preferences = WindowPreferences(self)  # the dialog, and what its settings change in the window
        self._build_menu()
        self._restore_layout()
        self.reload_profiles()
        if problem:
            self.show_message(problem[:1].upper() + problem[1:])
        try:
            binary = find_server_binary("").path
            caps, _version = binary_info(binary)  # cached per binary path + mtime
            self.profiles.set_binary(binary, CACHE_EVENTS_VERBOSITY if caps.has("-lv") else None)
        except (DiscoveryError, OSError):
            pass

    def _build_menu(self) -> None:
        menu = self.menuBar().addMenu("&Server")
        self.attach_action = menu.addAction("Attach to a running server…")
        self.attach_action.setToolTip("Watch a llama-server started elsewhere, without owning it.")
        self.attach_action.triggered.connect(self._on_attach)
        self.detach_action = menu.addAction("Detach")
        self.detach_action.triggered.connect(lambda: track(self.controller.detach_async(), "detaching"))
        self.loadcheck_action = menu.addAction("Load check…")
        self.loadcheck_action.setToolTip("Parallel streams for some seconds: inter-token gaps and stalls per stream, "
                                         "to compare before and after a remedy.")
        self.loadcheck_action.triggered.connect(self._on_load_check)
        menu.addSeparator()
        self.preferences_action = menu.addAction("Preferences…")
        self.preferences_action.setShortcut("Ctrl+,")
        self.preferences_action.triggered.connect(lambda: self.preferences.open())
        quit_action = menu.addAction("Quit")
        quit_action.triggered.connect(self.close)
        # Keyboard shortcuts for what people do every day; each does what its button does.
        self.session_menu = session = self.menuBar().addMenu("S&ession")
        for label, keys, act in (("Start the server", "F5", lambda: self._click(self.profiles.start_button)),
                                 ("Stop the server", "Shift+F5", lambda: self._click(self.profiles.stop_button)),
                                 ("Park the chosen slot", "Ctrl+P", lambda: self._on_sessions(
                                     lambda p: p.can_park(), "park_chosen")),
                                 ("Resume the selected session", "Ctrl+R", lambda: self._on_sessions(
                                     lambda p: p.can_resume(), "resume_selected"))):
            action = session.addAction(label)
            action.setShortcut(keys)
            action.triggered.connect(lambda _=False, act=act: act())
        help_menu = self.menuBar().addMenu("&Help")
        lifetime = help_menu.addAction("When does the server stop?")
        lifetime.triggered.connect(lambda: QMessageBox.information(self, "Server lifetime", SERVER_LIFETIME))

    @staticmethod
    def _click(button) -> None:
        if button.isEnabled():
            button.click()

    def _on_sessions(self, can, action: str) -> None:
        """Park or resume from the menu: on the Sessions tab (where the result shows), when it can."""
        panel = self.sessions_panel
        if panel is not None and can(panel):
            self.tabs.setCurrentWidget(panel)
            getattr(panel, action)()

    # -- the window as the user left it ---------------------------------------
    def _layout_settings(self):
        from PySide6.QtCore import QSettings

        from app import paths

        # a file of ours (not the desktop's registry): tests and portable installs stay isolated
        return QSettings(str(paths.config_dir() / "window.ini"), QSettings.IniFormat)

    def _restore_layout(self) -> None:
        s = self._layout_settings()
        geometry, splitter = s.value("geometry"), s.value("splitter")
        if geometry is not None:
            self.restoreGeometry(geometry)
        if splitter is not None:
            self.splitter.restoreState(splitter)
        old = s.value("keep_in_tray")  # kept here before the preferences existed: moved there once
        if old is not None:
            s.remove("keep_in_tray")
            if str(old).lower() == "true" and not self.prefs.keep_in_tray:
                self.preferences.set_keep_in_tray(True)

    def save_layout(self) -> None:
        s = self._layout_settings()
        s.setValue("geometry", self.saveGeometry())
        s.setValue("splitter", self.splitter.saveState())
        s.sync()

    def _on_load_check(self) -> None:
        from app.ui.dialogs.loadcheck import LoadCheckDialog

        url = self.controller.url
        if not url or self.controller.state != ServerState.READY:
            self.show_message("Start or attach to a server first.")
            return
        # the server's one client (its key, its keep-alive connections); kept: it runs on
        self.loadcheck_dialog = LoadCheckDialog(url, None, self, client=self.controller.client)
        self.loadcheck_dialog.show()

    def _on_attach(self) -> None:
        url, ok = QInputDialog.getText(self, "Attach to a server", "Server URL:", text="http://127.0.0.1:8080")
        if ok and url.strip():
            track(self.controller.attach_async(url.strip()), f"attaching to {url.strip()}")

    def add_panel(self, widget: QWidget, title: str) -> None:
        self.extra_panels.append(widget)
        self.tabs.addTab(widget, title)

    # -- profiles ---------------------------------------------------------
    def reload_profiles(self, select: str | None = None) -> None:
        try:
            self.store.ensure_default()
        except ProfileError as e:
            self.show_message(f"The default profile could not be read: {e}")
        profiles, errors = self.store.load_all()
        for e in errors:
            self.show_message(f"A profile file could not be read: {e}")
        self.profiles.set_profiles(profiles, select)

    def _on_save_profile(self, profile: LaunchProfile, previous: str) -> None:
        try:
            # A new profile (imported, or renamed) never overwrites another one silently.
            self.store.save(profile, previous_name=previous or None, overwrite=bool(previous))
        except ProfileError as e:
            self.profiles.errors.setText(str(e))
            return
        self.reload_profiles(select=profile.name)
        self.statusBar().showMessage(f"Saved profile '{profile.name}'", 4000)

    def _on_build_server(self) -> None:
        from app.ui.dialogs.build import open_build_dialog

        open_build_dialog(self)  # progress, Cancel; afterwards the default profile may switch (asked once)

    def _on_start(self, profile: LaunchProfile) -> None:
        from app.core.findings import Severity
        from app.core.rules import diagnose

        # the profile rules once more, as the launch goes: an error is said, not hidden in the form
        errors = [f for f in diagnose(profile) if f.severity is Severity.ERROR]
        if errors:
            self.show_message("Starting despite: " + "; ".join(f.message for f in errors))
        self.log_panel.set_buffer(self.controller.log_buffer)
        self.controller.start(profile)

    # -- server state -----------------------------------------------------
    def show_state(self, state: ServerState, detail: str) -> None:
        """The status bar says the selected server's state (a host's row: app.ui.servers.remote_view)."""
        self._shown_state = (state, detail)
        colour = theme.hex_of(STATE_ROLES.get(state, "muted"))
        self.state_label.setText(f"<b style='color:{colour}'>● Server {state}</b>")
        url = self.controller.url
        if state == ServerState.CRASHED:
            self.url_label.setText(detail)
        elif state == ServerState.READY:
            self.url_label.setText(detail or url or "")
        elif state in (ServerState.LOADING, ServerState.STARTING) and url:
            self.url_label.setText(url if state != ServerState.STARTING or not detail else detail)
        else:
            self.url_label.setText(detail)
        self.url_label.setToolTip(self.url_label.text())
        running = state in (ServerState.STARTING, ServerState.LOADING, ServerState.READY, ServerState.STOPPING)
        self.profiles.set_running(running)
        if state != ServerState.STARTING:
            self.progress.hide()

    def _on_theme_changed(self, _dark: bool) -> None:
        self.show_state(*self._shown_state)

    def show_time_saved(self, seconds: float) -> None:
        """The prefill time all resumes avoided (app.core.verdict.time_saved), in the status bar."""
        from app.core.units import fmt_duration
        from app.core.verdict import TIME_SAVED_HELP

        self.time_saved_label.setText(f"Time saved by resumes: {fmt_duration(seconds)}" if seconds > 0 else "")
        self.time_saved_label.setToolTip(TIME_SAVED_HELP)

    def _on_plan(self, plan) -> None:
        self.log_panel.set_buffer(self.controller.log_buffer)
        sup = self.controller.supervisor
        self.log_panel.set_log_file(sup.log_file_path if sup is not None else None)
        for note in getattr(plan, "notes", ()):
            self.show_message(f"Starting the server: {note}")

    def _on_selected(self, target_id: str) -> None:
        """Another server shown (the server list, a profile, a start): its log, its profile on the left."""
        self._on_plan(None)
        name = target_id.partition(":")[2] if target_id.startswith("profile:") else ""
        items = self.profiles.list.findItems(name, Qt.MatchExactly) if name else []
        if items and self.profiles.list.currentItem() is not items[0]:
            self.profiles.list.setCurrentItem(items[0])

    def _on_refused(self, message: str) -> None:
        self.show_message(message)
        self.profiles.errors.setText(message)

    def _on_crashed(self, outcome: Outcome) -> None:
        text = f"The server stopped unexpectedly: {outcome.summary()}"
        self.show_message(text)
        self.profiles.errors.setText(text)

    def _on_progress(self, what: str, pct: int) -> None:
        self.progress.show()
        self.progress.setFormat(f"{what}: %p%")
        self.progress.setValue(pct)

    def show_message(self, text: str) -> None:
        self.last_message = text
        self.statusBar().showMessage(text, 15000)
        log.warning(text)
