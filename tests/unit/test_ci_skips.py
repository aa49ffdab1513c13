"""Under CI a skip fails (tests/conftest.py); elsewhere it stays a skip.

A tiny test file runs in a pytest of its own (a subprocess) with the hooks of
tests/conftest.py, once with CI set and once without.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

TESTS = textwrap.dedent('''
    import pytest

    def test_passes():
        pass

    def test_skip_call():
        pytest.skip("no frobnicator here")

    @pytest.mark.skipif(True, reason="a skipif that holds")
    def test_skipif():
        pass

    def test_importorskip():
        pytest.importorskip("kv_valet_no_such_module_xyz")

    @pytest.fixture
    def needs_tool():
        pytest.skip("the tool is not installed")

    def test_fixture_skip(needs_tool):
        pass

    @pytest.mark.xfail(reason="known to fail")
    def test_xfail():
        assert False

    @pytest.mark.xfail(reason="thought to fail", strict=False)
    def test_xpass():
        pass

    def test_allowed():
        pytest.skip("allowed, for a reason")
''')

MODULE_SKIP = 'import pytest\npytest.importorskip("kv_valet_no_such_module_xyz")\n\ndef test_never():\n    pass\n'

# the allow-list in one place: this local conftest adds an entry to tests/conftest.py's list
LOCAL_CONFTEST = ('import tests.conftest as shared\n'
                  'shared.CI_ALLOWED_SKIPS["test_cases.py::test_allowed"] = "an example entry"\n')


def run_pytest(tmp_path: Path, ci: str | None, *files: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = str(ROOT)
    (tmp_path / "pytest.ini").write_text("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           "-rA", "-q", "--rootdir", str(tmp_path), "-c", str(tmp_path / "pytest.ini"), *files],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def cases(tmp_path):
    (tmp_path / "test_cases.py").write_text(TESTS)
    (tmp_path / "conftest.py").write_text(LOCAL_CONFTEST)
    return tmp_path


def test_without_ci_a_skip_stays_a_skip(cases):
    r = run_pytest(cases, None, "test_cases.py")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "1 passed, 5 skipped, 1 xfailed, 1 xpassed" in out, out


def test_under_ci_every_skip_fails_with_its_reason_but_the_allowed_one(cases):
    r = run_pytest(cases, "true", "test_cases.py")
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "4 failed, 1 passed, 1 skipped, 2 errors" in out, out
    for name in ("test_skip_call", "test_importorskip", "test_xfail", "test_xpass"):
        assert f"FAILED test_cases.py::{name}" in out, out
    for name in ("test_skipif", "test_fixture_skip"):  # a skip in set-up: an error
        assert f"ERROR test_cases.py::{name}" in out, out
    assert "SKIPPED [1] test_cases.py" in out and "allowed, for a reason" in out, out  # the allow-listed one
    for reason in ("no frobnicator here", "a skipif that holds", "kv_valet_no_such_module_xyz",
                   "the tool is not installed", "xfail: known to fail", "XPASS of a non-strict xfail"):
        assert reason in out, reason
    assert "[CI]" in out and "CI_ALLOWED_SKIPS" in out


def test_under_ci_a_module_skipped_at_collection_fails(tmp_path):
    (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP)
    (tmp_path / "test_other.py").write_text("def test_passes():\n    pass\n")
    r = run_pytest(tmp_path, None, "test_module_skip.py", "test_other.py")
    assert r.returncode == 0 and "1 passed, 1 skipped" in r.stdout, r.stdout + r.stderr
    r = run_pytest(tmp_path, "1", "test_module_skip.py", "test_other.py")
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "ERROR test_module_skip.py" in out and "kv_valet_no_such_module_xyz" in out, out
