"""A public --host without an API key is refused unless confirmed (issue #21, part 4), and the
refusal says what it exposes: in `kv-valet serve` (confirmed by ``expose_acknowledged = true``
in the profile) and in the window (Start asks; Cancel starts nothing)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from app import paths
from app.core.profile import LaunchProfile
from app.store.profiles import ProfileStore
from tests.conftest import free_port
from tests.fake_server.test_supervisor_fake import FAKE

EXPOSES = "anyone on the network can send prompts, read every slot and save, overwrite or restore parked sessions"


@pytest.fixture
def public_profile(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(64))
    return LaunchProfile(name="pub", model=str(model), server_binary=FAKE, host="0.0.0.0", port=free_port(),
                         ctx_size=2048, parallel=1)


def serve(profile: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", "serve", profile, "--quiet", "--no-park"],
                          capture_output=True, text=True, timeout=timeout, env=os.environ.copy())


def test_serve_refuses_a_public_host_without_a_key_and_says_what_it_exposes(public_profile):
    ProfileStore().save(public_profile)
    r = serve("pub")
    assert r.returncode != 0
    assert "0.0.0.0" in r.stderr and EXPOSES in r.stderr, r.stderr
    assert "expose_acknowledged = true" in r.stderr  # how to confirm it on the command line
    assert not (paths.runtime_dir() / "pub.json").exists()  # no server was started


def test_serve_starts_a_public_host_once_confirmed_or_keyed(public_profile):
    from tests.real.test_real_serve_verdicts import Serve

    for profile in (public_profile.replace(expose_acknowledged=True),
                    public_profile.replace(api_key="kvv-public-key", port=free_port())):
        ProfileStore().save(profile)
        s = Serve("pub")
        try:
            s.wait_for("ready at")
            code, _ = s.stop()
        finally:
            s.kill()
        assert code == 0, "".join(s.seen)


@pytest.mark.gui
def test_the_window_asks_before_a_public_start_and_cancel_starts_nothing(qtbot, qloop, public_profile,
                                                                          monkeypatch):
    from PySide6.QtWidgets import QMessageBox

    from app.ui.servers import profile_panel
    from app.ui.panels import build_window

    store = ProfileStore()
    store.save(public_profile.replace(host="127.0.0.1"))
    w = build_window(store, tabs=False)
    qtbot.addWidget(w)
    panel = w.profiles
    panel.set_profiles(store.load_all()[0], select="pub")
    panel.sig_start.disconnect()  # record the start instead of launching
    panel.sig_restart.disconnect()
    started: list[LaunchProfile] = []
    panel.sig_start.connect(started.append)
    asked: list[str] = []
    answer = {"button": QMessageBox.Cancel}

    def warning(parent, title, text, *args):
        asked.append(text)
        return answer["button"]

    monkeypatch.setattr(profile_panel.QMessageBox, "warning", staticmethod(warning))
    panel.w["host"].setText("0.0.0.0")

    panel._on_start()  # what the Start button does
    assert started == [] and len(asked) == 1
    assert "0.0.0.0" in asked[0] and EXPOSES in asked[0] and "Start it anyway?" in asked[0]

    answer["button"] = QMessageBox.Yes
    panel._on_start()
    assert len(started) == 1 and started[0].host == "0.0.0.0" and started[0].expose_acknowledged

    # with an API key there is nothing to confirm
    asked.clear()
    started.clear()
    panel.w["api_key"].setText("kvv-window-key")
    panel._on_start()
    assert asked == [] and len(started) == 1 and started[0].api_key == "kvv-window-key"
