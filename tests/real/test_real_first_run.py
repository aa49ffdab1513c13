"""The first-run guide, walked on the real server: start, fill, park, restart, resume, verdict."""

from __future__ import annotations

import asyncio

import pytest
from PySide6.QtCore import Qt

from app import paths
from app.store.catalog import Catalog
from app.store.profiles import ProfileStore
from app.ui.first_run import STEPS, FirstRunGuide, first_run_pending
from app.ui.main_window import MainWindow
from app.ui.wiring import attach_panels
from tests.conftest import run, signal_future

pytestmark = [pytest.mark.real_server, pytest.mark.gui]


def test_the_first_run_guide_walks_to_a_verdict(qtbot, qloop, real_profile):
    store = ProfileStore()
    store.save(real_profile.replace(name="default"))  # the default profile, on this test's port
    w = MainWindow(store)
    w.confirm_quit = False
    attach_panels(w)
    qtbot.addWidget(w)
    w.show()
    guide = FirstRunGuide(w)
    qtbot.addWidget(guide)
    guide.show()
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
    run(qloop, w.shutdown(), 60)


@pytest.mark.gui
def test_skip_closes_the_guide_for_good(qtbot, qloop):
    w = MainWindow(ProfileStore())
    qtbot.addWidget(w)
    guide = FirstRunGuide(w)
    qtbot.addWidget(guide)
    guide.show()
    qtbot.mouseClick(guide.skip_button, Qt.LeftButton)
    assert not guide.isVisible() and not first_run_pending(w)  # stored in the window's settings file
