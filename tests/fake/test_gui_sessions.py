"""The sessions panel on the fake (sidecar-writing) server: park, resume, verdict, rename, delete.

Each test runs as one coroutine on the qasync loop, as the app does.
"""

from __future__ import annotations

import asyncio

import pytest

from app.core.profile import LaunchProfile
from app.server.client import LlamaClient
from app.store.profiles import ProfileStore
from app.ui.main_window import MainWindow
from app.ui.sessions_panel import SessionsPanel
from tests.conftest import run, signal_future
from tests.fake.test_supervisor_fake import FAKE, free_port

pytestmark = pytest.mark.gui

PROMPT = " ".join(f"word{i}" for i in range(700))


@pytest.fixture
def setup(qtbot, qloop, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SIDECAR", "1")
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    profile = LaunchProfile(name="fake", model=str(model), server_binary=FAKE, port=free_port(), ctx_size=4096,
                            parallel=2)
    store = ProfileStore()
    store.save(profile)
    w = MainWindow(store)
    w.confirm_quit = False
    panel = SessionsPanel(store=store, confirm=lambda title, text: True)
    panel.attach(w.controller)
    w.add_panel(panel, "Sessions")
    qtbot.addWidget(w)
    return w, panel, profile


async def started(w, panel, profile):
    connected = signal_future(panel.sig_target, lambda t: t is not None)
    assert await w.controller.start_async(profile)
    await asyncio.wait_for(connected, 30)


async def complete(profile, prompt, slot):
    async with LlamaClient(profile.url) as c:
        return await c.completion(prompt, slot_id=slot, n_predict=2)


def test_park_resume_verdict_rename_delete(setup, qloop):
    w, panel, profile = setup

    async def scenario():
        await started(w, panel, profile)
        assert panel.park_button.isEnabled()
        await complete(profile, PROMPT, 0)
        result = await panel.park(0, "long chat")
        assert result.record.n_tokens > 600 and result.record.sidecar_status == "present"
        assert [r.name for r in panel.model.records] == ["long chat"]
        assert "Parked slot 0 as 'long chat'" in panel.message.text()
        idx = panel.model.index(0, 5)
        assert panel.model.data(idx).startswith("present") and "checkpoint" in panel.model.data(idx, 3).lower()

        restored = signal_future(panel.sig_restored)
        res = await panel.resume("long chat", 1)
        assert await asyncio.wait_for(restored, 5) == (1, result.record.n_tokens, "long chat")
        assert res.n_restored == result.record.n_tokens

        verdict = signal_future(panel.sig_verdict)
        await complete(profile, PROMPT + " and one more question", 1)
        slot, session, v = await asyncio.wait_for(verdict, 20)
        assert (slot, session, v.kind.value) == (1, "long chat", "HIT")
        assert panel.model.records[0].last_verdict == "HIT"

        assert panel.rename("long chat", "renamed")
        assert [r.name for r in panel.model.records] == ["renamed"]
        state_file = panel.model.records[0].state_path
        assert state_file.exists()
        assert panel.delete("renamed")
        assert panel.model.records == [] and not state_file.exists()
        await w.shutdown()

    run(qloop, scenario(), 90)


def test_refusal_is_shown_not_raised(setup, qloop):
    w, panel, profile = setup

    async def scenario():
        await started(w, panel, profile)
        assert await panel.park(0) is None  # slot 0 is empty
        assert not panel.message.text().startswith("Parked")
        assert "slot 0" in panel.message.text().lower()
        await w.shutdown()

    run(qloop, scenario(), 60)


def test_check_and_ab_from_the_panel(setup, qloop):
    w, panel, profile = setup

    async def scenario():
        await started(w, panel, profile)
        await complete(profile, PROMPT, 0)
        rec = (await panel.park(0, "chat")).record
        sidecar = rec.state_path.with_name(rec.state_file + ".ckpt")
        before = sidecar.read_bytes()
        report = await panel.check("chat", 1)
        assert report.verdict.kind.value == "HIT"
        assert panel.report_dialog.isVisible()
        ab = await panel.check("chat", 1, ab=True)
        kinds = [r.verdict.kind.value for r in ab.rows]
        assert kinds[:2] == ["HIT", "DISCARDED"]
        assert sidecar.read_bytes() == before  # put back byte-identical
        history = panel.catalog.history(rec.id)
        assert {e.kind for e in history} >= {"check", "ab"}
        panel.select("chat")
        panel._on_history()
        assert panel.history_dialog.isVisible()
        await w.shutdown()

    run(qloop, scenario(), 90)


def test_confirmation_does_not_block_the_loop(qtbot, qloop):
    """The real question box is opened non-modally and answered through a future."""
    from PySide6.QtWidgets import QMessageBox

    panel = SessionsPanel()
    qtbot.addWidget(panel)

    async def scenario():
        ticks = []

        async def ticker():  # other tasks keep running while the question is open
            for i in range(3):
                ticks.append(i)
                await asyncio.sleep(0)

        answer = asyncio.ensure_future(panel._confirmed("Resume session", "slot 1 holds 336 tokens"))
        await asyncio.gather(ticker(), asyncio.sleep(0.05))
        assert ticks == [0, 1, 2] and panel.question_box is not None
        panel.question_box.button(QMessageBox.Yes).click()
        assert await asyncio.wait_for(answer, 5) is True
        await panel.aclose()

    run(qloop, scenario(), 30)


def test_park_all_and_stop_then_resume_all_on_next_start(setup, qloop):
    w, panel, profile = setup

    async def scenario():
        await started(w, panel, profile)
        await complete(profile, PROMPT, 0)
        await complete(profile, "a short second chat " * 20, 1)
        stopped = signal_future(w.controller.sig_state, lambda s, d: s == "Stopped")
        results = await panel.park_all_and_stop()
        assert sorted(r.slot_id for r in results) == [0, 1] and all(r.ok for r in results)
        await asyncio.wait_for(stopped, 20)
        assert "Server Stopped" in w.state_label.text()

        await started(w, panel, profile)  # the next start of the profile offers "Resume all"
        assert panel.resume_all_button.isVisibleTo(panel) and panel.resume_all_button.text() == "Resume all (2)"
        out = await panel.resume_planned()
        assert sorted((r["slot"], r["ok"]) for r in out) == [(0, True), (1, True)]
        assert not panel.resume_all_button.isVisibleTo(panel)
        async with LlamaClient(profile.url) as c:
            assert len(await c.slots()) == 2
        await w.shutdown()

    run(qloop, scenario(), 90)
