"""Connect the window's panels to each other (they are built by app.ui.panels.build_window)."""

from __future__ import annotations

from app.core.background import TaskGroup


def wire(window) -> None:
    """The Sessions tab feeds the Monitor and the Cache health tab; the tray, the moves, a host's
    view and the shutdown guard subscribe to the Sessions controller's typed signals."""
    sessions, monitor, health = window.sessions_panel, window.monitor_panel, window.health_panel
    ctl = sessions.controller
    health.attach(window.controller, ctl, window)

    # A finding of the runtime detectors: a badge on the Monitor tab and a count on the tab.
    def on_findings(count: int, worst) -> None:
        monitor.set_health(count, worst)
        window.tabs.setTabText(window.tabs.indexOf(health), f"Cache health ({count})" if count else "Cache health")

    health.sig_findings.connect(on_findings)

    def on_sessions_changed() -> None:
        window.show_time_saved(ctl.catalog.total_time_saved())

    ctl.changed.connect(on_sessions_changed)
    on_sessions_changed()
    monitor.health_badge.clicked.connect(lambda: window.tabs.setCurrentWidget(health))

    # One bookkeeping for both tabs: the server's sampler reads the session service's own
    # record of what was restored where (with its verdict) and of each slot's
    # last task, which /slots cannot show (app.servers.service.sampler_for).
    def on_service(service) -> None:
        monitor.set_sidecar_behaviour(service.target.behaviour if service is not None else None)
        monitor.request_tick()

    def on_snapshot(snap) -> None:
        if ctl.service is not None and ctl.sessions is ctl.service and \
                snap.url.rstrip("/") == ctl.service.target.url.rstrip("/"):
            sessions.set_slot_rows(snap.slots)

    ctl.service_changed.connect(on_service)
    ctl.restored.connect(lambda _slot, _entry: monitor.request_tick())
    ctl.judged.connect(lambda _slot, _session, _verdict: monitor.request_tick())
    # a park or the server's start line can tell the build's sidecar behaviour later on
    ctl.changed.connect(lambda: monitor.set_sidecar_behaviour(
        ctl.service.target.behaviour if ctl.service is not None else None))
    monitor.sig_snapshot.connect(on_snapshot)
    from app.ui.sessions.move import SessionMoves  # Move to… / Copy to… on a session row: the other servers

    window.session_moves = SessionMoves(sessions, window.server_list)
    _show_snapshots(window)
    from app.ui.servers.remote_view import RemoteView  # a host's row: its sessions, park and resume there

    window.remote_view = RemoteView(window)
    window.server_list.sig_message.connect(lambda text, _ok: window.show_message(text))

    _guard_shutdown(window, ctl)

    # The tray: the state, Park all, Resume all, Open, Quit (where the desktop has one).
    from PySide6.QtWidgets import QSystemTrayIcon

    from app.ui.tray import Tray, tray_setting_action

    window.tray = Tray(window)
    if QSystemTrayIcon.isSystemTrayAvailable():
        window.tray.show()
    window.session_menu.addSeparator()
    window.tray_action = tray_setting_action(window)
    window.session_menu.addAction(window.tray_action)
    window.preferences.apply(window.prefs)


def _show_snapshots(window) -> None:
    """The status bar reads the shown server's snapshot from that server's one sampler (the
    server service's, as the Monitor tab and the server list do; a host's: app.ui.servers.remote_view)."""
    from app.core.states import ServerState
    from app.ui.widgets.status_bar import SnapshotLabel

    controller = window.controller
    samplers = controller.service.samplers
    window.snapshot_label = label = SnapshotLabel()
    window.statusBar().addPermanentWidget(label)
    samplers.subscribe(lambda key, snap: key == controller.target_id and label.show_snapshot(snap))
    controller.sig_selected.connect(lambda tid: label.show_snapshot(samplers.last(tid)))
    controller.sig_state.connect(lambda state, _detail: state in (ServerState.STOPPED, ServerState.CRASHED)
                                 and label.show_snapshot(None))


def _guard_shutdown(window, sessions) -> None:
    """Hold logind's delay lock while a server KV Valet started runs; on a shutdown or a
    suspend the server service's one park-then-stop (which keeps the server before a
    suspend), then let go."""
    from app.core.lifecycle import StopTrigger
    from app.core.states import PowerEvent
    from app.core.states import ServerState
    from app.servers.events import StateChanged
    from app.ui.shutdown_guard import ShutdownGuard

    guard = ShutdownGuard(parent=window)
    window.shutdown_guard = guard
    window.prepare_tasks = TaskGroup("the window's power events")

    def on_event(ev) -> None:  # any server's: the lock is held while any server launched here is Ready
        if not isinstance(ev, StateChanged):
            return
        if any(h.state == ServerState.READY for h in window.controller.owned_running()):
            guard.take()
        elif ev.state in (ServerState.STOPPED, ServerState.CRASHED):
            guard.release()

    async def park_then_release(what: PowerEvent) -> None:
        try:  # every server launched here, each into its own profile's folder
            await window.controller.park_then_stop_all(
                StopTrigger.SHUTDOWN if what is PowerEvent.SHUTDOWN else StopTrigger.SLEEP)
        finally:
            guard.release()  # whatever happens, the lock goes: logind must not wait for us forever

    def on_prepare(what, start: bool) -> None:
        what = PowerEvent(what)
        if start:
            window.prepare_tasks.start(park_then_release(what), f"parking before {what}")
        elif any(h.state == ServerState.READY for h in window.controller.owned_running()):
            guard.take()  # awake again: hold the lock for the next time
            if what is PowerEvent.SLEEP:  # did the chats survive? if not, offer what was parked before
                window.prepare_tasks.start(sessions.after_wake(), "checking the slots after a wake")

    window.controller.sig_event.connect(on_event)
    guard.sig_prepare.connect(on_prepare)
