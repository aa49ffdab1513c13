"""Start the window on a qasync event loop (asyncio inside Qt).

``KV_VALET_SMOKE=1`` starts the default profile, waits until the server is
Ready (or fails), prints the outcome and quits: CI runs the README's install
command that way, offscreen, to prove that a fresh install gets a working
server from the window's own Start path.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from app.core.background import track

log = logging.getLogger(__name__)


def _has_display() -> bool:
    if os.environ.get("QT_QPA_PLATFORM"):
        return True
    if sys.platform != "linux":
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


GIL_SWITCH_INTERVAL_S = 0.001
GC_THRESHOLDS = (10_000, 50, 50)


def tune_runtime() -> None:
    """Keep the GUI thread's pauses under a frame while a server floods its log.

    * The log is read and parsed by a thread of ours; with Python's default 5 ms
      GIL switch interval the GUI thread can wait that long for every turn.
    * A full (generation 2) garbage collection walks every object, the 20,000
      parsed lines of the ring buffer included: 20-30 ms. The objects that live
      as long as the app are frozen out of it, and the collections come less often.
    """
    import gc

    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)




def run_gui(start: str | None = None) -> int:
    """The window until it closes; its exit code. ``start``: a profile whose server it starts at once
    (``kv-valet --start PROFILE``, e.g. from a desktop autostart entry), saying on stdout when it is
    Ready or why it is not."""
    smoke = os.environ.get("KV_VALET_SMOKE") == "1"
    if smoke:
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    if not _has_display():
        print("kv-valet: no display found (DISPLAY/WAYLAND_DISPLAY unset). Run it on a desktop, or use the "
              "headless commands: kv-valet serve default, kv-valet status URL, kv-valet --help.", file=sys.stderr)
        return 2
    from app.ui import xcb_libs

    # Qt's xcb plugin without its X libraries aborts with its own error (and a hint that names
    # libxcb-cursor0 whatever is missing): say what is missing and how to install it instead.
    missing = xcb_libs.check(os.environ, xcb_libs.library_loads)
    if missing:
        print(missing, file=sys.stderr)
        return 2
    import qasync
    from PySide6.QtGui import QIcon
    from PySide6.QtWidgets import QApplication

    from app.ui.panels import build_window

    tune_runtime()

    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("KV Valet")
    app.setOrganizationName("kv-valet")
    icon_path = os.path.join(os.path.dirname(__file__), "..", "..", "resources", "kv-valet.svg")
    if os.path.exists(icon_path):
        app.setWindowIcon(QIcon(icon_path))
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    from app.ui.collector import MainThreadCollector

    # garbage collected on this thread only: a Qt object freed in a worker thread crashes the event loop
    collector = MainThreadCollector(parent=app)
    collector.start()
    from app.store.profiles import ProfileStore
    from app.ui.dialogs.first_run import greet

    fresh_install = not ProfileStore().names()  # before the window creates the default profile
    window = build_window()
    # The app ends when the window says it closed (sig_closed), not when the last window
    # hides: with "keep running in the tray" the window hides and KV Valet goes on.
    app.setQuitOnLastWindowClosed(False)
    window.show()
    result = {"code": 0}
    if not smoke:
        from PySide6.QtCore import QTimer

        from app.ui.dialogs.leftovers import check_leftover_servers

        QTimer.singleShot(0, lambda: check_leftover_servers(window))
        greet(window, fresh_install)  # the first-run guide; the built-server question after it

    if os.environ.get("KV_VALET_EXIT_AFTER_SHOW") == "1":
        # For packaging checks (the standalone build's smoke test): the window came up, say so, quit.
        from PySide6.QtCore import QTimer

        def shown_then_quit() -> None:
            print(f"window shown: {window.windowTitle()}" if window.isVisible() else "window not shown", flush=True)
            result["code"] = 0 if window.isVisible() else 1
            window._quit(park=False)

        QTimer.singleShot(0, shown_then_quit)

    if smoke:
        async def smoke_run():
            from app.store.profiles import DEFAULT_PROFILE_NAME

            window.confirm_quit = False
            profile = window.store.load(DEFAULT_PROFILE_NAME)
            ok = await window.controller.start_async(profile)
            state = window.controller.state.value
            print(f"kv-valet smoke: default profile → server {state}"
                  + (f" at {window.controller.url}" if ok else f": {window.last_message}"), flush=True)
            result["code"] = 0 if ok else 1
            await window.shutdown()
            window.close()
            app.quit()

        track(smoke_run(), "the install smoke run")

    if start is not None and not smoke:
        async def start_run():
            try:
                profile = window.store.load(start)
            except Exception as e:  # report: a missing or broken profile is said, the window stays
                log.warning("cannot start profile %s: %s", start, e)
                print(f"kv-valet: cannot start profile '{start}': {e}", file=sys.stderr, flush=True)
                return
            ok = await window.controller.start_async(profile)
            print(f"kv-valet: profile '{start}': server Ready at {window.controller.url}" if ok
                  else f"kv-valet: profile '{start}': the server did not start: {window.last_message}",
                  file=sys.stdout if ok else sys.stderr, flush=True)

        track(start_run(), f"starting profile {start} at launch")

    # The desktop session ends (logout): the same park-all-then-stop path as SIGTERM.
    app.commitDataRequest.connect(window.session_ending)
    # Ctrl-C in the terminal: close the window in order (the server is stopped).
    signal.signal(signal.SIGINT, lambda *_: window.close())
    # A logout or a reboot: park the chats, then quit (a second signal quits at once).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: loop.call_soon_threadsafe(window.park_and_quit))
    with loop:
        run_until_closed(loop, window)
    return result["code"]


def run_until_closed(loop, window) -> None:
    """Run the window until it closes. If something quits the application under it (a session
    manager ending the desktop session calls quit()), the chats are parked and the server stopped
    anyway, before the process goes."""
    try:
        loop.run_until_complete(_until_closed(window))
    except RuntimeError:  # "Event loop stopped before Future completed."
        if not getattr(window, "_closing", False):
            window._closing = True
            from app.core.lifecycle import StopTrigger

            # a session manager ending the desktop session: the one park-then-stop, its one timeout
            loop.run_until_complete(window.park_then_shutdown(StopTrigger.SESSION_END))


async def _until_closed(window) -> None:
    done = asyncio.Event()
    window.sig_closed.connect(done.set)
    await done.wait()
    await window.shutdown()
