"""The one crash-journal engine (app.sessions.journal): every kind registers its recovery, one loop runs them."""

from __future__ import annotations

import logging

import pytest

from app.sessions import journal
from app.sessions.journal import HideJournal, Journal, JournalKind, Owner, Recovery, recover, recovers, replay
from app.store.catalog import Catalog


@pytest.fixture
def kinds(monkeypatch):
    """A registry of its own: the test's fake kinds never leak into the app's."""
    registry: dict = {}
    monkeypatch.setattr(journal, "_RECOVERERS", registry)
    return registry


def test_a_registered_kind_runs_once_per_recovery(kinds):
    runs = []

    @recovers(JournalKind.PROXY_LEASE)
    def fake(run: Recovery) -> list[str]:
        runs.append(run.subject)
        return [f"recovered {run.subject}"]

    assert recover([JournalKind.PROXY_LEASE], Recovery(subject="leases")) == ["recovered leases"]
    assert runs == ["leases"]
    assert fake(Recovery(subject="again")) == ["recovered again"]  # calling it goes through the loop too
    assert runs == ["leases", "again"]


def test_a_failing_kind_is_reported_and_the_others_still_run(kinds, caplog):
    ran = []

    @recovers(JournalKind.AB_HIDE)
    def broken(run: Recovery) -> list[str]:
        raise RuntimeError("disk gone")

    @recovers(JournalKind.PROXY_LEASE)
    def fine(run: Recovery) -> list[str]:
        ran.append(True)
        return ["done"]

    with caplog.at_level(logging.ERROR):
        msgs = recover([JournalKind.AB_HIDE, JournalKind.PROXY_LEASE], Recovery())
    assert msgs == ["could not recover the interrupted ab-hide operations: disk gone", "done"]
    assert ran == [True]
    [rec] = [r for r in caplog.records if "ab-hide" in r.getMessage()]
    assert "disk gone" in str(rec.exc_info[1])


def test_an_unregistered_kind_is_an_error_not_a_silent_no_op(kinds):
    with pytest.raises(LookupError, match="move-in"):
        recover([JournalKind.MOVE_IN], Recovery())


def test_replay_ends_handled_entries_drops_malformed_and_leaves_running_ones(tmp_path):
    cat = Catalog(tmp_path / "c.db")
    try:
        j = Journal(cat)
        running = j.begin(HideJournal("a", "a.hidden", 1, Owner.me()))  # in flight in this process
        dead = j.begin(HideJournal("b", "b.hidden", 1, Owner(0, 0.0)))
        journal._IN_FLIGHT.discard(dead)  # its process died
        broken = j.begin(HideJournal("c", "c.hidden", 1, Owner(0, 0.0)))
        journal._IN_FLIGHT.discard(broken)
        bad = cat.add_pending(str(JournalKind.AB_HIDE), {"nonsense": 1})
        handled = []

        def handle(e: HideJournal) -> str | None:
            handled.append(e.sidecar)
            if e.sidecar == "c":
                raise OSError("read-only")
            return f"put back {e.sidecar}"

        msgs = replay(cat, JournalKind.AB_HIDE, handle, lambda e: f"the sidecar {e.sidecar}")
        assert handled == ["b", "c"]
        assert msgs == ["put back b", "could not recover the sidecar c: read-only",
                        f"dropped a malformed ab-hide journal entry #{bad}"]
        assert sorted(jid for jid, *_ in cat.list_pending()) == [running, broken]  # c stays for the next start
        j.end(running)
    finally:
        cat.close()
