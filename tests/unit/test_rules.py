"""Profile rules as data: each rule fires on its case and only there, remedies work, seeds are caught."""

from __future__ import annotations

import pytest

from app.core import rules
from app.core.argv import parse_command_line
from app.core.findings import Finding, Severity
from app.core.hazards import Hazard, hazards
from app.core.helptext import BinaryCaps
from app.core.profile import STOCK_CACHE_TYPES, LaunchProfile
from app.core.rules import (RULES, Facts, diagnose, parse_build_number, slot_ctx, swa_full_extra,
                            swa_layer_pattern)

# The seeds' own command lines, copied verbatim out of /work/shared/seeds/.
# 002: the GGML_ASSERT "tensor not allocated" crash report (Windows, -np 32, 4.5M context).
SEED_002 = (r".\llama-server.exe  -m C:\……models\Qwen3.6-35B-A3B-UD-Q4_K_XL.gguf --host 0.0.0.0 "
            r"--port 8080  -ctk q4_0 -ctv q4_0 -ngl 999   -a Qwen3.6-35B  -np 32 -c 4500000")
# 004: the idle-slot save stall (llama.cpp #30252), baseline command of its "solution steps".
SEED_004 = "llama-server -m Qwen3-8B-Q4_K_M.gguf -ngl 99 -fa on -ctk q8_0 -ctv q8_0 -np 8 -kvu -c 20480 -v"

STOCK_CAPS = BinaryCaps(frozenset(), frozenset(), frozenset(), STOCK_CACHE_TYPES)
# Gemma 3 270M (tests/fixtures/llama-server-b11434): 18 layers, 15 sliding, 1 KV head of 256.
GEMMA = Facts(memory_kind="sliding-window", architecture="gemma3", n_swa=512, n_ctx_train=32768, n_layer=18,
              n_embd_k_gqa=256, n_embd_v_gqa=256, swa_layers=swa_layer_pattern("gemma3", 18))
SAVE_OK = dict(save_dir="/data/sessions/p/", save_dir_exists=True, save_dir_is_dir=True, save_dir_writable=True,
               save_free_bytes=100 << 30)


def P(**kw) -> LaunchProfile:
    """A quiet profile (2 explicit slots, loopback) with changes."""
    base = dict(name="p", model="m.gguf", parallel=2)
    base.update(kw)
    return LaunchProfile(**base)


def ids(profile: LaunchProfile, facts: Facts | None = None) -> list[str]:
    return [f.rule_id for f in diagnose(profile, facts)]


def find(profile: LaunchProfile, facts: Facts | None, rule_id: str) -> Finding:
    return next(f for f in diagnose(profile, facts) if f.rule_id == rule_id)


