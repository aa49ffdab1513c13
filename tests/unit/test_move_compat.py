"""The move rules (app.core.compat): one refusal per rule, over value types, each with its remedy."""

from __future__ import annotations

from dataclasses import replace

import pytest

from app.core.compat import SessionFacts, TargetFacts, base_build, check_move

SESSION = SessionFacts(name="chat", n_tokens=1500, model_name="gemma.gguf", model_size=253_000_000,
                       model_sha256="", model_quick_id="q1:abc", cache_type_k="f16", cache_type_v="f16",
                       flash_attn="auto", swa_full=False, memory_kind="sliding-window",
                       server_build="b11434-8330e96 +sidecars-v2", state_version=4, sidecar_kind="PKCL",
                       sidecar_version=2, sidecar_count=3, total_bytes=30_000_000)
TARGET = TargetFacts(where="profile 'b'", profile="b", save_dir="/s/b/", model_path="/m/gemma.gguf",
                     model_size=253_000_000, model_quick_id="q1:abc", cache_type_k="f16", cache_type_v="f16",
                     flash_attn="auto", swa_full=False, ctx_checkpoints=32, n_ctx_slot=2048,
                     build="b11434-8330e96", build_keys=("b11434-8330e96",), state_version=None, behaviour="v2",
                     free_bytes=10 << 30, names=("other",))


def rules(compat, blocking=True):
    return [p.rule for p in (compat.refusals if blocking else compat.warnings)]


def test_a_compatible_target_passes_every_rule():
    c = check_move(SESSION, TARGET)
    assert c.ok and c.refusals == () and c.warnings == ()


def test_the_facts_travel_as_json_and_back():
    import json

    assert TargetFacts.from_dict(json.loads(json.dumps(TARGET.to_dict()))) == TARGET
    assert SessionFacts.from_dict(json.loads(json.dumps(SESSION.to_dict()))) == SESSION


# -- model identity ------------------------------------------------------------------------------------


def test_another_model_is_refused_by_its_quick_id():
    c = check_move(SESSION, replace(TARGET, model_quick_id="q1:zzz", model_path="/m/qwen.gguf"))
    [p] = c.refusals
    assert p.rule == "model" and "size and the SHA-256 of the first 16 MiB" in p.message
    assert "qwen.gguf" in p.message and "same GGUF" in p.remedy


def test_the_whole_file_hash_decides_when_both_have_it():
    s = replace(SESSION, model_sha256="a" * 64)
    assert check_move(s, replace(TARGET, model_sha256="a" * 64, model_quick_id="q1:other")).ok
    c = check_move(s, replace(TARGET, model_sha256="b" * 64))
    assert rules(c) == ["model"] and "SHA-256 of the whole file" in c.refusals[0].message


def test_an_unreadable_target_model_is_refused():
    c = check_move(SESSION, replace(TARGET, model_size=0, model_quick_id=""))
    assert rules(c) == ["model"] and "not readable" in c.refusals[0].message


def test_a_session_without_model_identity_only_warns():
    s = replace(SESSION, model_size=0, model_quick_id="", model_sha256="")
    c = check_move(s, TARGET)
    assert c.ok and rules(c, blocking=False) == ["model"]


# -- K/V types, flash attention, swa-full ------------------------------------------------------------


@pytest.mark.parametrize("field,flag", [("cache_type_k", "-ctk q8_0"), ("cache_type_v", "-ctv q8_0")])
def test_other_cache_types_are_refused(field, flag):
    c = check_move(replace(SESSION, **{field: "q8_0"}), TARGET)
    [p] = c.refusals
    assert p.rule == "cache types" and flag in p.remedy


def test_flash_attention_on_against_off_is_refused():
    c = check_move(replace(SESSION, flash_attn="on"), replace(TARGET, flash_attn="off"))
    [p] = c.refusals
    assert p.rule == "flash attention" and "V cache" in p.message and "-fa on" in p.remedy


def test_flash_attention_auto_against_explicit_warns():
    c = check_move(replace(SESSION, flash_attn="on"), TARGET)
    assert c.ok and rules(c, blocking=False) == ["flash attention"]


def test_swa_full_must_match_for_a_sliding_window_model():
    c = check_move(replace(SESSION, swa_full=True), TARGET)
    [p] = c.refusals
    assert p.rule == "swa-full" and "add --swa-full" in p.remedy
    dense = replace(SESSION, swa_full=True, memory_kind="dense", sidecar_kind=None)
    assert check_move(dense, TARGET).ok  # a dense model has no sliding-window cache


