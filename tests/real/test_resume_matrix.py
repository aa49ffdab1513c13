"""The resume matrix, measured again on real servers: every cell, and every face that predicts from it (issue #26).

``app/core/resume_matrix.json`` holds what a resume after a restart bought, per model family (tiny models
made here by llama.cpp's test-llama-archs), build (stock 11434, KV Valet's sidecar build in fork mode, the
turboquant fork's behaviour, and in v2), configuration and probe (tests/real/resume_matrix.py). The first test
measures all 300 cells (75 server configurations, each restarted once per probe: about two minutes on two quiet
cores, eleven on a busy pair; kept under a digest of the binaries, the models and the measuring code, and
measured again when any of them changes) and fails on any cell whose verdict is not the file's, or whose
figures (n_restored, prompt_n, cache_n, the sidecar's loaded count, the checkpoint used, the full re-processing
line) are not within resume_matrix.FIGURE_BOUNDS of the file's (all exact: see there why): a server that
changed, or a prediction someone edited. The measured side never comes from the file: it is the servers' own
figures, measured now or kept by an earlier measurement under the same digest. The second runs the app itself
on every family, build and configuration (75 servers, each restarted once) and checks that what it says before
(doctor, the park's warnings, the resume's question, the Sessions tooltip) and judges after agrees with the file.
"""

from __future__ import annotations

import asyncio

import pytest

from app.core.confirmation import NeedsConfirmation
from app.sessions.resume import ResumeUseless
from app.core.profile import LaunchProfile
from app.core.restore_needs import needs_checkpoints
from app.core.resume_matrix import BUILDS, CONFIGS, FAMILIES, PROBES, expect, predict
from app.core.rules import diagnose
from app.tools.diagnose import gather_facts
from tests.conftest import free_port
from tests.real.resume_matrix import FIGURE_BOUNDS, SYSTEM, figure_differences, measure_cached
from tests.real.sidecar_bin import sidecar_server_bin  # noqa: F401  (fixture)
from tests.real.test_real_families import archs_tool, tiny_models  # noqa: F401  (fixtures)
from tests.real.test_real_sidecar_verdicts import Running
from tests.real.tiny_models import FAMILIES as MODEL_FAMILIES

pytestmark = pytest.mark.real_server

RESUME_RULES = {"resume-after-restart", "build-drops-checkpoints", "no-checkpoints"}


@pytest.mark.timeout(1500)  # a hang guard above a measurement of all 300 cells on a busy pair of cores (~11 min)
def test_every_cell_is_what_the_matrix_file_says(sidecar_server_bin, archs_tool, tmp_path):
    """Measured now, or (the same binaries, models and measuring code: the same digest) as measured before:
    tests/real/resume_matrix.py measure_cached. Either way every cell's verdict and figures are compared with
    the file's, the figures within FIGURE_BOUNDS."""
    cells, digest, kept = measure_cached(tmp_path, progress=lambda s: None)
    print(f"resume matrix cells {'as kept under' if kept else 'measured now, kept under'} {digest[:16]}; "
          f"figures compared within {FIGURE_BOUNDS}")
    assert len(cells) == len(FAMILIES) * len(BUILDS) * len(CONFIGS) * len(PROBES)
    assert len({(c.family, c.build, c.config, c.probe) for c in cells}) == len(cells)  # every cell once
    wrong = []
    for c in cells:
        assert c.error is None, (c.family, c.build, c.config, c.probe, c.error)
        filed = expect(c.family, c.build, c.config, c.probe)
        assert filed is not None, (c.family, c.build, c.config, c.probe)
        name = f"{c.family}/{c.build}/{c.config}/{c.probe}"
        if c.verdict != filed.verdict:
            wrong.append(f"{name}: measured {c.verdict} ({c.reason}), the file says {filed.verdict}")
        wrong += [f"{name}: {d}" for d in figure_differences(c, filed)]
        # the one prediction every face uses says what was measured (not the file read twice)
        if c.probe in ("chat", "hidden"):
            p = predict(c.family, c.build, c.config, sidecar_usable=c.probe == "chat")
            if p.verdict != c.verdict or p.resumes is not (c.verdict == "HIT"):
                wrong.append(f"{name}: the prediction says {p.verdict}, measured {c.verdict}")
    assert not wrong, "\n".join(wrong)


#: every (family, build, configuration) of the matrix
FACES = [(f, b, c) for f in FAMILIES for b in BUILDS for c in CONFIGS]
FLAGS = {"swa-full": {"swa_full": True}, "ctx-checkpoints-0": {"ctx_checkpoints": 0}, "cache-ram-0": {"cache_ram": 0},
         "np2-kvu": {"parallel": 2, "kv_unified": True}}


@pytest.mark.parametrize("family,build,config", FACES, ids=["/".join(x) for x in FACES])
def test_what_the_app_says_and_judges_agrees_with_the_matrix(family, build, config, tiny_models, real_binary,
                                                             sidecar_server_bin, monkeypatch, tmp_path):
    monkeypatch.setenv("KVV_SIDECAR_MODE", "fork" if build == "fork" else "v2")
    binary = real_binary if build == "stock" else str(sidecar_server_bin)
    flags = {"parallel": 1, **FLAGS.get(config, {})}
    profile = LaunchProfile(name=f"m-{family}-{build}", model=str(tiny_models[family]), server_binary=binary,
                            port=free_port(), ctx_size=4096, slot_save_path=str(tmp_path / "slots") + "/", **flags)
    cell = expect(family, build, config, "chat")
    assert cell is not None
    resumes = cell.verdict == "HIT"

    # doctor, before anything ran: a resume rule fires exactly where the matrix says the turn is not a HIT
    fired = {f.rule_id for f in diagnose(profile, gather_facts(profile))} & RESUME_RULES
    assert bool(fired) is (not resumes), (fired, cell.verdict)

    prompt = SYSTEM + " " + MODEL_FAMILIES[family][0]

    async def go():
        async with Running(profile) as srv:
            await srv.fill(0, prompt)
            park = await srv.svc.park(0, "chat")
        said = " ".join(park.warnings)
        assert ("(HIT)" not in said) and (bool(said) is (not resumes)), said
        async with Running(profile) as srv:  # the restart
            tooltip = srv.svc.on_this_server(park.record) or ""
            if needs_checkpoints(MODEL_FAMILIES[family][1], swa_full=bool(profile.swa_full)):
                assert f"({cell.verdict})" in tooltip, tooltip  # what this loader does, then what was measured
            else:
                assert tooltip == ""  # kept like a dense model: nothing to say about a sidecar
            try:
                await srv.svc.resume("chat", 0)
                asked = False
            except NeedsConfirmation as e:
                asked = True
                assert f"({cell.verdict})" in " ".join(e.warnings)
                await srv.svc.resume("chat", 0, force=True)
            assert asked is (not resumes)
            name, v = await srv.other_client_query(0, prompt + " And one more thing.")
            assert name == "chat" and v.kind.name == cell.verdict, v.reason
            # the conversation proxy's restore decision, the call it makes (app.proxy.session_backend.SessionBackend):
            # it restores where the restore buys the turn something, and leaves the park where it buys nothing
            try:
                await srv.svc.resume("chat", 0, force=True, avoid_hazard=True, avoid_useless="chat")
                restored = True
            except ResumeUseless as e:
                restored = False
                assert f"({cell.verdict})" in e.reasons[0], e.reasons
            assert restored is (cell.verdict not in ("DISCARDED", "MISS")), cell.verdict

    asyncio.run(go())
