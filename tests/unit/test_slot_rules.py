"""The one rule for the default slot, and the typed slot rows it reads."""

import pytest

from app.sessions.service import ServiceError, SessionService
from app.sessions.slots import Purpose, SlotError, default_slot, find_row, no_default_reason
from app.sessions.target import ServerTarget
from app.monitor.slots import RestoredSlot, slot_rows
from app.store.catalog import Catalog

IDLE = {"id": 0, "n_ctx": 4096, "is_processing": False}


def rows(*slots, restored=None):
    return slot_rows(list(slots), restored or {})


def test_park_default_is_the_first_slot_that_holds_tokens():
    r = rows(dict(IDLE, id=0), dict(IDLE, id=1, id_task=3, n_prompt_tokens=700), dict(IDLE, id=2, id_task=4,
                                                                                      n_prompt_tokens=5))
    assert default_slot(r, Purpose.PARK) == 1
    assert default_slot(r, Purpose.PARK, preferred=2) == 2
    assert default_slot(rows(IDLE), Purpose.PARK) is None
    assert no_default_reason(rows(IDLE), Purpose.PARK) == "no slot holds tokens: there is nothing to park"


def test_resume_and_check_prefer_the_parked_slot_when_it_is_empty():
    r = rows(dict(IDLE, id=0), dict(IDLE, id=1), dict(IDLE, id=2, id_task=1, n_prompt_tokens=10))
    for purpose in (Purpose.RESUME, Purpose.CHECK):
        assert default_slot(r, purpose, preferred=1) == 1
        assert default_slot(r, purpose, preferred=2) == 0  # slot 2 holds tokens: the first empty one
        assert default_slot(r, purpose) == 0


def test_a_restored_slot_is_not_empty_and_a_busy_slot_is_not_chosen():
    r = rows(dict(IDLE, id=0), dict(IDLE, id=1, is_processing=True), restored={0: RestoredSlot(336, "a")})
    assert r[0].tokens_held == 336 and r[0].tokens_known_from_restore
    assert default_slot(r, Purpose.RESUME) is None
    assert "no empty slot (slots 0-1" in no_default_reason(r, Purpose.RESUME)


def test_ids_are_checked_because_the_server_wraps_them_around():
    r = rows(dict(IDLE, id=0), dict(IDLE, id=1))
    assert find_row(r, 1).id == 1
    try:
        find_row(r, 7)
    except SlotError as e:
        assert str(e) == "slot 7 does not exist: this server has slots 0-1"
    else:
        raise AssertionError("slot 7 accepted")


async def test_a_park_of_the_default_slot_reads_the_slots_once_and_tells_that_read(tmp_path):
    # the default slot is picked from the park's own read, in its turn of the slot queue; the read's
    # rows go to whoever keeps the server's slot picture (the window: its sampler)
    class Client:
        reads = 0

        async def slots(self):
            Client.reads += 1
            return [IDLE]

    with Catalog(tmp_path / "catalog.sqlite") as cat:
        svc = SessionService(ServerTarget(client=Client(), url="http://x", save_dir=tmp_path, catalog=cat,
                                          profile_name="p"))
        told = []
        svc.on_slots(told.append)
        with pytest.raises(ServiceError, match="no slot holds tokens: there is nothing to park"):
            await svc.park(None)
    assert Client.reads == 1 and told == [rows(IDLE)]
