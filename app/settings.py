"""The user's preferences: one small TOML file beside the profiles.

``<config>/settings.toml`` holds what the Preferences dialog and ``kv-valet
settings`` show: the data folder, the Monitor's polling rates, what happens to
sessions parked by "Park all & stop" at the next start, the tray, and how much
server log is kept. Only values that differ from the defaults are written, and the
file is edited in place (app.files.write_toml): comments, key order and keys or
tables this version does not know are kept, so a newer KV Valet's file survives an
older one. Qt-free: the window and the CLI read and write it through here.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from app import paths
from app import files


class SettingsError(Exception):
    """Values that cannot be saved; ``errors`` are (key, message) pairs, said as the user would fix them."""

    def __init__(self, errors: list[tuple[str, str]]):
        super().__init__("; ".join(f"{k}: {m}" for k, m in errors))
        self.errors = errors


class AutoResume(enum.StrEnum):
    OFFER = "offer"  # show "Resume all (N)"; a profile's "Resume parked slots on start" still resumes by itself
    ALWAYS = "always"  # every profile resumes what "Park all & stop" parked, at once


@dataclass(frozen=True)
class Settings:
    data_folder: str = ""  # "" = the platform's data folder (paths.default_data_dir()); read once per start
    monitor_interval_s: float = 1.0  # the Monitor's /slots + GPU poll
    monitor_busy_interval_s: float = 0.25  # ... while a slot is processing
    auto_resume: AutoResume = AutoResume.OFFER
    keep_in_tray: bool = False  # closing the window leaves KV Valet in the tray
    notifications: bool = True  # a desktop notification when background work ends
    log_file_mib: int = 20  # each server log file; rotated past this
    log_backups: int = 3  # rotated files kept per profile: <profile>.log.1 … .N
    park_timeout_s: float = 120.0  # the park before any stop (quit, logout, shutdown, sleep, serve) at most
    proxy_disk_budget_gib: int = 50  # the conversation proxy's parks of one profile at most; 0: no limit
    proxy_save_before_idle_clear: bool = True  # save idle slots before a server that clears them runs a task
    proxy_warm_start: bool = True  # at a start, restore the conversations used last into the free slots
    proxy_park_ahead: bool = True  # between requests, park the conversation the next eviction would take

    def errors(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if self.data_folder and not os.path.isabs(os.path.expanduser(self.data_folder)):
            out.append(("data_folder", f"must be an absolute path (got {self.data_folder!r})"))
        for key, lo, hi in (("monitor_interval_s", 0.1, 60.0), ("monitor_busy_interval_s", 0.05, 60.0)):
            v = getattr(self, key)
            if not lo <= v <= hi:
                out.append((key, f"must be between {lo:g} and {hi:g} seconds (got {v:g})"))
        if self.monitor_busy_interval_s > self.monitor_interval_s:
            out.append(("monitor_busy_interval_s", "the busy rate must be as fast as the idle one or faster "
                        f"({self.monitor_busy_interval_s:g} s > {self.monitor_interval_s:g} s)"))
        if not 1 <= self.log_file_mib <= 4096:
            out.append(("log_file_mib", f"must be between 1 and 4096 MiB (got {self.log_file_mib})"))
        if not 0 <= self.log_backups <= 100:
            out.append(("log_backups", f"must be between 0 and 100 files (got {self.log_backups})"))
        if not 0 <= self.proxy_disk_budget_gib <= 1_000_000:
            out.append(("proxy_disk_budget_gib", f"must be between 0 (no limit) and 1000000 GiB "
                                                 f"(got {self.proxy_disk_budget_gib})"))
        if not 1.0 <= self.park_timeout_s <= 3600.0:
            out.append(("park_timeout_s", f"must be between 1 and 3600 seconds (got {self.park_timeout_s:g})"))
        return out

    def proxy_disk_budget_bytes(self) -> int | None:
        """The proxy's disk budget in bytes (None: no limit)."""
        return self.proxy_disk_budget_gib * 1024 ** 3 if self.proxy_disk_budget_gib > 0 else None

    def data_path(self) -> Path | None:
        return Path(os.path.expanduser(self.data_folder)) if self.data_folder else None


DEFAULTS = Settings()
FIELDS = {f.name: f for f in dataclasses.fields(Settings)}


def settings_path() -> Path:
    return paths.settings_path()


def coerce(key: str, value) -> object:
    """A value from a file or a command line, as the field's type; ValueError says why not."""
    if key not in FIELDS:
        raise ValueError(f"unknown setting {key!r} (known: {', '.join(FIELDS)})")
    kind = type(getattr(DEFAULTS, key))
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("true", "yes", "on", "1"):
            return True
        if text in ("false", "no", "off", "0"):
            return False
        raise ValueError(f"{key} takes true or false (got {value!r})")
    if kind is AutoResume:
        try:
            return AutoResume(str(value).strip().lower())
        except ValueError:
            raise ValueError(f"{key} takes one of {', '.join(a.value for a in AutoResume)} (got {value!r})") from None
    if kind is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(f"{key} takes a whole number (got {value!r})")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key} takes a whole number (got {value!r})") from None
    if kind is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key} takes a number of seconds (got {value!r})") from None
    return str(value)


def _read_raw(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}


