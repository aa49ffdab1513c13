"""From a profile to a supervised server: checks first, then the Supervisor.

Everything that can be refused is refused here, before a process exists:
bad profile values, a missing binary, a flag or KV type the binary lacks,
a taken port.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from app import paths
from app import files
from app.server.cpu import repack_env
from app.core.argv import absorb_extra_args, server_env, to_argv
from app.core.helptext import BinaryCaps, unsupported
from app.core.profile import FieldError, LaunchProfile, ProfileError
from app.core.profile_check import validate
from app.paths import default_model_path
from app.server.discovery import DiscoveryError, binary_info, build_id, ensure_default_model, find_server_binary
from app.server.supervisor import Supervisor

# Cache events (checkpoints, full re-processing) are logged at trace level in build 11434.
CACHE_EVENTS_VERBOSITY = 4


@dataclass(frozen=True)
class LaunchPlan:
    profile: LaunchProfile
    binary: str
    binary_source: str
    caps: BinaryCaps
    version: str
    build: str
    argv: list[str]
    env: dict[str, str] = field(repr=False)  # holds LLAMA_API_KEY: kept out of repr() (logs, tracebacks)
    slot_save_path: str
    url: str
    notes: tuple[str, ...] = ()  # what the launch changed on its own, and why (shown in the log)


def slot_save_path_for(profile: LaunchProfile) -> str:
    path = profile.slot_save_path or str(paths.sessions_dir(profile.name))
    return path if path.endswith("/") else path + "/"


def plan_launch(profile: LaunchProfile, *, on_model_progress: Callable[[int, int], None] | None = None,
                check_files: bool = True) -> LaunchPlan:
    # Flags typed into the extra arguments that have a field (--api-key above all)
    # are launched from the field: the key travels in the environment, never argv.
    profile = absorb_extra_args(profile)[0]
    if check_files and profile.model == str(default_model_path()) and not Path(profile.model).is_file():
        ensure_default_model(on_model_progress)
    errors = validate(profile, check_files=check_files)
    if errors:
        raise ProfileError(errors, profile.name)
    try:
        found = find_server_binary(profile.server_binary)
        caps, version = binary_info(found.path)
    except DiscoveryError as e:
        raise ProfileError(FieldError("server_binary", str(e)), profile.name) from None
    bad = unsupported(profile, caps, found.path)
    if bad:
        raise ProfileError(bad, profile.name)
    save_dir = slot_save_path_for(profile)
    files.private_dir(save_dir)  # 0700: parked sessions hold whole conversations
    verbosity = CACHE_EVENTS_VERBOSITY if caps.has("-lv") else None
    argv = to_argv(profile, found.path, slot_save_path=save_dir, default_verbosity=verbosity)
    notes: list[str] = []
    env = launch_environment(argv, knows_no_repack=caps.has("--no-repack"), profile=profile, notes=notes)
    return LaunchPlan(profile, found.path, found.source, caps, version, build_id(version), argv, env,
                      save_dir, profile.url, tuple(notes))


def launch_environment(argv: list[str], *, knows_no_repack: bool = True, base: dict[str, str] | None = None,
                       profile: LaunchProfile | None = None, notes: list[str] | None = None) -> dict[str, str]:
    """The environment a llama-server (or another llama.cpp program that loads a model) is started
    with for ``argv``: the one rule the app's launch and the tests' own server starts share.

    ``base`` is the environment it builds on. ``None`` (the app's launch plan) gives only what is
    added, which the Supervisor lays over the process's own environment; a dict (a test starting a
    binary itself: usually ``os.environ`` with its additions) gives that whole environment with the
    additions on top. Added: the profile's API key (:func:`app.core.argv.server_env`, when ``profile``
    is given) and this CPU's workarounds (:func:`app.server.cpu.repack_env`: ``LLAMA_ARG_REPACK=false``
    where AMX is listed inside a virtual machine, unless ``argv`` or the environment already says;
    ``knows_no_repack``: the binary lists ``--no-repack``). A sentence for each change the launch
    made of its own accord is appended to ``notes``.
    """
    env = server_env(profile, base) if profile is not None else dict(base or {})
    seen = env if base is not None else {**os.environ, **env}  # what the server will find
    extra, note = repack_env(argv, knows_no_repack, environ=seen)
    env.update(extra)
    if note and notes is not None:
        notes.append(note)
    return env


def pid_record_path(profile_name: str) -> Path:
    return paths.runtime_dir() / f"{profile_name}.json"


def make_supervisor(plan: LaunchPlan, **kw) -> Supervisor:
    from app.settings import load_or_defaults

    p = plan.profile
    prefs = load_or_defaults()[0]  # how much server log to keep
    host = p.host.split(",")[0].strip()
    return Supervisor(
        plan.argv,
        url=plan.url,
        env=plan.env,
        api_key=resolve_api_key(p, environ={}),
        profile_name=p.name,
        pid_record_path=pid_record_path(p.name),
        auto_restart=p.auto_restart,
        check_port=(host, p.port) if not host.startswith("/") else None,
        log_file=kw.pop("log_file", paths.server_log_path(p.name)),
        log_file_bytes=prefs.log_file_mib * 1024 * 1024,
        log_backups=prefs.log_backups,
        **kw,
    )


def resolve_api_key(profile: LaunchProfile | None, *, environ=None) -> str | None:
    """The API key for a server: the profile's key, else its key file, else
    ``$LLAMA_API_KEY`` (``environ``, default the process environment; pass ``{}``
    for "the profile's key only"). The one place every front end gets a key from."""
    environ = os.environ if environ is None else environ
    if profile is not None:
        key = profile.api_key or _read_key_file(profile.api_key_file)
        if key:
            return key
    return environ.get("LLAMA_API_KEY") or None


def _read_key_file(path: str | None) -> str | None:
    if not path:
        return None
    try:
        for line in Path(os.path.expanduser(path)).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                return line
    except OSError:
        return None
    return None