# rule id -> (profile, facts) that trigger it, and (profile, facts) that do not.
CASES: dict[str, tuple[tuple[LaunchProfile, Facts], tuple[LaunchProfile, Facts]]] = {
    "rpc-prompt-cache": ((P(rpc="10.0.0.2:50052", parallel=32), Facts()),
                         (P(rpc="10.0.0.2:50052", parallel=1), Facts())),
    "rpc-endpoint-invalid": ((P(rpc="10.0.0.2", parallel=1), Facts()), (P(rpc="10.0.0.2:50052", parallel=1), Facts())),
    "kvu-idle-slots": ((P(kv_unified=True, parallel=8), Facts()),
                       (P(kv_unified=True, parallel=8, cache_ram=0), Facts())),
    "auto-kvu-idle-slots": ((P(parallel=None), Facts()),
                            (P(parallel=None, cache_idle_slots=False), Facts())),
    "no-checkpoints": ((P(ctx_checkpoints=0), GEMMA),
                       (P(ctx_checkpoints=0), Facts(memory_kind="dense"))),
    "build-drops-checkpoints": ((P(), Facts(memory_kind="recurrent-hybrid", build="b0-unknown",
                                            build_persists_checkpoints=False)),
                                (P(), Facts(memory_kind="recurrent-hybrid", build_persists_checkpoints=True))),
    "resume-after-restart": ((P(), Facts(memory_kind="recurrent-hybrid", architecture="lfm2", sidecar_behaviour="v2")),
                             (P(swa_full=True),
                              Facts(memory_kind="recurrent-hybrid", architecture="lfm2", sidecar_behaviour="v2"))),
    "cache-ram-off": ((P(cache_ram=0), Facts()), (P(cache_ram=4096), Facts())),
    "ctx-split": ((P(ctx_size=32768, parallel=4), Facts()), (P(ctx_size=32768, parallel=1), Facts())),
    "parked-session-too-big": ((P(ctx_size=8192, parallel=2), Facts(largest_session_tokens=5000)),
                               (P(ctx_size=8192, parallel=2), Facts(largest_session_tokens=4000))),
    "save-dir-unusable": ((P(slot_save_path="/etc/passwd/"),
                           Facts(**{**SAVE_OK, "save_dir_setting": "/etc/passwd/", "save_dir_is_dir": False})),
                          (P(), Facts(**SAVE_OK))),
    "save-dir-not-writable": ((P(slot_save_path="/ro/"),
                               Facts(**{**SAVE_OK, "save_dir_setting": "/ro/", "save_dir_writable": False})),
                              (P(), Facts(**SAVE_OK))),
    "save-disk-nearly-full": ((P(), Facts(**{**SAVE_OK, "save_free_bytes": 50 << 20},
                                          typical_park_bytes=20 << 20)),
                              (P(), Facts(**{**SAVE_OK, "save_free_bytes": 61 << 20},
                                          typical_park_bytes=20 << 20))),
    "exposed-no-key": ((P(host="0.0.0.0"), Facts()), (P(host="0.0.0.0", api_key="k"), Facts())),
    "exposed-acknowledged": ((P(host="0.0.0.0", expose_acknowledged=True), Facts()),
                             (P(host="127.0.0.1", expose_acknowledged=True), Facts())),
    "exposed-with-key": ((P(host="192.168.1.5", api_key="k"), Facts()), (P(api_key="k"), Facts())),
    "cache-type-k-unsupported": ((P(cache_type_k="turbo3"), Facts(caps=STOCK_CAPS)),
                                 (P(cache_type_k="q8_0"), Facts(caps=STOCK_CAPS))),
    "cache-type-v-unsupported": ((P(cache_type_v="turbo4"), Facts(cache_types=STOCK_CACHE_TYPES)),
                                 (P(cache_type_v="turbo4"), Facts())),
    "swa-full-memory": ((P(swa_full=True, ctx_size=8192), GEMMA),
                        (P(swa_full=True, ctx_size=8192), Facts(memory_kind="dense"))),
    "park-files-changed": ((P(), Facts(foreign_parks=("'Y': not the sidecar this session parked",))),
                           (P(), Facts(foreign_parks=()))),
}


def test_every_rule_has_a_case_and_unique_id():
    assert sorted(CASES) == sorted(r.id for r in RULES)
    assert len({r.id for r in RULES}) == len(RULES)
    for r in RULES:
        assert isinstance(r.severity, Severity) and r.source and r.message


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_rule_fires_on_its_case_and_not_on_the_near_miss(rule_id):
    (hit_p, hit_f), (miss_p, miss_f) = CASES[rule_id]
    finding = find(hit_p, hit_f, rule_id)
    rule = next(r for r in RULES if r.id == rule_id)
    assert finding.severity == rule.severity and finding.source == rule.source
    assert "{" not in finding.message  # every template value was filled
    assert rule_id not in ids(miss_p, miss_f)


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_each_remedy_makes_its_rule_stop_firing(rule_id):
    (profile, facts), _ = CASES[rule_id]
    finding = find(profile, facts, rule_id)
    for remedy in finding.remedies:
        fixed = remedy.apply(profile)
        assert rule_id not in ids(fixed, facts), remedy.label


def test_errors_come_first():
    p = P(host="0.0.0.0", cache_ram=0, ctx_size=8192, parallel=4, rpc="h:1")
    sev = [f.severity.rank for f in diagnose(p)]
    assert sev == sorted(sev, reverse=True) and sev[0] == Severity.ERROR.rank and sev[-1] == Severity.INFO.rank


