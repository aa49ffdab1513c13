"""Server > Preferences…: the settings of app.settings in a form.

Nothing is decided here: the values are validated and written by
:mod:`app.settings` (the same as ``kv-valet settings``); an error is shown
under the form and the dialog stays open with what the user typed.
"""

from __future__ import annotations

import dataclasses

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDialog, QDialogButtonBox, QDoubleSpinBox, QFileDialog,
                               QFormLayout, QHBoxLayout, QLabel, QLineEdit, QPushButton, QSpinBox, QVBoxLayout,
                               QWidget)

from app import paths, settings
from app.ui.widgets import theme
from app.settings import AutoResume, Settings

AUTO_RESUME_LABELS = {
    AutoResume.OFFER: "Offer \u201cResume all\u201d",
    AutoResume.ALWAYS: "Resume them at once",
}


class PreferencesDialog(QDialog):
    sig_saved = Signal(object)  # the saved Settings

    def __init__(self, current: Settings, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Preferences")
        self.setMinimumWidth(720)
        form = QFormLayout()

        self.data_folder = QLineEdit()
        self.data_folder.setPlaceholderText(str(paths.default_data_dir()) + "  (default)")
        self.browse_button = QPushButton("Browse…")
        self.browse_button.clicked.connect(self._browse)
        row = QHBoxLayout()
        row.addWidget(self.data_folder, 1)
        row.addWidget(self.browse_button)
        form.addRow("Data folder:", _wrap(row))
        self.data_status = QLabel()
        self.data_status.setWordWrap(True)
        self.data_status.setObjectName("data_status")
        form.addRow("", self.data_status)

        self.interval = _seconds(0.1, 60.0, 0.1)
        self.busy_interval = _seconds(0.05, 60.0, 0.05)
        form.addRow("Monitor refresh:", self.interval)
        form.addRow("… while a slot is busy:", self.busy_interval)

        self.auto_resume = QComboBox()
        for value, label in AUTO_RESUME_LABELS.items():
            self.auto_resume.addItem(label, value)
        form.addRow("Sessions parked by \u201cPark all && stop\u201d,\nat the next start:", self.auto_resume)

        self.keep_in_tray = QCheckBox("Keep running in the tray when the window is closed")
        self.notifications = QCheckBox("Desktop notifications for work finished in the background")
        form.addRow("Tray:", self.keep_in_tray)
        form.addRow("", self.notifications)

        self.log_file_mib = QSpinBox()
        self.log_file_mib.setRange(1, 4096)
        self.log_file_mib.setSuffix(" MiB per file")
        self.log_backups = QSpinBox()
        self.log_backups.setRange(0, 100)
        self.log_backups.setSuffix(" older files kept")
        logs = QHBoxLayout()
        logs.addWidget(self.log_file_mib)
        logs.addWidget(self.log_backups)
        logs.addStretch(1)
        form.addRow("Server log:", _wrap(logs))

        self.park_timeout = _seconds(1.0, 3600.0, 5.0)
        form.addRow("Park before a stop, at most:", self.park_timeout)

        self.proxy_budget = QSpinBox()
        self.proxy_budget.setRange(0, 1_000_000)
        self.proxy_budget.setSuffix(" GiB per profile")
        self.proxy_budget.setSpecialValueText("no limit")
        self.proxy_save_first = QCheckBox("Save idle slots before a server that clears them runs a task")
        form.addRow("Conversation proxy parks:", self.proxy_budget)
        form.addRow("", self.proxy_save_first)
        self.proxy_warm = QCheckBox("Restore the conversations used last into free slots when the proxy starts")
        form.addRow("", self.proxy_warm)
        self.proxy_park_ahead = QCheckBox("Park the next conversation to leave its slot while no request runs")
        form.addRow("", self.proxy_park_ahead)

        for key, widget in (("data_folder", self.data_folder), ("monitor_interval_s", self.interval),
                            ("monitor_busy_interval_s", self.busy_interval), ("auto_resume", self.auto_resume),
                            ("keep_in_tray", self.keep_in_tray), ("notifications", self.notifications),
                            ("log_file_mib", self.log_file_mib), ("log_backups", self.log_backups),
                            ("park_timeout_s", self.park_timeout), ("proxy_disk_budget_gib", self.proxy_budget),
                            ("proxy_save_before_idle_clear", self.proxy_save_first),
                            ("proxy_warm_start", self.proxy_warm), ("proxy_park_ahead", self.proxy_park_ahead)):
            widget.setToolTip(settings.describe(key))

        self.errors = QLabel()
        self.errors.setObjectName("errors")
        self.errors.setWordWrap(True)
        theme.tint(self.errors, "color: {crit};")
        self.buttons = QDialogButtonBox(QDialogButtonBox.Save | QDialogButtonBox.Cancel
                                        | QDialogButtonBox.RestoreDefaults)
        self.save_button = self.buttons.button(QDialogButtonBox.Save)
        self.defaults_button = self.buttons.button(QDialogButtonBox.RestoreDefaults)
        self.save_button.clicked.connect(self._save)
        self.buttons.rejected.connect(self.reject)
        self.defaults_button.clicked.connect(lambda: self.show_values(settings.DEFAULTS))

        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self.errors)
        layout.addWidget(self.buttons)
        self.data_folder.textChanged.connect(self._show_data_status)
        self.show_values(current)

    def show_values(self, s: Settings) -> None:
        self.data_folder.setText(s.data_folder)
        self.interval.setValue(s.monitor_interval_s)
        self.busy_interval.setValue(s.monitor_busy_interval_s)
        self.auto_resume.setCurrentIndex(max(0, self.auto_resume.findData(s.auto_resume)))
        self.keep_in_tray.setChecked(s.keep_in_tray)
        self.notifications.setChecked(s.notifications)
        self.log_file_mib.setValue(s.log_file_mib)
        self.log_backups.setValue(s.log_backups)
        self.park_timeout.setValue(s.park_timeout_s)
        self.proxy_budget.setValue(s.proxy_disk_budget_gib)
        self.proxy_save_first.setChecked(s.proxy_save_before_idle_clear)
        self.proxy_warm.setChecked(s.proxy_warm_start)
        self.proxy_park_ahead.setChecked(s.proxy_park_ahead)
        self.errors.clear()
        self._show_data_status()

    def values(self) -> Settings:
        return Settings(data_folder=self.data_folder.text().strip(), monitor_interval_s=self.interval.value(),
                        monitor_busy_interval_s=self.busy_interval.value(),
                        auto_resume=AutoResume(self.auto_resume.currentData()),
                        keep_in_tray=self.keep_in_tray.isChecked(), notifications=self.notifications.isChecked(),
                        log_file_mib=self.log_file_mib.value(), log_backups=self.log_backups.value(),
                        park_timeout_s=self.park_timeout.value(), proxy_disk_budget_gib=self.proxy_budget.value(),
                        proxy_save_before_idle_clear=self.proxy_save_first.isChecked(),
                        proxy_warm_start=self.proxy_warm.isChecked(),
                        proxy_park_ahead=self.proxy_park_ahead.isChecked())

    def _show_data_status(self) -> None:
        s = dataclasses.replace(settings.DEFAULTS, data_folder=self.data_folder.text().strip())
        status = settings.data_folder_status(s)
        self.data_status.setText(status[:1].upper() + status[1:] + ".")

    def _browse(self) -> None:
        start = self.data_folder.text().strip() or str(paths.data_dir())
        folder = QFileDialog.getExistingDirectory(self, "Data folder", start)
        if folder:
            self.data_folder.setText(folder)

    def _save(self) -> None:
        new = self.values()
        try:
            settings.save(new)
        except settings.SettingsError as e:
            self.errors.setText("Not saved: " + "; ".join(m for _k, m in e.errors))
            return
        except OSError as e:
            self.errors.setText(f"Not saved: {settings.settings_path()}: {e.strerror or e}")
            return
        self.sig_saved.emit(new)
        self.accept()


