"""The window's status bar: messages wrap inside the window's width, never widen it.

``QStatusBar.showMessage`` draws a message on one line; a long one (a crash summary, the
first-run guide's hints) is cut off, and a window was seen growing with such messages (issue #17).
Here a message goes into a label that takes the width the status bar has (horizontal policy
``Ignored``: its text never asks for more), wrapped at word boundaries on up to
:data:`MAX_LINES` lines; a longer one ends with "…". The whole message is always the label's
tooltip. Like Qt's own temporary message, it replaces the normal widgets (those added with
``addWidget``) until it times out or is cleared; the permanent ones stay.

``showMessage``, ``clearMessage`` and ``currentMessage`` keep their Qt meaning, so every caller
in Python (``window.statusBar().showMessage(text, ms)``) goes through the wrapping path.

:class:`SnapshotLabel` is the status bar's reading of the shown server's snapshot (its one
sampler's, app.monitor.sampler: the Monitor tab and the server list read the same): its health
(app.core.states.Health, coloured), the slots in use and the VRAM per GPU.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QFontMetrics, QTextLayout, QTextOption
from PySide6.QtWidgets import QLabel, QSizePolicy, QStatusBar, QWidget

from app.core.states import Health
from app.monitor.snapshot import Snapshot, summary
from app.ui.widgets import theme

MAX_LINES = 4

#: app.ui.widgets.theme roles of a server's health (any other: "crit")
HEALTH_ROLES = {Health.OK: "ok", Health.LOADING: "warn", Health.NOT_RUNNING: "muted"}


def wrap_lines(text: str, font, width: int, max_lines: int = MAX_LINES) -> list[str]:
    """``text`` broken at word boundaries (or anywhere, for a long path) into lines that fit
    ``width`` pixels; at most ``max_lines``, the last one elided with "…" when text is left."""
    if width <= 0:
        return [text]
    option = QTextOption()
    option.setWrapMode(QTextOption.WrapAtWordBoundaryOrAnywhere)
    lines: list[str] = []
    paragraphs = text.split("\n")
    for n, paragraph in enumerate(paragraphs):
        layout = QTextLayout(paragraph, font)
        layout.setTextOption(option)
        layout.beginLayout()
        pieces = []
        while True:
            line = layout.createLine()
            if not line.isValid():
                break
            line.setLineWidth(width)
            pieces.append((line.textStart(), line.textLength()))
        layout.endLayout()
        for i, (start, length) in enumerate(pieces or [(0, 0)]):
            if len(lines) == max_lines - 1 and (i < len(pieces) - 1 or n < len(paragraphs) - 1):
                rest = " ".join([paragraph[start:]] + paragraphs[n + 1:])
                lines.append(QFontMetrics(font).elidedText(rest, Qt.ElideRight, width))
                return lines
            lines.append(paragraph[start:start + length].rstrip())
    return lines


class MessageLabel(QLabel):
    """The status bar's message: wrapped to the width it is given, the whole text in its tooltip."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("status_message")
        self.setTextFormat(Qt.PlainText)  # a message is text, as showMessage draws it
        self.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)
        self.setMinimumWidth(0)
        self.setAlignment(Qt.AlignLeft | Qt.AlignVCenter)
        self._message = ""
        self._fitted_width = -1

    def message(self) -> str:
        return self._message

    def set_message(self, text: str) -> None:
        self._message = text
        self.setToolTip(text)
        self._fitted_width = -1
        self._fit()

    def resizeEvent(self, event) -> None:  # noqa: N802 (Qt's name)
        super().resizeEvent(event)
        self._fit()

    def _fit(self) -> None:
        width = self.contentsRect().width()
        if width == self._fitted_width:
            return
        self._fitted_width = width
        # The wrapping depends on the width alone (the policy is Ignored): the new text can
        # change the height the label asks for, never its width, so this settles at once.
        self.setText("\n".join(wrap_lines(self._message, self.font(), width)))


class MessageStatusBar(QStatusBar):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.message_label = MessageLabel()
        self.message_label.hide()
        super().addWidget(self.message_label, 1)
        self._normal: list[QWidget] = []  # added with addWidget/insertWidget, hidden under a message
        self._hidden: list[QWidget] = []
        self._showing = False
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.timeout.connect(self.clearMessage)

    def addWidget(self, widget: QWidget, stretch: int = 0) -> None:  # noqa: N802
        super().addWidget(widget, stretch)
        self._normal.append(widget)

    def insertWidget(self, index: int, widget: QWidget, stretch: int = 0) -> int:  # noqa: N802
        self._normal.append(widget)
        return super().insertWidget(index + 1 if index >= 0 else index, widget, stretch)  # after the message label

    def removeWidget(self, widget: QWidget) -> None:  # noqa: N802
        super().removeWidget(widget)
        self._normal = [w for w in self._normal if w is not widget]
        self._hidden = [w for w in self._hidden if w is not widget]

    def showMessage(self, text: str, timeout: int = 0) -> None:  # noqa: N802
        if not text:
            self.clearMessage()
            return
        if not self._showing:
            self._showing = True
            # shown, or to be shown with the window (a message can come before the window shows)
            self._hidden = [w for w in self._normal
                            if not (w.isHidden() and w.testAttribute(Qt.WA_WState_ExplicitShowHide))]
            for w in self._hidden:
                w.hide()
        self.message_label.set_message(text)
        self.message_label.show()
        if timeout > 0:
            self._timer.start(timeout)
        else:
            self._timer.stop()
        self.messageChanged.emit(text)

    def clearMessage(self) -> None:  # noqa: N802
        self._timer.stop()
        had, self._showing = self._showing, False
        self.message_label.hide()
        self.message_label.set_message("")  # and the status bar's height back to one line
        for w in self._hidden:
            w.show()
        self._hidden = []
        super().clearMessage()  # a status tip Qt drew itself (a menu entry's), if any
        if had:
            self.messageChanged.emit("")

    def currentMessage(self) -> str:  # noqa: N802
        return self.message_label.message() or super().currentMessage()


class SnapshotLabel(QLabel):
    """The shown server's last snapshot in one line ("health ok · 1 / 2 slots in use · GPU0 9.0/16.0 GiB")."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("snapshot_label")
        self.setToolTip("The shown server as its sampler saw it last (the Monitor tab has the details).")
        self.snapshot: Snapshot | None = None

    def show_snapshot(self, snap: Snapshot | None) -> None:
        """Show ``snap`` (None: no server sampled)."""
        self.snapshot = snap
        if snap is None:
            self.setText("")
            return
        colour = theme.hex_of(HEALTH_ROLES.get(snap.health, "crit"))
        self.setText(f"<span style='color:{colour}'>{summary(snap)}</span>")