def test_a_quiet_profile_has_no_findings():
    assert diagnose(P(), Facts(**SAVE_OK, caps=STOCK_CAPS, memory_kind="dense")) == []


# -- the seeds -------------------------------------------------------------------------


def test_seed_002_command_line():
    p = parse_command_line(SEED_002)
    assert (p.parallel, p.ctx_size, p.host, p.rpc) == (32, 4500000, "0.0.0.0", None)
    assert ids(p) == ["exposed-no-key", "ctx-split"]
    assert "140,625 tokens" in find(p, None, "ctx-split").message
    # The crash itself is the RPC path (#26128); the seed's command line has no --rpc.
    with_rpc = parse_command_line(SEED_002 + " --rpc 192.168.1.20:50052")
    assert ids(with_rpc) == ["rpc-prompt-cache", "exposed-no-key", "ctx-split"]
    f = find(with_rpc, None, "rpc-prompt-cache")
    assert "--no-cache-prompt does not help" in f.message
    assert [r.changes for r in f.remedies] == [{"cache_ram": 0}, {"parallel": 1}]
    assert "rpc-prompt-cache" not in ids(with_rpc.replace(cache_ram=0))
    assert "rpc-prompt-cache" not in ids(with_rpc.replace(parallel=1))


def test_seed_004_command_line():
    p = parse_command_line(SEED_004)
    assert (p.kv_unified, p.parallel, p.cache_type_k, p.flash_attn) == (True, 8, "q8_0", "on")
    assert ids(p) == ["kvu-idle-slots"]
    f = find(p, Facts(build_number=11387), "kvu-idle-slots")
    assert f.severity == Severity.WARNING and "Build 11387 does not have the fix" in f.message
    assert [r.changes for r in f.remedies] == [{"cache_idle_slots": False}, {"kv_unified": None}]
    assert "a build with the fix" in find(p, None, "kvu-idle-slots").message.lower()
    assert ids(f.remedies[0].apply(p)) == []
    # Dropping -kvu splits -c across the 8 slots: the doctor says what that leaves.
    assert ids(f.remedies[1].apply(p)) == ["ctx-split"]
    assert "2,560 tokens" in find(f.remedies[1].apply(p), None, "ctx-split").message


def test_kvu_stall_is_quiet_on_a_build_with_the_fix(monkeypatch):
    p = parse_command_line(SEED_004)
    assert "kvu-idle-slots" in ids(p, Facts(build_number=99999))  # fix build not known: still warned
    assert "not known to have the fix" in find(p, Facts(build_number=99999), "kvu-idle-slots").message
    monkeypatch.setattr(rules, "KVU_IDLE_STALL_FIXED_IN_BUILD", 11500)
    assert "kvu-idle-slots" not in ids(p, Facts(build_number=11500))
    assert "kvu-idle-slots" in ids(p, Facts(build_number=11499))
    assert "kvu-idle-slots" in ids(p, Facts())  # build unknown


def test_kvu_stall_needs_the_kv_on_a_gpu():
    assert "kvu-idle-slots" not in ids(parse_command_line(SEED_004).replace(gpu_layers="0"))


# -- rule details ----------------------------------------------------------------------


def test_checkpoints_rule_by_memory_kind():
    p = P(ctx_checkpoints=0)
    assert "sliding-window model" in find(p, GEMMA, "no-checkpoints").message
    assert "if the model uses a sliding window" in find(p, Facts(), "no-checkpoints").message
    assert "no-checkpoints" in ids(p, Facts(memory_kind="recurrent-hybrid"))
    # --swa-full keeps every position of an SWA model: no checkpoints needed.
    assert "no-checkpoints" not in ids(p.replace(swa_full=True), GEMMA)
    assert "no-checkpoints" in ids(p.replace(swa_full=True), Facts(memory_kind="recurrent-hybrid"))


