"""Per-build sidecar predictions (app.core.sidecar_behaviour) on files written here.

Each loader rule is the one the real server in that mode applies; the real-server
proofs are tests/real/test_real_sidecar_modes.py."""

from __future__ import annotations

import dataclasses

import struct

import pytest

from app.core.sidecar_behaviour import (MISSING, Behaviour, Evidence, discard_reason, identify,
                                        predict_load, sideless_warning)
from app.core.verdict import Reuse, VerdictKind, judge
from app.server.cpu import REPACK_ENV, amx_under_hypervisor, repack_env
from app.server.logparse import Kind, SidecarMode, parse_line
from app.server.sidecar import Checkpoint, fnv1a64_file, read_facts, write_pkcl

BLOB = b"\x01" * 64


def v1(tmp_path, cps=((2015, 991, 2014), (2527, 1503, 2526)), extra=b""):
    state = tmp_path / "a.bin"
    state.write_bytes(b"state" * 10)
    write_pkcl(tmp_path / "a.bin.ckpt", [(Checkpoint(n, lo, hi, len(BLOB), 0), BLOB, b"") for n, lo, hi in cps])
    if extra:
        with open(tmp_path / "a.bin.ckpt", "ab") as f:
            f.write(extra)
    return state


def v2(tmp_path, cps=((2015, 991, 2014), (2527, 1503, 2526)), state_hash=None):
    state = tmp_path / "b.bin"
    state.write_bytes(b"other state" * 10)
    h = fnv1a64_file(state) if state_hash is None else state_hash
    out = struct.pack("<IIQI", 0x4C434B50, 2, h, len(cps))
    for n, lo, hi in cps:
        out += struct.pack("<qii", n, lo, hi)
        for block in (BLOB, b"", b""):
            out += struct.pack("<Q", len(block)) + block
    (tmp_path / "b.bin.ckpt").write_bytes(out)
    return state


def test_facts_of_both_versions(tmp_path):
    f1 = read_facts(v1(tmp_path))
    assert (f1.kind, f1.version, f1.count, f1.trailing, f1.short) == ("PKCL", 1, 2, 0, None)
    state = v2(tmp_path)
    f2 = read_facts(state)
    assert (f2.version, f2.count, f2.state_hash) == (2, 2, fnv1a64_file(state))
    assert read_facts(tmp_path / "none.bin") == MISSING


def test_trailing_bytes_the_fork_loads_and_strict_loaders_refuse(tmp_path):
    facts = read_facts(v1(tmp_path, extra=b"\0" * 7))
    assert facts.trailing == 7
    fork = predict_load(Behaviour.FORK, facts, n_restored=2538, ctx_checkpoints=32)
    assert fork.loads is True and fork.count == 2 and "7 trailing bytes" in fork.sentence
    port = predict_load(Behaviour.PORT, facts, n_restored=2538, ctx_checkpoints=32)
    assert port.loads is False and not port.tip and "trailing bytes" in port.refusal


def test_fork_accepts_what_the_port_refuses(tmp_path):
    facts = read_facts(v1(tmp_path, cps=((9000, 500, 400),)))  # past the tokens, pos_max < pos_min
    assert predict_load(Behaviour.FORK, facts, n_restored=2538, ctx_checkpoints=1).loads is True
    port = predict_load(Behaviour.PORT, facts, n_restored=2538, ctx_checkpoints=32)
    assert port.loads is False and "past the 2,538 restored" in port.refusal


