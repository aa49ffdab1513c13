"""The server log: follows the tail, filters by level and text, copies.

Responsive under floods: lines are not pushed into the widget one by one; a
timer pulls whatever arrived since the last tick from the ring buffer and
appends it as one block, and the widget keeps a bounded number of lines.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QTimer, QUrl, Signal
from PySide6.QtGui import QDesktopServices, QFont, QGuiApplication, QTextCursor
from PySide6.QtWidgets import (QCheckBox, QComboBox, QHBoxLayout, QLabel, QLineEdit, QPlainTextEdit,
                               QPushButton, QVBoxLayout, QWidget)

from app.server.logparse import Kind
from app.server.supervisor import LogBuffer, LogLine

LEVELS = [("All lines", ""), ("Info and above", "I"), ("Warnings and errors", "W"), ("Errors only", "E"),
          ("Cache events", "cache")]
_RANK = {"D": 0, "I": 1, "": 1, "W": 2, "E": 3}
CACHE_KINDS = {Kind.FULL_REPROCESS, Kind.CHECKPOINT_RESTORED, Kind.CHECKPOINT_CREATED, Kind.IDLE_SLOT_SAVE,
               Kind.PROMPT_CACHE_UPDATE, Kind.SIDECAR_SAVED, Kind.SIDECAR_RESTORED, Kind.SIDECAR_WRITE_FAILED,
               Kind.PROMPT_EVAL}
MAX_LINES_SHOWN = 5000
MAX_LINES_PER_TICK = 100  # at 100 ms a tick: 1,000 lines/s on screen; more is skipped (all are in the file)


class LogPanel(QWidget):
    sig_lines_shown = Signal(int)  # total lines appended so far (for tests and benchmarks)

    def __init__(self, parent=None, interval_ms: int = 100):
        super().__init__(parent)
        self._buffer: LogBuffer | None = None
        self._seq = 0
        self.lines_shown = 0
        self.lines_skipped = 0
        self.view = QPlainTextEdit(readOnly=True)
        self.view.setMaximumBlockCount(MAX_LINES_SHOWN)
        self.view.setLineWrapMode(QPlainTextEdit.NoWrap)
        self.view.setFont(QFont("monospace", 9))
        self.view.document().rootFrame()  # made now, not with the first line: the window's objects stay level
        self.view.setToolTip("The server's own log, newest at the bottom.")
        self.level = QComboBox()
        for label, _ in LEVELS:
            self.level.addItem(label)
        self.level.setToolTip("Show only lines of this level or above. 'Cache events' shows checkpoint, "
                              "prompt-cache and re-prefill lines.")
        self.search = QLineEdit(placeholderText="Filter text…")
        self.search.setClearButtonEnabled(True)
        self.search.setToolTip("Show only lines containing this text (case-insensitive).")
        self.follow = QCheckBox("Follow")
        self.follow.setChecked(True)
        self.follow.setToolTip("Keep the newest line in view.")
        self.copy_button = QPushButton("Copy")
        self.copy_button.setToolTip("Copy the lines shown to the clipboard.")
        self.open_file_button = QPushButton("Open log file")
        self.open_file_button.setToolTip("The server's whole log on disk (every line, also those no longer "
                                         "shown here), in the default text viewer.")
        self.open_file_button.setEnabled(False)
        self.log_file: Path | None = None
        self.count_label = QLabel("")
        bar = QHBoxLayout()
        for w in (self.level, self.search, self.follow, self.copy_button, self.open_file_button):
            bar.addWidget(w)
        bar.addStretch(1)
        bar.addWidget(self.count_label)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addLayout(bar)
        lay.addWidget(self.view)
        self.level.currentIndexChanged.connect(self._rebuild)
        self.search.textChanged.connect(self._rebuild)
        self.copy_button.clicked.connect(self.copy_shown)
        self.open_file_button.clicked.connect(self._on_open_file)
        self.timer = QTimer(self)
        self.timer.setInterval(interval_ms)
        self.timer.timeout.connect(self.pull)
        self.timer.start()

    def set_log_file(self, path) -> None:
        """The file the server's full log goes to (None: none)."""
        self.log_file = Path(path) if path else None
        self.open_file_button.setEnabled(self.log_file is not None)
        self.open_file_button.setToolTip(str(self.log_file) if self.log_file else "")

    def _on_open_file(self) -> None:
        if self.log_file is not None:
            QDesktopServices.openUrl(QUrl.fromLocalFile(str(self.log_file)))

    def set_buffer(self, buffer: LogBuffer) -> None:
        self._buffer = buffer
        self._seq = 0
        self.lines_skipped = 0
        self._rebuild()  # what the buffer holds already, at once (the per-tick cap is for new lines)

    def _accept(self, item: LogLine) -> bool:
        mode = LEVELS[self.level.currentIndex()][1]
        ev = item.event
        if mode == "cache":
            if ev.kind not in CACHE_KINDS:
                return False
        elif mode and _RANK.get(ev.level, 1) < _RANK[mode]:
            return False
        needle = self.search.text().strip().lower()
        return not needle or needle in ev.line.lower()

    def pull(self) -> int:
        if self._buffer is None:
            return 0
        items = self._buffer.since(self._seq)
        if not items:
            return 0
        if len(items) > MAX_LINES_PER_TICK:
            # Appending tens of thousands of lines a second would freeze the window, and
            # nobody reads that fast: show the newest, count the rest (all are in the file).
            self.lines_skipped += len(items) - MAX_LINES_PER_TICK
            items = items[-MAX_LINES_PER_TICK:]
        self._seq = items[-1].seq
        shown = [it.event.line for it in items if self._accept(it)]
        if shown:
            self._append("\n".join(shown))
            self.lines_shown += len(shown)
            self.sig_lines_shown.emit(self.lines_shown)
        skipped = (f" · {self.lines_skipped:,} skipped to stay responsive (all are in the log file)"
                   if self.lines_skipped else "")
        self.count_label.setText(f"{len(self._buffer):,} lines{skipped}")
        return len(shown)

    def _append(self, text: str) -> None:
        bar = self.view.verticalScrollBar()
        at_bottom = bar.value() >= bar.maximum() - 2
        self.view.appendPlainText(text)
        if self.follow.isChecked() or at_bottom:
            self.view.moveCursor(QTextCursor.End)
            bar.setValue(bar.maximum())

    def _rebuild(self) -> None:
        self.view.clear()
        self.view.document().rootFrame()  # made again now (a clear drops it): the window's objects stay level
        if self._buffer is None:
            return
        items = self._buffer.since(0)[-MAX_LINES_SHOWN * 4:]
        self._seq = self._buffer.seq
        shown = [it.event.line for it in items if self._accept(it)][-MAX_LINES_SHOWN:]
        if shown:
            self._append("\n".join(shown))
            self.lines_shown += len(shown)
            self.sig_lines_shown.emit(self.lines_shown)

    def shown_text(self) -> str:
        return self.view.toPlainText()

    def copy_shown(self) -> None:
        QGuiApplication.clipboard().setText(self.shown_text())
