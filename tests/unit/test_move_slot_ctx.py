"""A move to a profile that sets no -c: the slot context comes from its running server's
``GET /slots`` (the fake llama-server, tests/fake_server), else the rule says it is not known."""

from __future__ import annotations

import asyncio
from pathlib import Path
from urllib.parse import urlparse

import pytest

from app.move.endpoints import LocalEndpoint
from app.move.facts import describe_target, slots_ctx
from app.move.transfer import move_session
from app.move.values import MoveRefused
from app.store.profiles import ProfileStore
from tests.fake_server.conftest import run_fake_server
from tests.unit.move_helpers import N_TOKENS, model_file, open_catalog, park_file, profile


def no_ctx_profile(tmp_path, name: str, url: str | None = None):
    """A profile without -c (ctx_size unset), on the port of the server at ``url``."""
    model = model_file(tmp_path)
    p = profile(tmp_path, name, model).replace(ctx_size=None)
    if url is not None:
        p = p.replace(port=urlparse(url).port)
    ProfileStore().save(p, overwrite=True)
    return p


def test_the_running_servers_slots_say_what_a_slot_holds(tmp_path):
    b = no_ctx_profile(tmp_path / "b", "b")
    with open_catalog() as cat:
        assert asyncio.run(describe_target(cat, "b")).n_ctx_slot is None  # no server: not known
    with fake(tmp_path / "server") as (url, _proc):  # -c 8192 -np 2: 4,096 tokens a slot
        no_ctx_profile(tmp_path / "b", "b", url)
        with open_catalog() as cat:
            assert asyncio.run(describe_target(cat, "b")).n_ctx_slot == 4096
    assert b.ctx_size is None


def fake(folder: Path, **kw):
    """The fake llama-server (-c 8192 -np 2 unless ``extra_args`` say otherwise) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    return run_fake_server(folder, **kw)


def test_a_move_is_judged_by_the_running_servers_slot_context(tmp_path):
    model = model_file(tmp_path)
    a = profile(tmp_path, "a", model)
    with open_catalog() as cat:
        park_file(cat, a, "chat")
    # a server whose slots hold fewer tokens than the session: refused before any byte moves
    with fake(tmp_path / "small", extra_args=["-c", "512"]) as (url, _proc):
        b = no_ctx_profile(tmp_path, "b", url)
        with open_catalog() as cat:
            with pytest.raises(MoveRefused) as refused:
                asyncio.run(move_session(LocalEndpoint(cat, "a"), "chat", LocalEndpoint(cat, "b")))
            assert any(f"a slot of profile 'b' holds 256 tokens, the session has {N_TOKENS:,}" in r
                       for r in refused.value.reasons), refused.value.reasons
            assert cat.list("b") == []
    # a server with room: the move goes through without the "not known" warning
    with fake(tmp_path / "big") as (url, _proc):
        no_ctx_profile(tmp_path, "b", url)
        with open_catalog() as cat:
            result = asyncio.run(move_session(LocalEndpoint(cat, "a"), "chat", LocalEndpoint(cat, "b")))
    assert result.moved and not any("slot context" in w for w in result.warnings), result.warnings
    assert b.ctx_size is None


def test_slots_ctx_reads_slots_and_status_rows():
    assert slots_ctx([{"id": 0, "n_ctx": 4096}, {"id": 1, "n_ctx": 4096}]) == 4096
    assert slots_ctx([{"id": 0, "n_ctx": None}, {"id": 1}]) is None
    assert slots_ctx({"error": "no slots"}) is None and slots_ctx(None) is None
    assert slots_ctx([{"n_ctx": True}, {"n_ctx": 0}, {"n_ctx": 2048}]) == 2048
