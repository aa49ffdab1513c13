"""Screenshots of the real window for the README and docs/, taken from the running app.

Not drawn: the script starts KV Valet's own window on the default profile (the
real llama-server and Gemma 3 270M), fills a slot, parks it, restarts the
server, resumes the session, lets another request be judged, and grabs each
tab as the user would see it (``QWidget.grab`` of the live window). Run it on a
display, under Xvfb, or offscreen:

    QT_QPA_PLATFORM=offscreen .venv/bin/python packaging/screenshots.py [--out docs/screenshots] [--dark]

``--dark`` hands the app a dark palette, as a dark desktop does, and names the
images ``*-dark.png``.

It runs the app from a neutral home, so the pictures show no folder of the machine that took
them and your profiles, sessions and window layout are not touched: the script re-runs itself with
``HOME``, ``XDG_CONFIG_HOME``/``XDG_DATA_HOME``/``XDG_STATE_HOME``/``XDG_CACHE_HOME`` and
``KV_VALET_CONFIG_DIR``/``KV_VALET_DATA_DIR``/``KV_VALET_STATE_DIR`` inside a fresh
``/tmp/kv-valet-demo/home/user`` (``--home``; a fixed path, not a random temporary one, because
the window shows it: the sessions folder, the command line), and with Python from a link to the
virtualenv at ``~/kv-valet/.venv`` there, so the bundled llama-server's path reads
``/tmp/kv-valet-demo/home/user/kv-valet/.venv/lib/…`` rather than the checkout's. The folder is
removed at the end; one left there by an interrupted run is replaced (only one with this script's
marker file: anything else there is refused).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NEUTRAL_HOME = "/tmp/kv-valet-demo/home/user"
MARKER = ".kv-valet-screenshots"  # in a home this script made, and may empty
IN_NEUTRAL_HOME = "KVV_SCREENSHOTS_IN_NEUTRAL_HOME"  # set for the re-run inside it

TEXT = ("The valet parks each car in a numbered bay and writes the bay on a ticket. "
        "When the owner returns, the valet reads the ticket and fetches the car without searching. ") * 20


async def shoot(window, out: Path, suffix: str = "") -> None:
    from app.server.client import LlamaClient

    panel = window.sessions_panel

    def grab(name: str, tab=None) -> None:
        if tab is not None:
            window.tabs.setCurrentWidget(tab)
        # a passing status message (this machine's CPU note at the start, say) is not the picture's
        window.statusBar().clearMessage()
        window.repaint()
        window.grab().save(str(out / f"{name}{suffix}.png"))
        print(out / f"{name}{suffix}.png")

    async def started() -> None:
        connected = asyncio.get_running_loop().create_future()
        panel.controller.service_changed.connect(lambda s: connected.done() or s is None or connected.set_result(s))
        window.profiles.start_button.click()
        await asyncio.wait_for(connected, 300)

    async def done(label: str) -> None:
        from app.ui.sessions.controller import Operation

        op, fut = Operation(label), asyncio.get_running_loop().create_future()
        panel.controller.said.connect(lambda said_op, ok, text: fut.done() or said_op is not op or fut.set_result(ok))
        await asyncio.wait_for(fut, 120)

    await started()
    url = window.controller.url
    async with LlamaClient(url) as c:
        await c.completion(TEXT, slot_id=0, n_predict=8)
    window.tabs.setCurrentWidget(window.monitor_panel)  # the Monitor samples while it is shown
    sampled = asyncio.get_running_loop().create_future()
    window.monitor_panel.sig_snapshot.connect(
        lambda snap: sampled.done() or not any(r.tokens_held for r in snap.slots) or sampled.set_result(snap))
    window.monitor_panel.request_tick()
    await asyncio.wait_for(sampled, 60)
    grab("monitor", window.monitor_panel)
    window.tabs.setCurrentWidget(panel)
    panel.name.setText("long chat")
    panel.slot.setCurrentIndex(panel.slot.findData(0))
    waiting = done("Park")
    panel.park_button.click()
    await waiting
    await window.controller.stop_async()
    await started()
    panel.select("long chat")
    panel.slot.setCurrentIndex(panel.slot.findData(1))
    panel.controller.questions.confirm = lambda title, text: True
    waiting = done("Resume")
    panel.resume_button.click()
    await waiting
    verdict = asyncio.get_running_loop().create_future()
    panel.controller.judged.connect(lambda *a: verdict.done() or verdict.set_result(a))
    async with LlamaClient(url) as c:
        await c.completion(TEXT + " And then?", slot_id=1, n_predict=4)
    await asyncio.wait_for(verdict, 120)
    await asyncio.sleep(0.5)
    grab("sessions", panel)
    grab("cache-health", window.health_panel)
    grab("log", window.log_panel)
    await window.shutdown()


def dark_palette():
    """A dark Fusion palette, as a dark GNOME or KDE hands one to Qt."""
    from PySide6.QtGui import QColor, QPalette

    pal = QPalette()
    for role, colour in ((QPalette.Window, "#2b2b2b"), (QPalette.WindowText, "#e6e6e6"), (QPalette.Base, "#1e1e1e"),
                         (QPalette.AlternateBase, "#262626"), (QPalette.Text, "#e6e6e6"), (QPalette.Button, "#353535"),
                         (QPalette.ButtonText, "#e6e6e6"), (QPalette.Highlight, "#2f65ca"),
                         (QPalette.HighlightedText, "#ffffff"), (QPalette.ToolTipBase, "#353535"),
                         (QPalette.ToolTipText, "#e6e6e6"), (QPalette.PlaceholderText, "#8b949e"),
                         (QPalette.Mid, "#3a3a3a"), (QPalette.Dark, "#1a1a1a"), (QPalette.Light, "#505050"),
                         (QPalette.Midlight, "#404040"), (QPalette.Shadow, "#000000")):
        pal.setColor(role, QColor(colour))
    return pal


def neutral_home(home: Path) -> Path:
    """``home``, new and empty, with the marker that lets a later run empty it again."""
    if home.exists():
        if not (home / MARKER).is_file():
            raise SystemExit(f"screenshots.py: {home} exists and is not a home this script made; "
                             "remove it or choose another with --home")
        shutil.rmtree(home)
    home.mkdir(parents=True, mode=0o700)
    (home / MARKER).write_text("made by packaging/screenshots.py, which removes it when done\n")
    (home / ".cache" / "tmp").mkdir(parents=True)
    return home


def neutral_env(home: Path) -> dict[str, str]:
    """The environment of the app in ``home``: every folder it writes or shows lies in there."""
    env = dict(os.environ)
    env.pop("PYTHONHOME", None)
    xdg = {"XDG_CONFIG_HOME": home / ".config", "XDG_DATA_HOME": home / ".local" / "share",
           "XDG_STATE_HOME": home / ".local" / "state", "XDG_CACHE_HOME": home / ".cache"}
    env.update({k: str(v) for k, v in xdg.items()})
    env.update(HOME=str(home), TMPDIR=str(home / ".cache" / "tmp"),
               KV_VALET_CONFIG_DIR=str(xdg["XDG_CONFIG_HOME"] / "kv-valet"),
               KV_VALET_DATA_DIR=str(xdg["XDG_DATA_HOME"] / "kv-valet"),
               KV_VALET_STATE_DIR=str(xdg["XDG_STATE_HOME"] / "kv-valet"))
    env[IN_NEUTRAL_HOME] = "1"
    if sys.prefix == sys.base_prefix:  # no virtualenv: packages in the user site stay found
        import site

        env.setdefault("PYTHONUSERBASE", site.getuserbase())
    return env


def python_in(home: Path) -> str:
    """The interpreter, through a link to its virtualenv inside ``home`` (the packages' paths,
    llama-server's among them, are then under ``home`` too); outside a virtualenv, itself."""
    if sys.prefix == sys.base_prefix:
        return sys.executable
    link = home / "kv-valet" / ".venv"
    link.parent.mkdir(parents=True)
    link.symlink_to(sys.prefix, target_is_directory=True)
    return str(link / "bin" / os.path.basename(sys.executable))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "screenshots"))
    ap.add_argument("--dark", action="store_true", help="as on a desktop in dark mode")
    ap.add_argument("--port", type=int, default=None, help="the default profile's port (default 8080)")
    ap.add_argument("--home", default=NEUTRAL_HOME, help=f"the neutral home the app runs in (default {NEUTRAL_HOME})")
    args = ap.parse_args()
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    if os.environ.get(IN_NEUTRAL_HOME) != "1":
        home = Path(args.home).absolute()
        top = home  # the first folder of the path that this run creates, removed at the end
        while not top.parent.exists():
            top = top.parent
        try:
            neutral_home(home)
        except OSError as e:
            raise SystemExit(f"screenshots.py: cannot make the neutral home: {e}; choose another with --home") from None
        try:
            argv = [python_in(home), str(Path(__file__).resolve()), "--out", str(out), "--home", str(home)]
            argv += (["--dark"] if args.dark else []) + (["--port", str(args.port)] if args.port else [])
            return subprocess.run(argv, env=neutral_env(home), cwd=home).returncode
        finally:
            shutil.rmtree(top, ignore_errors=True)

    import qasync
    from PySide6.QtWidgets import QApplication

    from app.store.profiles import ProfileStore
    from app.ui.panels import build_window

    app = QApplication([])
    if args.dark:
        app.setPalette(dark_palette())
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    store = ProfileStore()
    store.ensure_default()
    if args.port:
        store.save(store.load("default").replace(port=args.port), previous_name="default", overwrite=True)
    window = build_window(store)
    window.confirm_quit = False
    window.resize(1400, 860)
    window.show()
    window.profiles.set_profiles([store.load("default")], select="default")
    with loop:
        loop.run_until_complete(shoot(window, out, "-dark" if args.dark else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
