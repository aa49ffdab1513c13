"""Add a host from the window: name, destination, port, kv-valet path, key file (issue #20).

Saved through app.store.hosts (the file ``kv-valet hosts`` edits), then checked at once
(app.servers.remote_sessions.check_host: the key against known_hosts, the login, its kv-valet): the
outcome is shown in the dialog — "host key verified" or the refusal with its remedy. The
dialog stays open on a refusal so the user can fix a field and press Add again; a host that
answered is listed in the server list (``sig_added``) and the dialog closes.
"""

from __future__ import annotations


from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QDialog, QDialogButtonBox, QFormLayout, QLabel, QLineEdit, QProgressBar, QSpinBox,
                               QVBoxLayout)

from app.ui.widgets import theme
from app.ui.widgets.tasks import Tasks


class HostDialog(QDialog):
    sig_added = Signal(str)  # the host's name, saved and answering
    sig_checked = Signal(bool, str)  # ok, what the check said

    def __init__(self, parent=None, *, make_host=None):
        """``make_host(cfg) -> RemoteHost``: how a host is reached (a test passes its known_hosts)."""
        super().__init__(parent)
        self.setWindowTitle("Add a host")
        self.tasks = Tasks("HostDialog", self._task_failed)
        self.make_host = make_host or _default_host
        self.host = None  # the checked host's connection, handed to the server list
        self.name = QLineEdit(placeholderText="gpu-box")
        self.destination = QLineEdit(placeholderText="me@gpu-box.lan, or an ~/.ssh/config alias")
        self.port = QSpinBox()
        self.port.setRange(0, 65535)
        self.port.setSpecialValueText("default (ssh's)")
        self.kv_valet = QLineEdit("kv-valet")
        self.kv_valet.setToolTip("The kv-valet command on the host: a full path when a login without a terminal "
                                 "does not have it on its PATH (e.g. ~/kv-valet/.venv/bin/kv-valet).")
        self.identity = QLineEdit(placeholderText="optional: else the agent, ~/.ssh/config, ~/.ssh/id_*")
        form = QFormLayout()
        form.addRow("Name", self.name)
        form.addRow("Destination", self.destination)
        form.addRow("Port", self.port)
        form.addRow("kv-valet on the host", self.kv_valet)
        form.addRow("Key file", self.identity)
        self.result = QLabel("KV Valet logs in as `ssh` does and never accepts an unknown host key: connect once "
                             "with ssh first.")
        self.result.setWordWrap(True)
        self.result.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.busy = QProgressBar()
        self.busy.setRange(0, 0)
        self.busy.hide()
        self.buttons = QDialogButtonBox(QDialogButtonBox.Cancel)
        self.add_button = self.buttons.addButton("Add and check", QDialogButtonBox.AcceptRole)
        self.add_button.setDefault(True)
        self.buttons.rejected.connect(self.reject)
        self.add_button.clicked.connect(lambda: self.tasks.spawn(self.add(), "adding a host"))
        lay = QVBoxLayout(self)
        lay.addLayout(form)
        lay.addWidget(self.result)
        lay.addWidget(self.busy)
        lay.addWidget(self.buttons)
        self.resize(560, 0)

    def config(self):
        """The host as typed (app.store.hosts.HostConfig); HostsError says what is wrong."""
        from app.store.hosts import HostConfig

        return HostConfig(name=self.name.text().strip(), destination=self.destination.text().strip(),
                          port=self.port.value() or None, kv_valet=self.kv_valet.text().strip() or "kv-valet",
                          identity_file=self.identity.text().strip() or None)

    async def add(self) -> bool:
        """Save the host (replacing one of the same name only after it answered) and check it."""
        from app.servers.remote_sessions import check_host
        from app.store.hosts import HostsError, HostStore

        try:
            cfg = self.config()
        except HostsError as e:
            return self._show(False, str(e))
        self.add_button.setEnabled(False)
        self.busy.show()
        self._show(True, f"Connecting to {cfg.destination}…")
        host = self.make_host(cfg)
        try:
            ok, text = await check_host(host)
            if ok:
                try:
                    HostStore().save(cfg, overwrite=True)
                except (HostsError, OSError) as e:
                    ok, text = False, f"The host answered but could not be saved: {e}"
        finally:
            self.busy.hide()
            self.add_button.setEnabled(True)
        if not ok:
            await host.close()
            return self._show(False, text)
        self.host = host
        self._show(True, text)
        self.sig_added.emit(cfg.name)
        self.accept()
        return True

    def _show(self, ok: bool, text: str) -> bool:
        theme.tint(self.result, "" if ok else "color: {crit};")
        self.result.setText(text)
        if text and not text.endswith("…"):
            self.sig_checked.emit(ok, text)
        return ok

    def _task_failed(self, exc: BaseException) -> None:
        self._show(False, f"Failed: {exc}")


def _default_host(cfg):
    from app.remote.host import RemoteHost

    return RemoteHost(cfg)
