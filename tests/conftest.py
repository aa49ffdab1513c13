"""Shared test set-up: every test gets its own config and data folders."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
B11434 = FIXTURES / "llama-server-b11434"
SIDECAR_BUILD = FIXTURES / "sidecar-build-b11434"

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(autouse=True)
def isolated_dirs(tmp_path, monkeypatch):
    """Profiles, catalog and parked sessions of a test never touch the user's."""
    monkeypatch.setenv("KV_VALET_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("KV_VALET_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("LLAMA_API_KEY", raising=False)
    yield
