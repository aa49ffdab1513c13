"""The Sessions tab on the fake (sidecar-writing) server, driven by clicks.

Each test runs as one coroutine on the qasync loop, as the app does, and
presses the buttons a user presses (``qtbot.mouseClick``): the handlers that
run are the ones a user runs. Assertions are on what the user sees (message,
table, Monitor tab) and on what lands on disk (catalog rows, files).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time

import pytest
from PySide6.QtCore import Qt

from app import paths
from app.core.profile import LaunchProfile
from app.core.units import fmt_duration
from app.server.client import LlamaClient
from app.store.catalog import Catalog
from app.store.profiles import ProfileStore
from app.ui.panels import build_window
from app.ui.monitor.panel import SlotsTableModel
from app.ui.sessions.panel import SessionsPanel
from app.ui.sessions.controller import Operation
from app.ui.sessions.model import COL_SIDECAR
from tests.conftest import run, signal_future
from tests.fake_server.gui_helpers import make_window
from tests.fake_server.test_supervisor_fake import FAKE, free_port

pytestmark = pytest.mark.gui

PROMPT = " ".join(f"word{i}" for i in range(700))


@pytest.fixture
def setup(qtbot, qloop, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SIDECAR", "1")
    w, profile = make_window(qtbot, tmp_path)  # the Sessions and Monitor tabs, wired as the app wires them
    panel: SessionsPanel = w.sessions_panel
    open_tab(qtbot, w, panel)  # the user works in the Sessions tab
    return w, panel, profile


def open_tab(qtbot, w, panel):
    bar = w.tabs.tabBar()
    qtbot.mouseClick(bar, Qt.LeftButton, pos=bar.tabRect(w.tabs.indexOf(panel)).center())
    assert panel.isVisible()


async def started(w, panel, profile):
    connected = signal_future(panel.controller.service_changed, lambda s: s is not None)
    assert await w.controller.start_async(profile)
    await asyncio.wait_for(connected, 120)


async def complete(profile, prompt, slot, api_key=None):
    async with LlamaClient(profile.url, api_key) as c:
        return await c.completion(prompt, slot_id=slot, n_predict=2)


async def click(qtbot, panel, button, op: Operation, timeout: float = 120):
    """Click ``button`` and wait for the Sessions controller to say the operation's outcome."""
    done = signal_future(panel.controller.said, lambda said_op, ok, text: said_op is op)
    qtbot.mouseClick(button, Qt.LeftButton)
    return await asyncio.wait_for(done, timeout)


def choose_slot(panel, slot_id):
    idx = panel.slot.findData(slot_id)
    assert idx >= 0, [panel.slot.itemText(i) for i in range(panel.slot.count())]
    panel.slot.setCurrentIndex(idx)


def click_row(qtbot, panel, name):
    row = [r.name for r in panel.model.records].index(name)
    rect = panel.table.visualRect(panel.model.index(row, 0))
    qtbot.mouseClick(panel.table.viewport(), Qt.LeftButton, pos=rect.center())
    assert panel.selected().name == name


