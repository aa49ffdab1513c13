"""Start/stop on the host (app.remote.unit): the systemd path by its exact argv (no user manager
runs here), the hosts file."""

from __future__ import annotations

import subprocess

import pytest

from app.remote.unit import UnitControl, UnitError
from app.store.hosts import HostConfig, HostStore, HostsError


class Recorder:
    """Answers ``systemctl --user`` as a reachable user manager with the unit installed would."""

    def __init__(self, fail: dict[str, str] | None = None):
        self.argv: list[list[str]] = []
        self.fail = fail or {}

    def __call__(self, argv):
        self.argv.append(argv)
        verb = argv[2]
        if verb in self.fail:
            return subprocess.CompletedProcess(argv, 5, "", self.fail[verb])
        if verb == "show":
            return subprocess.CompletedProcess(argv, 0, "LoadState=loaded\nActiveState=active\nSubState=running\n"
                                                        "MainPID=4242\n", "")
        return subprocess.CompletedProcess(argv, 0, "", "")


@pytest.mark.parametrize("action", ["start", "stop"])
def test_with_a_user_manager_start_and_stop_are_systemctl_on_the_installed_unit(action):
    rec = Recorder()
    out = UnitControl("big model", run=rec).do(action)
    assert rec.argv == [["systemctl", "--user", "show-environment"],
                        ["systemctl", "--user", action, "kv-valet-big_model.service"],
                        ["systemctl", "--user", "show", "kv-valet-big_model.service",
                         "--property=LoadState,ActiveState,SubState,MainPID"]]
    assert out == {"unit": "kv-valet-big_model.service", "manager": "systemd", "profile": "big model",
                   "installed": True, "active": True, "state": "active", "sub_state": "running", "pid": 4242}


def test_a_unit_not_installed_names_install_service():
    rec = Recorder(fail={"start": "Failed to start kv-valet-p.service: Unit kv-valet-p.service not found."})
    with pytest.raises(UnitError, match="kv-valet install-service p"):
        UnitControl("p", run=rec).do("start")


def test_without_a_user_manager_the_answer_says_so():
    rec = Recorder(fail={"show-environment": "Failed to connect to bus: No medium found"})
    out = UnitControl("p", run=rec).do("status")
    assert out["manager"] == "detached" and out["active"] is False
    assert "no systemd user manager here (Failed to connect to bus: No medium found)" in out["note"]
    assert rec.argv == [["systemctl", "--user", "show-environment"]]


def test_the_hosts_file_keeps_the_users_comments(tmp_path):
    path = tmp_path / "hosts.toml"
    store = HostStore(path)
    store.save(HostConfig("gpu", "me@gpu.lan", port=2222, identity_file="~/.ssh/id_gpu"))
    path.write_text(path.read_text() + "# my note\n")
    store.save(HostConfig("laptop", "laptop", kv_valet="/opt/kvv/bin/kv-valet"))
    assert [h.name for h in store.all()] == ["gpu", "laptop"]
    assert store.get("gpu") == HostConfig("gpu", "me@gpu.lan", port=2222, identity_file="~/.ssh/id_gpu")
    assert store.get("laptop").kv_valet == "/opt/kvv/bin/kv-valet"
    assert "# my note" in path.read_text()
    with pytest.raises(HostsError, match="exists"):
        store.save(HostConfig("gpu", "other"))
    assert store.remove("gpu") and not store.remove("gpu")
    with pytest.raises(HostsError, match="no host named 'gpu'"):
        store.get("gpu")
    with pytest.raises(HostsError):
        HostConfig("x", "-oProxyCommand=evil")  # never an ssh option in disguise


def test_the_status_line_names_a_unit_only_where_one_is_installed():
    from app.remote.unit import service_line

    detached = {"unit": "kv-valet-p.service", "manager": "detached", "profile": "p", "installed": False,
                "active": True, "state": "active", "pid": 42}
    assert service_line(detached) == "kv-valet serve p (detached, no systemd unit): running (pid 42)"
    assert service_line(dict(detached, active=False, pid=None)) == \
        "kv-valet serve p (detached, no systemd unit): not running"
    unit = {"unit": "kv-valet-p.service", "manager": "systemd", "profile": "p", "installed": True,
            "active": True, "state": "active", "pid": 7}
    assert service_line(unit) == "kv-valet-p.service: active (pid 7)"
    assert service_line(dict(unit, installed=False, active=False, state="inactive", pid=None)) == \
        "kv-valet-p.service: not installed (kv-valet install-service p writes it)"