def test_v2_hash_count_and_empty_list(tmp_path):
    state = v2(tmp_path)
    h = fnv1a64_file(state)
    facts = read_facts(state)
    ok = predict_load(Behaviour.V2, facts, n_restored=2538, ctx_checkpoints=32, state_hash=h)
    assert ok.loads is True and ok.count == 2
    stale = predict_load(Behaviour.V2, facts, n_restored=2538, ctx_checkpoints=32, state_hash=h ^ 1)
    assert stale.loads is False and stale.tip and "state hash" in stale.refusal
    fewer = predict_load(Behaviour.V2, facts, n_restored=2538, ctx_checkpoints=1, state_hash=h)
    assert fewer.loads is False and "--ctx-checkpoints 1" in fewer.refusal
    pending = predict_load(Behaviour.V2, facts, n_restored=2538, ctx_checkpoints=32, hash_known=False)
    assert pending.loads is None and "not checked yet" in pending.sentence
    empty = read_facts(v2(tmp_path, cps=()))
    assert "empty list" in predict_load(Behaviour.V2, empty, n_restored=10, ctx_checkpoints=32, state_hash=None).refusal
    # a v1 file on a v2 server, and the reverse
    assert predict_load(Behaviour.V2, read_facts(v1(tmp_path)), n_restored=2538, ctx_checkpoints=32).loads is False
    assert predict_load(Behaviour.FORK, facts, n_restored=2538, ctx_checkpoints=32).loads is False


def test_missing_sidecar_per_build():
    assert predict_load(Behaviour.FORK, MISSING, n_restored=100, ctx_checkpoints=32).tip
    assert predict_load(Behaviour.V2, MISSING, n_restored=100, ctx_checkpoints=32).tip
    assert not predict_load(Behaviour.PORT, MISSING, n_restored=100, ctx_checkpoints=32).tip
    assert predict_load(Behaviour.UNKNOWN, MISSING, n_restored=100, ctx_checkpoints=32).loads is None
    none = predict_load(Behaviour.NONE, MISSING, n_restored=100, ctx_checkpoints=32)
    assert none.loads is False and "reads no sidecars" in none.sentence
    off = predict_load(Behaviour.FORK, MISSING, n_restored=100, ctx_checkpoints=0)
    assert off.loads is False and not off.tip


@pytest.mark.parametrize("b", [Behaviour.FORK, Behaviour.V2, Behaviour.PORT, Behaviour.NONE])
def test_the_fallback_warning_for_a_family_the_matrix_lacks(b):
    p = predict_load(b, MISSING, n_restored=100, ctx_checkpoints=32)
    text = sideless_warning(b, p, "sliding-window")
    assert text.endswith(
        "Because this model uses sliding-window attention, a chat client's first query after the restore "
        "re-prefills everything, as every such family did without its checkpoints in the resume matrix."), text
    assert sideless_warning(b, p, "dense") is None


def test_an_unknown_build_is_warned_and_said_unknown():
    p = predict_load(Behaviour.UNKNOWN, MISSING, n_restored=100, ctx_checkpoints=32)
    p = dataclasses.replace(p, loads=False)
    text = sideless_warning(Behaviour.UNKNOWN, p, "sliding-window")
    assert "not known yet" in text, text


def test_discard_reason_names_the_builds_refusal(tmp_path):
    state = v2(tmp_path)
    p = predict_load(Behaviour.V2, read_facts(state), n_restored=2538, ctx_checkpoints=1,
                     state_hash=fnv1a64_file(state))
    reason = discard_reason(Behaviour.V2, p)
    assert "refused the sidecar" in reason and "tip checkpoint" in reason
    v = judge(Reuse(2538, 0, 2549, prompt_total=2549, restored=True, sidecar_status="present",
                    sidecar_loaded_count=0, behaviour=Behaviour.V2, prediction=p))
    assert v.kind is VerdictKind.DISCARDED and "refused the sidecar" in v.reason and "--ctx-checkpoints 1" in v.reason
    tip = predict_load(Behaviour.FORK, MISSING, n_restored=2538, ctx_checkpoints=32)
    v = judge(Reuse(2538, 0, 2549, prompt_total=2549, restored=True, sidecar_status="missing",
                    sidecar_loaded_count=0, behaviour=Behaviour.FORK, prediction=tip))
    assert "tip checkpoint" in v.reason


def test_identify_from_the_evidence():
    assert identify(Evidence(mode_line="fork")) is Behaviour.FORK
    assert identify(Evidence(built_by_kv_valet=True)) is Behaviour.V2
    assert identify(Evidence(built_by_kv_valet=True, env_mode="fork")) is Behaviour.FORK
    assert identify(Evidence(park_wrote="v1")) is Behaviour.FORK
    assert identify(Evidence(park_wrote="v1", ignoring_line=True)) is Behaviour.PORT
    assert identify(Evidence(park_wrote="v2")) is Behaviour.V2
    assert identify(Evidence(park_wrote="none")) is Behaviour.NONE
    assert identify(Evidence()) is Behaviour.UNKNOWN


