"""The suite on three workers on two cores (pytest-xdist): what must not overlap shares a worker, servers share the cores."""

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


def test_the_suite_runs_on_three_workers_by_group():
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    words = addopts.split()
    assert words[words.index("-n") + 1] == "3" and words[words.index("--dist") + 1] == "loadgroup"


def test_a_worker_count_is_read_on_the_controller_and_on_a_worker():
    assert conftest.xdist_worker_count(SimpleNamespace(workerinput={"workercount": 2})) == 2
    assert conftest.xdist_worker_count(SimpleNamespace(option=SimpleNamespace(numprocesses=2))) == 2
    assert conftest.xdist_worker_count(SimpleNamespace(option=SimpleNamespace(numprocesses=None))) == 0
    assert conftest.xdist_worker_count(SimpleNamespace(option=SimpleNamespace())) == 0


@pytest.mark.skipif(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")) < 2, reason="runs on a worker of several")
def test_on_several_workers_every_server_gets_one_thread():
    """llama-server reads LLAMA_ARG_THREADS; every server a test starts inherits this environment."""
    assert os.environ.get("LLAMA_ARG_THREADS") == conftest.XDIST_SERVER_THREADS == "1"


class _Node(SimpleNamespace):
    """A pytest 9.2 item's id (``_id``, a NodeId) and markers."""

    @property
    def nodeid(self) -> str:
        return str(self._id)

    def iter_markers(self, name):
        return (m for m in self.markers if m.name == name)


def test_on_a_worker_grouped_tests_carry_their_group_in_the_node_id_and_come_first():
    """pytest-xdist 3.8 writes the @group suffix to item._nodeid, which pytest 9.2 does not read."""
    from _pytest import nodes

    items = [_Node(_id=nodes.NodeId.parse(path), markers=[m.mark for m in marks]) for path, *marks in [
        ("tests/unit/test_argv.py::test_a", ),
        ("tests/ssh/test_remote_host.py::test_b", pytest.mark.xdist_group("ssh")),
        ("tests/packaging/test_standalone.py::test_c[x]", pytest.mark.xdist_group(name="standalone")),
    ]]
    conftest._group_node_ids(items)
    assert [i.nodeid for i in items] == ["tests/ssh/test_remote_host.py::test_b@ssh",
                                         "tests/packaging/test_standalone.py::test_c[x]@standalone",
                                         "tests/unit/test_argv.py::test_a"]
    conftest._group_node_ids(items)  # once only
    assert items[0].nodeid.endswith("::test_b@ssh")
