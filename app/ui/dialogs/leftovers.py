"""At a start: the servers an earlier KV Valet launched and left running (it was killed or crashed).

Each one found (by pid and start time, app.servers.service) is offered: attach to it, stop it,
or leave it.
"""

from __future__ import annotations

from PySide6.QtWidgets import QMessageBox

from app.core.background import track


def check_leftover_servers(window, ask: bool = True) -> list:
    """Servers launched by an earlier KV Valet that is gone (pid + start time match)."""
    controller = window.controller
    found = controller.service.leftovers(window.store.names())
    for rec in found:
        if not ask:
            continue
        box = QMessageBox(QMessageBox.Question, "Server still running",
                          f"The server of profile '{rec.profile}' (pid {rec.pid}, {rec.url}) is still running: it "
                          "outlived an earlier KV Valet. Its live slots are intact.", parent=window)
        attach = box.addButton("Attach", QMessageBox.AcceptRole)
        stop = box.addButton("Stop it", QMessageBox.DestructiveRole)
        box.addButton("Leave it", QMessageBox.RejectRole)
        box.exec()
        if box.clickedButton() is attach:
            track(controller.attach_async(rec.url, leftover=rec), f"attaching to {rec.url}")
        elif box.clickedButton() is stop:
            track(controller.service.stop_leftover(rec), f"stopping the leftover server pid {rec.pid}")
    return found
