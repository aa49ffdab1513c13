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


# -- private folders and files ----------------------------------------------------------------
# Parked sessions hold whole conversations, profiles hold API keys, logs hold prompts: every
# folder KV Valet creates is 0700 and every file it writes 0600, whatever the umask.

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def private_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` and its missing parents, each 0700; a folder that exists is left as
    it is (it may be the user's own, chosen in the preferences)."""
    path = Path(path)
    missing = []
    p = path
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=PRIVATE_DIR_MODE)
        except FileExistsError:
            continue  # made meanwhile by another process (or thread)
        os.chmod(d, PRIVATE_DIR_MODE)  # the umask only takes bits away; be exact all the same
    if not path.is_dir():
        path.mkdir(parents=True, exist_ok=True)  # raises the error that says why not
    return path


def make_private(path: str | os.PathLike) -> None:
    """chmod 0600 a file KV Valet owns (a state file the server wrote with its umask); a
    symlink is not followed, and a file of another user is left as it is."""
    try:
        if not os.path.islink(path):
            os.chmod(path, PRIVATE_FILE_MODE)
    except OSError:
        pass


def touch_private(path: str | os.PathLike) -> None:
    """Create ``path`` empty and 0600 if it is missing (a file another program then writes
    into, as SQLite its catalog: its -wal and -shm files take the same mode), or make ours
    0600. Errors are left to that program to report."""
    try:
        if os.path.islink(path):
            return
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK, PRIVATE_FILE_MODE)
    except OSError:
        return
    try:
        os.fchmod(fd, PRIVATE_FILE_MODE)
    except OSError:
        pass
    finally:
        os.close(fd)


def open_private(path: str | os.PathLike, mode: str = "w", **kw):
    """``open(path, mode)`` for writing ("w", "a", "wb", "ab"), the file created 0600 (and an
    existing one of ours made 0600)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    fd = os.open(path, flags, PRIVATE_FILE_MODE)
    try:
        os.fchmod(fd, PRIVATE_FILE_MODE)
    except OSError:
        pass
    return os.fdopen(fd, mode, **kw)


def write_private(path: str | os.PathLike, data: str | bytes, *, encoding: str = "utf-8") -> Path:
    """Write ``path`` atomically (a temporary file beside it, then a rename), 0600, its folder
    created 0700 when missing."""
    import threading

    path = Path(path)
    private_dir(path.parent)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}.{threading.get_ident()}")
    try:
        with open_private(tmp, "wb") as f:
            f.write(data.encode(encoding) if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    return path


def server_log_path(profile_name: str) -> Path:
    """The full log of a profile's server (rotated: ``.1`` … ``.3`` are older)."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in profile_name) or "_"
    return state_dir() / "logs" / f"{safe}.log"
