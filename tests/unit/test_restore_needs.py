"""What a restore needs, from the memory kind and the restoring server's flags (app.core.restore_needs)."""

from __future__ import annotations

import pytest

from app.core.restore_needs import effective_kind, needs_checkpoints
from app.core.sidecar_behaviour import Behaviour, LoadPrediction, SidecarFacts, predict_load, sideless_warning
from app.core.states import MemoryKind


@pytest.mark.parametrize("kind,swa_full,needs", [
    (MemoryKind.DENSE, False, False), (MemoryKind.DENSE, True, False),
    (MemoryKind.SLIDING_WINDOW, False, True), (MemoryKind.SLIDING_WINDOW, True, False),
    (MemoryKind.RECURRENT_HYBRID, False, True), (MemoryKind.RECURRENT_HYBRID, True, True),
    ("unknown", False, False), (None, False, False),
])
def test_needs_checkpoints_by_kind_and_swa_full(kind, swa_full, needs):
    assert needs_checkpoints(kind, swa_full=swa_full) is needs


def test_a_sliding_window_model_under_swa_full_is_met_as_dense():
    assert effective_kind("sliding-window", swa_full=True) == "dense"
    assert effective_kind("recurrent-hybrid", swa_full=True) == "recurrent-hybrid"


def test_the_forks_empty_list_is_predicted_to_load_and_warned_as_no_checkpoint():
    """The fork's lax loader takes a sidecar with no checkpoints: it replaces the slot's list with
    nothing and makes no tip, so the resume re-prefills as if there were no sidecar."""
    facts = SidecarFacts(path="x.ckpt", kind="PKCL", version=1, count=0, size=12)
    p = predict_load(Behaviour.FORK, facts, n_restored=900, ctx_checkpoints=32)
    assert p.loads is True and p.count == 0 and "empty list" in p.sentence and p.rolls_back_nowhere
    warning = sideless_warning(Behaviour.FORK, p, "sliding-window")
    assert warning is not None and "empty list" in warning
    assert sideless_warning(Behaviour.FORK, LoadPrediction(True, count=2), "sliding-window") is None
