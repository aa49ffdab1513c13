"""The suite on two workers (pytest-xdist): what must not overlap shares a worker, servers share the cores."""

from __future__ import annotations

import os
import tomllib
from types import SimpleNamespace

import pytest

from tests import conftest
from tests.conftest import ROOT


class Item(SimpleNamespace):
    """The part of a pytest item the grouping reads and writes."""

    def get_closest_marker(self, name):
        return next((m for m in self.markers if m.name == name), None)

    def add_marker(self, mark):
        self.markers.append(mark.mark)


def _item(path: str, *markers) -> Item:
    return Item(fspath=str(ROOT / path), markers=[m.mark for m in markers])


def test_every_ssh_test_is_in_the_ssh_group_and_nothing_else_is_grouped():
    ssh = _item("tests/ssh/test_remote_host.py")
    real = _item("tests/real/test_real_cli.py")
    unit = _item("tests/unit/test_argv.py")
    chosen = _item("tests/ssh/test_gui_remote.py", pytest.mark.xdist_group("mine"))
    elsewhere = Item(fspath="/tmp/elsewhere/test_x.py", markers=[])  # a test's own pytest run
    conftest.pytest_collection_modifyitems(None, [ssh, real, unit, chosen, elsewhere])
    assert [m.kwargs.get("name") or m.args[0] for m in ssh.markers if m.name == "xdist_group"] == ["ssh"]
    assert real.markers == [] and unit.markers == [] and elsewhere.markers == []
    assert [m.args[0] for m in chosen.markers] == ["mine"]  # a test's own group is kept


def test_the_suite_runs_on_two_workers_by_group():
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    words = addopts.split()
    assert words[words.index("-n") + 1] == "2" and words[words.index("--dist") + 1] == "loadgroup"


def test_a_worker_count_is_read_on_the_controller_and_on_a_worker():
    assert conftest.xdist_worker_count(SimpleNamespace(workerinput={"workercount": 2})) == 2
    assert conftest.xdist_worker_count(SimpleNamespace(option=SimpleNamespace(numprocesses=2))) == 2
    assert conftest.xdist_worker_count(SimpleNamespace(option=SimpleNamespace(numprocesses=None))) == 0
    assert conftest.xdist_worker_count(SimpleNamespace(option=SimpleNamespace())) == 0


@pytest.mark.skipif(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")) < 2, reason="runs on a worker of two")
def test_on_two_workers_every_server_gets_one_thread():
    """llama-server reads LLAMA_ARG_THREADS; every server a test starts inherits this environment."""
    assert os.environ.get("LLAMA_ARG_THREADS") == conftest.XDIST_SERVER_THREADS == "1"
