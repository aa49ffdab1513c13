"""Server > Preferences…, used as a user uses it: typed, clicked, saved; what changes and what lands on disk."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tomllib

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication

from app import paths
from app.store.catalog import Catalog
from app.ui.sessions.controller import Operation
from tests.conftest import ROOT, run, signal_future
from tests.fake_server.gui_helpers import make_window
from tests.fake_server.test_gui_sessions import PROMPT, click, complete, open_tab, started

pytestmark = pytest.mark.gui


def open_preferences(qtbot, w):
    w.preferences_action.trigger()  # Server > Preferences… (Ctrl+,)
    qtbot.waitUntil(lambda: w.preferences.dialog is not None and w.preferences.dialog.isVisible(), timeout=120_000)
    return w.preferences.dialog


def type_into(qtbot, box, text: str) -> None:
    """Select what the field holds and type over it, as a user does."""
    box.setFocus()
    edit = box.lineEdit() if hasattr(box, "lineEdit") else box
    edit.selectAll()
    qtbot.keyClicks(edit, text)


def saved_file() -> dict:
    return tomllib.loads(paths.settings_path().read_text())


def test_preferences_typed_and_saved_apply_at_once_and_land_on_disk(qtbot, qloop, tmp_path, monkeypatch):
    w, profile = make_window(qtbot, tmp_path)

    async def scenario():
        connected = signal_future(w.sessions_panel.controller.service_changed, lambda s: s is not None)
        sampling = signal_future(w.monitor_panel.sig_sampling, lambda on: on)
        assert await w.controller.start_async(profile)
        await asyncio.wait_for(asyncio.gather(connected, sampling), 120)
        assert w.monitor_panel.sampler.interval == 1.0

        dlg = open_preferences(qtbot, w)
        type_into(qtbot, dlg.interval, "0.5")
        type_into(qtbot, dlg.busy_interval, "0.2")
        qtbot.mouseClick(dlg.keep_in_tray, Qt.LeftButton)
        qtbot.mouseClick(dlg.notifications, Qt.LeftButton)
        dlg.auto_resume.setFocus()
        qtbot.keyClick(dlg.auto_resume, Qt.Key_Down)
        type_into(qtbot, dlg.log_backups, "1")
        qtbot.mouseClick(dlg.save_button, Qt.LeftButton)
        qtbot.waitUntil(lambda: not dlg.isVisible(), timeout=120_000)

        assert saved_file() == {"monitor_interval_s": 0.5, "monitor_busy_interval_s": 0.2, "keep_in_tray": True,
                                "notifications": False, "auto_resume": "always", "log_backups": 1}
        # applied without a restart: the running sampler's rates, the Session menu's tray entry, notifications
        assert (w.monitor_panel.sampler.interval, w.monitor_panel.sampler.busy_interval) == (0.5, 0.2)
        assert w.tray_action.isChecked() and w.keep_in_tray
        w.tray.notify("title", "text")
        assert w.tray.notifications == []
        assert w.last_message == "Preferences saved."

        # the menu entry and the dialog agree: unticking the tray entry is saved the same way
        w.tray_action.trigger()
        assert "keep_in_tray" not in saved_file() and not w.keep_in_tray
        dlg = open_preferences(qtbot, w)
        assert not dlg.keep_in_tray.isChecked() and dlg.interval.value() == 0.5
        qtbot.mouseClick(dlg.defaults_button, Qt.LeftButton)  # Restore defaults, then Cancel: nothing changes
        assert dlg.interval.value() == 1.0
        qtbot.mouseClick(dlg.buttons.button(dlg.buttons.StandardButton.Cancel), Qt.LeftButton)
        assert saved_file()["monitor_interval_s"] == 0.5
        await w.shutdown()

    run(qloop, scenario(), 240)


def test_bad_values_are_refused_with_the_reason_and_nothing_is_written(qtbot, tmp_path):
    paths.settings_path().parent.mkdir(parents=True, exist_ok=True)
    paths.settings_path().write_text("log_backups = 7\n")  # what the user saved before
    w, _profile = make_window(qtbot, tmp_path)
    dlg = open_preferences(qtbot, w)
    type_into(qtbot, dlg.interval, "0.2")
    type_into(qtbot, dlg.busy_interval, "1")
    qtbot.mouseClick(dlg.save_button, Qt.LeftButton)
    assert dlg.isVisible() and "busy rate must be as fast as the idle one" in dlg.errors.text()
    # nothing lost: what was typed stays in the form, what was saved stays in the file
    assert (dlg.interval.value(), dlg.busy_interval.value(), dlg.log_backups.value()) == (0.2, 1.0, 7)
    assert paths.settings_path().read_text() == "log_backups = 7\n"
    type_into(qtbot, dlg.busy_interval, "0.1")
    type_into(qtbot, dlg.data_folder, "relative/folder")
    qtbot.mouseClick(dlg.save_button, Qt.LeftButton)
    assert dlg.isVisible() and "must be an absolute path" in dlg.errors.text()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    type_into(qtbot, dlg.data_folder, str(blocker / "sub"))
    qtbot.mouseClick(dlg.save_button, Qt.LeftButton)
    assert dlg.isVisible() and "cannot be used" in dlg.errors.text()
    assert dlg.data_folder.text() == str(blocker / "sub")
    assert paths.settings_path().read_text() == "log_backups = 7\n"


def test_a_new_data_folder_applies_from_the_next_start(qtbot, tmp_path, monkeypatch):
    monkeypatch.delenv("KV_VALET_DATA_DIR")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    w, _profile = make_window(qtbot, tmp_path)
    before = paths.data_dir()
    assert before == tmp_path / "xdg" / "kv-valet"
    dlg = open_preferences(qtbot, w)
    new = tmp_path / "big disk" / "kv-valet"
    type_into(qtbot, dlg.data_folder, str(new))
    assert "applies from the next start" in dlg.data_status.text()
    qtbot.mouseClick(dlg.save_button, Qt.LeftButton)
    qtbot.waitUntil(lambda: not dlg.isVisible(), timeout=120_000)
    assert saved_file() == {"data_folder": str(new)} and new.is_dir()
    assert "applies from the next start" in w.last_message
    assert paths.data_dir() == before  # this run keeps its catalog where it is

    env = {k: v for k, v in os.environ.items()}
    r = subprocess.run([sys.executable, "-m", "app", "settings"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"# data folder in use: {new}" in r.stdout  # the next start uses it


def test_resume_them_at_once_resumes_what_park_all_and_stop_left(qtbot, qloop, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SIDECAR", "1")
    w, profile = make_window(qtbot, tmp_path)
    panel = w.sessions_panel
    open_tab(qtbot, w, panel)

    async def scenario():
        await started(w, panel, profile)
        await complete(profile, PROMPT, 0)
        stopped = signal_future(w.controller.sig_state, lambda s, d: s == "Stopped")
        label, ok, _text = await click(qtbot, panel, panel.park_stop_button, Operation.PARK_ALL_AND_STOP)
        assert ok
        await asyncio.wait_for(stopped, 120)

        dlg = open_preferences(qtbot, w)
        dlg.auto_resume.setFocus()
        qtbot.keyClick(dlg.auto_resume, Qt.Key_Down)  # "Resume them at once"
        qtbot.mouseClick(dlg.save_button, Qt.LeftButton)
        qtbot.waitUntil(lambda: not dlg.isVisible(), timeout=120_000)

        resumed = signal_future(panel.controller.said, lambda op, ok, text: op is Operation.RESUME_ALL)
        await started(w, panel, profile)
        label, ok, text = await asyncio.wait_for(resumed, 120)
        assert ok and "→ slot 0: ok" in text
        assert not panel.resume_all_button.isVisibleTo(panel)
        with Catalog(paths.catalog_path()) as cat:
            assert [r.slot_id for r in cat.list("fake")] == [0]
        await w.shutdown()

    run(qloop, scenario(), 240)


def test_a_broken_settings_file_is_said_and_the_defaults_apply(qtbot, tmp_path):
    paths.settings_path().parent.mkdir(parents=True, exist_ok=True)
    paths.settings_path().write_text("monitor_interval_s = 'fast'\n")
    w, _profile = make_window(qtbot, tmp_path)
    assert "The settings file is not usable" in w.last_message and "monitor_interval_s" in w.last_message
    assert w.monitor_panel.interval == 1.0
    QApplication.processEvents()


def test_the_tray_choice_kept_in_window_ini_by_an_older_version_moves_into_the_preferences(qtbot, tmp_path):
    ini = paths.config_dir() / "window.ini"
    ini.parent.mkdir(parents=True, exist_ok=True)
    ini.write_text("[General]\nkeep_in_tray=true\n")
    w, _profile = make_window(qtbot, tmp_path)
    assert w.keep_in_tray and w.tray_action.isChecked()
    assert saved_file() == {"keep_in_tray": True} and "keep_in_tray" not in ini.read_text()
