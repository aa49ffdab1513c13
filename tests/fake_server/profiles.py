"""A profile that launches the fake llama-server (no Qt: for service and CLI tests too)."""

from __future__ import annotations

from app.core.profile import LaunchProfile
from app.store.profiles import ProfileStore
from tests.conftest import free_port
from tests.fake_server.test_supervisor_fake import FAKE


def fake_profile(tmp_path, **fields) -> LaunchProfile:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    profile = LaunchProfile(name="fake", model=str(model), server_binary=FAKE, port=free_port(), ctx_size=4096,
                            parallel=2, **fields)
    ProfileStore().save(profile)
    return profile
