"""slot_rows and slots_state_from_error over real llama-server b11434 responses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.monitor.slots import RestoredSlot, SlotRow, SlotsUnavailable, slot_rows, slots_state_from_error

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llama-server-b11434"


@pytest.fixture(scope="module")
def responses() -> dict:
    return json.loads((FIXTURES / "responses.json").read_text())


def test_slots_after_task(responses):
    rows = slot_rows(responses["slots_after_task"]["body"])
    assert [r.id for r in rows] == [0, 1]
    idle, used = rows
    assert idle == SlotRow(
        id=0, n_ctx=4096, busy=False, tokens_held=None, tokens_known_from_restore=False,
        n_prompt_tokens=None, n_cached=None, n_processed=None, n_decoded=None,
        id_task=None, session=None,
    )
    assert used.n_ctx == 4096 and not used.busy
    assert used.id_task == 1
    assert used.n_prompt_tokens == 336 and used.n_decoded == 0
    assert used.tokens_held == 336 and not used.tokens_known_from_restore
    assert used.n_cached == 0 and used.n_processed == 0


def test_slots_after_restore_shows_restored_count(responses):
    restore = responses["restore_ok"]
    body = restore["body"]
    restored = {body["id_slot"]: RestoredSlot(body["n_restored"], body["filename"], None)}
    rows = slot_rows(responses["slots_after_restore"]["body"], restored)
    slot0 = rows[0]
    # the server shows no task for the restored slot: the app's count is used
    assert "n_prompt_tokens" not in responses["slots_after_restore"]["body"][0]
    assert slot0.tokens_held == 336
    assert slot0.tokens_known_from_restore is True
    assert slot0.session == "fixture.bin"
    assert slot0.fill_fraction == pytest.approx(336 / 4096)
    assert rows[1].tokens_known_from_restore is False


def test_once_the_slot_runs_a_task_the_server_count_wins(responses):
    slots = json.loads(json.dumps(responses["slots_after_task"]["body"]))
    slots[1]["n_prompt_tokens"] = 400
    slots[1]["next_token"][0]["n_decoded"] = 25
    slots[1]["is_processing"] = True
    rows = slot_rows(slots, {1: RestoredSlot(336, "s1.bin", id_task=0)})
    assert rows[1].tokens_held == 400 and not rows[1].tokens_known_from_restore  # n_prompt_tokens counts decoded ones
    assert rows[1].busy and rows[1].session == "s1.bin"


def test_older_builds_n_tokens_and_odd_json():
    rows = slot_rows([
        {"id": 0, "n_ctx": 2048, "n_tokens": 100, "id_task": -1,
         "next_token": {"n_decoded": 5}, "state": 1},
        {"id": "1"},
        "garbage",
        {"n_ctx": None, "next_token": []},
        {"id": 3, "n_ctx": 1024, "n_prompt_tokens": True},
    ])
    assert len(rows) == 4
    assert rows[0].tokens_held == 100 and rows[0].id_task is None and rows[0].busy
    assert rows[1].id == 1 and rows[1].n_ctx is None and rows[1].tokens_held is None
    assert rows[2].id is None and rows[2].n_decoded is None
    assert rows[3].n_prompt_tokens is None  # a bool is not a count
    assert slot_rows(None) == [] and slot_rows({"error": {}}) == []


class HttpError(Exception):
    def __init__(self, status, message):
        super().__init__(message)
        self.status = status
        self.message = message


def test_no_slots_reason():
    msg = "This server does not support slots endpoint. Start it with `--slots`"
    no = SlotsUnavailable.NO_SLOTS
    assert no == "the server was started with --no-slots: slot monitoring is off"
    assert slots_state_from_error(HttpError(501, msg)) == no
    assert slots_state_from_error(501) == no
    assert slots_state_from_error(RuntimeError("This server does not support slots endpoint.")) == no
    assert slots_state_from_error(
        {"error": {"code": 501, "message": msg, "type": "not_supported_error"}}
    ) == no


def test_other_failures():
    assert slots_state_from_error(HttpError(500, "boom")) == "GET /slots failed: HTTP 500: boom"
    assert slots_state_from_error(404) == "GET /slots failed: HTTP 404"
    r = slots_state_from_error(ConnectionRefusedError("Connection refused"))
    assert r.startswith("GET /slots failed: ") and "Connection refused" in r
    assert slots_state_from_error(TimeoutError()) == "GET /slots failed: TimeoutError"
    assert slots_state_from_error(None) == "GET /slots failed: unknown error"

    class StatusCodeError(Exception):
        status_code = 503

    assert slots_state_from_error(StatusCodeError("Loading model")).startswith("GET /slots failed: HTTP 503")


def test_a_routers_slots_are_explained_not_failed():
    """A router answers GET /slots without ?model= with a 400: the slots' state says what a router is."""
    err = {"error": {"code": 400, "message": "model name is missing from the request",
                     "type": "invalid_request_error"}}
    assert slots_state_from_error(err) == SlotsUnavailable.ROUTER
    assert "router" in SlotsUnavailable.ROUTER
    assert slots_state_from_error({"error": {"code": 400, "message": "bad"}}) != SlotsUnavailable.ROUTER
