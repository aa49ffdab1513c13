"""The output check's measured drift bound (app.core.output_drift): pure, reads one packaged file."""

from __future__ import annotations

import json

import pytest

from app.core.output_drift import DATA_FILE, Bound, DriftDataError, bound_for, load

DATA = {"factor": 1.5, "cells": [
    {"arch": "gemma3", "family": "sliding-window", "model": "tiny", "precision": "f32", "build": "stock",
     "threads": 1, "n": 20, "max": 0.001},
    {"arch": "gemma3", "family": "sliding-window", "model": "gemma-3-270m", "precision": "reduced", "build": "fork",
     "threads": 2, "n": 20, "max": 0.2001},
    {"arch": "gemma3", "family": "sliding-window", "model": "gemma-3-270m", "precision": "reduced", "build": "v2",
     "threads": 1, "n": 20, "max": 0.1},
    {"arch": "llama", "family": "dense", "model": "tiny", "precision": "f32", "build": "stock", "threads": 1,
     "n": 20, "max": 0.5},
    {"arch": "qwen35", "family": "hybrid", "model": "tiny", "precision": "f32", "build": "v2", "threads": 1, "n": 0,
     "max": 9.0},
]}


def test_a_bound_is_the_largest_drift_of_the_architecture_at_that_precision_times_the_stated_factor():
    b = bound_for("gemma3", "reduced", DATA)
    assert b == Bound(0.301, "gemma3", 40, 0.2001, 1.5, "reduced")  # rounded up, never down
    assert b.source() == "the largest drift measured on 40 correct restores of reduced-precision gemma3, 0.200 nats, x1.5"
    # an F32 model: its architecture's cells at any precision, the wider bound winning (no bound rests on a
    # measurement that saw no drift at all)
    assert bound_for("gemma3", "f32", DATA) == Bound(0.301, "gemma3", 60, 0.2001, 1.5, None)
    assert bound_for("llama", "f32", DATA).nats == 0.75


def test_a_quantized_model_of_an_architecture_measured_only_in_f32_gets_the_reduced_precision_bound():
    """A real Q4 qwen35 or llama model must not be judged by the F32 tiny model's drift of ~0: that would call
    its correct restores wrong."""
    for arch in ("llama", "qwen35", "mistral3"):
        b = bound_for(arch, "reduced", DATA)
        assert (b.nats, b.arch, b.restores, b.precision) == (0.301, None, 40, "reduced")
        assert "this one was not measured at this precision" in b.source()


def test_a_model_of_unknown_precision_gets_the_largest_bound_of_all():
    for arch in ("mistral3", None, "gemma3"):
        b = bound_for(arch, None, DATA)
        assert (b.nats, b.arch, b.restores, b.precision) == (0.75, None, 80, None)
        assert "this one was not measured" in b.source()


def test_a_missing_or_empty_measurement_is_an_error_in_plain_words(tmp_path):
    with pytest.raises(DriftDataError, match="cannot be read"):
        load(str(tmp_path / "none.json"))
    (tmp_path / "bad.json").write_text(json.dumps({"cells": []}))
    with pytest.raises(DriftDataError, match="no cells or no factor"):
        load(str(tmp_path / "bad.json"))
    with pytest.raises(DriftDataError, match="no measured cells"):
        bound_for("gemma3", "reduced", {"factor": 1.5, "cells": [{"arch": "gemma3", "n": 0, "max": 1}]})


def test_the_packaged_measurement_covers_every_family_build_and_thread_count_with_20_restores_each():
    """Issue #36: correct restores across every family of the resume matrix, stock/fork/v2, 1 and 2
    threads, at least 20 repeats each; the file says how it was made."""
    from tests.real.tiny_models import FAMILIES

    data = load()
    assert data["source"] and data["statistic"] and data["factor"] >= 1.0
    tiny = {(c["arch"], c["build"], c["threads"]): c["n"] for c in data["cells"] if c["model"] == "tiny"}
    for arch, _kind in FAMILIES.values():
        for build in ("stock", "fork", "v2"):
            for threads in (1, 2):
                assert tiny.get((arch, build, threads), 0) >= 20, (arch, build, threads)
    assert any(c["arch"] == "gemma3" and c["model"] != "tiny" for c in data["cells"]), "Gemma 3 270M itself"
    assert bound_for(None).nats >= max(c["max"] for c in data["cells"])
    assert all(c["precision"] in ("f32", "reduced") for c in data["cells"])
    # Gemma 3 270M (Q4_K_M) itself, not only its F32 tiny sibling, sets the bound of real gemma3 models
    assert bound_for("gemma3", "reduced").arch == "gemma3"
    assert DATA_FILE.name == "output_drift.json"
