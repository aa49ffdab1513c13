"""The server list above the tabs: every server the window runs or watches, one row each.

Selecting a row shows that server in every tab (Log, Sessions, Monitor, Conversations):
:meth:`app.ui.servers.controller.ServerController.select`. The rows and what they say come
from :mod:`app.servers.server_list` (a source per machine: this one's server service first,
a remote host's after it); this widget lists them, refreshes their figures while it is
visible, and follows the controller's events for states at once.
"""

from __future__ import annotations

import logging

from PySide6.QtCore import QItemSelectionModel, QModelIndex, QTimer, Qt, Signal
from PySide6.QtWidgets import (QAbstractItemView, QHBoxLayout, QHeaderView, QLabel, QMenu, QTableView,
                               QToolButton, QVBoxLayout, QWidget)

from app.core.background import track
from app.core.states import ServerState
from app.servers.server_list import (COL_NAME, LocalServerSource, RemoteServerSource, ServerList, ServerListSource,
                                  shown_rows)
from app.servers.events import StateChanged
from app.ui.servers.list_model import TARGET_ROLE, ServerListModel
from app.ui.widgets.tasks import Tasks

log = logging.getLogger(__name__)

REFRESH_MS = 2000
HINT = "Select a server: the tabs below show it. Start another profile and it runs beside the others."


