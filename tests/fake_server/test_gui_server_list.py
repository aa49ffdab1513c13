"""The server list on two fake servers under two profiles, driven by clicks (issue #20).

Both profiles are started from the window, one after the other (the second while the first
runs); both rows show; selecting a row drives the Sessions and Monitor tabs; a park on one
server lands in that profile's folder and catalog rows only, and the other server's slots
and files stay as they were.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from PySide6.QtCore import Qt

from app import paths
from app.core.states import ServerState
from app.servers.server_list import COL_NAME, COL_SLOTS, COL_STATE
from app.server.client import LlamaClient
from app.store.catalog import Catalog
from app.store.profiles import ProfileStore
from app.ui.sessions.controller import Operation
from tests.conftest import free_port, signal_future
from tests.fake_server.gui_helpers import make_window

pytestmark = pytest.mark.gui

PROMPT = " ".join(f"word{i}" for i in range(300))


def click_profile(qtbot, w, name: str) -> None:
    lst = w.profiles.list
    item = lst.findItems(name, Qt.MatchExactly)[0]
    qtbot.mouseClick(lst.viewport(), Qt.LeftButton, pos=lst.visualItemRect(item).center())
    assert lst.currentItem().text() == name


def click_row(qtbot, w, target_id: str) -> None:
    panel = w.server_list
    row = panel.model.row_of(target_id)
    assert row is not None, [r.target_id for r in panel.model.rows]
    rect = panel.table.visualRect(panel.model.index(row, COL_NAME))
    qtbot.mouseClick(panel.table.viewport(), Qt.LeftButton, pos=rect.center())
    assert w.controller.target_id == target_id


async def start_by_click(qtbot, w, name: str) -> None:
    click_profile(qtbot, w, name)
    connected = signal_future(w.sessions_panel.controller.service_changed, lambda s: s is not None and s.profile_name == name)
    assert w.profiles.start_button.isEnabled()  # no "stop the other first"
    qtbot.mouseClick(w.profiles.start_button, Qt.LeftButton)
    await asyncio.wait_for(connected, 120)


async def listed(w, predicate, timeout: float = 120):
    """Wait until the server list's rows satisfy ``predicate`` (each refresh says so)."""
    panel = w.server_list
    if predicate(panel.model):
        return
    done = signal_future(panel.sig_refreshed, lambda: predicate(panel.model))
    panel.refresh_soon()
    await asyncio.wait_for(done, timeout)


def cell(model, target_id: str, col: int) -> str:
    return model.text(model.row_of(target_id), col)


async def fill(profile, slot: int, prompt: str) -> None:
    async with LlamaClient(profile.url) as c:
        await c.completion(prompt, slot_id=slot, n_predict=2)


async def park_by_click(qtbot, panel, slot: int, name: str) -> str:
    panel.slot.setCurrentIndex(panel.slot.findData(slot))
    panel.name.setText(name)
    done = signal_future(panel.controller.said, lambda op, ok, text: op is Operation.PARK)
    qtbot.mouseClick(panel.park_button, Qt.LeftButton)
    _label, ok, text = await asyncio.wait_for(done, 120)
    assert ok, text
    return text


def open_tab(qtbot, w, panel) -> None:
    bar = w.tabs.tabBar()
    qtbot.mouseClick(bar, Qt.LeftButton, pos=bar.tabRect(w.tabs.indexOf(panel)).center())
    assert panel.isVisible()


def files_in(folder) -> set[str]:
    return {p.name for p in folder.iterdir()} if folder.is_dir() else set()


