"""A stop's park of a continued session keeps what the session earned (issue #28, item 6).

As a user met it: resume on the sidecar-writing server, the next turn is a HIT with time saved, then
the stop parks the continued slot into the same session (no dated copy). Before, `sessions show` had
no verdict afterwards and the time-saved total read 0 ms. Real server (b11434 + KV Valet's patch,
v2 sidecars), Gemma 3 270M, every workflow through the server and session services the window uses.
"""

from __future__ import annotations

import asyncio

import pytest

from app import paths
from app.core.lifecycle import StopTrigger
from app.core.verdict import VerdictKind
from app.servers.service import ServerService
from app.store.catalog import Catalog
from tests.real.helpers import TEXT
from tests.real.sidecar_bin import sidecar_server_bin  # noqa: F401  (fixture)

pytestmark = pytest.mark.real_server

PROMPT = TEXT * 2  # about 1,400 tokens: more than two SWA windows


async def launched(profile):
    catalog = Catalog(paths.catalog_path())
    servers = ServerService(catalog)
    handle = await servers.launch(profile)
    assert handle is not None
    return catalog, servers, handle, await servers.sessions(handle.id)


def test_the_stops_park_of_a_continued_session_keeps_its_verdict_ledger_and_history(
        real_profile, sidecar_server_bin, monkeypatch):  # noqa: F811
    monkeypatch.setenv("KVV_SIDECAR_MODE", "v2")
    profile = real_profile.replace(name="built", server_binary=str(sidecar_server_bin))

    async def go():
        catalog, servers, handle, svc = await launched(profile)
        try:
            await svc.target.client.completion(PROMPT, slot_id=0, n_predict=2)
            first = (await svc.park(0, "design chat")).record
        finally:
            await servers.aclose()
            catalog.close()

        catalog, servers, handle, svc = await launched(profile)  # the restart
        try:
            verdict = asyncio.get_running_loop().create_future()
            svc.on_verdict(lambda slot, name, v: verdict.done() or verdict.set_result((name, v)))
            await svc.resume("design chat", 0, force=True)
            await svc.target.client.completion(PROMPT + " Which bay?", slot_id=0, n_predict=2)
            name, v = await asyncio.wait_for(verdict, 120)
            earned = catalog.get("built", "design chat")
            report = await servers.park_then_stop(handle.id, StopTrigger.QUIT)  # quitting the window
        finally:
            await servers.aclose()
            catalog.close()
        return first, name, v, earned, report

    first, name, v, earned, report = asyncio.run(go())
    assert (name, v.kind) == ("design chat", VerdictKind.HIT), v.reason
    assert earned.time_saved_s > 0 and earned.last_verdict is VerdictKind.HIT
    assert report.complete and [r.record.name for r in report.results if r.ok] == ["design chat"]
    with Catalog(paths.catalog_path()) as cat:
        [after] = cat.list("built")  # the same session, re-parked: no dated copy
        history = [e.kind for e in cat.history(after.id)]
    assert after.id == first.id and after.n_tokens > first.n_tokens
    assert after.last_verdict is VerdictKind.HIT and after.last_verdict_reason == earned.last_verdict_reason
    assert after.time_saved_s == earned.time_saved_s and cat_total(after.profile) == earned.time_saved_s
    assert "resume" in history


def cat_total(profile: str) -> float:
    with Catalog(paths.catalog_path()) as cat:
        return cat.total_time_saved(profile)
