"""Where KV Valet keeps its files.

Config (profiles), data (catalog, parked sessions) and state (server logs)
follow the XDG base directory spec. Tests and portable installs override them
with ``KV_VALET_CONFIG_DIR``, ``KV_VALET_DATA_DIR`` and ``KV_VALET_STATE_DIR``.
"""

from __future__ import annotations

import os
from pathlib import Path

APP_DIR_NAME = "kv-valet"


def _xdg(var: str, fallback: str) -> Path:
    value = os.environ.get(var)
    if value and os.path.isabs(value):
        return Path(value)
    return Path.home() / fallback


def config_dir() -> Path:
    override = os.environ.get("KV_VALET_CONFIG_DIR")
    if override:
        return Path(override)
    return _xdg("XDG_CONFIG_HOME", ".config") / APP_DIR_NAME


def data_dir() -> Path:
    override = os.environ.get("KV_VALET_DATA_DIR")
    if override:
        return Path(override)
    return _xdg("XDG_DATA_HOME", ".local/share") / APP_DIR_NAME


def profiles_dir() -> Path:
    return config_dir() / "profiles"


def sessions_dir(profile_name: str) -> Path:
    """Default ``--slot-save-path`` of a profile: one folder per profile."""
    return data_dir() / "sessions" / profile_name


def catalog_path() -> Path:
    return data_dir() / "catalog.sqlite3"


def runtime_dir() -> Path:
    """Pid records of servers the app launched (found again after a crash)."""
    return data_dir() / "run"


def state_dir() -> Path:
    override = os.environ.get("KV_VALET_STATE_DIR")
    if override:
        return Path(override)
    return _xdg("XDG_STATE_HOME", ".local/state") / APP_DIR_NAME


def server_log_path(profile_name: str) -> Path:
    """The full log of a profile's server (rotated: ``.1`` … ``.3`` are older)."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in profile_name) or "_"
    return state_dir() / "logs" / f"{safe}.log"
