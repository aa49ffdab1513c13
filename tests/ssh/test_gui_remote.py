"""Issue #20 in the window, over the real sshd (tests/ssh/conftest.py): the second home is the
other machine, running this checkout's real ``kv-valet`` and a real llama-server (Gemma 3 270M);
a real llama-server runs here too, started from the window.

Driven as a user does: the host added through the Add a host dialog (refused first, while its
key is not in known_hosts, with the remedy; added once it is), its row listed; its server
started from the row's menu (the host's ``kv-valet service start``); a chat there parked by the
host's own ``kv-valet park``; the remote row clicked: the Sessions tab lists the host's parked
session, the status bar says "Ready on box" and the Monitor tab shows the host's slots; Park on
that tab parks on the host; the session dragged onto this machine's row, moved
with "restore there and judge": it lands in this machine's catalog and folder (same SHA-256),
leaves the host (its file gone), and the verdict is said (stock build, sliding-window model:
DISCARDED, see tests/ssh/test_ssh_end_to_end.py). Cache health follows the selected server.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest
from PySide6.QtCore import QPointF, Qt
from PySide6.QtGui import QDragEnterEvent, QDragMoveEvent, QDropEvent
from PySide6.QtWidgets import QApplication

from app import paths
from app.core.profile import LaunchProfile
from app.core.states import ServerState
from app.servers.server_list import COL_NAME
from app.store.catalog import Catalog
from app.store.profiles import ProfileStore
from app.ui.sessions.controller import Operation
from tests.conftest import free_port, signal_future
from tests.fake_server.gui_helpers import make_window
from tests.fake_server.test_gui_server_list import click_row, listed, open_tab, start_by_click
from tests.real.helpers import TEXT

pytestmark = [pytest.mark.real_server, pytest.mark.gui]


def sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture
def ssh_home(sshd, real_binary, real_model, tmp_path, monkeypatch):
    """This user's ~/.ssh with an empty known_hosts (the test adds the key when asked), no agent."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "known_hosts").write_text("")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    return home / ".ssh" / "known_hosts"


async def add_host_by_dialog(w, sshd) -> tuple[bool, str]:
    dlg = w.server_list.host_dialog or w.server_list.open_host_dialog()
    dlg.name.setText("box")
    dlg.destination.setText(sshd.destination)
    dlg.port.setValue(sshd.port)
    dlg.identity.setText(str(sshd.client_key))
    checked = signal_future(dlg.sig_checked)
    dlg.add_button.click()
    return await asyncio.wait_for(checked, 120)


def drop_on_row(w, mime, target_id: str) -> None:
    """A drag of ``mime`` entering the server list and dropped on ``target_id``'s row, as Qt delivers it."""
    table = w.server_list.table
    rect = table.visualRect(w.server_list.model.index(w.server_list.model.row_of(target_id), COL_NAME))
    at = rect.center()
    for ev in (QDragEnterEvent(at, Qt.MoveAction, mime, Qt.LeftButton, Qt.NoModifier),
               QDragMoveEvent(at, Qt.MoveAction, mime, Qt.LeftButton, Qt.NoModifier),
               QDropEvent(QPointF(at), Qt.MoveAction, mime, Qt.LeftButton, Qt.NoModifier)):
        assert QApplication.sendEvent(table.viewport(), ev) and ev.isAccepted()


