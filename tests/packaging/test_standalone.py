"""The standalone one-folder build (packaging/build-standalone, PyInstaller) runs without Python.

The session fixture builds it without the default model (``--no-model``: same build
time, half the disk) into the build cache, ``$XDG_CACHE_HOME/kv-valet/standalone``:
a cold build takes about 15 s on two cores, a cached one is reused at once.
``KV_VALET_STANDALONE_BUNDLE=/path/to/kv-valet`` tests a folder built elsewhere instead.
Every run of the bundle gets a bare environment: no Python, no virtual environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "packaging" / "build-standalone"

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the standalone build is made for Linux"),
    pytest.mark.timeout(1200),  # the first test pays for the build (cold: ~15 s here, minutes on a slow disk)
    # one worker builds and runs them all: on two workers both built at once (the build script's lock
    # made the second wait ~31 s for the first's folder), a worker's time spent idle in a clean clone
    pytest.mark.xdist_group("standalone"),
]


@pytest.fixture(scope="session")
def bundle() -> Path:
    prebuilt = os.environ.get("KV_VALET_STANDALONE_BUNDLE")
    if prebuilt:
        path = Path(prebuilt)
    else:
        try:
            import PyInstaller  # noqa: F401
        except ImportError:
            if os.environ.get("CI"):  # the test extra brings it: in CI this test runs, never skips
                pytest.fail("PyInstaller is not installed (it comes with the test and build extras)")
            pytest.skip("PyInstaller is not installed: pip install -e '.[build]'")
        r = subprocess.run([sys.executable, str(BUILD_SCRIPT), "--no-model"], cwd=ROOT,
                           capture_output=True, text=True, timeout=1100, stdin=subprocess.DEVNULL)
        assert r.returncode == 0, f"build-standalone failed:\n{r.stderr[-6000:]}"
        path = Path(r.stdout.strip().splitlines()[-1])
    assert (path / "kv-valet").is_file(), f"no kv-valet executable in {path}"
    return path


def bare_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """What a machine without Python gives: no PYTHONPATH/PYTHONHOME/VIRTUAL_ENV, a plain PATH."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8"}
    env.update(extra)
    return env


def isolated(tmp_path: Path) -> dict[str, str]:
    return {"KV_VALET_CONFIG_DIR": str(tmp_path / "config"), "KV_VALET_DATA_DIR": str(tmp_path / "data"),
            "KV_VALET_STATE_DIR": str(tmp_path / "state"), "XDG_RUNTIME_DIR": str(tmp_path)}


def run(argv: list, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def test_cli_runs_without_python(bundle, tmp_path):
    assert list((bundle / "_internal").glob("libpython3*.so*")), "the bundle carries no libpython"
    r = run([bundle / "kv-valet", "--help"], bare_env(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "usage: kv-valet" in r.stdout
    assert "doctor" in r.stdout
    r = run([bundle / "kv-valet", "--version"], bare_env(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("kv-valet ")


def test_window_appears_offscreen(bundle, tmp_path):
    """No arguments opens the window; KV_VALET_EXIT_AFTER_SHOW=1 says so once it is shown, then quits."""
    env = bare_env(tmp_path, QT_QPA_PLATFORM="offscreen", KV_VALET_EXIT_AFTER_SHOW="1", **isolated(tmp_path))
    r = run([bundle / "kv-valet"], env, timeout=60)  # shown in about a second
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert "window shown: KV Valet" in r.stdout, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"


def test_bundled_llama_server_is_found_and_runs(bundle, tmp_path):
    # PATH without llama-server, no $LLAMA_SERVER: the default profile gets the bundle's own
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    env = bare_env(tmp_path, **isolated(tmp_path))
    env["PATH"] = str(empty)
    r = run([bundle / "kv-valet", "doctor", "default", "--json"], env, timeout=120)
    assert r.returncode in (0, 1), r.stderr  # 1: findings that are errors (no model in this build)
    facts = json.loads(r.stdout)["facts"]
    binary = Path(facts["binary"] or "").resolve()
    assert binary.is_relative_to((bundle / "_internal").resolve()), facts["binary"]
    assert os.access(binary, os.X_OK)
    assert facts["cache_types"], "the app could not run the bundled llama-server's --help"
    # it runs by itself too, with no help from the bundle's library path
    r = run([binary, "--version"], bare_env(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "version:" in r.stdout + r.stderr


def test_child_processes_get_the_users_library_path(bundle, tmp_path):
    """The bootloader's LD_LIBRARY_PATH (the bundle first) is not passed on to a user's llama-server."""
    dump = tmp_path / "child-env.txt"
    fake = tmp_path / "llama-server"
    fake.write_text('#!/bin/sh\nenv > "$KV_TEST_ENV_DUMP"\necho "usage: llama-server --model FNAME"\n')
    fake.chmod(0o755)
    env = bare_env(tmp_path, LLAMA_SERVER=str(fake), LD_LIBRARY_PATH="/opt/user-libs",
                   KV_TEST_ENV_DUMP=str(dump), **isolated(tmp_path))
    r = run([bundle / "kv-valet", "doctor", "default", "--json"], env, timeout=120)
    assert r.returncode in (0, 1), r.stderr
    assert json.loads(r.stdout)["facts"]["binary"] == str(fake)
    child = dict(line.split("=", 1) for line in dump.read_text().splitlines() if "=" in line)
    assert child.get("LD_LIBRARY_PATH") == "/opt/user-libs"
    assert "LD_LIBRARY_PATH_ORIG" not in child
