"""The window's Start path when the launch is refused: the reason is shown, nothing is started."""

from __future__ import annotations

import socket

import pytest

from app.core.profile import LaunchProfile
from app.store.profiles import ProfileStore
from app.ui.panels import build_window
from tests.conftest import run, signal_future
from tests.fake_server.test_supervisor_fake import FAKE, free_port

pytestmark = pytest.mark.gui


@pytest.fixture
def window(qtbot, qloop, tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    profile = LaunchProfile(name="fake", model=str(model), server_binary=FAKE, port=free_port())
    store = ProfileStore()
    store.save(profile)
    w = build_window(store, tabs=False)
    qtbot.addWidget(w)
    w.profiles.set_profiles([profile], select="fake")
    return w, profile


def test_port_taken_is_shown_and_nothing_starts(window, qloop, qtbot):
    w, profile = window
    with socket.socket() as s:
        s.bind(("127.0.0.1", profile.port))
        s.listen()
        error = signal_future(w.controller.sig_error)
        w.profiles.start_button.click()
        message = run(qloop, error, 120)
    assert f"port {profile.port} on 127.0.0.1 is already in use" in message
    assert "already in use" in w.profiles.errors.text()
    assert "Server Stopped" in w.state_label.text() and w.profiles.start_button.isEnabled()
    assert w.controller.pid is None


def test_bad_profile_value_is_refused_before_launch(window, qloop):
    w, profile = window
    w.profiles.w["cache_type_k"].setCurrentText("turbo4")  # the fake answers --help like the stock build
    error = signal_future(w.controller.sig_error)
    w.profiles.start_button.click()
    message = run(qloop, error, 120)
    assert "does not support KV cache type 'turbo4'" in message and FAKE in message
    assert w.controller.supervisor is None
