"""A launch profile checked whole: every field, the files it names, and the flags in its extra
arguments that belong to a field (:func:`app.core.argv.absorb_extra_args`).

Its own module because it builds on both :mod:`app.core.profile` (the data) and
:mod:`app.core.argv` (the flags), and argv builds on the profile.
"""

from __future__ import annotations

from pathlib import Path

from app.core.argv import absorb_extra_args
from app.core.profile import (NAME_RE, BUILT_MARKER, FLASH_ATTN_VALUES, KNOWN_CACHE_TYPES, SPLIT_MODES,
                              FieldError, LaunchProfile, ProfileError, exposure_warning, is_loopback,
                              parse_rpc_workers)


def validate(profile: LaunchProfile, *, check_files: bool = True) -> list[FieldError]:
    """Every problem with the profile's own values (not the binary's abilities)."""
    errors: list[FieldError] = []

    def err(f: str, msg: str) -> None:
        errors.append(FieldError(f, msg))

    if not NAME_RE.match(profile.name or ""):
        err("name", "use 1-64 letters, digits, spaces, '.', '_' or '-', starting with a letter or digit")
    if profile.router and profile.model:
        err("model", "a router has no model of its own: clear the model, or turn router mode off")
    elif not profile.model and not profile.router:
        err("model", "no model file given (or turn router mode on: llama-server then loads the model "
            "each request names)")
    elif profile.router:
        pass
    elif check_files:
        p = Path(profile.model).expanduser()
        if not p.is_file():
            err("model", f"model file not found: {p}")
        elif not _readable(p):
            err("model", f"model file is not readable: {p}")
    if check_files and profile.server_binary and profile.server_binary != BUILT_MARKER:  # marker: resolved at launch
        b = Path(profile.server_binary).expanduser()
        if not b.is_file():
            err("server_binary", f"server binary not found: {b}")
    if not (1 <= profile.port <= 65535):
        err("port", f"{profile.port} is not a TCP port (1-65535)")
    if not profile.host.strip():
        err("host", "empty host")
    for fname, lo in (("ctx_size", 0), ("parallel", -1), ("ctx_checkpoints", 0), ("main_gpu", 0)):
        v = getattr(profile, fname)
        if v is not None and v < lo:
            what = "slots" if fname == "parallel" else "value"
            err(fname, f"{v} is negative: the number of {what} must be {lo} or more")
    if profile.parallel == 0:
        err("parallel", "0 slots: use 1 or more (or -1 for auto)")
    if profile.cache_ram is not None and profile.cache_ram < -1:
        err("cache_ram", f"{profile.cache_ram} MiB: use -1 (no limit), 0 (off) or a size in MiB")
    if profile.gpu_layers is not None:
        g = profile.gpu_layers
        # isascii: "²" and "١٢" are digits to str.isdigit, but not to int() or llama-server
        if g not in ("auto", "all") and not (g.isascii() and g.lstrip("-").isdigit() and int(g) >= 0):
            err("gpu_layers", f"'{g}': use a number of layers, 'auto' or 'all'")
    for fname in ("cache_type_k", "cache_type_v"):
        v = getattr(profile, fname)
        if v is not None and v not in KNOWN_CACHE_TYPES:
            err(fname, f"unknown KV cache type '{v}' (known: {', '.join(KNOWN_CACHE_TYPES)})")
    if profile.flash_attn is not None and profile.flash_attn not in FLASH_ATTN_VALUES:
        err("flash_attn", f"'{profile.flash_attn}': use on, off or auto")
    if profile.split_mode is not None and profile.split_mode not in SPLIT_MODES:
        err("split_mode", f"'{profile.split_mode}': use {', '.join(SPLIT_MODES)}")
    if profile.tensor_split is not None:
        try:
            parts = [float(x) for x in profile.tensor_split.split(",")]
            if any(x < 0 for x in parts):
                raise ValueError
        except ValueError:
            err("tensor_split", f"'{profile.tensor_split}': use proportions like 3,1")
    if profile.rpc is not None:
        workers, problems = parse_rpc_workers(profile.rpc)
        if problems or not workers:
            err("rpc", "; ".join(problems or ["no worker given"]) + ": use HOST:PORT,HOST:PORT (llama-server "
                "aborts at start on an entry it cannot parse)")
    if profile.verbosity is not None and not (0 <= profile.verbosity <= 5):
        err("verbosity", f"{profile.verbosity}: use 1 (errors) to 5 (debug)")
    if profile.api_key and any(c in profile.api_key for c in "\r\n"):
        err("api_key", "the API key may not contain line breaks")
    if check_files and profile.api_key_file:
        kf = Path(profile.api_key_file).expanduser()
        if not kf.is_file():
            err("api_key_file", f"API key file not found: {kf}")
        elif kf.stat().st_mode & 0o077:
            err("api_key_file", f"{kf} can be read by other users: run chmod 600 on it")
    for conflict in absorb_extra_args(profile)[1]:
        err("extra_args", conflict)
    if not is_loopback(profile.host) and not profile.has_api_key and not profile.expose_acknowledged:
        err("host", exposure_warning(profile) + " Set an API key, or confirm that this is what you want "
            "(Start in the window asks; for the command line, put expose_acknowledged = true in the profile).")
    return errors


def check(profile: LaunchProfile, *, check_files: bool = True) -> LaunchProfile:
    errors = validate(profile, check_files=check_files)
    if errors:
        raise ProfileError(errors, profile.name)
    return profile


def _readable(p: Path) -> bool:
    try:
        with open(p, "rb") as f:
            f.read(4)
        return True
    except OSError:
        return False
