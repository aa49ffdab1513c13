"""Where KV Valet keeps its files (how it writes them: :mod:`app.files`).

Config (profiles, settings), data (catalog, parked sessions), state (server logs)
and cache (built servers) are the platform's user folders, from platformdirs (the
XDG base directory spec on Linux: ``$XDG_CONFIG_HOME``, ``$XDG_DATA_HOME``,
``$XDG_STATE_HOME`` and ``$XDG_CACHE_HOME`` are honoured when absolute); the data
folder can be moved in the preferences. Tests and portable installs override them
with ``KV_VALET_CONFIG_DIR``, ``KV_VALET_DATA_DIR`` and ``KV_VALET_STATE_DIR``.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import platformdirs
from platformdirs.unix import Unix as _FreedesktopDirs

APP_DIR_NAME = "kv-valet"
DEFAULT_MODEL_NAME = "gemma-3-270m-q4_k_m.gguf"  # what a fresh install starts with (app.server.discovery)


def _user_dirs() -> platformdirs.PlatformDirs:
    """Read anew at each call: the environment (``$XDG_*``) may change under a test."""
    return platformdirs.PlatformDirs(APP_DIR_NAME, appauthor=False)


def xdg_data_home() -> Path:
    """The freedesktop data folder itself (``$XDG_DATA_HOME``, default ``~/.local/share``): where
    desktop entries, metainfo and icons go. XDG on every platform: these are freedesktop files."""
    return _FreedesktopDirs().user_data_path


def xdg_config_home() -> Path:
    """The freedesktop config folder itself (``$XDG_CONFIG_HOME``, default ``~/.config``): where
    systemd user units go."""
    return _FreedesktopDirs().user_config_path


def config_dir() -> Path:
    override = os.environ.get("KV_VALET_CONFIG_DIR")
    if override:
        return Path(override)
    return _user_dirs().user_config_path


def settings_path() -> Path:
    """The preferences (app.settings): ``<config>/settings.toml``."""
    return config_dir() / "settings.toml"


def default_data_dir() -> Path:
    return _user_dirs().user_data_path


_chosen_data_dirs: dict[Path, Path | None] = {}


def chosen_data_dir() -> Path | None:
    """The data folder chosen in the preferences, read once per start (per settings file):
    a catalog and its sessions never move under a running app."""
    key = settings_path()
    if key not in _chosen_data_dirs:
        _chosen_data_dirs[key] = _data_folder_setting(key)
    return _chosen_data_dirs[key]


def _data_folder_setting(path: Path) -> Path | None:
    """``data_folder`` of the settings file (app.settings writes it), read here without the
    settings module, which builds on this one: a missing file, an unreadable one or a value that is
    not an absolute path is "none chosen" (the Preferences say what is wrong). Another key's bad value
    does not move the data folder."""
    try:
        with open(path, "rb") as f:
            value = tomllib.load(f).get("data_folder", "")
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(value, str) or not value or not os.path.isabs(os.path.expanduser(value)):
        return None
    return Path(os.path.expanduser(value))


def data_dir() -> Path:
    """``$KV_VALET_DATA_DIR``, else the preferences' data folder, else the XDG default."""
    override = os.environ.get("KV_VALET_DATA_DIR")
    if override:
        return Path(override)
    return chosen_data_dir() or default_data_dir()


def default_model_path() -> Path:
    """Where the default model (Gemma 3 270M) is assembled: ``<data>/models/``."""
    return data_dir() / "models" / DEFAULT_MODEL_NAME


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
    return _user_dirs().user_state_path


def cache_dir() -> Path:
    """The user's cache folder for KV Valet (``$XDG_CACHE_HOME/kv-valet``): built servers."""
    return _user_dirs().user_cache_path


def server_log_path(profile_name: str) -> Path:
    """The full log of a profile's server (rotated: ``.1`` … ``.3`` are older)."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in profile_name) or "_"
    return state_dir() / "logs" / f"{safe}.log"
