"""Questions that do not block the event loop.

A modal ``exec()`` inside a coroutine would spin a nested Qt loop and make
qasync enter other tasks while this one waits; ``open()`` and a future do not.
A panel holds a :class:`Questions` (composition, not a mixin); a test may set
``confirm`` (``confirm(title, text) -> bool`` or an awaitable bool) or click the
real box (``box``, open while a question waits).
"""

from __future__ import annotations

import asyncio
import inspect

from PySide6.QtWidgets import QMessageBox, QWidget


class Questions:
    def __init__(self, parent: QWidget, confirm=None):
        self.parent = parent
        self.confirm = confirm  # None: the real box; else a test's (or the first-run guide's) stand-in
        self.box: QMessageBox | None = None

    async def ask(self, title: str, text: str) -> bool:
        """The real question box, opened without a nested loop: True when the user says Yes."""
        box = QMessageBox(QMessageBox.Question, title, text, QMessageBox.Yes | QMessageBox.Cancel, self.parent)
        fut = asyncio.get_running_loop().create_future()
        box.finished.connect(lambda _r: fut.done() or fut.set_result(
            box.standardButton(box.clickedButton()) == QMessageBox.Yes))
        self.box = box
        box.open()
        try:
            return await fut
        finally:
            self.box = None
            box.deleteLater()

    async def confirmed(self, title: str, text: str) -> bool:
        answer = (self.confirm or self.ask)(title, text)
        if inspect.isawaitable(answer):
            answer = await answer
        return bool(answer)
