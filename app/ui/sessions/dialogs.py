"""The Sessions tab's dialogs: built here, opened and awaited by the panel.

Each question is opened with ``open()``, not ``exec()``, and awaited through
:func:`answer`: a modal ``exec()`` inside a coroutine would spin a nested Qt
loop (see :mod:`app.ui.widgets.questions`). The panel keeps the dialog it shows in an
attribute (``days_dialog``, ``folder_dialog``, ``history_dialog``) so a test
can answer it as a user would.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from PySide6.QtWidgets import QDialog, QFileDialog, QInputDialog, QLabel, QVBoxLayout, QWidget


async def answer(dlg: QDialog, value_of: Callable[[int], Any]) -> Any:
    """Open ``dlg`` without a nested event loop and wait until it is answered: ``value_of``
    of its result code (``QDialog.Accepted`` or ``Rejected``). The dialog is deleted after."""
    fut = asyncio.get_running_loop().create_future()
    dlg.finished.connect(lambda r: fut.done() or fut.set_result(value_of(r)))
    dlg.open()  # not exec(): see app.ui.widgets.questions
    try:
        return await fut
    finally:
        dlg.deleteLater()


def folder_dialog(parent: QWidget) -> QFileDialog:
    """Asks the folder an attached server parks into (its --slot-save-path)."""
    dlg = QFileDialog(parent, "The server's --slot-save-path folder")
    dlg.setFileMode(QFileDialog.Directory)
    return dlg


def chosen_folder(dlg: QFileDialog, result: int) -> str:
    """The folder chosen in :func:`folder_dialog` ("" when cancelled)."""
    return dlg.selectedFiles()[0] if result and dlg.selectedFiles() else ""


def days_dialog(parent: QWidget) -> QInputDialog:
    """"Delete older than…"'s first question: how many days."""
    dlg = QInputDialog(parent)
    dlg.setWindowTitle("Delete older sessions")
    dlg.setLabelText("Delete the sessions last parked more than this many days ago:")
    dlg.setInputMode(QInputDialog.IntInput)
    dlg.setIntRange(0, 36500)
    dlg.setIntValue(30)
    return dlg


def chosen_days(dlg: QInputDialog, result: int) -> int | None:
    """The days answered in :func:`days_dialog` (None when cancelled)."""
    return dlg.intValue() if result == QDialog.Accepted else None


def history_dialog(parent: QWidget, name: str, events) -> QDialog:
    """Every resume, check and A/B run of the session ``name`` over time (not modal)."""
    from app.ui.dialogs.check_charts import HistoryChart

    dlg = QDialog(parent)
    dlg.setWindowTitle(f"Resume history — {name}")
    chart = HistoryChart(dlg)
    chart.set_events(events)
    lay = QVBoxLayout(dlg)
    lay.addWidget(QLabel("Restore time and first-query prompt time of every resume, check and A/B run, "
                         "coloured by verdict: a regression after a server update shows here."))
    lay.addWidget(chart, 1)
    dlg.resize(720, 380)
    return dlg


def ask_new_name(parent: QWidget, old: str) -> str | None:
    """"Rename…": the new name typed (stripped), or None when cancelled or unchanged."""
    new, ok = QInputDialog.getText(parent, "Rename session", "New name:", text=old)
    return new.strip() if ok and new.strip() and new.strip() != old else None
