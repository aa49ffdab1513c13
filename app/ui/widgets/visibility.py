"""Sampling only while someone can see it.

A panel that polls (the Monitor) mixes :class:`PausesWhenHidden` in: its
``sampler`` (anything with ``pause()`` and ``resume()``, or None) is paused
while the panel is hidden — another tab shown, the window minimised or hidden
to the tray — and resumed when it shows again.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QEvent, QObject, Qt
from PySide6.QtWidgets import QWidget


class PausesWhenHidden:
    sampler: Any = None
    _watched_window: QWidget | None = None

    def _should_sample(self) -> bool:
        if not self.isVisible():
            return False
        win = self.window()
        return not (win is not None and win.windowState() & Qt.WindowMinimized)

    def update_pause(self) -> None:
        """Pause or resume the sampler as the panel is seen now (the panel calls it when it sets one)."""
        s = self.sampler
        if s is None:
            return
        if self._should_sample():
            s.resume()
        else:
            s.pause()

    def _watch_window(self) -> None:
        win = self.window()
        if win is self._watched_window:
            return
        if self._watched_window is not None:
            self._watched_window.removeEventFilter(self)
        self._watched_window = win
        if win is not None and win is not self:
            win.installEventFilter(self)

    def showEvent(self, event: Any) -> None:  # noqa: N802
        super().showEvent(event)
        self._watch_window()
        self.update_pause()

    def hideEvent(self, event: Any) -> None:  # noqa: N802
        super().hideEvent(event)
        self.update_pause()

    def changeEvent(self, event: Any) -> None:  # noqa: N802
        super().changeEvent(event)
        if event.type() == QEvent.WindowStateChange:
            self.update_pause()

    def eventFilter(self, obj: QObject, event: QEvent) -> bool:  # noqa: N802
        if obj is self._watched_window and event.type() in (QEvent.WindowStateChange, QEvent.Show, QEvent.Hide):
            self.update_pause()
        return False