async def slot_chooser_shows(panel, slot_id, text, timeout=120):
    """The chooser follows the server's one slot picture (its sampler's snapshots: the Monitor's ticks,
    the server list's refresh)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        idx = panel.slot.findData(slot_id)
        if idx >= 0 and text in panel.slot.itemText(idx):
            return panel.slot.itemText(idx)
        await asyncio.sleep(0.05)
    raise AssertionError([panel.slot.itemText(i) for i in range(panel.slot.count())])


@contextlib.asynccontextmanager
async def slots_reads(w):
    """Each ``GET /slots`` of the shown server through its one HTTP client while the block runs, with
    the periodic readers held off: the server list's refresh (one already under way ends first; the
    Monitor tab is not seen: its sampler is paused)."""
    client, reads = w.controller.handle.client, []
    real = client.slots

    async def counted(*args, **kwargs):
        reads.append(args)
        return await real(*args, **kwargs)

    w.server_list.refresh_soon = lambda: None
    await w.server_list.tasks.wait()
    client.slots = counted
    try:
        yield reads
    finally:
        del client.slots, w.server_list.refresh_soon


def test_park_resume_verdict_delete_by_clicks(setup, qloop, qtbot):
    w, panel, profile = setup

    async def scenario():
        await started(w, panel, profile)
        assert panel.park_button.isEnabled()
        await complete(profile, PROMPT, 0)
        # regression: the chooser said "slot 0 — empty" until a park; it follows /slots now
        await slot_chooser_shows(panel, 0, "tokens")

        choose_slot(panel, None)  # "default slot": the park picks the slot that holds tokens
        qtbot.keyClicks(panel.name, "long chat")
        clicked = time.time()
        pictured = signal_future(w.monitor_panel.sig_snapshot, lambda snap: snap.taken_at >= clicked)
        async with slots_reads(w) as reads:
            label, ok, text = await click(qtbot, panel, panel.park_button, Operation.PARK)
            picture = await asyncio.wait_for(pictured, 120)
        assert ok and "Parked slot 0 as 'long chat'" in text
        # one park, one read of /slots: its decision's, which is the server's picture (the Monitor's too)
        assert len(reads) == 1, reads
        n_live = picture.slots[0].tokens_held
        assert n_live > 600 and panel.slot.itemText(panel.slot.findData(0)) == f"slot 0 — {n_live:,} tokens"
        with Catalog(paths.catalog_path()) as cat:
            rec = cat.get("fake", "long chat")
        assert rec.n_tokens > 600 and rec.sidecar_status == "present" and rec.sidecar_count > 0
        assert rec.state_path.is_file() and rec.state_path.with_name(rec.state_file + ".ckpt").is_file()
        assert [r.name for r in panel.model.records] == ["long chat"]

        click_row(qtbot, panel, "long chat")
        choose_slot(panel, 1)
        label, ok, text = await click(qtbot, panel, panel.resume_button, Operation.RESUME)
        assert ok and f"into slot 1: {rec.n_tokens:,} tokens" in text
        restored_in_monitor = signal_future(w.monitor_panel.sig_snapshot, lambda snap: any(
            r.id == 1 and r.tokens_known_from_restore for r in snap.slots))
        open_tab(qtbot, w, w.monitor_panel)  # the user looks at the Monitor tab
        await asyncio.wait_for(restored_in_monitor, 120)
        m: SlotsTableModel = w.monitor_panel.slots_model
        tokens = m.data(m.index(1, SlotsTableModel.COL_TOKENS))
        assert tokens == f"{rec.n_tokens:,} (restored)"
        assert m.data(m.index(1, SlotsTableModel.COL_SESSION)) == "long chat"
        with Catalog(paths.catalog_path()) as cat:
            assert cat.get("fake", "long chat").last_verdict == "UNKNOWN"

        # another client's next query on slot 1 is judged from the log
        verdict = signal_future(panel.controller.judged)
        await complete(profile, PROMPT + " and one more question", 1)
        slot, session, v = await asyncio.wait_for(verdict, 120)
        assert (slot, session, v.kind) == (1, "long chat", "HIT")
        assert panel.model.records[0].last_verdict == "HIT"
        # the prefill it avoided, at the rate measured from the first fill, shows in the status bar
        assert panel.model.records[0].time_saved_s > 0
        assert w.time_saved_label.text().startswith("Time saved by resumes: ")
        assert "cache_n" in w.time_saved_label.toolTip()
        monitor_verdict = signal_future(w.monitor_panel.sig_snapshot, lambda snap: any(
            r.id == 1 and "HIT" in (r.session or "") for r in snap.slots))
        w.monitor_panel.request_tick()
        await asyncio.wait_for(monitor_verdict, 120)

        open_tab(qtbot, w, panel)
        click_row(qtbot, panel, "long chat")
        # and, for this session, in the details line under the table
        saved = fmt_duration(panel.selected().time_saved_s)
        assert f"Time saved: {saved} (the last resume saved " in panel.list.details.text()
        label, ok, text = await click(qtbot, panel, panel.delete_button, Operation.DELETE)
        assert ok and panel.model.records == [] and not rec.state_path.exists()
        assert not rec.state_path.with_name(rec.state_file + ".ckpt").exists()
        await w.shutdown()

    run(qloop, scenario(), 240)


def test_park_of_an_empty_slot_is_shown_not_raised(setup, qloop, qtbot):
    w, panel, profile = setup

    async def scenario():
        await started(w, panel, profile)
        choose_slot(panel, 0)
        label, ok, text = await click(qtbot, panel, panel.park_button, Operation.PARK)
        assert not ok and "slot 0 is empty" in text
        with Catalog(paths.catalog_path()) as cat:
            assert cat.list() == []
        await w.shutdown()

    run(qloop, scenario(), 240)


def test_check_and_ab_by_clicks(setup, qloop, qtbot):
    w, panel, profile = setup

    async def scenario():
        await started(w, panel, profile)
        await complete(profile, PROMPT, 0)
        label, ok, _ = await click(qtbot, panel, panel.park_all_button, Operation.PARK_ALL)
        assert ok
        rec = panel.model.records[0]
        sidecar = rec.state_path.with_name(rec.state_file + ".ckpt")
        before = sidecar.read_bytes()

        click_row(qtbot, panel, rec.name)
        choose_slot(panel, 1)
        label, ok, text = await click(qtbot, panel, panel.check_button, Operation.CHECK, 120)
        assert ok and "HIT" in text and panel.report_dialog.isVisible()
        label, ok, text = await click(qtbot, panel, panel.ab_button, Operation.AB_CHECK, 120)
        assert ok, text
        ab = panel.report_dialog.report
        assert [ab.row(a).verdict.kind for a in ("with sidecar", "sidecar hidden")] == ["HIT", "DISCARDED"]
        # the window runs the server: every probe ran in a fresh server process, as the seed's A/B
        assert ab.protocol == "across restarts" and all(r.fresh_process for r in ab.rows)
        assert panel.controller.service is not None
        # the build's sidecar behaviour, from the server's start line, named in the Monitor
        assert "PKCL v2" in w.monitor_panel.sidecar_label.text()
        tip = panel.source_model.data(panel.source_model.index(0, COL_SIDECAR), Qt.ToolTipRole)
        assert "On this server (v2): this build will load the sidecar's" in tip
        assert sidecar.read_bytes() == before  # put back byte-identical
        with Catalog(paths.catalog_path()) as cat:
            assert {e.kind for e in cat.history(rec.id)} >= {"check", "ab"}
            assert cat.list_pending() == []
        qtbot.mouseClick(panel.history_button, Qt.LeftButton)
        assert panel.history_dialog.isVisible()
        await w.shutdown()

    run(qloop, scenario(), 120)


def test_park_all_and_stop_then_resume_all_by_clicks(setup, qloop, qtbot):
    w, panel, profile = setup

    async def scenario():
        await started(w, panel, profile)
        await complete(profile, PROMPT, 0)
        await complete(profile, "a short second chat " * 20, 1)
        stopped = signal_future(w.controller.sig_state, lambda s, d: s == "Stopped")
        label, ok, text = await click(qtbot, panel, panel.park_stop_button, Operation.PARK_ALL_AND_STOP)
        assert ok and "slot 0:" in text and "slot 1:" in text
        await asyncio.wait_for(stopped, 120)
        assert "Server Stopped" in w.state_label.text()
        with Catalog(paths.catalog_path()) as cat:
            assert sorted(r.slot_id for r in cat.list("fake")) == [0, 1]

        await started(w, panel, profile)  # the next start of the profile offers "Resume all"
        assert panel.resume_all_button.isVisibleTo(panel) and panel.resume_all_button.text() == "Resume all (2)"
        label, ok, text = await click(qtbot, panel, panel.resume_all_button, Operation.RESUME_ALL)
        assert ok and "→ slot 0: ok" in text and "→ slot 1: ok" in text
        assert not panel.resume_all_button.isVisibleTo(panel)
        await w.shutdown()

    run(qloop, scenario(), 240)


def test_park_all_and_stop_with_a_failing_slot_reports_it_and_keeps_the_server(setup, qloop, qtbot, monkeypatch):
    """Regression: a failing slot raised AttributeError in the panel."""
    monkeypatch.setenv("FAKE_SAVE_ERROR", "1")
    w, panel, profile = setup

    async def scenario():
        await started(w, panel, profile)
        await complete(profile, PROMPT, 0)
        label, ok, text = await click(qtbot, panel, panel.park_stop_button, Operation.PARK_ALL_AND_STOP)
        assert not ok
        assert "slot 0: failed: the server refused to save slot 0: Unable to save slot" in text
        assert "The server keeps running" in text
        assert w.controller.state == "Ready"
        await w.shutdown()

    run(qloop, scenario(), 240)


def test_sessions_tab_uses_the_profiles_key_file(qtbot, qloop, tmp_path, monkeypatch):
    """Regression: the Sessions tab ignored a profile's API key file (every call got 401)."""
    monkeypatch.setenv("FAKE_SIDECAR", "1")
    key_file = tmp_path / "key"
    key_file.write_text("s3cret-key\n")
    key_file.chmod(0o600)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    profile = LaunchProfile(name="keyed", model=str(model), server_binary=FAKE, port=free_port(), ctx_size=4096,
                            parallel=2, api_key_file=str(key_file))
    store = ProfileStore()
    store.save(profile)
    w = build_window(store)
    w.confirm_quit = False
    panel = w.sessions_panel
    qtbot.addWidget(w)
    w.show()
    open_tab(qtbot, w, panel)

    async def scenario():
        await started(w, panel, profile)
        await complete(profile, PROMPT, 0, api_key="s3cret-key")
        choose_slot(panel, 0)
        label, ok, text = await click(qtbot, panel, panel.park_button, Operation.PARK)
        assert ok, text
        await w.shutdown()

    run(qloop, scenario(), 240)