# -- versions ------------------------------------------------------------------------------------------


def test_another_state_version_is_refused():
    c = check_move(replace(SESSION, server_build="b9000-abc"), replace(TARGET, state_version=3))
    [p] = c.refusals
    assert p.rule == "state version" and "version 4" in p.message and "reads only version 3" in p.message


def test_the_same_base_build_reads_its_own_state_files():
    assert base_build("b11434-8330e96 +sidecars-v2") == "b11434-8330e96"
    assert check_move(SESSION, replace(TARGET, state_version=3)).ok  # same llama.cpp build: the learnt 3 is moot


def test_an_unknown_state_version_of_another_build_only_warns():
    c = check_move(replace(SESSION, server_build="b9000-abc"), TARGET)
    assert c.ok and rules(c, blocking=False) == ["state version"]


def test_an_unreadable_state_header_is_refused():
    assert rules(check_move(replace(SESSION, state_version=None), TARGET)) == ["state version"]


@pytest.mark.parametrize("behaviour,reader", [("none", "reads no sidecars"), ("fork", "PKCL v1 sidecars only"),
                                              ("port", "PKCL v1 sidecars only")])
def test_a_sidecar_the_target_build_cannot_read_is_refused(behaviour, reader):
    c = check_move(SESSION, replace(TARGET, behaviour=behaviour))
    [p] = c.refusals
    assert p.rule == "sidecar version" and reader in p.message and "checkpoints would be lost" in p.message
    assert "PKCL v2" in p.remedy


def test_a_pkcl_v1_sidecar_goes_to_the_fork():
    assert check_move(replace(SESSION, sidecar_version=1), replace(TARGET, behaviour="fork")).ok


def test_an_unknown_target_build_only_warns_about_the_sidecar():
    c = check_move(SESSION, replace(TARGET, behaviour="unknown"))
    assert c.ok and rules(c, blocking=False) == ["sidecar version"]


def test_no_sidecar_no_sidecar_rules():
    s = replace(SESSION, sidecar_kind=None, sidecar_version=None, sidecar_count=0)
    assert check_move(s, replace(TARGET, behaviour="none", ctx_checkpoints=0)).ok


# -- --ctx-checkpoints ---------------------------------------------------------------------------------


def test_ctx_checkpoints_zero_is_refused():
    c = check_move(SESSION, replace(TARGET, ctx_checkpoints=0))
    [p] = c.refusals
    assert p.rule == "ctx-checkpoints" and "--ctx-checkpoints 3" in p.remedy


def test_more_checkpoints_than_a_strict_loader_admits_is_refused():
    c = check_move(SESSION, replace(TARGET, ctx_checkpoints=2))
    [p] = c.refusals
    assert p.rule == "ctx-checkpoints" and "refuses" in p.message
    fork = check_move(replace(SESSION, sidecar_version=1), replace(TARGET, ctx_checkpoints=2, behaviour="fork"))
    assert fork.ok  # the fork's loader does not check the count


# -- slot context, disk, name ----------------------------------------------------------------------------


def test_a_slot_too_small_is_refused():
    c = check_move(SESSION, replace(TARGET, n_ctx_slot=1024))
    [p] = c.refusals
    assert p.rule == "slot context" and "1,024" in p.message and "raise -c" in p.remedy


def test_an_unknown_slot_size_only_warns():
    c = check_move(SESSION, replace(TARGET, n_ctx_slot=None))
    assert c.ok and rules(c, blocking=False) == ["slot context"]


def test_a_full_disk_is_refused():
    c = check_move(SESSION, replace(TARGET, free_bytes=1 << 20))
    assert rules(c) == ["disk space"]


def test_a_name_taken_at_the_target_is_refused_unless_renamed():
    c = check_move(SESSION, replace(TARGET, names=("chat",)))
    [p] = c.refusals
    assert p.rule == "name" and "--rename" in p.remedy
    assert check_move(SESSION, replace(TARGET, names=("chat",)), name="chat 2").ok


def test_every_refusal_is_reported_at_once():
    t = replace(TARGET, cache_type_k="q4_0", n_ctx_slot=100, behaviour="none", names=("chat",))
    assert rules(check_move(SESSION, t)) == ["name", "cache types", "sidecar version", "slot context"]
