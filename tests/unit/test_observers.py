"""app.core.observers: the one observer list of the services."""

import logging

from app.core.observers import Observers


def test_every_observer_is_told_in_order_and_can_be_removed():
    told = []
    obs: Observers[[int]] = Observers("slot changes")
    a = obs.add(lambda n: told.append(("a", n)))
    obs.add(lambda n: told.append(("b", n)))
    obs.emit(1)
    obs.remove(a)
    obs.remove(a)  # twice: nothing
    obs.emit(2)
    assert told == [("a", 1), ("b", 1), ("b", 2)] and len(obs) == 1


def test_a_failing_observer_is_logged_with_context_and_the_others_are_still_told(caplog):
    told = []
    obs: Observers[[str]] = Observers("server state")

    def broken(state):
        raise RuntimeError("panel gone")

    obs.add(broken)
    obs.add(told.append)
    with caplog.at_level(logging.ERROR):
        obs.emit("ready")
    assert told == ["ready"]
    [rec] = [r for r in caplog.records if "server state" in r.getMessage()]
    assert "'ready'" in rec.getMessage() and "panel gone" in str(rec.exc_info[1])


def test_an_observer_may_remove_itself_while_told():
    obs: Observers[[]] = Observers("once")
    told = []

    def once():
        told.append(1)
        obs.remove(once)

    obs.add(once)
    obs.emit()
    obs.emit()
    assert told == [1]
