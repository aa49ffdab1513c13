"""The window's panels, built in one place: for the app (:mod:`app.ui.app`) and for the tests.

:func:`build_window` makes the server controller, the panels (:class:`app.ui.panel_set.Panels`), the
:class:`~app.ui.main_window.MainWindow` that shows them, and wires them to each other
(:func:`app.ui.wiring.wire`: the tray, the shutdown guard, the moves, a host's view).
``tabs=False`` leaves out the Sessions, Monitor, Cache health and Conversations tabs (a test of
the profile form or of the status bar needs no server panels).
"""

from __future__ import annotations

from app import settings
from app.store.profiles import ProfileStore
from app.ui.conversations.panel import ConversationsPanel
from app.ui.main_window import MainWindow
from app.ui.monitor.health_panel import HealthPanel
from app.ui.monitor.panel import MonitorPanel
from app.ui.panel_set import Panels
from app.ui.servers.controller import ServerController
from app.ui.servers.list_panel import ServerListPanel
from app.ui.servers.log_panel import LogPanel
from app.ui.servers.profile_panel import ProfilePanel
from app.ui.sessions.controller import SessionsController
from app.ui.sessions.panel import SessionsPanel


def sessions_panel(*, catalog=None, store: ProfileStore | None = None, confirm=None) -> SessionsPanel:
    """A Sessions tab: its controller and its widget (the catalog is opened here when not given)."""
    return SessionsPanel(SessionsController(catalog=catalog, store=store, confirm=confirm))


def build_panels(controller: ServerController, store: ProfileStore, *, tabs: bool = True) -> Panels:
    panels = Panels(profiles=ProfilePanel(), log=LogPanel(), server_list=ServerListPanel(controller))
    if tabs:
        prefs = settings.load_or_defaults()[0]
        panels.sessions = sessions_panel(store=store, catalog=controller.service.catalog)
        panels.sessions.controller.attach(controller)
        panels.monitor = MonitorPanel(interval=prefs.monitor_interval_s, busy_interval=prefs.monitor_busy_interval_s)
        panels.monitor.attach(controller)
        panels.health = HealthPanel(store=store)
        panels.conversations = ConversationsPanel()
        panels.conversations.attach(controller)
    return panels


def build_window(store: ProfileStore | None = None, *, tabs: bool = True) -> MainWindow:
    """The window as the app shows it (``tabs``: with its server panels, wired)."""
    from app.ui.wiring import wire

    store = store or ProfileStore()
    controller = ServerController()
    window = MainWindow(store, controller, build_panels(controller, store, tabs=tabs))
    if tabs:
        wire(window)
    return window
