"""Drag a parked session onto a server row; the dialog that asks how (issue #20).

* :func:`session_mime` — a session row as drag data (``application/x-kv-valet-session``: its
  name, profile and host, JSON), started by :class:`SessionDragger` on the Sessions table.
* :class:`ServerDropTarget` — the server list's viewport takes such a drop on a row and says
  which session went onto which server (``sig_dropped``).
* :class:`MoveDialog` — Move or Copy, and "restore there and judge" (only where the target's
  server runs: a profile that is not running receives the files, nothing is restored).
"""

from __future__ import annotations

import json

from PySide6.QtCore import QEvent, QMimeData, QObject, Qt, Signal
from PySide6.QtGui import QDrag
from PySide6.QtWidgets import QApplication, QCheckBox, QDialog, QDialogButtonBox, QLabel, QRadioButton, QVBoxLayout

from app.core.states import ServerState

MIME = "application/x-kv-valet-session"


def session_mime(name: str, profile: str | None, host: str) -> QMimeData:
    data = QMimeData()
    data.setData(MIME, json.dumps({"name": name, "profile": profile, "host": host}).encode())
    data.setText(name)
    return data


def dropped_session(mime: QMimeData) -> dict | None:
    if not mime.hasFormat(MIME):
        return None
    try:
        d = json.loads(bytes(mime.data(MIME)).decode())
    except ValueError:
        return None
    return d if isinstance(d, dict) and d.get("name") else None


class SessionDragger(QObject):
    """Starts a drag of the session under the mouse on the Sessions table (``mime_of(rec)``)."""

    def __init__(self, table, selected, mime_of):
        super().__init__(table)
        self.table, self.selected, self.mime_of = table, selected, mime_of
        self._pressed = None
        table.viewport().installEventFilter(self)

    def eventFilter(self, obj, ev) -> bool:  # noqa: N802
        if ev.type() == QEvent.MouseButtonPress and ev.button() == Qt.LeftButton:
            self._pressed = ev.position().toPoint()
        elif ev.type() == QEvent.MouseButtonRelease:
            self._pressed = None
        elif ev.type() == QEvent.MouseMove and self._pressed is not None and ev.buttons() & Qt.LeftButton:
            if (ev.position().toPoint() - self._pressed).manhattanLength() >= QApplication.startDragDistance():
                self._pressed = None
                rec = self.selected()
                if rec is not None:
                    drag = QDrag(self.table)
                    drag.setMimeData(self.mime_of(rec))
                    drag.exec(Qt.MoveAction | Qt.CopyAction, Qt.MoveAction)
                    return True
        return False


class ServerDropTarget(QObject):
    """The server list's viewport as a drop target: a session dropped on a row."""

    sig_dropped = Signal(dict, str)  # the session (name, profile, host), the row's target id

    def __init__(self, table, target_at):
        super().__init__(table)
        self.table, self.target_at = table, target_at
        table.viewport().setAcceptDrops(True)
        table.viewport().installEventFilter(self)

    def eventFilter(self, obj, ev) -> bool:  # noqa: N802
        kind = ev.type()
        if kind not in (QEvent.DragEnter, QEvent.DragMove, QEvent.Drop):
            return False
        session = dropped_session(ev.mimeData())
        target = self.target_at(ev.position().toPoint()) if session is not None else None
        if session is None or (target is None and kind != QEvent.DragEnter):
            ev.ignore()
            return True
        ev.acceptProposedAction()
        if kind == QEvent.Drop:
            self.sig_dropped.emit(session, target)
        return True


class MoveDialog(QDialog):
    """How a session goes to a server: moved or copied, restored and judged there or not."""

    def __init__(self, parent, name: str, target, *, copy: bool = False):
        super().__init__(parent)
        where = target.name + ("" if target.host == "this machine" else f" on {target.host}")
        self.setWindowTitle("Move a parked session")
        self.move_button = QRadioButton(f"Move '{name}' to {where} (it leaves where it is)")
        self.copy_button = QRadioButton("Copy it there (it stays where it is too)")
        (self.copy_button if copy else self.move_button).setChecked(True)
        running = target.state is ServerState.READY
        self.restore = QCheckBox("Then restore it there and judge a first query (the verdict)")
        self.restore.setEnabled(running)
        self.restore.setChecked(running)
        # the output check costs a second, cold prefill of the whole chat at the target: the user's choice
        self.output_check = QCheckBox("…and compare its output with a cold prefill (slower: the chat is "
                                      "prefilled once more)")
        self.output_check.setEnabled(running)
        self.output_check.setChecked(running)
        self.restore.toggled.connect(self.output_check.setEnabled)
        note = QLabel("" if running else f"'{target.name}' is not running: the session is received there, ready to "
                      "resume when it starts; nothing is restored now.")
        note.setWordWrap(True)
        buttons = QDialogButtonBox(QDialogButtonBox.Ok | QDialogButtonBox.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        self.ok_button = buttons.button(QDialogButtonBox.Ok)
        lay = QVBoxLayout(self)
        for w in (self.move_button, self.copy_button, self.restore, self.output_check, note, buttons):
            lay.addWidget(w)

    def choice(self, result: int) -> tuple[bool, bool, bool] | None:
        """(copy, restore, output check), or None when cancelled."""
        if result != QDialog.Accepted:
            return None
        restore = self.restore.isEnabled() and self.restore.isChecked()
        return self.copy_button.isChecked(), restore, restore and self.output_check.isChecked()
