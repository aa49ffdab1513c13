"""A question opens without a nested event loop: other tasks go on until the user answers."""

import asyncio

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QMessageBox

from app.ui.panels import sessions_panel
from tests.conftest import run

pytestmark = pytest.mark.gui


def test_the_question_box_does_not_block_the_loop(qtbot, qloop):
    panel = sessions_panel()
    qtbot.addWidget(panel)

    async def scenario():
        ticks = []

        async def ticker():
            for i in range(3):
                ticks.append(i)
                await asyncio.sleep(0)

        answer = asyncio.ensure_future(panel.controller.questions.confirmed("Resume session", "slot 1 holds 336 tokens"))
        await ticker()  # three turns of the loop while the question is open
        assert ticks == [0, 1, 2] and not answer.done()
        assert panel.controller.questions.box is not None and panel.controller.questions.box.isVisible()
        qtbot.mouseClick(panel.controller.questions.box.button(QMessageBox.Yes), Qt.LeftButton)
        assert await asyncio.wait_for(answer, 120) is True
        await panel.aclose()

    run(qloop, scenario(), 240)
