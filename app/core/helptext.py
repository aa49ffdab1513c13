"""What a llama-server build accepts, read from its own ``--help``.

Builds drift (the turboquant fork adds ``turbo2/3/4`` cache types, old builds
lack ``-lv``): a profile is checked against the binary it will run, never
against a hard-coded list.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from app.core.argv import OPTIONS
from app.core.conversation import ServerCaching
from app.core.profile import FieldError, LaunchProfile

_ALLOWED = re.compile(r"allowed values:\s*(.+)$")


@dataclass(frozen=True)
class BinaryCaps:
    """The flags of one server binary and the KV cache types it accepts."""

    flags: frozenset[str]
    value_flags: frozenset[str]  # flags followed by a placeholder (N, TYPE, FNAME, ...)
    optional_value_flags: frozenset[str]  # `[on|off|auto]` style
    cache_types: tuple[str, ...]

    def has(self, flag: str) -> bool:
        return spelled(flag) in self.flags

    def takes_value(self, flag: str) -> bool | None:
        flag = spelled(flag)
        if flag in self.optional_value_flags:
            return None  # let the caller look at the next word
        if flag in self.value_flags:
            return True
        if flag in self.flags:
            return False
        return None


def spelled(flag: str) -> str:
    """``flag`` as llama.cpp's argument parser reads it: a long flag's underscores are dashes
    (``--backend_sampling`` is ``--backend-sampling``, which llama.cpp's own server tests pass)."""
    return flag.replace("_", "-") if flag.startswith("--") else flag


def parse_help(text: str) -> BinaryCaps:
    flags: set[str] = set()
    value_flags: set[str] = set()
    optional: set[str] = set()
    cache_types: tuple[str, ...] = ()
    last_flags: list[str] = []
    for raw in text.splitlines():
        line = raw.rstrip()
        if line.startswith("-"):
            # "-c,    --ctx-size N      description": the spec ends at the first wide
            # gap that does not follow a comma.
            parts = re.split(r"\s{2,}", line)
            spec, i = parts[0], 1
            while spec.endswith(",") and i < len(parts):
                spec, i = spec + " " + parts[i], i + 1
            names, placeholder, is_optional = _split_spec(spec)
            last_flags = names
            flags.update(names)
            if placeholder:
                (optional if is_optional else value_flags).update(names)
            continue
        a = _ALLOWED.search(line)
        if a and any(n in ("-ctk", "--cache-type-k") for n in last_flags):
            cache_types = tuple(t.strip() for t in a.group(1).split(",") if t.strip())
    return BinaryCaps(frozenset(flags), frozenset(value_flags), frozenset(optional), cache_types)


def _split_spec(spec: str) -> tuple[list[str], bool, bool]:
    """``-ngl,  --gpu-layers, --n-gpu-layers N`` -> (names, has value, optional)."""
    names: list[str] = []
    placeholder = False
    optional = False
    for part in re.split(r",\s*|\s+", spec):
        if not part:
            continue
        if part.startswith("-") and len(part) > 1 and not part[1].isdigit():
            names.append(part)
        else:
            placeholder = True
            if part.startswith("["):
                optional = True
    return names, placeholder, optional


def unsupported(profile: LaunchProfile, caps: BinaryCaps, binary: str) -> list[FieldError]:
    """Flags or values in the profile that this binary does not accept."""
    from app.core.argv import to_argv

    errors: list[FieldError] = []
    argv = to_argv(profile, binary, include_secrets=True)[1:]
    by_flag = {o.names[0]: o.field for o in OPTIONS}
    by_flag.update({n: o.field for o in OPTIONS for n in o.negatives})
    for word in argv:
        if not word.startswith("-") or _looks_numeric(word):
            continue
        flag = word.split("=", 1)[0]
        if not caps.has(flag):
            field = by_flag.get(flag, "extra_args")
            errors.append(FieldError(field, f"{binary} does not accept {flag}"))
    if caps.cache_types:
        for field in ("cache_type_k", "cache_type_v"):
            v = getattr(profile, field)
            if v is not None and v not in caps.cache_types:
                errors.append(
                    FieldError(
                        field,
                        f"{binary} does not support KV cache type '{v}' "
                        f"(it accepts: {', '.join(caps.cache_types)})",
                    )
                )
    return errors


def _looks_numeric(word: str) -> bool:
    try:
        float(word)
        return True
    except ValueError:
        return False


# -- what the server does with prompts by itself (the conversation proxy's concern) -----------------

_OFF_VALUES = frozenset({"", "0", "off", "no", "none", "false", "disabled"})


def descriptions(text: str) -> dict[str, str]:
    """Each flag of a ``--help`` text with its description (continuation lines joined, spaces
    collapsed): ``{"--cache-ram": "set the maximum cache size in MiB (default: 8192, ...) ...", ...}``."""
    out: dict[str, str] = {}
    names: list[str] = []
    parts: list[str] = []

    def flush() -> None:
        desc = " ".join(" ".join(parts).split())
        for n in names:
            out[n] = desc

    for raw in text.splitlines():
        line = raw.rstrip()
        if line.startswith("-"):
            flush()
            cols = re.split(r"\s{2,}", line)
            spec, i = cols[0], 1
            while spec.endswith(",") and i < len(cols):
                spec, i = spec + " " + cols[i], i + 1
            names = _split_spec(spec)[0]
            parts = cols[i:]
        elif names and line.strip():
            parts.append(line.strip())
        elif not line.strip():
            flush()
            names, parts = [], []
    flush()
    return out


def _last(argv: list[str], names: tuple[str, ...]) -> tuple[str, str | None] | None:
    """The last of ``names`` in ``argv`` and the word after it (or its ``=value``); None if absent."""
    found = None
    for i, word in enumerate(argv):
        flag, eq, value = word.partition("=")
        if flag in names:
            found = (flag, value if eq else (argv[i + 1] if i + 1 < len(argv) else None))
    return found


def _default(desc: str) -> str | None:
    m = re.search(r"\(default:\s*([^,)]*)", desc)
    return m.group(1).strip().lower() if m else None


def server_caching(argv: list[str], help_text: str) -> ServerCaching:
    """What a server started with ``argv`` does with prompts by itself, from the binary's own
    ``--help`` (its flags and their descriptions, not only the flags' presence):

    * idle-slot caching (``--cache-idle-slots``, needs ``--cache-ram`` != 0): it saves idle slots
      to its RAM cache when a task starts, and clears them when the description says so (build
      11434: "clear them when using unified KV", so only with ``-kvu``, which defaults on when
      ``-np`` is auto; later upstream builds clear them always);
    * sleep (``--sleep-idle-seconds N``, N > 0): the context is destroyed after N idle seconds;
    * a disk prompt cache (a flag whose description speaks of prompts on disk: ``--cache-disk``
      in forks and upstream PR #28092), enabled by the argv or by its stated default.

    """
    desc = descriptions(help_text)
    notes: list[str] = []
    # the RAM prompt cache
    ram = 0
    if "--cache-ram" in desc:
        given = _last(argv, ("-cram", "--cache-ram"))
        value = given[1] if given else _default(desc["--cache-ram"])
        try:
            ram = int(value or "0")
        except ValueError:
            ram = 0
    # idle-slot caching
    saved = cleared = False
    idle_desc = desc.get("--cache-idle-slots")
    if idle_desc is not None:
        given = _last(argv, ("--cache-idle-slots", "--no-cache-idle-slots"))
        on = given[0] == "--cache-idle-slots" if given else (_default(idle_desc) or "").startswith("enabled")
        saved = on and ram != 0
        if on and ram == 0:
            notes.append("--cache-idle-slots is off: it needs --cache-ram, which is 0")
        if saved and re.search(r"\bclear", idle_desc, re.I):
            if re.search(r"clear\w*[^.(]*unified", idle_desc, re.I):
                cleared = _unified(argv, desc)
                notes.append("idle slots are saved to the RAM cache" + (
                    " and cleared (unified KV)" if cleared else ", not cleared (no unified KV)"))
            else:
                cleared = True
                notes.append("idle slots are saved to the RAM cache and cleared when another task starts")
        elif saved:
            notes.append("idle slots are saved to the RAM cache (kept in their slots)")
    # sleep
    sleep = None
    if "--sleep-idle-seconds" in desc:
        given = _last(argv, ("--sleep-idle-seconds",))
        try:
            n = int(given[1]) if given and given[1] is not None else -1
        except ValueError:
            n = -1
        if n > 0:
            sleep = n
            notes.append(f"the server sleeps after {n} idle seconds (its context destroyed)")
    # a disk prompt cache
    disk = None
    for flag, text in desc.items():
        low = text.lower()
        if not flag.startswith("--") or "disk" not in low or "prompt" not in low or flag.startswith("--no-"):
            continue
        names = [n for n, d in desc.items() if d is text]
        last = _last(argv, tuple(names))
        if last is not None and last[0].startswith(("--no-", "-no-")):
            continue  # turned off by its negative flag, given last
        given = last
        if given is not None:
            takes_value = any(n in _value_flags(help_text) for n, d in desc.items() if d is text)
            if takes_value and (given[1] or "").strip().lower() in _OFF_VALUES:
                continue
        elif not (_default(text) or "").startswith("enabled"):
            continue
        disk = flag
        notes.append(f"the server persists prompts on disk itself ({flag}: {text[:120]})")
        break
    return ServerCaching(idle_slots_saved=saved, idle_slots_cleared=cleared, sleep_idle_seconds=sleep,
                         disk_cache=disk, ram_cache=ram != 0, notes=tuple(notes))


def _value_flags(help_text: str) -> frozenset[str]:
    caps = parse_help(help_text)
    return caps.value_flags | caps.optional_value_flags


def _unified(argv: list[str], desc: dict[str, str]) -> bool:
    given = _last(argv, ("-kvu", "--kv-unified", "-no-kvu", "--no-kv-unified"))
    if given is not None:
        return given[0] in ("-kvu", "--kv-unified")
    default = _default(desc.get("--kv-unified", "")) or ""
    if "auto" in default:  # "enabled if number of slots is auto"
        np = _last(argv, ("-np", "--parallel"))
        return np is None or (np[1] or "").strip() in ("-1", "")
    return default.startswith("enabled")