def test_build_that_drops_checkpoints():
    facts = Facts(memory_kind="sliding-window", build="b0-unknown", build_persists_checkpoints=False)
    f = find(P(), facts, "build-drops-checkpoints")
    assert "b0-unknown" in f.message and "--swa-full" in f.message
    assert "build-drops-checkpoints" not in ids(P(), Facts(memory_kind="dense", build_persists_checkpoints=False))
    assert "build-drops-checkpoints" not in ids(P(), Facts(memory_kind="sliding-window"))  # never observed
    assert "build-drops-checkpoints" not in ids(P(swa_full=True), facts)
    # --ctx-checkpoints 0 already says it.
    assert ids(P(ctx_checkpoints=0), facts) == ["no-checkpoints"]


def test_resume_after_restart_says_what_the_matrix_measured_and_its_remedy():
    """A stock build that parked nothing yet: the matrix says a hybrid's next turn after a restart
    re-processes everything, and names the built server; LFM2 on the built server rolls back to an
    earlier checkpoint, and --swa-full makes it a HIT."""
    f = find(P(), Facts(memory_kind="recurrent-hybrid", architecture="qwen35", sidecar_behaviour="none"),
             "resume-after-restart")
    assert "(DISCARDED)" in f.message and "built server" in f.message, f.message
    f = find(P(), Facts(memory_kind="recurrent-hybrid", architecture="lfm2", sidecar_behaviour="v2"),
             "resume-after-restart")
    assert "(PARTIAL)" in f.message and "--swa-full" in f.message, f.message
    # where the matrix says HIT, no rule about resumes fires
    for p, facts in ((P(), Facts(memory_kind="recurrent-hybrid", architecture="qwen35", sidecar_behaviour="v2")),
                     (P(swa_full=True), Facts(memory_kind="sliding-window", architecture="gemma3",
                                              sidecar_behaviour="none", build_persists_checkpoints=False)),
                     (P(), Facts(memory_kind="dense", architecture="llama", sidecar_behaviour="none"))):
        assert not {"resume-after-restart", "build-drops-checkpoints", "no-checkpoints"} & set(ids(p, facts))


def test_session_too_big_uses_the_per_slot_context_and_suggests_a_c():
    facts = Facts(largest_session_tokens=5000)
    f = find(P(ctx_size=8192, parallel=2), facts, "parked-session-too-big")
    assert "5,000 tokens" in f.message and "4,096" in f.message
    assert f.remedies[0].changes == {"ctx_size": 2 * 5120}
    # Unified KV: a slot holds all of -c.
    assert "parked-session-too-big" not in ids(P(ctx_size=8192, parallel=2, kv_unified=True, cache_idle_slots=False),
                                                facts)
    # No -c: the model's training context.
    assert slot_ctx(P(parallel=2), Facts(n_ctx_train=32768)) == 16384
    assert slot_ctx(P(parallel=2), Facts()) is None


def test_save_dir_facts_only_describe_the_folder_they_were_gathered_for():
    facts = Facts(save_dir="/data/sessions/p/", save_dir_exists=False, save_dir_writable=False)
    f = find(P(), facts, "save-dir-unusable")
    assert "cannot be created" in f.message and f.severity == Severity.ERROR
    assert f.remedies == ()  # the default folder: nothing to switch back to
    # The profile now names another folder: these facts say nothing about it.
    assert "save-dir-unusable" not in ids(P(slot_save_path="/elsewhere/"), facts)
    # A missing folder that the launch can create is fine.
    assert ids(P(), Facts(save_dir="/x/", save_dir_exists=False, save_dir_writable=True)) == []


def test_disk_room_in_parks():
    facts = Facts(**{**SAVE_OK, "save_free_bytes": 10 << 20}, typical_park_bytes=20 << 20)
    f = find(P(), facts, "save-disk-nearly-full")
    assert "room for no park" in f.message and "20.0 MiB" in f.message
    facts = Facts(**{**SAVE_OK, "save_free_bytes": 45 << 20}, typical_park_bytes=20 << 20)
    assert "room for 2 more parks" in find(P(), facts, "save-disk-nearly-full").message
    assert "save-disk-nearly-full" not in ids(P(), Facts(**SAVE_OK))  # no park yet: no typical size


