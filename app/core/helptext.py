"""What a llama-server build accepts, read from its own ``--help``.

Builds drift (the turboquant fork adds ``turbo2/3/4`` cache types, old builds
lack ``-lv``): a profile is checked against the binary it will run, never
against a hard-coded list.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from app.core.argv import OPTIONS
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
        return flag in self.flags

    def takes_value(self, flag: str) -> bool | None:
        if flag in self.optional_value_flags:
            return None  # let the caller look at the next word
        if flag in self.value_flags:
            return True
        if flag in self.flags:
            return False
        return None


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
        if flag not in caps.flags:
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
