"""Cancel on a move's progress bar in the window (issue #20), on two fake servers.

A cancel that lands while the target commits: the move waits for the commit's outcome, and
the target listed the session before the source was deleted, so the window says that both
copies remain (``move_session``'s ``on_committed``), not "cancelled"; both catalogs list it.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QPushButton

from app import paths
from app.move.endpoints import LocalEndpoint
from app.store.catalog import Catalog
from app.store.profiles import ProfileStore
from tests.conftest import free_port, signal_future
from tests.fake_server.gui_helpers import make_window
from tests.fake_server.test_gui_server_list import PROMPT, click_row, fill, listed, park_by_click, start_by_click

pytestmark = pytest.mark.gui


class HeldCommit(LocalEndpoint):
    """A profile here whose commit starts, says so, and waits for ``release`` before it runs."""

    def __init__(self, catalog, profile):
        super().__init__(catalog, profile)
        self.committing, self.release = asyncio.Event(), asyncio.Event()

    async def commit(self, manifest):
        self.committing.set()
        await self.release.wait()
        return await super().commit(manifest)


def test_a_cancel_that_lands_after_the_target_listed_the_session_says_both_copies_remain(
        qtbot, qloop, tmp_path, monkeypatch):
    w, a = make_window(qtbot, tmp_path)
    b = dataclasses.replace(a, name="other", port=free_port())
    ProfileStore().save(b)
    w.reload_profiles(select="fake")
    moves = w.session_moves

    async def scenario():
        await start_by_click(qtbot, w, "fake")
        await start_by_click(qtbot, w, "other")
        await listed(w, lambda m: len(m.rows) == 2)
        await fill(a, 0, PROMPT)
        shown = signal_future(w.sessions_panel.controller.service_changed, lambda s: s is not None and s.profile_name == "fake")
        click_row(qtbot, w, "profile:fake")
        await asyncio.wait_for(shown, 120)
        await park_by_click(qtbot, w.sessions_panel, 0, "chat")
        with Catalog(paths.catalog_path()) as cat:
            rec = cat.get("fake", "chat")
        target = HeldCommit(w.sessions_panel.controller.catalog, "other")
        monkeypatch.setattr(moves, "endpoint", lambda row: target)
        row = w.server_list.servers.row("profile:other")

        done = signal_future(moves.sig_done)
        moves.panel.controller.spawn(moves.move_or_copy(rec, row, copy=False), "the move under test")
        await asyncio.wait_for(target.committing.wait(), 120)
        cancel = moves.progress.findChild(QPushButton)
        assert cancel.text() == "Cancel"
        qtbot.mouseClick(cancel, Qt.LeftButton)  # lands while the target commits
        target.release.set()
        ok, text = await asyncio.wait_for(done, 120)
        assert not ok and "cancelled after it was copied to 'other' as 'chat'" in text, text
        assert "both copies remain" in text and "Not moved" not in text
        assert w.sessions_panel.message.text() == text
        with Catalog(paths.catalog_path()) as cat:
            assert sorted((r.profile, r.name) for r in cat.list()) == [("fake", "chat"), ("other", "chat")]
            assert cat.get("fake", "chat").state_path.is_file() and cat.get("other", "chat").state_path.is_file()
        await w.shutdown()

    qloop.run_until_complete(asyncio.wait_for(scenario(), 120))
