"""The clock jumping backwards: ages and "older than" stay sane.

A session parked while the clock was two days ahead (a wrong RTC corrected by NTP, a VM
restored from a snapshot) carries an ``updated_at`` in the future once the clock is set
back. The window must not show a negative or absurd age, and "Delete older than N days"
(window or CLI) must delete only what was really parked more than N days ago: never the
"future" session, nor one parked just now.
"""

from __future__ import annotations

import time

import pytest

from app import paths
from app.sessions.records import DAY_S, older_than
from app.server.statefile import write_state_file
from app.store.catalog import Catalog, SessionRecord
from tests.conftest import run
from tests.faults.helpers import assert_consistent, cli

pytestmark = pytest.mark.gui


def _park(cat: Catalog, name: str, at: float, n_tokens: int) -> None:
    """A session as a park at wall-clock time ``at`` writes it (a real state file, its row)."""
    folder = paths.sessions_dir("real")
    folder.mkdir(parents=True, exist_ok=True)
    state = folder / f"{name}.bin"
    write_state_file(state, list(range(n_tokens)), bytes(4096))
    cat.add_or_replace(SessionRecord(name=name, profile="real", state_file=state.name, save_dir=str(folder),
                                     state_size=state.stat().st_size, n_tokens=n_tokens, memory_kind="dense",
                                     sidecar_status="not needed", created_at=at, updated_at=at))


def test_clock_jumping_back_keeps_ages_and_older_than_sane(qtbot, qloop, monkeypatch):
    from app.ui.panels import sessions_panel
    from app.ui.sessions.model import COL_AGE, COL_NAME

    real_now = time.time()
    with Catalog(paths.catalog_path()) as cat:
        _park(cat, "old", real_now - 10 * DAY_S, 100)
        # parked while the clock was 2 days ahead: time.time() itself said so, as a park reads it
        with monkeypatch.context() as clock:
            clock.setattr(time, "time", lambda: real_now + 2 * DAY_S)
            _park(cat, "future", time.time(), 200)
        # the clock is set back
        _park(cat, "fresh", time.time(), 300)
    folder = paths.sessions_dir("real")

    # the window: no negative age, no "in 2 d"; the future session reads "just now"
    from app.store.profiles import ProfileStore

    panel = sessions_panel(catalog=Catalog(paths.catalog_path()), store=ProfileStore())
    qtbot.addWidget(panel)
    panel.show()
    qtbot.waitExposed(panel)
    panel.refresh()
    m = panel.table.model()
    ages = {m.data(m.index(r, COL_NAME)): m.data(m.index(r, COL_AGE)) for r in range(m.rowCount())}
    assert ages == {"old": "10 d ago", "future": "just now", "fresh": "just now"}, ages
    run(qloop, panel.aclose(), 120)

    # "older than": only what was really parked that long ago
    with Catalog(paths.catalog_path()) as cat:
        assert [r.name for r in older_than(cat, 1)] == ["old"]
        assert [r.name for r in older_than(cat, 0, now=time.time() + 1)] == ["old", "fresh"]
    rc, out, err = run(qloop, cli("sessions", "rm", "--older-than", "1"), 120)
    assert rc == 0 and "1 session parked before" in out and "future" not in out and "fresh" not in out, (out, err)
    rc, out, err = run(qloop, cli("sessions", "rm", "--older-than", "1", "--yes"), 120)
    assert rc == 0 and "deleted 1 session parked before" in out, (out, err)
    listed = assert_consistent([folder])
    assert sorted(listed) == ["fresh", "future"]
    assert sorted(p.name for p in folder.iterdir()) == ["fresh.bin", "future.bin"]

    # a re-park of the "future" session after the jump: its age is its new park, its row keeps the first
    with Catalog(paths.catalog_path()) as cat:
        _park(cat, "future", time.time(), 250)
        rec = cat.get("real", "future")
        assert rec.updated_at <= time.time() and rec.n_tokens == 250
    assert sorted(assert_consistent([folder])) == ["fresh", "future"]