def test_long_messages_do_not_widen_the_window(setup, qloop, qtbot):
    """Regression: a long status message widened the window past the screen (1,280 → 1,540 px)."""
    w, panel, profile = setup
    w.resize(1280, 800)
    qtbot.waitExposed(w)
    width = w.width()
    long_path = "/home/user/.local/share/kv-valet/sessions/" + "a-very-long-session-name-" * 12 + ".bin"
    panel.say(f"Parked slot 0 as 'x' in {long_path}", ok=True)
    w.show_state("Crashed", f"exit 134 (SIGABRT): GGML_ASSERT failed at {long_path}")
    w.show_message(f"The server stopped unexpectedly: {long_path}")
    settle_layouts()
    assert w.width() == width


def settle_layouts(max_rounds: int = 100) -> None:
    """Deliver posted events until a round delivers no LayoutRequest: every layout the
    messages touched has been recomputed, up to the window (no timed wait)."""
    from PySide6.QtCore import QCoreApplication, QEvent, QObject

    class Counter(QObject):
        n = 0

        def eventFilter(self, obj, event):
            if event.type() == QEvent.LayoutRequest:
                self.n += 1
            return False

    app = QCoreApplication.instance()
    counter = Counter()
    app.installEventFilter(counter)
    try:
        for _ in range(max_rounds):
            counter.n = 0
            QCoreApplication.sendPostedEvents()
            app.processEvents()
            if counter.n == 0:
                return
        raise AssertionError(f"layouts still changing after {max_rounds} rounds")
    finally:
        app.removeEventFilter(counter)