def _seconds(lo: float, hi: float, step: float) -> QDoubleSpinBox:
    box = QDoubleSpinBox()
    box.setRange(lo, hi)
    box.setDecimals(2)
    box.setSingleStep(step)
    box.setSuffix(" s")
    return box


def _wrap(layout) -> QWidget:
    w = QWidget()
    layout.setContentsMargins(0, 0, 0, 0)
    w.setLayout(layout)
    return w


class WindowPreferences:
    """What the preferences change in the window (``window.preferences``): Server > Preferences…
    opens the dialog (kept as ``dialog`` while open), and a save applies what applies at once."""

    def __init__(self, window):
        self.window = window
        self.dialog: PreferencesDialog | None = None

    def open(self) -> None:
        if self.dialog is None:
            self.dialog = PreferencesDialog(self.window.prefs, self.window)
            self.dialog.sig_saved.connect(self._saved)
            self.dialog.finished.connect(lambda _r: setattr(self, "dialog", None))
        self.dialog.open()

    def _saved(self, prefs: Settings) -> None:
        moved = prefs.data_path() != self.window.prefs.data_path()
        self.apply(prefs)
        self.window.show_message("Preferences saved." + (f" The {settings.data_folder_status(prefs)}." if moved
                                                          else ""))

    def apply(self, prefs: Settings) -> None:
        """The preferences that apply at once: tray, notifications, the Monitor's polling rates, every
        running conversation proxy's park budget and idle-slot saving. (The data folder applies from
        the next start; the log limits from the next launch; the auto-resume choice at the next
        connection.)"""
        w = self.window
        w.prefs = prefs
        w.keep_in_tray = prefs.keep_in_tray
        action = getattr(w, "tray_action", None)
        if action is not None and action.isChecked() != prefs.keep_in_tray:
            action.blockSignals(True)
            action.setChecked(prefs.keep_in_tray)
            action.blockSignals(False)
        if w.tray is not None:
            w.tray.notifications_on = prefs.notifications
        if w.monitor_panel is not None:
            w.monitor_panel.set_rates(prefs.monitor_interval_s, prefs.monitor_busy_interval_s)
        for handle in list(w.controller.service.servers.values()):  # every running conversation proxy
            if getattr(handle, "proxy", None) is not None:
                handle.proxy.apply_settings(prefs)

    def set_keep_in_tray(self, on: bool) -> None:
        """Session > Keep running in the tray when closed: saved with the other preferences."""
        try:
            self.apply(settings.update(keep_in_tray=bool(on)))
        except (settings.SettingsError, OSError) as e:
            self.window.keep_in_tray = bool(on)  # for this run at least
            self.window.show_message(f"The preference could not be saved: {e}")