def load(path: Path | None = None) -> Settings:
    """The saved settings; a missing file is the defaults. A broken file raises SettingsError."""
    path = path or settings_path()
    try:
        raw = _read_raw(path)
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise SettingsError([("file", f"{path} cannot be read: {e}")]) from None
    except RecursionError:  # tomllib recurses per level of nested arrays and tables
        raise SettingsError([("file", f"{path} cannot be read: nested too deep")]) from None
    values, errors = {}, []
    for key, value in raw.items():
        if key not in FIELDS:
            continue  # a newer version's key: kept on save, ignored here
        try:
            values[key] = coerce(key, value)
        except ValueError as e:
            errors.append((key, str(e)))
    settings = Settings(**values)
    errors += settings.errors()
    if errors:
        raise SettingsError([(k, f"{m} (in {path})") for k, m in errors])
    return settings


def load_or_defaults(path: Path | None = None) -> tuple[Settings, str]:
    """(settings, problem): a broken file never stops the app; the problem is said instead."""
    try:
        return load(path), ""
    except SettingsError as e:
        return DEFAULTS, f"the settings file is not usable, defaults apply: {e}"


HEADER = "# KV Valet settings (Preferences, or `kv-valet settings`). Only changed values are written."


def save(settings: Settings, path: Path | None = None) -> Path:
    """Validate, then write atomically, editing the file that is there (tomlkit): the user's
    comments, key order and keys or tables this version does not know are kept."""
    errors = settings.errors()
    folder = settings.data_path()
    if folder is not None and not errors:
        try:
            files.private_dir(folder)
            if not os.access(folder, os.W_OK | os.X_OK):
                raise PermissionError("not writable")
        except OSError as e:
            errors.append(("data_folder", f"{folder} cannot be used: {e.strerror or e}"))
    if errors:
        raise SettingsError(errors)
    path = path or settings_path()
    values = {key: getattr(settings, key) for key in FIELDS}
    return files.write_toml(path, values, defaults=dataclasses.asdict(DEFAULTS), header=HEADER)


def update(path: Path | None = None, **changes) -> Settings:
    """Load, change some values (coerced), save; returns the saved settings."""
    current = load(path)
    values = {k: coerce(k, v) for k, v in changes.items()}
    new = dataclasses.replace(current, **values)
    save(new, path)
    return new


def as_toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return '"' + "".join(c if " " <= c != "\x7f" else f"\\u{ord(c):04x}" for c in text) + '"'


def auto_resumes(setting: AutoResume, profile_resumes: bool) -> bool:
    """Whether the sessions "Park all & stop" left behind are resumed without asking."""
    return setting is AutoResume.ALWAYS or profile_resumes


def describe(key: str) -> str:
    """One line for ``kv-valet settings`` and the dialog's tooltips."""
    return HELP[key]


HELP = {
    "data_folder": "Where parked sessions, the catalog and models live (empty: the XDG default). Read once at "
                   "start; sessions already parked stay in the old folder.",
    "monitor_interval_s": "How often the Monitor polls /slots, the process and the GPUs.",
    "monitor_busy_interval_s": "The same while a slot is processing (faster, to catch short tasks).",
    "auto_resume": "After 'Park all & stop', at the next start: offer 'Resume all', or resume at once. A profile's "
                   "'Resume parked slots on start' resumes by itself either way.",
    "keep_in_tray": "Closing the window leaves KV Valet and its server running in the tray.",
    "notifications": "A desktop notification when a park or resume finishes in the background, or a resume "
                     "re-prefilled.",
    "log_file_mib": "Size of each server log file before it is rotated.",
    "log_backups": "Rotated server log files kept per profile (<profile>.log.1 … .N).",
    "park_timeout_s": "How long the park of every slot before a stop may take (quit, logout, shutdown, sleep, "
                      "'kv-valet serve' stopping); past it, or at a second signal, the server stops anyway.",
    "proxy_disk_budget_gib": "The conversation proxy's parked conversations of one profile take at most this much "
                             "disk; past it the least recently used are deleted (0: no limit). A running proxy "
                             "applies a change at its next save.",
    "proxy_save_before_idle_clear": "When the server clears idle slots (--cache-idle-slots with unified KV), the "
                                    "proxy saves a conversation's idle slot before another request runs, so it "
                                    "comes back from its park. Off: it is re-processed instead.",
    "proxy_warm_start": "When the proxy starts, it restores the parked conversations used last into the free "
                        "slots before any request asks, so the first turn after a restart starts at once. Off: a "
                        "conversation is restored when its next request comes.",
    "proxy_park_ahead": "When the conversations outnumber the slots, the proxy parks the one the next new "
                        "conversation would push out while no request runs, so that conversation does not wait "
                        "for the save. Off: the save happens when the slot is taken.",
}


def data_folder_status(settings: Settings) -> str:
    """Which data folder is in use, and when a changed one applies: one sentence for both faces."""
    in_use = paths.data_dir()
    if os.environ.get("KV_VALET_DATA_DIR"):
        return f"data folder in use: {in_use} (set by $KV_VALET_DATA_DIR, which wins over this setting)"
    chosen = settings.data_path() or paths.default_data_dir()
    if chosen == in_use:
        return f"data folder in use: {in_use}"
    return (f"data folder in use: {in_use}; {chosen} applies from the next start "
            "(sessions parked so far stay in the old folder)")
