"""Cache health in the window: the seeds' crash and stall, their cause, and the fix by one click.

The fake server reproduces the two field reports: FAKE_ABORT_ON_IDLE_SAVE prints
seed 002's GGML_ASSERT and aborts on an idle-slot save; FAKE_IDLE_SAVE_SECONDS
makes each idle-slot save block the server like seed 004's.
"""

from __future__ import annotations

import asyncio
import re

import pytest
from PySide6.QtCore import Qt

from app import paths
from app.server.client import LlamaClient
from app.store.catalog import Catalog
from app.store.profiles import ProfileStore
from app.ui.sessions.controller import Operation
from tests.conftest import run, signal_future
from tests.fake_server.gui_helpers import make_window
from tests.fake_server.test_gui_sessions import PROMPT, choose_slot, click, click_row, open_tab

pytestmark = pytest.mark.gui


async def start(w, profile):
    connected = signal_future(w.sessions_panel.controller.service_changed, lambda s: s is not None)
    assert await w.controller.start_async(profile)
    return await asyncio.wait_for(connected, 120)


async def complete(url, prompt, slot):
    async with LlamaClient(url) as c:
        return await c.completion(prompt, slot_id=slot, n_predict=2)


def test_seed_002_crash_shows_cause_and_remedy_and_the_fix_resumes_the_chat(qtbot, qloop, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SIDECAR", "1")
    w, profile = make_window(qtbot, tmp_path)
    panel, health = w.sessions_panel, w.health_panel

    async def scenario():
        await start(w, profile)
        open_tab(qtbot, w, panel)
        await complete(profile.url, PROMPT, 0)
        choose_slot(panel, 0)
        qtbot.keyClicks(panel.name, "chat")
        assert (await click(qtbot, panel, panel.park_button, Operation.PARK))[1]
        await w.controller.stop_async()

        monkeypatch.setenv("FAKE_ABORT_ON_IDLE_SAVE", "1")  # the next server has its KV "on RPC"
        await start(w, profile)
        click_row(qtbot, panel, "chat")
        choose_slot(panel, 0)
        assert (await click(qtbot, panel, panel.resume_button, Operation.RESUME))[1]
        finding = signal_future(health.sig_findings)
        crashed = signal_future(w.controller.sig_crashed)
        with pytest.raises(Exception):  # another client's request on slot 1: the idle-slot save of slot 0 aborts
            await complete(profile.url, "a second chat", 1)
        outcome = await asyncio.wait_for(crashed, 120)
        assert "GGML assertion failed" in outcome.summary()
        count, worst = await asyncio.wait_for(finding, 120)
        assert (count, worst) == (1, "error")
        assert w.monitor_panel.health_badge.isVisibleTo(w.monitor_panel)
        assert "Cache health (1)" in w.tabs.tabText(w.tabs.indexOf(health))

        open_tab(qtbot, w, health)
        f = health.selected()
        assert f.rule_id == "rpc-prompt-cache-assert" and "#26128" in health.detail.text()
        assert [b.text() for b in health.remedy_buttons] == ["Apply: Turn the prompt cache off (--cache-ram 0)",
                                                             "Apply: Use one slot (-np 1)"]
        done = signal_future(health.sig_remedy_done, lambda ok, text: text.startswith("Remedy applied")
                             or not ok)
        qtbot.mouseClick(health.remedy_buttons[0], Qt.LeftButton)
        ok, text = await asyncio.wait_for(done, 120)
        assert ok, text
        fixed = ProfileStore().load("fake-fix-rpc-prompt-cache-assert")
        assert fixed.cache_ram == 0 and ProfileStore().load("fake").cache_ram is None  # a copy; the original stays
        argv = w.controller.plan.argv
        flag = next(a for a in argv if a in ("-cram", "--cache-ram"))
        assert w.controller.profile.name == fixed.name and argv[argv.index(flag) + 1] == "0"
        assert "'chat' → slot 0: resumed" in text
        svc = panel.controller.service
        assert svc.target.restored[0].session == "chat"
        # the same request no longer crashes the server: no idle-slot save without a prompt cache
        await complete(fixed.url, "a second chat", 1)
        assert w.controller.state == "Ready"
        await w.shutdown()

    run(qloop, scenario(), 120)


def test_seed_004_idle_save_stall_is_measured_and_the_fix_parks_and_resumes(qtbot, qloop, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_IDLE_SAVE_SECONDS", "0.4")
    w, profile = make_window(qtbot, tmp_path, kv_unified=True, cache_idle_slots=True)
    panel, health = w.sessions_panel, w.health_panel

    async def scenario():
        await start(w, profile)
        await complete(profile.url, PROMPT, 0)
        finding = signal_future(health.sig_findings)
        await complete(profile.url, "another conversation about trains " * 10, 1)  # slot 0 is saved meanwhile
        count, _worst = await asyncio.wait_for(finding, 120)
        f = health.health.findings[0]
        assert f.rule_id == "idle-slot-save-stall" and f.slot == 0 and f.details["ms"] >= 350
        assert health.health.figures.worst_idle_save_ms >= 350

        open_tab(qtbot, w, health)
        # the text shows the figures (how long the save took on this machine is not the test's business:
        # at least the injected 0.4 s, above)
        fig, text = health.health.figures, health.figures.text()
        assert f"Idle-slot / prompt-cache saves: 2, worst {fig.worst_idle_save_ms:,.0f} ms" in text
        bars = [int(m.group(1)) for m in re.finditer(r"█+ (\d+)$", text, re.M)]
        assert sum(bars) == 2 and bars == [n for _, n in fig.histogram() if n]  # slot 1 was empty: ~0 ms
        done = signal_future(health.sig_remedy_done, lambda ok, text: text.startswith("Remedy applied")
                             or not ok)
        qtbot.mouseClick(health.remedy_buttons[0], Qt.LeftButton)  # --no-cache-idle-slots
        ok, text = await asyncio.wait_for(done, 120)
        assert ok, text
        assert w.controller.profile.cache_idle_slots is False
        assert "--no-cache-idle-slots" in w.controller.plan.argv
        # -kvu cleared the idle slot 0 when it was saved (seed 004's TAG_IDLE_SLOT_CLEAR): slot 1 held the chat
        assert "parked 1 of 1 slots first" in text and "→ slot 1: resumed" in text
        with Catalog(paths.catalog_path()) as cat:
            assert [r.slot_id for r in cat.list("fake")] == [1]
        await w.shutdown()

    run(qloop, scenario(), 120)