def test_exposure_reuses_the_profile_text():
    from app.core.profile import exposure_warning

    p = P(host="0.0.0.0")
    assert find(p, None, "exposed-no-key").message.startswith(exposure_warning(p))
    assert find(p.replace(api_key="k"), None, "exposed-with-key").message == exposure_warning(p.replace(api_key="k"))


def test_cache_types_come_from_the_binary():
    turbo = BinaryCaps(frozenset(), frozenset(), frozenset(), STOCK_CACHE_TYPES + ("turbo3",))
    assert "cache-type-k-unsupported" not in ids(P(cache_type_k="turbo3"), Facts(caps=turbo))
    f = find(P(cache_type_k="turbo3"), Facts(caps=STOCK_CAPS), "cache-type-k-unsupported")
    assert "'turbo3'" in f.message and "q8_0" in f.message
    assert ids(P(cache_type_k="turbo3"), Facts()) == []  # binary unknown: nothing to say


def test_swa_full_estimate_matches_the_real_server():
    # Fixture log, -c 8192 -np 2: "creating SWA KV cache, size = 1024 cells", 30 MiB for 15 layers;
    # --swa-full makes it 4096 cells per slot, i.e. 90 MiB more.
    p = P(swa_full=True, ctx_size=8192, parallel=2)
    assert swa_full_extra(p, GEMMA) == (90 << 20, 6144)
    assert "about 90.0 MiB more KV memory" in find(p, GEMMA, "swa-full-memory").message
    # q8_0 K and V: 34/32 bytes per value.
    q8 = p.replace(cache_type_k="q8_0", cache_type_v="q8_0")
    assert swa_full_extra(q8, GEMMA)[0] == int(90 * (1 << 20) * 34 / 64)
    # Unified KV, 4 slots: the SWA cache holds 512 x 4 + 512 cells, padded to 2560.
    assert swa_full_extra(p.replace(parallel=4, kv_unified=True), GEMMA) == (15 * 1024 * (8192 - 2560), 8192 - 2560)
    # Unknown numbers: no estimate, still the finding.
    bare = Facts(memory_kind="sliding-window")
    assert swa_full_extra(p, bare) is None
    assert "not known" in find(p, bare, "swa-full-memory").message
    assert swa_full_extra(p.replace(cache_type_k="turbo3"), GEMMA) is None


def test_swa_layer_pattern():
    assert sum(swa_layer_pattern("gemma3", 18)) == 15
    assert swa_layer_pattern("gemma3", 6) == (True,) * 5 + (False,)
    assert swa_layer_pattern("gemma2", 4) == (True, False, True, False)
    assert swa_layer_pattern("cohere2moe", 4) == (False, True, True, True)  # dense first
    assert swa_layer_pattern("gemma3", 3, [1, 0, 1]) == (True, False, True)  # the GGUF's own array
    assert swa_layer_pattern("llama", 32) is None
    assert swa_layer_pattern("foo", 4, 0) == (True,) * 4


@pytest.mark.parametrize("text, number", [
    ("version: 0.6.0-dev (build 0, commit unknown)\nbuilt with GNU 12.2.0", None),
    ("version: 0.6.0 (build 11434, commit 8330e96)", 11434),
    ("version: 4149 (1bb30bf2)\nbuilt with cc", 4149),
    ("b11387-8330e96", 11387),
    ("b0-unknown", None),
    ("", None),
    (None, None),
])
def test_parse_build_number(text, number):
    assert parse_build_number(text) == number


# -- hazards(), the profile form's view --------------------------------------------------


def test_hazards_are_the_findings_without_facts():
    p = P(host="0.0.0.0", kv_unified=True, parallel=8)
    hs = hazards(p)
    assert [h.key for h in hs] == ids(p)
    assert all(isinstance(h, Hazard) for h in hs)
    assert hs[0].severity == Severity.ERROR and hs[0].text == diagnose(p)[0].message
    assert Hazard("k", "t").severity == Severity.WARNING  # old two-field form still builds
