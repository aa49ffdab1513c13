"""The time a resume saved: tokens reused x the measured prefill rate; zero when it re-prefilled."""

from __future__ import annotations

import asyncio

import pytest

from app import paths
from app.core.profile import LaunchProfile
from app.core.verdict import Verdict, VerdictKind, time_saved
from app.sessions.service import SessionService
from app.server.client import LlamaClient
from app.server.launcher import make_supervisor, plan_launch
from app.store.catalog import Catalog
from tests.fake_server.test_supervisor_fake import FAKE, free_port, wait_for_line

PROMPT = " ".join(f"word{i}" for i in range(700))


def test_time_saved_rule():
    hit = Verdict(VerdictKind.HIT, "", n_restored=1000, cache_n=990, prompt_n=12)
    assert time_saved(hit, 300.0) == pytest.approx(3.3)
    assert time_saved(hit, None) is None  # no prefill rate measured yet: unknown, not zero
    assert time_saved(Verdict(VerdictKind.DISCARDED, "", cache_n=0, prompt_n=1000), 300.0) == 0.0
    assert time_saved(Verdict(VerdictKind.UNKNOWN, ""), 300.0) is None


@pytest.mark.parametrize("sidecar", [True, False])
async def test_a_resume_records_what_it_saved(tmp_path, monkeypatch, sidecar):
    if sidecar:
        monkeypatch.setenv("FAKE_SIDECAR", "1")
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    profile = LaunchProfile(name="ts", model=str(model), server_binary=FAKE, port=free_port(), ctx_size=4096,
                            parallel=2)

    async def running():
        plan = plan_launch(profile)
        sup = make_supervisor(plan)
        await sup.start()
        cat = Catalog(paths.catalog_path())
        svc = await SessionService.connect(cat, url=plan.url, profile=profile, log_buffer=sup.log,
                                           build=plan.build, supervisor=sup)
        return sup, cat, svc

    sup, cat, svc = await running()
    try:
        async with LlamaClient(profile.url) as c:
            await c.completion(PROMPT, slot_id=0, n_predict=2)
        await wait_for_line(sup, "prompt eval time")  # the fill's prefill rate is measured from it
        await svc.park(0, "chat")
    finally:
        await svc.aclose()
        await sup.aclose()
        cat.close()
    sup, cat, svc = await running()
    try:
        verdict = asyncio.get_running_loop().create_future()
        svc.on_verdict(lambda slot, name, v: verdict.done() or verdict.set_result(v))
        await svc.resume("chat", 1, force=True)
        async with LlamaClient(profile.url) as c:
            await c.completion(PROMPT + " and one more", slot_id=1, n_predict=2)
        v = await asyncio.wait_for(verdict, 120)
        rec = cat.get("ts", "chat")
        rate = cat.prefill_rate("ts")
    finally:
        await svc.aclose()
        await sup.aclose()
        cat.close()
    assert rate  # measured from the first fill's prompt
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "app.cli", "sessions", "list"], capture_output=True, text=True,
                         timeout=60).stdout
    assert "time saved by resumes:" in out and " saved " in out
    if sidecar:
        assert v.kind is VerdictKind.HIT
        assert rec.last_time_saved_s == pytest.approx(v.cache_n / rate) and rec.time_saved_s > 0
    else:
        assert v.kind is VerdictKind.DISCARDED
        assert rec.last_time_saved_s == 0.0 and rec.time_saved_s == 0.0