class ServerListPanel(QWidget):
    sig_chosen = Signal(str)  # the user selected a row: its target id
    sig_refreshed = Signal()  # the rows were listed again (a refresh's figures, or a state)
    sig_message = Signal(str, bool)  # for the status bar: text, ok (a host's start or stop, a failure)

    def __init__(self, controller, parent=None):
        super().__init__(parent)
        self.controller = controller
        self.servers = ServerList([LocalServerSource(controller.service)])
        self.tasks = Tasks("ServerListPanel", self._task_failed)
        self._closed = False
        self._refreshing = False
        self._selecting = False
        self.host_dialog = None  # the Add a host dialog while it is open
        self.model = ServerListModel(self)
        self.table = QTableView()
        self.table.setObjectName("server_list")
        self.table.setModel(self.model)
        self.table.setSelectionBehavior(QAbstractItemView.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.NoEditTriggers)
        self.table.verticalHeader().hide()
        self.table.setWordWrap(False)
        self.table.setShowGrid(False)
        self.table.setAlternatingRowColors(True)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeToContents)
        header.setStretchLastSection(True)
        self.table.setToolTip("Every server KV Valet runs or watches. Hover a cell for its figures.")
        self.table.selectionModel().currentRowChanged.connect(self._on_row)
        self.table.setContextMenuPolicy(Qt.CustomContextMenu)
        self.table.customContextMenuRequested.connect(self._on_menu)
        self.title = QLabel("<b>Servers</b>")
        self.hint = QLabel(HINT)
        self.hint.setObjectName("server_list_hint")
        self.hint.setEnabled(False)  # the palette's muted text, light or dark
        top = QHBoxLayout()
        top.addWidget(self.title)
        top.addWidget(self.hint, 1)
        self.hosts_button = QToolButton()
        self.hosts_button.setText("Add a host")
        self.hosts_button.setToolTip("List the servers of another machine, over SSH (the hosts of `kv-valet hosts`).")
        self.hosts_button.setPopupMode(QToolButton.InstantPopup)
        self.hosts_menu = QMenu(self.hosts_button)
        self.hosts_menu.aboutToShow.connect(self._fill_hosts_menu)
        self.hosts_button.setMenu(self.hosts_menu)
        top.addWidget(self.hosts_button)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 4)
        lay.addLayout(top)
        lay.addWidget(self.table)
        self.timer = QTimer(self)
        self.timer.setInterval(REFRESH_MS)
        self.timer.timeout.connect(self._on_timer)
        self.servers.on_change(self.show_rows)
        controller.sig_selected.connect(self._on_selected)
        controller.sig_event.connect(self._on_event)
        self.show_rows()

    # -- sources --------------------------------------------------------------------------
    def add_source(self, source: ServerListSource) -> None:
        """A remote host's servers as rows (the same protocol as this machine's)."""
        self.servers.add(source)
        self.refresh_soon()

    def _fill_hosts_menu(self) -> None:
        from app.store.hosts import HostsError, HostStore

        self.hosts_menu.clear()
        new = self.hosts_menu.addAction("New host…")
        new.setToolTip("A machine you reach with ssh: its name, destination, port and kv-valet; checked at once.")
        new.triggered.connect(self.open_host_dialog)
        self.hosts_menu.addSeparator()
        listed = {s.name for s in self.servers.sources}
        try:
            names = HostStore().names()
        except (HostsError, OSError) as e:
            self.hosts_menu.addAction(f"The hosts file cannot be read: {e}").setEnabled(False)
            return
        for name in names:
            action = self.hosts_menu.addAction(name)
            action.setEnabled(name not in listed)
            action.triggered.connect(lambda _=False, name=name: self.add_host(name))
        if not names:
            self.hosts_menu.addAction("No SSH host saved yet").setEnabled(False)

    def open_host_dialog(self):
        """The Add a host dialog (app.ui.dialogs.host); a host that answered is listed at once."""
        from app.ui.dialogs.host import HostDialog

        self.host_dialog = dlg = HostDialog(self)
        dlg.sig_added.connect(lambda _name: self.tasks.spawn(self._list_host(dlg.host), "listing a new host's servers"))
        dlg.finished.connect(lambda _r: setattr(self, "host_dialog", None))
        dlg.open()
        return dlg

    async def _list_host(self, host) -> None:
        if any(s.name == host.name for s in self.servers.sources):
            await self.servers.remove(host.name)  # added again (a new port, a new path): the new one
        self.add_source(RemoteServerSource(host, service=self.controller.service))

    def add_host(self, name: str) -> None:
        """List host ``name``'s servers (app.remote over SSH, through its own kv-valet)."""
        from app.remote.host import RemoteHost
        from app.store.hosts import HostStore

        self.add_source(RemoteServerSource(RemoteHost(HostStore().get(name)), service=self.controller.service))

    # -- rows -------------------------------------------------------------------------------
    def show_rows(self) -> None:
        if self._closed:
            return
        rows = shown_rows(self.servers.rows(), self.controller.target_id)
        if self.model.set_rows(rows):
            self._select_row(self.controller.target_id)
        running = any(r.state is not ServerState.STOPPED for r in rows)
        if running and not self.timer.isActive():
            self.timer.start()
        elif not running:
            self.timer.stop()
        self.hint.setText(HINT if rows else "No server runs yet: select a profile on the left and press Start.")
        self.sig_refreshed.emit()

    def _on_event(self, ev) -> None:
        self.show_rows()
        if isinstance(ev, StateChanged) and ev.state is ServerState.READY:
            self.refresh_soon()  # its slots and figures now, not at the next tick

    def _on_timer(self) -> None:
        if self.isVisible():
            self.refresh_soon()

    def refresh_soon(self) -> None:
        if not self._closed and not self._refreshing:
            self.tasks.spawn(self.refresh(), "the server list: sampling every server's figures")

    async def refresh(self) -> None:
        """Sample every source's figures and list them."""
        self._refreshing = True
        try:
            await self.servers.refresh()
        finally:
            self._refreshing = False
        self.show_rows()

    # -- selection --------------------------------------------------------------------------
    def _on_row(self, current, _previous) -> None:
        if self._selecting or not current.isValid():
            return
        tid = self.model.data(self.model.index(current.row(), COL_NAME), TARGET_ROLE)
        if tid and tid != self.controller.target_id:
            self.controller.select(tid)
            self.sig_chosen.emit(tid)

    def _on_selected(self, target_id: str) -> None:
        self.show_rows()  # a stopped server stays listed while it is the one shown
        self._select_row(target_id)

    def _select_row(self, target_id: str | None) -> None:
        row = self.model.row_of(target_id)
        self._selecting = True
        try:
            sm = self.table.selectionModel()
            if row is None:
                sm.clearSelection()
                sm.setCurrentIndex(QModelIndex(), QItemSelectionModel.NoUpdate)
            else:
                self.table.selectRow(row)
        finally:
            self._selecting = False

    def select(self, target_id: str) -> bool:
        """Select the row of ``target_id`` as a click does; False when it is not listed."""
        row = self.model.row_of(target_id)
        if row is None:
            return False
        self.table.selectRow(row)
        return True

    # -- a row's menu -------------------------------------------------------------------------
    def _on_menu(self, pos) -> None:
        index = self.table.indexAt(pos)
        if not index.isValid():
            return
        row = self.model.rows[index.row()]
        h = self.controller.service.get(row.target_id)
        self.menu = menu = QMenu(self)
        show = menu.addAction("Show in the tabs")
        show.triggered.connect(lambda: self.select(row.target_id))
        if row.kind == "remote":
            action = "stop" if row.state is not ServerState.STOPPED else "start"
            unit = menu.addAction(f"{action.capitalize()} on {row.host}")
            unit.setToolTip(f"Through its systemd user unit kv-valet-{row.profile} (kv-valet service {action} there)")
            unit.triggered.connect(lambda: self.tasks.spawn(self.remote_unit(row, action), f"{action} {row.target_id}"))
        if h is not None and h.stoppable and row.state in (ServerState.STARTING, ServerState.LOADING, ServerState.READY):
            stop = menu.addAction("Stop")
            stop.triggered.connect(lambda: track(self.controller.service.stop(row.target_id), f"stopping {row.name}"))
        if h is not None and h.attached is not None:
            detach = menu.addAction("Detach")
            detach.triggered.connect(lambda: track(self.controller.service.remove(row.target_id),
                                                   f"detaching {row.name}"))
        menu.popup(self.table.viewport().mapToGlobal(pos))

    async def remote_unit(self, row, action: str) -> dict | None:
        """Start or stop a host's server (RemoteHost.systemd); the list shows its new state."""
        from app.remote.host import RemoteError

        source = next((s for s in self.servers.sources if s.name == row.host), None)
        if source is None:
            return None
        self.hint.setText(f"{action.capitalize()}ing '{row.profile}' on {row.host}…")
        try:
            data = await source.host.systemd(action, row.profile)
        except RemoteError as e:
            self.sig_message.emit(f"{action.capitalize()} '{row.profile}' on {row.host} failed: {e}", False)
            return None
        finally:
            await self.refresh()
        state = "running" if data.get("active") else "stopped"
        note = f" ({data['note']})" if data.get("note") else ""
        self.sig_message.emit(f"'{row.profile}' on {row.host}: {state}, {data.get('manager', 'systemd')}{note}", True)
        return data

    def _task_failed(self, exc: BaseException) -> None:
        self.sig_message.emit(f"Failed: {exc}", False)

    # -- closing ---------------------------------------------------------------------------------
    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.timer.stop()
        self.controller.sig_selected.disconnect(self._on_selected)
        self.controller.sig_event.disconnect(self._on_event)
        await self.tasks.end()
        await self.servers.aclose()
