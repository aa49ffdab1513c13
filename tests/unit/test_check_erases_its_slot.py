"""A check or an A/B leaves its slot empty once it restored into it (app.sessions.check.leaves_nothing):
a park of every slot at a stop has nothing of it to park again as a new dated session."""

from __future__ import annotations

import pytest

from app.monitor.slots import RestoredSlot
from app.server.client import ServerUnreachable
from app.sessions import check
from app.sessions.target import HeldSession


class Client:
    def __init__(self, fail: bool = False):
        self.erased: list[int] = []
        self.fail = fail

    async def erase_slot(self, slot_id: int) -> dict:
        if self.fail:
            raise ServerUnreachable("http://127.0.0.1:1", "connection refused")
        self.erased.append(slot_id)
        return {"id_slot": slot_id, "n_erased": 9}


class Target:
    def __init__(self, client: Client):
        self.client = client
        self.restored = {1: RestoredSlot(700, "s1", None)}
        self.held_as = {1: HeldSession("s1", 700, None)}


async def test_the_slot_is_emptied_after_a_check_that_restored_into_it():
    t = Target(Client())

    async def run():
        check._mark_used(1)
        return "report"

    assert await check.leaves_nothing(t, 1, run)() == "report"
    assert t.client.erased == [1] and not t.restored and not t.held_as


async def test_a_failed_check_still_empties_the_slot_and_its_error_goes_on():
    t = Target(Client())

    async def run():
        check._mark_used(1)
        raise check.CheckError("the probe query failed: boom")

    with pytest.raises(check.CheckError, match="boom"):
        await check.leaves_nothing(t, 1, run)()
    assert t.client.erased == [1]


async def test_a_check_refused_before_its_restore_leaves_the_slot_alone():
    """A busy slot (someone's request) or a slot id the server would wrap around: nothing is erased."""
    t = Target(Client())

    async def run():
        raise check.CheckError("slot 1 is busy: wait until it is idle or pick another slot")

    with pytest.raises(check.CheckError):
        await check.leaves_nothing(t, 1, run)()
    assert t.client.erased == [] and t.restored and t.held_as


async def test_a_server_gone_at_the_end_does_not_hide_the_report():
    t = Target(Client(fail=True))

    async def run():
        check._mark_used(1)
        return "report"

    assert await check.leaves_nothing(t, 1, run)() == "report"
    assert not t.restored


async def test_marks_outside_a_check_are_ignored():
    check._mark_used(3)  # no check running: nothing to remember, nothing raised