@pytest.mark.timeout(1200)  # above its own guard (the scenario: 900 s, of which the move: 600 s)
def test_add_a_host_list_its_sessions_park_there_and_drag_one_here_with_a_verdict(
        qtbot, qloop, tmp_path, sshd, ssh_home, real_binary, real_model):
    there = LaunchProfile(name="there", model=real_model, server_binary=real_binary, port=free_port(), ctx_size=4096,
                          parallel=1, slot_save_path=str(sshd.remote_home / "slots-gui") + "/")
    sshd.save_profile(there)
    here = there.replace(name="here", port=free_port(), slot_save_path=str(tmp_path / "slots-here") + "/")
    ProfileStore().save(here)
    w, _fake = make_window(qtbot, tmp_path)
    w.reload_profiles(select="here")
    panel, sessions = w.server_list, w.sessions_panel

    async def scenario():
        await start_by_click(qtbot, w, "here")

        # the dialog: refused while the key is unknown (with the remedy), added once it is known
        ok, text = await add_host_by_dialog(w, sshd)
        assert not ok and "REFUSED" in text and "ssh-keyscan" in text, text
        assert panel.host_dialog is not None and panel.servers.row("box:there") is None
        ssh_home.write_text(sshd.known_hosts.read_text())
        ok, text = await add_host_by_dialog(w, sshd)
        assert ok and "host key verified" in text and "there" in text, text
        await listed(w, lambda m: m.row_of("box:there") is not None)
        ids = [r.target_id for r in panel.model.rows]
        assert ids[0] == "profile:here" and "box:there" in ids  # this machine first, then the host's profiles
        assert panel.model.text(ids.index("box:there"), 2) == "box"

        # its server started from the row's menu; a chat there, parked by the host's own kv-valet
        row = panel.servers.row("box:there")
        started = await panel.remote_unit(row, "start")
        assert started["active"] is True, started
        try:
            await listed(w, lambda m: m.rows[m.row_of("box:there")].state is ServerState.READY)
            host = panel.servers.sources[1].host
            async with host.llama_client(there.url) as client:
                await client.completion(TEXT, slot_id=0, n_predict=4)
            await host.run_cli_text(["park", "there", "--slot", "0", "--name", "chat"])
            [remote] = await host.sessions("there")
            remote_state = Path(remote["save_dir"]) / remote["state_file"]
            before = sshd.sha256(remote_state)

            # a click on the remote row: the Sessions tab lists the host's session
            loaded = signal_future(w.remote_view.sig_loaded, lambda tid, _s: tid == "box:there")
            slots = signal_future(sessions.controller.slots_changed, lambda rows: len(rows) == there.parallel)
            click_row(qtbot, w, "box:there")
            await asyncio.wait_for(loaded, 120)
            assert [r.name for r in sessions.source_model.records] == ["chat"]  # listed before its status came
            await asyncio.wait_for(slots, 120)  # the host's status: its slots
            assert sessions.controller.sessions.host == "box"
            assert not sessions.check_button.isEnabled() and not sessions.rename_button.isEnabled()  # the host's
            assert sessions.park_button.isEnabled() and "'there' on box: Ready" in sessions.hint.text()
            assert "not shown here" in w.log_panel.view.toPlainText()
            assert w.health_panel.shown == "box:there" and w.health_panel.table.rowCount() == 0
            assert "Ready on box" in w.state_label.text() and "Server Stopped" not in w.state_label.text()

            # the Monitor tab: the host's slots from its `kv-valet status there --json`, asked while seen
            monitored = signal_future(w.remote_view.sig_monitor, lambda tid: tid == "box:there")
            open_tab(qtbot, w, w.monitor_panel)
            await asyncio.wait_for(monitored, 120)
            assert w.monitor_panel.slots_model.rowCount() == there.parallel
            assert "there on box" in w.monitor_panel.status_label.text() and "ok" in w.monitor_panel.status_label.text()
            open_tab(qtbot, w, sessions)

            # Park on that tab parks on the host
            sessions.slot.setCurrentIndex(sessions.slot.findData(0))
            sessions.name.setText("again")
            parked = signal_future(sessions.controller.said, lambda op, ok, text: op is Operation.PARK)
            relisted = signal_future(w.remote_view.sig_loaded, lambda tid, _s: tid == "box:there")
            qtbot.mouseClick(sessions.park_button, Qt.LeftButton)
            _label, ok, text = await asyncio.wait_for(parked, 120)
            assert ok, text
            await asyncio.wait_for(relisted, 120)
            assert sorted(r.name for r in sessions.source_model.records) == ["again", "chat"]

            # drag "chat" onto this machine's row: moved, restored and judged here
            rec = next(r for r in sessions.source_model.records if r.name == "chat")
            asking = signal_future(w.session_moves.sig_asking)
            done = signal_future(w.session_moves.sig_done)
            drop_on_row(w, w.session_moves.mime_of(rec), "profile:here")
            await asyncio.wait({asking}, timeout=120)
            assert asking.done(), sessions.message.text()
            dlg = asking.result()
            assert dlg.move_button.isChecked() and dlg.restore.isEnabled() and dlg.restore.isChecked()
            assert dlg.output_check.isEnabled() and dlg.output_check.isChecked()
            dlg.output_check.click()  # judged without a second, cold prefill of the chat
            dlg.ok_button.click()
            ok, text = await asyncio.wait_for(done, 600)
            assert ok and text.startswith("Moved 'chat' to 'here' as 'chat'"), text
            assert "first query: DISCARDED" in text, text
            assert w.session_moves.last_restore["verdict"]["kind"] == "DISCARDED"
            assert w.session_moves.last_restore["report"]["output_check"] is False

            # on disk: in this machine's catalog and folder, same bytes; gone on the host
            with Catalog(paths.catalog_path()) as cat:
                mine = cat.get("here", "chat")
            assert mine is not None and mine.state_path.parent == Path(here.slot_save_path.rstrip("/"))
            assert sha(mine.state_path) == before
            assert not sshd.exists(remote_state)
            assert [s["name"] for s in await host.sessions("there")] == ["again"]
            assert [r.name for r in sessions.source_model.records] == ["again"]  # the tab listed it again
        finally:
            stopped = await panel.remote_unit(panel.servers.row("box:there"), "stop")
        assert stopped is not None and stopped["active"] is False

        # back to this machine's row: its own sessions, its own health
        shown = signal_future(sessions.controller.service_changed, lambda s: s is not None and s.profile_name == "here")
        click_row(qtbot, w, "profile:here")
        await asyncio.wait_for(shown, 120)
        assert sessions.controller.sessions is sessions.controller.service
        assert [r.name for r in sessions.source_model.records] == ["chat"]
        assert w.health_panel.shown == "profile:here"
        await w.shutdown()

    qloop.run_until_complete(asyncio.wait_for(scenario(), 900))
