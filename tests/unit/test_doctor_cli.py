"""``kv-valet doctor PROFILE``: facts gathered without raising, findings printed, exit 1 on an error.

The command runs in a subprocess through a parser built here from
``app.cli.doctor.add_commands`` (so the test does not depend on its registration
in app/cli/__init__.py), against a fake llama-server that answers ``--help`` and
``--version`` with the real build 11434 captures, and a tiny GGUF with Gemma 3
270M's attention numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from app.core.findings import Remedy
from app.core.profile import LaunchProfile
from app.store.catalog import Catalog, SessionRecord
from app.store.profiles import ProfileStore
from tests.conftest import B11434, ROOT

gguf = pytest.importorskip("gguf")

RUN_DOCTOR = (
    "import argparse, sys\n"
    "from app.cli import doctor\n"
    "parser = argparse.ArgumentParser(prog='kv-valet')\n"
    "doctor.add_commands(parser.add_subparsers(dest='command', required=True))\n"
    "args = parser.parse_args(sys.argv[1:])\n"
    "sys.exit(int(args.run(args)))\n"
)


def run_doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RUN_DOCTOR, "doctor", *args], capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ), timeout=60)


@pytest.fixture
def fake_server(tmp_path) -> Path:
    """A llama-server stand-in: --help and --version of the real build 11434."""
    script = tmp_path / "llama-server"
    script.write_text("#!/bin/sh\n"
                      "case \"$1\" in\n"
                      f"  --help) cat '{B11434 / 'help.txt'}' ;;\n"
                      f"  --version) cat '{B11434 / 'version.txt'}' ;;\n"
                      "esac\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


@pytest.fixture
def gemma(tmp_path) -> Path:
    """Gemma 3 270M's metadata numbers in a tiny GGUF (18 layers, 1 KV head of 256, n_swa 512)."""
    path = tmp_path / "gemma.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    for key, value in {"block_count": 18, "context_length": 32768, "embedding_length": 640,
                       "attention.head_count": 4, "attention.head_count_kv": 1, "attention.key_length": 256,
                       "attention.value_length": 256, "attention.sliding_window": 512}.items():
        w.add_uint32(f"gemma3.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def save(profile: LaunchProfile) -> LaunchProfile:
    ProfileStore().save(profile)
    return profile


# -- the command -----------------------------------------------------------------------


def test_quiet_profile_exits_0(fake_server, gemma):
    save(LaunchProfile(name="calm", model=str(gemma), server_binary=str(fake_server), ctx_size=8192, parallel=1))
    r = run_doctor("calm")
    assert r.returncode == 0, r.stderr
    assert "No known problems with this profile." in r.stdout
    assert "model: gemma3, sliding-window, n_swa 512" in r.stdout
    assert f"binary: {fake_server} (build number unknown)" in r.stdout


def test_seed_004_profile_warns_with_fix_and_source_but_exits_0(fake_server, gemma):
    save(LaunchProfile(name="kvu", model=str(gemma), server_binary=str(fake_server), gpu_layers="99",
                       cache_type_k="q8_0", cache_type_v="q8_0", parallel=8, kv_unified=True, ctx_size=20480))
    r = run_doctor("kvu")
    assert r.returncode == 0, r.stderr
    assert "WARNING  kvu-idle-slots" in r.stdout
    assert "fix: --no-cache-idle-slots  (Turn idle-slot caching off)" in r.stdout
    assert "fix: drop --kv-unified  (Drop -kvu)" in r.stdout
    assert "source: seed 004, llama.cpp #30252 (fixed by #31391)" in r.stdout
    assert "1 finding: 1 warning" in r.stdout


def test_errors_exit_1_and_come_first(fake_server, gemma):
    save(LaunchProfile(name="bad", model=str(gemma), server_binary=str(fake_server), host="0.0.0.0",
                       parallel=32, ctx_size=4500000, rpc="192.168.1.20:50052", cache_type_k="turbo3"))
    r = run_doctor("bad")
    assert r.returncode == 1, r.stderr
    out = r.stdout
    order = [out.index(f"{sev:<8} {rule}") for sev, rule in
             (("ERROR", "rpc-prompt-cache"), ("ERROR", "exposed-no-key"), ("INFO", "ctx-split"))]
    assert order == sorted(order)
    assert "  fix: --cache-ram 0\n" in out and "fix: --parallel 1  (Set -np 1)" in out
    assert "fix: --host 127.0.0.1" in out
    # The binary's --help lists no turbo types.
    assert "ERROR    cache-type-k-unsupported" in out and "fix: drop --cache-type-k turbo3" in out


def test_json_report(fake_server, gemma):
    save(LaunchProfile(name="swa", model=str(gemma), server_binary=str(fake_server), ctx_size=8192, parallel=2,
                       swa_full=True))
    r = run_doctor("swa", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["profile"] == "swa" and data["errors"] == 0
    facts = data["facts"]
    assert (facts["build"], facts["build_number"], facts["memory_kind"], facts["n_swa_layers"]) == (
        "b0-unknown", None, "sliding-window", 15)
    assert "q8_0" in facts["cache_types"]
    assert [f["rule_id"] for f in data["findings"]] == ["ctx-split", "swa-full-memory"]
    swa = data["findings"][1]
    assert swa["details"]["extra_bytes"] == 90 << 20
    assert swa["remedies"] == [{"label": "Turn --swa-full off (resumes then need context checkpoints)",
                                "changes": {"swa_full": False}, "flags": "drop --swa-full"}]


def test_unknown_profile_is_an_error():
    r = run_doctor("nope")
    assert r.returncode == 1
    assert "no profile named 'nope'" in r.stderr and r.stdout == ""


def test_missing_binary_and_model_still_diagnose(tmp_path):
    save(LaunchProfile(name="ghost", model=str(tmp_path / "gone.gguf"), server_binary=str(tmp_path / "no-server"),
                       ctx_checkpoints=0))
    r = run_doctor("ghost")
    assert r.returncode == 0, r.stderr
    assert "binary: not found" in r.stdout and "could not be read" in r.stdout
    assert "WARNING  no-checkpoints" in r.stdout  # memory kind unknown: said conditionally
    assert "if the model uses a sliding window" in r.stdout


def test_slot_save_path_that_is_a_file_is_an_error(fake_server, gemma, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    save(LaunchProfile(name="nofolder", model=str(gemma), server_binary=str(fake_server), parallel=1,
                       slot_save_path=str(blocker) + "/"))
    r = run_doctor("nofolder")
    assert r.returncode == 1
    assert "ERROR    save-dir-unusable" in r.stdout and "is not a folder" in r.stdout
    assert "fix: drop --slot-save-path" in r.stdout


def test_registered_command_when_the_cli_has_it():
    from app.cli import build_parser

    if "doctor" not in build_parser()._subparsers._group_actions[0].choices:  # noqa: SLF001
        pytest.skip("doctor is not registered in app/cli/__init__.py yet")
    r = subprocess.run([sys.executable, "-m", "app.cli", "doctor", "nope"], capture_output=True, text=True,
                       cwd=ROOT, env=dict(os.environ), timeout=60)
    assert r.returncode == 1 and "no profile named 'nope'" in r.stderr


def test_in_process_parser_and_exit_codes(fake_server, gemma, capsys):
    from app.cli import doctor

    parser = argparse.ArgumentParser(prog="kv-valet")
    doctor.add_commands(parser.add_subparsers(dest="command", required=True))
    save(LaunchProfile(name="open", model=str(gemma), server_binary=str(fake_server), parallel=1, host="0.0.0.0"))
    args = parser.parse_args(["doctor", "open"])
    assert args.run(args) == 1
    assert "ERROR    exposed-no-key" in capsys.readouterr().out
    save(LaunchProfile(name="open", model=str(gemma), server_binary=str(fake_server), parallel=1, host="0.0.0.0",
                       expose_acknowledged=True))
    assert args.run(args) == 0
    assert "WARNING  exposed-acknowledged" in capsys.readouterr().out


# -- remedies as flags ------------------------------------------------------------------


def test_remedy_flags():
    from app.cli.doctor import remedy_flags

    p = LaunchProfile(name="x", ctx_checkpoints=0, kv_unified=True, swa_full=True, cache_type_k="turbo3")
    assert remedy_flags(p, Remedy("a", {"cache_ram": 0})) == "--cache-ram 0"
    assert remedy_flags(p, Remedy("b", {"ctx_checkpoints": None})) == "drop --ctx-checkpoints 0"
    assert remedy_flags(p, Remedy("c", {"kv_unified": None})) == "drop --kv-unified"
    assert remedy_flags(p, Remedy("d", {"kv_unified": False})) == "--no-kv-unified"
    assert remedy_flags(p, Remedy("e", {"cache_idle_slots": False})) == "--no-cache-idle-slots"
    assert remedy_flags(p, Remedy("f", {"swa_full": False})) == "drop --swa-full"
    assert remedy_flags(p, Remedy("g", {"parallel": 4, "kv_unified": None})) == "--parallel 4, drop --kv-unified"
    assert remedy_flags(p, Remedy("label only", {"ctx_size": None})) == "label only"


# -- gather_facts ---------------------------------------------------------------------


def test_gather_facts_never_raises_and_leaves_unknowns_none(tmp_path):
    from app.tools.diagnose import gather_facts

    f = gather_facts(LaunchProfile(name="g", model=str(tmp_path / "none.gguf"),
                                   server_binary=str(tmp_path / "none")))
    assert (f.caps, f.binary, f.build_number, f.architecture, f.n_layer) == (None, None, None, None, None)
    assert f.memory_kind == "unknown"
    assert f.save_dir is not None and f.save_dir_exists is False and f.save_dir_writable is True
    assert f.parked_sessions is None  # no catalog file: none is created
    from app import paths

    assert not paths.catalog_path().exists()


def test_gather_facts_from_binary_model_and_catalog(fake_server, gemma):
    from app.tools.diagnose import gather_facts

    prof = LaunchProfile(name="g", model=str(gemma), server_binary=str(fake_server))
    cat = Catalog(":memory:")
    for i, (size, tokens) in enumerate([(10 << 20, 1000), (20 << 20, 2892), (30 << 20, 500)]):
        cat.add_or_replace(SessionRecord(name=f"s{i}", profile="g", state_file=f"s{i}.bin", save_dir="/x",
                                         state_size=size, n_tokens=tokens))
    cat.add_or_replace(SessionRecord(name="other", profile="h", state_file="o.bin", save_dir="/x",
                                     state_size=1 << 30, n_tokens=99999))
    cat.record_sidecar_observation("b0-unknown", False, "sliding-window")
    f = gather_facts(prof, cat)
    assert f.binary == str(fake_server) and f.build == "b0-unknown" and f.build_number is None
    assert "q8_0" in f.known_cache_types() and "turbo3" not in f.known_cache_types()
    assert (f.architecture, f.memory_kind, f.n_swa, f.n_ctx_train, f.n_layer) == (
        "gemma3", "sliding-window", 512, 32768, 18)
    assert (f.n_embd_k_gqa, f.n_embd_v_gqa, f.n_swa_layers) == (256, 256, 15)
    assert (f.parked_sessions, f.typical_park_bytes, f.largest_session_tokens) == (3, 20 << 20, 2892)
    assert f.build_persists_checkpoints is False
    from app.core.rules import diagnose

    assert "build-drops-checkpoints" in [x.rule_id for x in diagnose(prof.replace(parallel=1), f)]
    cat.close()


def test_build_keys_match_what_the_catalog_records():
    from app.tools.diagnose import build_keys

    assert build_keys("version: 0.6.0-dev (build 0, commit unknown)\nbuilt with GNU")[0] == "b0-unknown"
    assert build_keys("version: 4149 (1bb30bf2)\nbuilt with cc")[0] == "b4149-1bb30bf2"


def test_gather_facts_sees_a_read_only_folder(tmp_path):
    from app.tools.diagnose import gather_facts

    if os.geteuid() == 0:  # root writes into a mode-500 folder; not into /proc/sys (proc_sys_permission)
        ro = Path("/proc/sys")
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
    try:
        with pytest.raises(OSError):  # really read-only for this user
            (ro / "kv-valet-probe").mkdir()
        f = gather_facts(LaunchProfile(name="g", slot_save_path=str(ro) + "/"))
        assert (f.save_dir_exists, f.save_dir_is_dir, f.save_dir_writable) == (True, True, False)
        f = gather_facts(LaunchProfile(name="g", slot_save_path=str(ro / "sub") + "/"))
        assert (f.save_dir_exists, f.save_dir_writable) == (False, False)
    finally:
        if ro.is_relative_to(tmp_path):
            ro.chmod(0o700)


def test_doctor_names_the_builds_sidecar_behaviour(fake_server, gemma):
    """From the server log KV Valet keeps for the profile: its build's start line."""
    from app import paths

    save(LaunchProfile(name="modes", model=str(gemma), server_binary=str(fake_server), ctx_size=8192, parallel=1))
    assert "checkpoint sidecars:" not in run_doctor("modes").stdout  # nothing known yet
    log = paths.server_log_path("modes")
    log.parent.mkdir(parents=True, exist_ok=True)
    fork = (B11434.parent / "sidecar-modes-b11434" / "fork" / "01-fill-save.log").read_text()
    log.write_text(fork)
    r = run_doctor("modes")
    assert "checkpoint sidecars: turboquant fork (#206)" in r.stdout, r.stdout
    assert json.loads(run_doctor("modes", "--json").stdout)["facts"]["sidecar_behaviour"] == "fork"