def test_window_and_cli_end_in_the_same_catalog_and_files(setup, qloop, qtbot):
    """One scenario (park slot 0, resume into slot 1) through the window, then the CLI."""
    w, panel, profile = setup

    def state():
        with Catalog(paths.catalog_path()) as cat:
            recs = [(r.name, r.state_file, r.n_tokens, str(r.sidecar_status), r.sidecar_count, r.slot_id,
                     r.last_n_restored, str(r.last_verdict)) for r in cat.list("fake")]
        folder = paths.data_dir() / "sessions"
        files = sorted((p.name, p.stat().st_size) for p in folder.rglob("*") if p.is_file())
        return recs, files

    async def cli(*args):
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "app.cli", *args,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                    env=dict(os.environ))
        out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        return out.decode()

    async def scenario():
        await started(w, panel, profile)
        await complete(profile, PROMPT, 0)
        await slot_chooser_shows(panel, 0, "tokens")
        choose_slot(panel, 0)
        qtbot.keyClicks(panel.name, "same")
        assert (await click(qtbot, panel, panel.park_button, Operation.PARK))[1]
        click_row(qtbot, panel, "same")
        choose_slot(panel, 1)
        assert (await click(qtbot, panel, panel.resume_button, Operation.RESUME))[1]
        by_window = state()

        click_row(qtbot, panel, "same")
        assert (await click(qtbot, panel, panel.delete_button, Operation.DELETE))[1]
        async with LlamaClient(profile.url) as c:
            await c.erase_slot(1)
        assert state() == ([], [])

        await cli("park", "fake", "--slot", "0", "--name", "same")
        await cli("resume", "fake", "same", "--slot", "1")
        assert state() == by_window
        await w.shutdown()

    run(qloop, scenario(), 240)
