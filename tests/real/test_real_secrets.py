"""An API key reaches the real server and nothing else: not argv, not a log, not the pid record.

The key is typed where users type it by mistake (Extra arguments) and in the key
field; it must end up in the server's environment only, and every front end must
still get through with it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from app.cli.connect import connect  # the one resolver, as `kv-valet park` reaches a profile
from app.server.launcher import make_supervisor, plan_launch, pid_record_path
from app.store.catalog import Catalog
from app import paths
from app.store.profiles import ProfileStore

pytestmark = pytest.mark.real_server

KEY = "kvv-secret-4f9d2c71"


def test_a_key_typed_into_extra_arguments_stays_out_of_argv_logs_and_records(real_profile, caplog):
    caplog.set_level(logging.DEBUG)
    profile = real_profile.replace(name="keyed", extra_args=("--api-key", KEY, "--metrics"))
    ProfileStore().save(profile)

    async def go():
        plan = await asyncio.to_thread(plan_launch, profile)
        sup = make_supervisor(plan)
        await sup.start()
        try:
            pid = sup.pid
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert KEY.encode() not in b" ".join(cmdline) and b"--metrics" in cmdline
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            assert f"LLAMA_API_KEY={KEY}".encode() in environ.split(b"\0")

            # the key works (the server demands it) and the service finds it in the profile
            with Catalog(paths.catalog_path()) as cat:
                svc = await connect(cat, "keyed")
                rows = await svc.slot_rows()
                assert len(rows) == 2
                await svc.aclose()
            # the CLI gets it from the environment, never from an argument
            env = dict(os.environ, LLAMA_API_KEY=KEY)
            r = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "app.cli", "status", plan.url,
                                                         "--json"], capture_output=True, text=True, env=env,
                                        timeout=60)
            assert r.returncode == 0 and json.loads(r.stdout)["health"] == "ok", r.stderr
            r = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "app.cli", "status", plan.url,
                                                         "--json"], capture_output=True, text=True,
                                        env={k: v for k, v in os.environ.items() if k != "LLAMA_API_KEY"},
                                        timeout=60)
            assert json.loads(r.stdout)["slots_error"]  # without the key: refused
            log_text = "\n".join(item.event.line for item in sup.log.since(0))
            record = pid_record_path("keyed").read_text()
        finally:
            await sup.aclose()
        return log_text, record

    log_text, record = asyncio.run(go())
    assert "listening on" in log_text and KEY not in log_text
    assert KEY not in record
    assert KEY not in caplog.text
    from app.store.profiles import profile_path

    saved = profile_path("keyed", ProfileStore().folder)
    assert "--api-key" not in saved.read_text() and saved.stat().st_mode & 0o077 == 0


@pytest.mark.gui
def test_a_profiles_key_is_in_no_argv_file_report_log_panel_window_text_or_crash_message(
        qtbot, qloop, real_profile, caplog, tmp_path):
    """The key in the profile's own field: the window starts the real server with it, a client
    fills a slot, `kv-valet park`, `check --ab` with three exports, `doctor`, `sessions list` and
    `status` run as separate processes, the window's log panel shows the server log, a
    text every widget of the window shows is read, the server is killed and the window says why. Then every file under
    the data and state folders (catalog, server log, pid record, caches, the parked files),
    every export, every command's output, the window's texts and the server's
    /proc/PID/cmdline are searched for the key: it is in none of them."""
    import httpx
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QLineEdit

    from app.ui.panels import build_window
    from tests.conftest import run, signal_future
    from tests.real.helpers import TEXT

    caplog.set_level(logging.DEBUG)
    profile = real_profile.replace(name="keyed", api_key=KEY)
    store = ProfileStore()
    store.save(profile)
    w = build_window(store, tabs=False)
    w.confirm_quit = False
    qtbot.addWidget(w)
    w.profiles.set_profiles([profile], select="keyed")
    run(qloop, _click_start(qtbot, w, Qt.LeftButton, signal_future), 120)
    pid = w.controller.supervisor.pid
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    assert b"llama-server" in cmdline and KEY.encode() not in cmdline
    assert f"LLAMA_API_KEY={KEY}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")

    exports = tmp_path / "exports"
    exports.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_API_KEY"}  # the CLI finds the key in the profile
    commands = {
        "park": ["park", "keyed", "--slot", "0", "--name", "chat"],
        # tokens and verdicts, not text: the output check's cold prefills would read nothing that is asserted
        "check": ["check", "keyed", "chat", "--ab", "--yes", "--no-output-check", "--export", str(exports / "x.md"),
                  "--export", str(exports / "x.json"), "--export", str(exports / "x.csv")],
        "doctor": ["doctor", "keyed"],
        "doctor-json": ["doctor", "keyed", "--json"],
        "sessions": ["sessions", "list", "--json"],
        "status": ["status", "keyed", "--json"],
    }
    done: dict[str, subprocess.CompletedProcess] = {}

    async def clients():
        async with httpx.AsyncClient(base_url=profile.url, headers={"Authorization": f"Bearer {KEY}"},
                                     trust_env=False, timeout=300) as c:
            r = await c.post("/completion", json={"prompt": TEXT, "id_slot": 0, "n_predict": 4, "cache_prompt": True})
            r.raise_for_status()
        for name, args in commands.items():
            done[name] = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "app.cli", *args],
                                                 capture_output=True, text=True, env=env, timeout=600)

    run(qloop, clients(), 900)
    assert done["park"].returncode == 0, done["park"].stderr
    assert done["check"].returncode in (0, 3), done["check"].stdout + done["check"].stderr  # 3: DISCARDED (stock)
    assert all((exports / f"x.{ext}").stat().st_size > 0 for ext in ("md", "json", "csv"))
    assert done["doctor-json"].returncode in (0, 1) and json.loads(done["doctor-json"].stdout)
    assert json.loads(done["sessions"].stdout)[0]["name"] == "chat"
    assert json.loads(done["status"].stdout)["health"] == "ok", done["status"].stderr  # the key got it through

    if "listening on" not in w.log_panel.shown_text():
        run(qloop, signal_future(w.log_panel.sig_lines_shown,
                                 lambda n: "listening on" in w.log_panel.shown_text()), 10)
    # the form shows the key as dots, and its command-line preview masks it
    assert w.profiles.w["api_key"].echoMode() != QLineEdit.Normal
    assert w.profiles.w["api_key"].text() == KEY  # the field holds it: what it shows must not
    texts = {"log panel": w.log_panel.shown_text(), "preview": w.profiles.preview.toPlainText(),
             "window": window_text(w)}
    assert "keyed" in texts["window"] and "listening on" in texts["window"]  # the walk reads what is shown

    crashed = signal_future(w.controller.sig_crashed)
    os.kill(pid, signal.SIGKILL)
    outcome = run(qloop, crashed, 120)
    texts |= {"crash": outcome.summary(), "form errors": w.profiles.errors.text(), "state": w.state_label.text(),
              "url label": w.url_label.text(), "log panel after the crash": w.log_panel.shown_text(),
              "window after the crash": window_text(w)}
    assert "signal 9" in texts["crash"]
    run(qloop, w.shutdown(), 120)

    for name, r in done.items():
        texts[f"{name} stdout"], texts[f"{name} stderr"] = r.stdout, r.stderr
    texts["python logging"] = caplog.text  # at DEBUG, qasync logs the arguments of every call it runs
    assert [name for name, text in texts.items() if KEY in text] == []
    roots = (paths.data_dir(), paths.state_dir(), Path(profile.slot_save_path), exports)
    searched = [p for root in roots for p in root.rglob("*") if p.is_file()]
    assert any(p.name == "keyed.log" for p in searched) and any(p.suffix == ".bin" for p in searched)
    assert any(p.name == "catalog.sqlite3" for p in searched)
    assert [str(p) for p in searched if KEY.encode() in p.read_bytes()] == []


def window_text(window) -> str:
    """Every text the window shows a user, read from its widgets (not from a screenshot's compressed
    bytes): labels, buttons, line edits as displayed (a password field shows dots), text panes,
    combo boxes, tabs, tool tips, and every cell of every table and list."""
    from PySide6.QtCore import QModelIndex, Qt
    from PySide6.QtWidgets import (QAbstractButton, QAbstractItemView, QComboBox, QLabel, QLineEdit,
                                   QPlainTextEdit, QTabBar, QTextEdit, QWidget)

    out = [window.windowTitle()]
    for wd in [window, *window.findChildren(QWidget)]:
        out.append(wd.toolTip())
        if isinstance(wd, (QLabel, QAbstractButton)):
            out.append(wd.text())
        elif isinstance(wd, QLineEdit):
            out.append(wd.displayText())
        elif isinstance(wd, (QPlainTextEdit, QTextEdit)):
            out.append(wd.toPlainText())
        elif isinstance(wd, QComboBox):
            out += [wd.itemText(i) for i in range(wd.count())]
        elif isinstance(wd, QTabBar):
            out += [wd.tabText(i) for i in range(wd.count())]
        elif isinstance(wd, QAbstractItemView) and wd.model() is not None:
            m = wd.model()  # a list model's columnCount is private: walk the cells that exist
            cells = [(r, c) for r in range(m.rowCount(QModelIndex())) for c in range(64) if m.hasIndex(r, c)]
            out += [str(m.data(m.index(r, c), role) or "") for r, c in cells for role in (Qt.DisplayRole, Qt.ToolTipRole)]
    return "\n".join(out)


async def _click_start(qtbot, w, button, signal_future):
    ready = signal_future(w.controller.sig_state, lambda s, d: s == "Ready")
    qtbot.mouseClick(w.profiles.start_button, button)
    await ready
