"""Models of every memory kind, made here by llama.cpp's own test-llama-archs (issue #26, items 1 and 8).

Each family's tiny model is read by KV Valet from its GGUF, then loaded by the real stock llama-server
(b11434), whose own log at load says what it made of the model: the two must agree. A dense llama
made by test-llama-archs carries ``llama.ssm.*`` and ``llama.attention.sliding_window`` keys (the tool
writes them for every architecture): it is still dense, for KV Valet as for the server.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.core.profile import LaunchProfile
from app.server.gguf_info import read_model_info
from app.sessions.behaviour import memory_kind_from_log_file
from tests.conftest import free_port
from tests.real.helpers import start_server
from tests.real.sidecar_bin import BUILD_SCRIPT
from tests.real.test_real_sidecar_modes import until
from tests.real.tiny_models import FAMILIES, make_model

pytestmark = pytest.mark.real_server


@pytest.fixture(scope="session")
def archs_tool() -> Path:
    r = subprocess.run([sys.executable, str(BUILD_SCRIPT), "--cached-only", "--tool", "test-llama-archs"],
                       capture_output=True, text=True, timeout=120)
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        if os.environ.get("CI"):
            pytest.fail("test-llama-archs not built (required in CI): run tests/sidecar-server/build")
        pytest.skip("test-llama-archs not built: run tests/sidecar-server/build")
    return Path(lines[-1])


@pytest.fixture(scope="session")
def tiny_models(archs_tool, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tiny-models")
    return {family: make_model(archs_tool, arch, folder) for family, (arch, _kind) in FAMILIES.items()}


def test_each_family_reads_as_its_memory_kind(tiny_models):
    for family, path in tiny_models.items():
        arch, kind = FAMILIES[family]
        info = read_model_info(path)
        assert (info.architecture, info.memory_kind, info.context_length) == (arch, kind, 65536), family
        assert path.stat().st_size < 32 << 20  # tiny: a few MB


def test_the_stock_server_says_the_same_kind_at_load(tiny_models, real_binary, tmp_path):
    """The server's own print_info (arch, is_swa_any) gives each family the kind KV Valet read."""
    async def load(family: str, path: Path):
        profile = LaunchProfile(name=f"tiny-{family}", model=str(path), server_binary=real_binary, port=free_port(),
                                ctx_size=1024, parallel=1, slot_save_path=str(tmp_path / family) + "/")
        plan, sup = await start_server(profile)
        try:
            # the server prints its load before it listens, but the supervisor's reader writes those lines
            # to the log file on its own thread: on a busy machine /health can answer first (seen: the
            # gemma3 model read as None). Wait for the lines to land (the guard only fails a hang).
            kind = lambda: memory_kind_from_log_file(sup.log_file_path, pid=sup.pid)  # noqa: E731
            await until(kind)
            return kind()
        finally:
            await sup.aclose()

    said = {family: asyncio.run(load(family, path)) for family, path in tiny_models.items()}
    assert said == {family: kind for family, (_arch, kind) in FAMILIES.items()}
