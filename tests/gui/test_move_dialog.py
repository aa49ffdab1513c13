"""The move dialog's choices (app.ui.dialogs.move.MoveDialog): restore there, and the output check
that a restore may leave out (a second, cold prefill of the whole chat at the target)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDialog

from app.core.states import ServerState
from app.ui.dialogs.move import MoveDialog

pytestmark = pytest.mark.gui


def _target(state: ServerState):
    return SimpleNamespace(name="b", host="this machine", state=state)


def test_a_running_target_restores_and_checks_the_output_unless_the_user_unticks_it(qtbot):
    dlg = MoveDialog(None, "chat", _target(ServerState.READY))
    qtbot.addWidget(dlg)
    assert dlg.choice(QDialog.Accepted) == (False, True, True)
    qtbot.mouseClick(dlg.output_check, Qt.LeftButton)
    assert dlg.choice(QDialog.Accepted) == (False, True, False)
    qtbot.mouseClick(dlg.output_check, Qt.LeftButton)
    qtbot.mouseClick(dlg.restore, Qt.LeftButton)  # no restore: no output check either
    assert not dlg.output_check.isEnabled()
    assert dlg.choice(QDialog.Accepted) == (False, False, False)
    assert dlg.choice(QDialog.Rejected) is None


def test_a_target_not_running_offers_neither(qtbot):
    dlg = MoveDialog(None, "chat", _target(ServerState.STOPPED), copy=True)
    qtbot.addWidget(dlg)
    assert not dlg.restore.isEnabled() and not dlg.output_check.isEnabled()
    assert dlg.choice(QDialog.Accepted) == (True, False, False)