def test_two_servers_listed_selected_and_parked_without_cross_talk(qtbot, qloop, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SIDECAR", "1")
    w, a = make_window(qtbot, tmp_path)
    b = dataclasses.replace(a, name="other", port=free_port())
    ProfileStore().save(b)
    w.reload_profiles(select="fake")
    sessions = w.sessions_panel
    dir_a, dir_b = paths.sessions_dir("fake"), paths.sessions_dir("other")

    async def scenario():
        await start_by_click(qtbot, w, "fake")
        await start_by_click(qtbot, w, "other")  # the first one runs on
        ids = ["profile:fake", "profile:other"]
        await listed(w, lambda m: [r.target_id for r in m.rows] == ids
                     and all(r.state is ServerState.READY for r in m.rows))
        assert w.controller.target_id == "profile:other" and w.server_list.table.currentIndex().row() == 1
        assert [cell(w.server_list.model, t, COL_STATE) for t in ids] == ["Ready", "Ready"]

        await fill(a, 0, PROMPT)
        await fill(b, 1, PROMPT + " on the other server")
        await listed(w, lambda m: all(cell(m, t, COL_SLOTS) == "1 / 2 in use" for t in ids))

        # select "fake": every tab shows it
        monitor_on_a = signal_future(w.monitor_panel.sig_snapshot, lambda snap: snap.url.rstrip("/") == a.url)
        shown_a = signal_future(sessions.controller.service_changed, lambda s: s is not None and s.profile_name == "fake")
        click_row(qtbot, w, "profile:fake")
        await asyncio.wait_for(shown_a, 120)
        assert w.profiles.list.currentItem().text() == "fake"  # the profile on the left follows
        open_tab(qtbot, w, w.monitor_panel)  # the Monitor samples while it is seen
        snap = await asyncio.wait_for(monitor_on_a, 120)
        assert [r.id for r in snap.slots if (r.tokens_held or 0) > 0] == [0]  # its slots, not the other's
        open_tab(qtbot, w, sessions)
        assert "Ready" in w.state_label.text() and w.profiles.stop_button.isEnabled()

        text = await park_by_click(qtbot, sessions, 0, "on fake")
        assert "Parked slot 0 as 'on fake'" in text
        with Catalog(paths.catalog_path()) as cat:
            assert [(r.profile, r.name, r.slot_id) for r in cat.list()] == [("fake", "on fake", 0)]
            rec = cat.get("fake", "on fake")
        assert rec.state_path.parent == dir_a and rec.state_path.is_file()
        assert files_in(dir_b) == set()  # nothing landed in the other profile's folder
        assert [r.name for r in sessions.model.records] == ["on fake"]

        # select "other": its (empty) sessions, its slots; park there
        shown_b = signal_future(sessions.controller.service_changed, lambda s: s is not None and s.profile_name == "other")
        click_row(qtbot, w, "profile:other")
        await asyncio.wait_for(shown_b, 120)
        assert sessions.model.records == []  # the Sessions tab lists this server's sessions only
        text = await park_by_click(qtbot, sessions, 1, "on other")
        assert "Parked slot 1 as 'on other'" in text
        with Catalog(paths.catalog_path()) as cat:
            assert sorted((r.profile, r.name, r.slot_id) for r in cat.list()) == [("fake", "on fake", 0),
                                                                                ("other", "on other", 1)]
            rec_b = cat.get("other", "on other")
        assert rec_b.state_path.parent == dir_b
        assert files_in(dir_a) == {rec.state_file, rec.state_file + ".ckpt"}  # the first park, untouched

        # Move to… on the first park's row: the menu lists the other server; the move lands there only
        menu = w.session_moves.menu_for(rec)
        move_menu = next(a.menu() for a in menu.actions() if a.text() == "Move to…")
        assert [a.text() for a in move_menu.actions()] == ["other (Ready)"]
        moved = signal_future(w.session_moves.sig_done)
        move_menu.actions()[0].trigger()
        ok, text = await asyncio.wait_for(moved, 120)
        assert ok and text.startswith("Moved 'on fake' to 'other' as 'on fake'"), text
        with Catalog(paths.catalog_path()) as cat:
            assert sorted((r.profile, r.name) for r in cat.list()) == [("other", "on fake"), ("other", "on other")]
            assert cat.get("other", "on fake").state_path.parent == dir_b
        assert files_in(dir_a) == set() and sorted(r.name for r in sessions.model.records) == ["on fake", "on other"]

        # stopping one from the list leaves the other running, and it stays shown while selected
        stopped = signal_future(w.controller.sig_event, lambda ev: getattr(ev, "state", None) is ServerState.STOPPED)
        await w.controller.service.stop("profile:other")
        await asyncio.wait_for(stopped, 120)
        assert w.controller.service.get("profile:fake").state is ServerState.READY
        click_row(qtbot, w, "profile:fake")
        await listed(w, lambda m: [r.target_id for r in m.rows] == ["profile:fake"])  # a stopped one goes
        await w.shutdown()

    qloop.run_until_complete(asyncio.wait_for(scenario(), 120))


def test_a_remote_hosts_servers_list_after_this_machines_and_select_like_them(qtbot, qloop, tmp_path):
    from app.servers.server_list import RemoteServerSource
    from tests.unit.test_server_list import STATUS, FakeHost

    w, _a = make_window(qtbot, tmp_path)
    host = FakeHost([{"profile": {"name": "big"}, "status": STATUS, "running": True}])

    async def scenario():
        refreshed = signal_future(w.server_list.sig_refreshed, lambda: w.server_list.model.row_of("gpu-box:big") == 0)
        w.server_list.add_source(RemoteServerSource(host))
        await asyncio.wait_for(refreshed, 120)
        assert [w.server_list.model.text(0, c) for c in range(3)] == ["big", "Ready", "gpu-box"]
        click_row(qtbot, w, "gpu-box:big")
        assert w.sessions_panel.controller.service is None and not w.profiles.stop_button.isEnabled()
        await w.shutdown()
        assert host.closed  # the host's connection goes with the window

    qloop.run_until_complete(asyncio.wait_for(scenario(), 240))
