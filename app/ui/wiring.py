"""Attach the panels (sessions, monitor) to the main window and connect them."""

from __future__ import annotations

from app.ui.monitor_panel import MonitorPanel
from app.ui.sessions_panel import SessionsPanel


def attach_panels(window) -> None:
    sessions = _attached(SessionsPanel(store=window.store), window.controller)
    monitor = _attached(MonitorPanel(), window.controller)
    window.add_panel(sessions, "Sessions")
    window.add_panel(monitor, "Monitor")

    # After a restore /slots shows no tokens for the slot: the monitor shows
    # the count the sessions panel knows, with the session and its verdict.
    def on_restored(slot: int, n: int, session: str) -> None:
        monitor.restored[slot] = (n, session)
        monitor.request_tick()

    def on_verdict(slot: int, session: str, verdict) -> None:
        if slot in monitor.restored:
            n, _ = monitor.restored[slot]
            figures = ""
            if verdict.prompt_n is not None and verdict.cache_n is not None:
                figures = f" (cache_n {verdict.cache_n:,}, prompt_n {verdict.prompt_n:,})"
            monitor.restored[slot] = (n, f"{session} — {verdict.kind.value}{figures}")
            monitor.request_tick()

    sessions.sig_restored.connect(on_restored)
    sessions.sig_verdict.connect(on_verdict)
    window.sessions_panel = sessions
    window.monitor_panel = monitor


def _attached(panel, controller):
    panel.attach(controller)
    return panel
