"""The ``timings`` of a llama-server response, read once (app.core.timings.Timings)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from app.core.timings import Timings
from tests.conftest import B11434

RESPONSES = json.loads((B11434 / "responses.json").read_text())


def test_a_real_completion_response():
    t = Timings.of(RESPONSES["completion"]["body"])
    assert (t.cache_n, t.prompt_n, t.prompt_ms, t.predicted_n, t.predicted_ms) == (0, 12, 89.226, 8, 177.37)
    assert t.prompt_per_token_ms == 7.4355 and t.predicted_per_second == pytest.approx(39.4655, abs=1e-4)
    assert t.save_ms is None and t.restore_ms is None
    assert t.ttft_ms == pytest.approx(89.226 + 25.33857142857143)


def test_real_save_and_restore_responses():
    assert Timings.of(RESPONSES["save_ok"]["body"]).save_ms == 4.931
    assert Timings.of(RESPONSES["restore_ok"]["body"]).restore_ms == 2.874
    assert Timings.of(RESPONSES["restore_ok"]["body"]).prompt_n is None


def test_missing_timings():
    assert Timings.from_json(None) is None and Timings.from_json([1, 2]) is None and Timings.from_json("x") is None
    assert Timings.from_json({}) == Timings()
    assert Timings.of({}) == Timings() == Timings.of({"timings": None}) == Timings.of("not a response")
    assert Timings.of({"timings": {"prompt_n": 5}}) == Timings(prompt_n=5)
    assert Timings().ttft_ms is None


def test_strings_are_read_when_they_are_numbers():
    t = Timings.from_json({"prompt_n": "12", "cache_n": " 2880 ", "prompt_ms": "78.5", "predicted_n": "1.0",
                           "save_ms": "fast", "restore_ms": "", "predicted_ms": "1e400"})
    assert (t.prompt_n, t.cache_n, t.prompt_ms, t.predicted_n) == (12, 2880, 78.5, 1)
    assert t.save_ms is None and t.restore_ms is None and t.predicted_ms is None
    assert Timings.from_json({"prompt_n": "9" * 1000}).prompt_n is None  # not a count this server writes


def test_negative_and_odd_numbers_are_unknown():
    t = Timings.from_json({"prompt_n": -1, "cache_n": -5, "prompt_ms": -0.5, "predicted_n": 2.5,
                           "predicted_ms": float("nan"), "save_ms": float("inf"), "restore_ms": True,
                           "prompt_per_second": [1], "predicted_per_token_ms": {"a": 1}})
    assert t == Timings()
    assert Timings.from_json({"prompt_n": 0, "cache_n": 3.0, "prompt_ms": 0}) == Timings(prompt_n=0, cache_n=3,
                                                                                           prompt_ms=0.0)
    assert isinstance(Timings.from_json({"cache_n": 3.0}).cache_n, int)


def test_ttft_without_a_predicted_token_or_a_per_token_figure():
    assert Timings(prompt_ms=10.0).ttft_ms == 10.0
    assert Timings(prompt_ms=10.0, predicted_n=0, predicted_ms=50.0).ttft_ms == 10.0
    assert Timings(prompt_ms=10.0, predicted_n=4, predicted_ms=20.0).ttft_ms == 15.0
    assert Timings(prompt_ms=10.0, predicted_n=4, predicted_per_token_ms=2.0, predicted_ms=20.0).ttft_ms == 12.0


def test_timings_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Timings().prompt_n = 3
