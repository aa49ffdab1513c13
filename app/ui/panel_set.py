"""The panels a window shows, as one value: :mod:`app.ui.panels` builds them, the
:class:`~app.ui.main_window.MainWindow` lays them out.

A module of its own, below both: the window names what it is given without importing the
builder, which imports the window.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.ui.conversations.panel import ConversationsPanel
from app.ui.monitor.health_panel import HealthPanel
from app.ui.monitor.panel import MonitorPanel
from app.ui.servers.list_panel import ServerListPanel
from app.ui.servers.log_panel import LogPanel
from app.ui.servers.profile_panel import ProfilePanel
from app.ui.sessions.panel import SessionsPanel


@dataclass
class Panels:
    profiles: ProfilePanel
    log: LogPanel
    server_list: ServerListPanel
    sessions: SessionsPanel | None = None  # the server tabs: None in a window built without them
    monitor: MonitorPanel | None = None
    health: HealthPanel | None = None
    conversations: ConversationsPanel | None = None