def test_log_lines_of_the_modes():
    ev = parse_line("0.01.022.945 I srv    load_model: checkpoint sidecars: fork")
    assert ev.kind is Kind.SIDECAR_MODE and isinstance(ev, SidecarMode) and ev.mode == "fork"
    ev = parse_line("0.04.040.237 W slot process_sing: id  0 | task -1 | ignoring checkpoint sidecar: state hash "
                    "mismatch (the sidecar belongs to another save) (/home/user/slots/a.bin.ckpt)")
    assert ev.kind is Kind.SIDECAR_IGNORED and ev.path == "/home/user/slots/a.bin.ckpt"
    assert ev.reason.startswith("state hash mismatch")
    ev = parse_line("0.04.867.946 W slot process_sing: id  0 | task -1 | failed to write checkpoint sidecar /x.ckpt")
    assert ev.kind is Kind.SIDECAR_WRITE_FAILED


def test_amx_in_a_vm_runs_without_repacking():
    amx_vm = frozenset({"avx2", "amx_tile", "amx_int8", "hypervisor"})
    assert amx_under_hypervisor(amx_vm) and not amx_under_hypervisor(frozenset({"amx_tile"}))
    extra, why = repack_env(["llama-server"], True, environ={}, flags=amx_vm)
    assert extra == {REPACK_ENV: "false"} and "--no-repack" in why
    assert repack_env(["llama-server", "--repack"], True, environ={}, flags=amx_vm) == ({}, None)
    assert repack_env(["llama-server"], True, environ={REPACK_ENV: "true"}, flags=amx_vm) == ({}, None)
    assert repack_env(["llama-server"], False, environ={}, flags=amx_vm) == ({}, None)
    assert repack_env(["llama-server"], True, environ={}, flags=frozenset({"avx2", "hypervisor"})) == ({}, None)


def test_the_mode_of_one_run_in_a_log_file_that_holds_several(tmp_path):
    """The supervisor's log file appends a section per launch: the asked process's mode, not the
    last one in the file (connect reads it before the loop has heard the start line)."""
    from app.sessions.behaviour import mode_from_log_file

    log = tmp_path / "p.log"
    log.write_text("===== 2026-12-01 10:00:00 pid 100: llama-server -m m.gguf\n"
                   "0.01.022.945 I srv    load_model: checkpoint sidecars: fork\n"
                   "===== 2026-12-01 10:05:00 pid 200: llama-server -m m.gguf\n"
                   "0.01.022.945 I srv    load_model: checkpoint sidecars: v2\n"
                   "===== 2026-12-01 10:09:00 pid 300: llama-server -m m.gguf\n")
    assert mode_from_log_file(log, pid=100) == "fork"
    assert mode_from_log_file(log, pid=200) == "v2"
    assert mode_from_log_file(log, pid=300) is None  # its start line is not there yet
    assert mode_from_log_file(log) == "v2"  # without a pid: the last run that said it


def test_log_evidence_reads_only_the_new_lines_and_keeps_what_it_saw():
    """A park re-identifies a server still UNKNOWN: the log's evidence is read on from where the last
    park left it (the mode line kept once it has scrolled by), and read again from the start of another
    buffer (a new server process)."""
    from app.sessions.behaviour import LogEvidence
    from app.server.supervisor import LogBuffer

    log = LogBuffer(capacity=3)
    seen = LogEvidence()
    log.append("checkpoint sidecars: v2")
    assert seen.read(log).mode_line == "v2" and not seen.ignoring
    for i in range(5):  # the mode line leaves the buffer
        log.append(f"srv  log line {i}")
    log.append("ignoring checkpoint sidecar: /tmp/a.bin.ckpt (hash mismatch)")
    assert seen.read(log).mode_line == "v2" and seen.ignoring
    other = LogBuffer()
    other.append("srv  nothing said")
    assert seen.read(other).mode_line is None and not seen.ignoring
