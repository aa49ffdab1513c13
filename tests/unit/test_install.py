"""install-desktop / install-service write valid files into the user's XDG folders."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess

import pytest

from app.cli import main
from app.cli.install import APP_ID, unit_name
from app.core.profile import LaunchProfile
from app.store.profiles import ProfileStore


def debian_tool(name: str, package: str) -> str:
    """A validator from Debian's packages: required in CI (.ci/run installs it), else the test skips."""
    found = shutil.which(name, path="/usr/bin:/bin:/usr/local/bin")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing in CI: apt-get install {package}")
        pytest.skip(f"{name} is not installed (apt-get install {package})")
    return found


@pytest.fixture
def xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "share"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("PATH", "/nonexistent")  # no systemctl, no update-desktop-database: files only
    return tmp_path


def test_install_desktop_writes_entry_metainfo_and_icons_and_uninstall_removes_them(xdg, capsys):
    assert main(["install-desktop"]) == 0
    share = xdg / "share"
    entry = configparser.ConfigParser(interpolation=None)
    entry.read(share / "applications" / f"{APP_ID}.desktop")
    d = entry["Desktop Entry"]
    assert d["Type"] == "Application" and d["Icon"] == APP_ID and d["Terminal"] == "false"
    assert d["Exec"].endswith("kv-valet") and d["Exec"].startswith("/")  # this installation's, not PATH's
    for size in (16, 32, 48, 64, 128, 256):
        png = share / "icons" / "hicolor" / f"{size}x{size}" / "apps" / f"{APP_ID}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (share / "icons" / "hicolor" / "scalable" / "apps" / f"{APP_ID}.svg").is_file()
    metainfo = share / "metainfo" / f"{APP_ID}.metainfo.xml"
    r = subprocess.run([debian_tool("appstreamcli", "appstream"), "validate", "--no-net", str(metainfo)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    # desktop-file-validate: no error, no warning, not even a hint
    r = subprocess.run([debian_tool("desktop-file-validate", "desktop-file-utils"),
                        str(share / "applications" / f"{APP_ID}.desktop")], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "" and r.stderr.strip() == "", r.stdout + r.stderr
    assert main(["uninstall-desktop"]) == 0
    assert not metainfo.exists() and not (share / "applications" / f"{APP_ID}.desktop").exists()


def test_install_service_writes_a_user_unit_whose_stop_parks(xdg, capsys):
    ProfileStore().save(LaunchProfile(name="chat box", model="/m.gguf"))
    assert main(["install-service", "chat box", "--no-enable"]) == 0
    unit = xdg / "config" / "systemd" / "user" / unit_name("chat box")
    text = unit.read_text()
    assert "ExecStart=" in text and " serve chat box --quiet" in text and "KillSignal=SIGTERM" in text
    assert "WantedBy=default.target" in text
    # without systemctl, enabling says so (the unit is written)
    assert main(["install-service", "chat box"]) == 1
    assert "systemctl is not available" in capsys.readouterr().err
    assert main(["uninstall-service", "chat box"]) == 0 and not unit.exists()
    assert main(["install-service", "no-such-profile", "--no-enable"]) == 1


def test_the_window_has_a_gui_script_entry_point():
    import tomllib
    from pathlib import Path

    data = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert data["project"]["gui-scripts"]["kv-valet-window"] == "app.cli.gui:open_window"
