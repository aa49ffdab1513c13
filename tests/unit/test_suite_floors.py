"""Floors that cannot be narrowed (issue #35).

- ``.ci/check-commands`` refuses a README test command whose pytest runs a part of the suite (a path,
  ``-k``, ``-m``, ``--deselect``, ``-x``, ...) and lets the real one and the harmless options through;
- with ``KVV_SUITE_FLOOR`` set (``.ci/run`` sets it) ``tests/conftest.py`` fails a run of fewer tests
  than the floor whatever pytest was given, paths included: a pytest of its own (a subprocess) runs a
  tiny test file with the hooks of tests/conftest.py and a floor file of the test's own.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKER = ROOT / ".ci" / "check-commands"
README_TEST = ('.venv/bin/pip install -e ".[test]" && .venv/bin/python tests/sidecar-server/build && '
               '.venv/bin/python -m pytest')


def checker():
    loader = importlib.machinery.SourceFileLoader("kvv_check_commands", str(CHECKER))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def readme(tmp_path: Path, test_command: str) -> Path:
    path = tmp_path / "README.md"
    path.write_text("# x\n\n<!-- install-command -->\n```sh\npython3 -m venv .venv && .venv/bin/pip install -e .\n```\n\n"
                    f"<!-- test-command -->\n```sh\n{test_command}\n```\n", encoding="utf-8")
    return path


def run_checker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECKER), *args], capture_output=True, text=True, timeout=60)


# -- the checker ------------------------------------------------------------------------------------

@pytest.mark.parametrize("tail", [
    " tests/unit", " tests/unit/test_argv.py::test_x", ' -k "not slow"', " -k x", ' -m "not real_server"',
    " --deselect tests/real", " -x", " --exitfirst", " -qx", " --maxfail=1", " --lf", " --last-failed", " --ff",
    " --sw", " --co", " --collect-only", " -p no:randomly", " --pyargs app", " -c other.ini", " --rootdir=tests",
    " --confcutdir=tests", " --noconftest", " -o addopts=", " --ignore=tests/real", " --ignore-glob=*real*",
    " -- tests", " || true", "; true", " | tee log", " > log 2>&1", " $(echo tests/unit)",
])
def test_the_checker_refuses_a_narrowed_test_command(tail):
    cc = checker()
    with pytest.raises(cc.Refused):
        cc.check_test_command(README_TEST + tail)


@pytest.mark.parametrize("command", [
    "cd tests && .venv/bin/python -m pytest",
    "CI= .venv/bin/python -m pytest",
    "unset KVV_SUITE_FLOOR && .venv/bin/python -m pytest",
    "env -u KVV_SUITE_FLOOR .venv/bin/python -m pytest",
    ".venv/bin/pip install -e .",  # no pytest at all
    ".venv/bin/python -mpytest tests/unit",
])
def test_the_checker_refuses_a_chain_that_changes_the_shell_or_runs_no_pytest(command):
    cc = checker()
    with pytest.raises(cc.Refused):
        cc.check_test_command(command)


@pytest.mark.parametrize("tail", ["", " -n 2", " -n2 --dist loadgroup", " -n auto --dist=loadgroup",
                                  " -q", " -vv -rA", " -rfE --durations=30", " --tb=short --color=no",
                                  " --numprocesses 2"])
def test_the_checker_accepts_the_readme_command_and_harmless_options(tail):
    checker().check_test_command(README_TEST + tail)


def test_the_real_readme_passes_the_checker():
    done = run_checker()
    assert done.returncode == 0, done.stderr
    printed = run_checker("--print", "test-command")
    assert printed.returncode == 0 and "pytest" in printed.stdout
    assert checker().commands()["test-command"] == printed.stdout.strip()


def test_a_narrowed_readme_exits_2_with_the_reason_on_one_line(tmp_path):
    done = run_checker("--readme", str(readme(tmp_path, README_TEST + " tests/unit")))
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "'tests/unit' narrows the suite" in lines[0], done.stderr
    printed = run_checker("--readme", str(readme(tmp_path, README_TEST + " -k x")), "--print", "test-command")
    assert printed.returncode == 2 and printed.stdout == "" and "'-k'" in printed.stderr


def test_a_readme_without_the_commands_is_refused(tmp_path):
    (tmp_path / "README.md").write_text("# nothing here\n", encoding="utf-8")
    done = run_checker("--readme", str(tmp_path / "README.md"))
    assert done.returncode == 2 and "lacks the install-command" in done.stderr


def test_ci_run_calls_the_checker_first_and_has_no_extractor_of_its_own():
    text = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    commands = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert commands[:3] == ["set -euo pipefail", 'cd "$(dirname "$0")/.."', "python3 .ci/check-commands"
                            "  # before anything else: says the commands, or why the test command is refused"]
    assert "awk" not in text
    assert "KVV_SUITE_FLOOR=1" in text


# -- the floor of tests/conftest.py ---------------------------------------------------------------

CASES = "def test_a():\n    pass\n\n\ndef test_b():\n    pass\n\n\ndef test_c():\n    pass\n"
#: a test's own pytest subprocess (as this file's) is not the suite: the variable was taken out
CHILD = "import os\n\n\ndef test_the_variable_was_taken_out():\n    assert 'KVV_SUITE_FLOOR' not in os.environ\n"
#: the floor file of the test's own, set on tests/conftest.py's module (loaded as a plugin, -p tests.conftest)
LOCAL_CONFTEST = ("from pathlib import Path\nimport tests.conftest as shared\n"
                  "shared.MIN_TESTS_FILE = Path(__file__).with_name('min_tests.txt')\n")


def run_floor(tmp_path: Path, floor: int, *, env: dict[str, str], args: list[str]) -> subprocess.CompletedProcess:
    """pytest on a tiny folder with tests/conftest.py's hooks and a floor of its own; no plugin but the
    ones named (``-p xdist`` for two workers): a second's start, not a whole suite's set-up."""
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "test_child.py").write_text(CHILD)
    (tmp_path / "conftest.py").write_text(LOCAL_CONFTEST)
    (tmp_path / "min_tests.txt").write_text(f"# the floor of this test\n{floor}\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    base = {k: v for k, v in os.environ.items()
            if k not in ("CI", "KVV_SUITE_FLOOR", "PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTEST_XDIST_WORKER")}
    base.update(env, PYTHONPATH=str(ROOT), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           "-q", "--rootdir", str(tmp_path), "-c", str(tmp_path / "pytest.ini"), *args],
                          cwd=tmp_path, env=base, capture_output=True, text=True, timeout=120)


def test_with_the_floor_variable_a_run_of_chosen_tests_below_the_floor_fails(tmp_path):
    # paths and node ids given: judged all the same (without the variable they would not be)
    done = run_floor(tmp_path, 4, env={"KVV_SUITE_FLOOR": "1", "CI": "true"},
                     args=["test_cases.py::test_a", "test_cases.py::test_b", "test_child.py"])
    assert done.returncode == 1, done.stdout + done.stderr
    assert "3 passed" in done.stdout  # every test passed: the floor alone fails the run
    assert "[CI] only 3 tests ran; the suite has at least 4" in done.stdout


def test_with_the_floor_variable_two_workers_at_the_floor_pass(tmp_path):
    """Under pytest-xdist the controller counts every worker's tests (4 of the floor's 4, spread over
    two workers: counted on the workers alone, the controller would see none); the child test sees no
    variable."""
    done = run_floor(tmp_path, 4, env={"KVV_SUITE_FLOOR": "1"}, args=["-p", "xdist", "-n", "2", "test_cases.py",
                                                                     "test_child.py"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 passed" in done.stdout and "[CI] only" not in done.stdout
    # one more than ran: the controller fails it
    done = run_floor(tmp_path, 5, env={"KVV_SUITE_FLOOR": "1"}, args=["-p", "xdist", "-n", "2", "test_cases.py",
                                                                     "test_child.py"])
    assert done.returncode == 1 and "[CI] only 4 tests ran; the suite has at least 5" in done.stdout, \
        done.stdout + done.stderr


def test_without_the_variable_ci_judges_only_a_run_without_paths(tmp_path):
    # today's rule for CI alone: a run of chosen files is not the suite
    done = run_floor(tmp_path, 4, env={"CI": "true"}, args=["test_cases.py"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 passed" in done.stdout and "[CI] only" not in done.stdout
