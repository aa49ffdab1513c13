"""Where KV Valet keeps its files.

Config (profiles, settings), data (catalog, parked sessions) and state (server
logs) follow the XDG base directory spec; the data folder can be moved in the
preferences. Tests and portable installs override them
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


def settings_path() -> Path:
    """The preferences (app.settings): ``<config>/settings.toml``."""
    return config_dir() / "settings.toml"


def default_data_dir() -> Path:
    return _xdg("XDG_DATA_HOME", ".local/share") / APP_DIR_NAME


_chosen_data_dirs: dict[Path, Path | None] = {}


def chosen_data_dir() -> Path | None:
    """The data folder chosen in the preferences, read once per start (per settings file):
    a catalog and its sessions never move under a running app."""
    key = settings_path()
    if key not in _chosen_data_dirs:
        from app.settings import load_or_defaults  # the same top layer; imported late (it imports us)

        _chosen_data_dirs[key] = load_or_defaults(key)[0].data_path()
    return _chosen_data_dirs[key]


def data_dir() -> Path:
    """``$KV_VALET_DATA_DIR``, else the preferences' data folder, else the XDG default."""
    override = os.environ.get("KV_VALET_DATA_DIR")
    if override:
        return Path(override)
    return chosen_data_dir() or default_data_dir()


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
