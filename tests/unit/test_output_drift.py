"""The output check's measured drift bound (app.core.output_drift): pure, reads one packaged file."""

from __future__ import annotations

import json

import pytest

from app.core.output_drift import DATA_FILE, Bound, DriftDataError, bound_for, load

DATA = {"factor": 1.5, "cells": [
    {"arch": "gemma3", "family": "sliding-window", "model": "tiny", "build": "stock", "threads": 1, "n": 20,
     "max": 0.1},
    {"arch": "gemma3", "family": "sliding-window", "model": "gemma-3-270m", "build": "fork", "threads": 2,
     "n": 20, "max": 0.2001},
    {"arch": "llama", "family": "dense", "model": "tiny", "build": "stock", "threads": 1, "n": 20, "max": 0.5},
    {"arch": "qwen35", "family": "hybrid", "model": "tiny", "build": "v2", "threads": 1, "n": 0, "max": 9.0},
]}


def test_an_architectures_bound_is_its_largest_measured_drift_times_the_stated_factor():
    b = bound_for("gemma3", DATA)
    assert b == Bound(0.301, "gemma3", 40, 0.2001, 1.5)  # rounded up, never down
    assert b.source() == "the largest drift measured on 40 correct restores of gemma3, 0.200 nats, x1.5"


def test_an_architecture_not_measured_gets_the_largest_bound_of_all_and_says_so():
    for arch in ("mistral3", None, "qwen35"):  # a cell of no restores measured nothing
        b = bound_for(arch, DATA)
        assert (b.nats, b.arch, b.restores) == (0.75, None, 60)
        assert "this one was not measured" in b.source()


def test_a_missing_or_empty_measurement_is_an_error_in_plain_words(tmp_path):
    with pytest.raises(DriftDataError, match="cannot be read"):
        load(str(tmp_path / "none.json"))
    (tmp_path / "bad.json").write_text(json.dumps({"cells": []}))
    with pytest.raises(DriftDataError, match="no cells or no factor"):
        load(str(tmp_path / "bad.json"))
    with pytest.raises(DriftDataError, match="no measured cells"):
        bound_for("gemma3", {"factor": 1.5, "cells": [{"arch": "gemma3", "n": 0, "max": 1}]})


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
    assert DATA_FILE.name == "output_drift.json"
