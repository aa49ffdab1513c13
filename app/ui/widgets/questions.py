"""Questions that do not block the event loop.

A modal ``exec()`` inside a coroutine would spin a nested Qt loop and make
qasync enter other tasks while this one waits; ``open()`` and a future do not.
A panel mixes :class:`AsksQuestions` in; a test may replace ``confirm``
(``confirm(title, text) -> bool`` or an awaitable bool) or click the real box
(``question_box``).
"""

from __future__ import annotations

import asyncio
import inspect

from PySide6.QtWidgets import QMessageBox


class AsksQuestions:
    question_box: QMessageBox | None = None
    confirm = None  # set by the panel: its own _ask, or a test's stand-in

    async def _ask(self, title: str, text: str) -> bool:
        box = QMessageBox(QMessageBox.Question, title, text, QMessageBox.Yes | QMessageBox.Cancel, self)
        fut = asyncio.get_running_loop().create_future()
        box.finished.connect(lambda _r: fut.done() or fut.set_result(
            box.standardButton(box.clickedButton()) == QMessageBox.Yes))
        self.question_box = box
        box.open()
        try:
            return await fut
        finally:
            self.question_box = None
            box.deleteLater()

    async def _confirmed(self, title: str, text: str) -> bool:
        answer = (self.confirm or self._ask)(title, text)
        if inspect.isawaitable(answer):
            answer = await answer
        return bool(answer)
