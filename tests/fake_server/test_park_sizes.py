"""Sizes before a park (issue #26 item 4), against the fake llama-server: the park predicts its state file
and sidecar (app.core.park_size) and refuses before the server is asked when the free space or the disk
budget cannot hold them; a refused save names the predicted need."""

from __future__ import annotations

from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest

from app import paths
from app.core import park_size as ps
from app.sessions import park as park_mod
from app.sessions.park import ParkError, park_slot
from app.sessions.park_prediction import predict_park_size
from app.store.catalog import Catalog
from tests.fake_server.test_park_resume import PROMPT, close, connect, fill_and_park, run, tmp_files

gguf = pytest.importorskip("gguf")

Usage = namedtuple("Usage", "total used free")


def write_dense_model(tmp_path: Path) -> Path:
    """A GGUF whose metadata gives a dense llama's layout: 2 layers, 2 KV heads of 128: 2,064 bytes a token."""
    path = tmp_path / "model.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_embedding_length(256)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_key_length(128)
    w.add_value_length(128)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_prediction_comes_from_the_model_metadata(fake_server, tmp_path):
    write_dense_model(tmp_path)

    async def go():
        t = await connect(url, tmp_path)
        try:
            return predict_park_size(t, 1000, name="chat")
        finally:
            await close(t)

    with fake_server() as (url, _):
        size = run(go())
    assert size.source == ps.SOURCE_METADATA
    assert size.state == 12 + 4 * (1000 + 4) + 8 + 16 + 1000 * 12 + 2 * (24 + 1000 * 1024)  # 2,064,100
    assert size.sidecar <= 20  # dense: no checkpoints (a v2 build writes its 20-byte header)


def test_a_park_larger_than_the_disk_budget_is_refused_before_the_save(fake_server, tmp_path):
    write_dense_model(tmp_path)
    with fake_server() as (url, _):
        with pytest.raises(ParkError) as refused:
            run(_park(url, tmp_path, budget_bytes=64 * 1024))
    msg = str(refused.value)
    assert "disk budget of 64.0 KiB" in msg and "from model metadata" in msg and "nothing was saved" in msg
    assert not list((tmp_path / "slots").iterdir())  # the server was never asked: no file, no temp
    with Catalog(paths.catalog_path()) as cat:
        assert cat.list() == [] and cat.list_pending() == []


def test_a_park_that_the_free_space_cannot_hold_is_refused_before_the_save(fake_server, tmp_path, monkeypatch):
    write_dense_model(tmp_path)
    monkeypatch.setattr(park_mod.shutil, "disk_usage", lambda p: Usage(1 << 30, (1 << 30) - 100_000, 100_000))
    with fake_server() as (url, _):
        with pytest.raises(ParkError) as refused:
            run(_park(url, tmp_path))
    msg = str(refused.value)
    assert "not enough space to park" in msg and "97.7 KiB free" in msg and "state " in msg
    assert not list((tmp_path / "slots").iterdir())


def test_a_budget_that_holds_the_park_lets_it_run(fake_server, tmp_path):
    write_dense_model(tmp_path)
    with fake_server() as (url, _):
        res = run(_park(url, tmp_path, budget_bytes=1 << 30))
    assert res.ok and res.record.state_size > 0


def test_without_metadata_the_earlier_parks_calibrate_the_prediction(fake_server, tmp_path):
    """The fake's model file says nothing of its layout: a second park is predicted from the first
    (the catalog's state_size / n_tokens), and refused by a budget below that."""
    with fake_server(FAKE_SIDECAR=1) as (url, _):
        first = run(fill_and_park(url, tmp_path, name="one")).record

        async def predict():
            t = await connect(url, tmp_path)
            try:
                return predict_park_size(t, first.n_tokens * 2, name="two", quick_id=first.model_quick_id)
            finally:
                await close(t)

        size = run(predict())
        assert size.source == ps.SOURCE_PARKS
        assert size.state == pytest.approx(2 * first.state_size, rel=0.01)
        if first.sidecar_count:
            assert size.n_checkpoints == first.sidecar_count and size.sidecar > 0
        with pytest.raises(ParkError) as refused:
            run(_park(url, tmp_path, name="two", budget_bytes=first.state_size // 2))
        assert "from earlier parks" in str(refused.value)


def test_a_refused_save_names_the_predicted_need(fake_server, tmp_path, monkeypatch):
    """The disk fills between the check and the save: the server's "Unable to save slot" is explained
    with the prediction (the previous copy's bytes per token only when nothing predicts)."""
    write_dense_model(tmp_path)
    calls = []

    def usage(path):
        calls.append(path)
        free = (1 << 40) if len(calls) == 1 else 50_000  # plenty at the check, full at the failed save
        return Usage(1 << 41, (1 << 41) - free, free)

    monkeypatch.setattr(park_mod.shutil, "disk_usage", usage)
    with fake_server(FAKE_SAVE_ERROR=1) as (url, _):
        with pytest.raises(ParkError) as failed:
            run(_park(url, tmp_path))
    msg = str(failed.value)
    assert "the disk holding" in msg and "is full: 48.8 KiB free" in msg and "from model metadata" in msg
    assert tmp_files(tmp_path) == []


def test_why_save_failed_without_a_prediction_uses_the_previous_copy(tmp_path, monkeypatch):
    monkeypatch.setattr(park_mod.shutil, "disk_usage", lambda p: Usage(1 << 30, 0, 1000))
    with Catalog(paths.catalog_path()) as cat:
        assert park_mod._why_save_failed(tmp_path, 100, cat, "p", "x") == \
            f"the disk holding {tmp_path} is almost full: 1000 B free"
        size = ps.ParkSize(n_tokens=100, state=5000, per_checkpoint=100, n_checkpoints=2, sidecar=300)
        why = park_mod._why_save_failed(tmp_path, 100, cat, "p", "x", size)
    assert why.startswith(f"the disk holding {tmp_path} is full: 1000 B free, the save needs about 5.2 KiB")
    assert "2 checkpoints of 100 B" in why


async def _park(url, tmp_path, name="chat", budget_bytes=None):
    t = await connect(url, tmp_path)
    try:
        await t.client.completion(PROMPT, slot_id=0, n_predict=4)
        return await park_slot(t, 0, name, budget_bytes=budget_bytes)
    finally:
        await close(t)


def test_the_doctors_disk_check_predicts_a_full_slot_before_any_park(tmp_path):
    """No park yet: the disk checks' park size is a full slot's, predicted from the metadata."""
    from app.core.profile import LaunchProfile
    from app.tools.diagnose import gather_facts

    model = write_dense_model(tmp_path)
    profile = LaunchProfile(name="sizes", model=str(model), ctx_size=2000, parallel=2,
                            slot_save_path=str(tmp_path / "slots") + "/")
    with Catalog(paths.catalog_path()) as cat:
        facts = gather_facts(profile, cat)
    assert facts.typical_park_bytes == 2_064_100 + (20 if facts.sidecar_behaviour != "none" else 0)
