"""The first-run guide, walked on the real server: start, fill, park, restart, resume, verdict."""

from __future__ import annotations

import asyncio

import pytest
from PySide6.QtCore import Qt

from app import paths
from app.core.profile import BUILT_MARKER
from app.store.catalog import Catalog
from app.store.profiles import ProfileStore
from app.ui.dialogs.first_run import STEPS, FirstRunGuide, first_run_pending
from app.ui.panels import build_window
from tests.conftest import run, signal_future
from tests.fake_server.gui_helpers import walk_guide
from tests.real.helpers import link_real_build
from tests.real.sidecar_bin import sidecar_server_bin  # noqa: F401  (fixture)

pytestmark = [pytest.mark.real_server, pytest.mark.gui]


def open_guide(qtbot, store):
    """The window on ``store`` with its first-run guide open."""
    w = build_window(store)
    w.confirm_quit = False
    qtbot.addWidget(w)
    w.show()
    guide = FirstRunGuide(w)
    qtbot.addWidget(guide)
    guide.show()
    return w, guide


@pytest.mark.timeout(600)  # above its own guards: the walk (400 s) and the shutdown (60 s)
def test_the_first_run_guide_walks_to_a_verdict(qtbot, qloop, real_profile):
    store = ProfileStore()
    store.save(real_profile.replace(name="default"))  # the default profile, on this test's port
    w, guide = open_guide(qtbot, store)
    assert first_run_pending(w) and guide.next_button.text() == STEPS[0][0]

    async def scenario():
        results = []
        for i, (title, _text) in enumerate(STEPS):
            done = signal_future(guide.sig_step_done, lambda index, text, i=i: index == i)
            assert guide.next_button.text() == title
            qtbot.mouseClick(guide.next_button, Qt.LeftButton)
            index, text = await asyncio.wait_for(done, 180)
            results.append(text)
            if i == 0:
                assert w.controller.state == "Ready"  # the first step ends at a Ready default server
        return results

    results = run(qloop, scenario(), 400)
    assert "Parked slot 0 as 'first chat'" in results[2]
    assert "Resumed 'first chat' into slot 0" in results[4]
    assert results[5].startswith("Verdict: DISCARDED")  # the stock build keeps no checkpoints
    with Catalog(paths.catalog_path()) as cat:
        assert cat.get("default", "first chat").last_verdict == "DISCARDED"
    assert guide.next_button.text() == "Close"
    qtbot.mouseClick(guide.next_button, Qt.LeftButton)
    assert not first_run_pending(w) and not guide.isVisible()
    run(qloop, w.shutdown(), 120)


@pytest.mark.gui
def test_skip_closes_the_guide_for_good(qtbot, qloop):
    w = build_window(ProfileStore(), tabs=False)
    qtbot.addWidget(w)
    guide = FirstRunGuide(w)
    qtbot.addWidget(guide)
    guide.show()
    qtbot.mouseClick(guide.skip_button, Qt.LeftButton)
    assert not guide.isVisible() and not first_run_pending(w)  # stored in the window's settings file


@pytest.mark.timeout(1500)  # above its own guards: two walks (400 s each), the build (300 s), a resume (120 s), shutdown
def test_the_first_run_ends_in_a_hit_on_the_built_server(qtbot, qloop, real_profile, sidecar_server_bin,  # noqa: F811
                                                         tmp_path, monkeypatch):
    """DISCARDED on the stock build, then the guide's own Build button (the real pipeline: a
    cache hit on the entry tests/sidecar-server/build made, linked into this test's cache
    folder), the same steps on the built server to a HIT, and the session parked on the
    stock build still resumes there (DISCARDED: it has no sidecar, and the verdict says so)."""
    from app.ui.dialogs.first_run import BUILT_STEPS

    root = link_real_build(sidecar_server_bin, tmp_path, monkeypatch)
    real_entry = sidecar_server_bin.parent
    store = ProfileStore()
    store.save(real_profile.replace(name="default", ctx_size=8192))
    w, guide = open_guide(qtbot, store)

    first = run(qloop, walk_guide(qtbot, guide, STEPS), 400)
    assert first[5].startswith("Verdict: DISCARDED") and guide.build_button.isVisible()
    built = signal_future(guide.sig_built)
    qtbot.mouseClick(guide.build_button, Qt.LeftButton)
    ok, text = run(qloop, built, 300)
    assert ok, text
    assert store.load("default").server_binary == BUILT_MARKER

    second = run(qloop, walk_guide(qtbot, guide, BUILT_STEPS), 400)
    assert str(root / real_entry.name / "llama-server") in second[0]  # the restart ran the built server
    assert second[5].startswith("Verdict: HIT"), second[5]
    assert "× faster" in second[5] and guide.prefill_ms["DISCARDED"] > guide.prefill_ms["HIT"]
    svc = w.sessions_panel.controller.service
    assert str(svc.target.behaviour) == "v2"

    async def stock_session_on_the_built_server():
        result = await svc.resume("first chat", 1, force=True)  # parked by the stock build: resumable
        assert result.n_restored > 0
        verdict = signal_future(w.sessions_panel.controller.judged, lambda slot, _name, _v: slot == 1)
        text = await svc.target.client.detokenize(read_tokens("first chat"))
        await svc.target.client.completion(text + " Thanks.", slot_id=1, n_predict=1)
        _slot, _name, v = await asyncio.wait_for(verdict, 120)
        return v

    v = run(qloop, stock_session_on_the_built_server(), 120)
    assert v.kind == "DISCARDED" and "no checkpoint sidecar" in v.reason, v.reason
    with Catalog(paths.catalog_path()) as cat:
        assert cat.get("default", "first chat (built)").last_verdict == "HIT"
        assert cat.get("default", "first chat").sidecar_status == "missing"
    run(qloop, w.shutdown(), 120)


def read_tokens(name: str) -> list[int]:
    from app.server.statefile import read_state_tokens

    with Catalog(paths.catalog_path()) as cat:
        return read_state_tokens(cat.get("default", name).state_path)
