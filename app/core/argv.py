"""The one place that turns a profile into llama-server's argv, and back.

``to_argv`` builds the command line the app launches. ``parse_command_line``
reads what users run today (``llama-server -m x.gguf -ngl 99 -c 32768 ...``)
into a profile (a line without a model is a router's, as llama-server takes it). The pair round-trips: ``parse_argv(to_argv(p)) == p`` and flags
the app does not model are kept, in order, as ``extra_args``.
"""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass
from typing import Callable, Iterable

from app.core.profile import LaunchProfile


@dataclass(frozen=True)
class Option:
    field: str
    names: tuple[str, ...]  # first one is what to_argv writes
    kind: str  # "int" | "str" | "flag" | "toggle" | "optional"
    negatives: tuple[str, ...] = ()  # toggles: the names that mean False


OPTIONS: tuple[Option, ...] = (
    Option("model", ("-m", "--model"), "str"),
    Option("host", ("--host",), "str"),
    Option("port", ("--port",), "int"),
    Option("ctx_size", ("-c", "--ctx-size"), "int"),
    Option("parallel", ("-np", "--parallel"), "int"),
    Option("gpu_layers", ("-ngl", "--gpu-layers", "--n-gpu-layers"), "str"),
    Option("cache_type_k", ("-ctk", "--cache-type-k"), "str"),
    Option("cache_type_v", ("-ctv", "--cache-type-v"), "str"),
    Option("cache_ram", ("-cram", "--cache-ram"), "int"),
    Option("ctx_checkpoints", ("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints"), "int"),
    Option("kv_unified", ("-kvu", "--kv-unified"), "toggle", ("-no-kvu", "--no-kv-unified")),
    Option("cache_idle_slots", ("--cache-idle-slots",), "toggle", ("--no-cache-idle-slots",)),
    Option("flash_attn", ("-fa", "--flash-attn"), "optional"),
    Option("swa_full", ("--swa-full",), "flag"),
    Option("split_mode", ("-sm", "--split-mode"), "str"),
    Option("tensor_split", ("-ts", "--tensor-split"), "str"),
    Option("main_gpu", ("-mg", "--main-gpu"), "int"),
    Option("rpc", ("--rpc",), "str"),
    Option("slot_save_path", ("--slot-save-path",), "str"),
    Option("api_key", ("--api-key",), "str"),
    Option("api_key_file", ("--api-key-file",), "str"),
    Option("verbosity", ("-lv", "--verbosity", "--log-verbosity"), "int"),
    Option("metrics", ("--metrics",), "flag"),
    Option("slots_endpoint", ("--slots",), "toggle", ("--no-slots",)),
)

_BY_NAME: dict[str, tuple[Option, bool]] = {}
for _opt in OPTIONS:
    for _n in _opt.names:
        _BY_NAME[_n] = (_opt, True)
    for _n in _opt.negatives:
        _BY_NAME[_n] = (_opt, False)

# Flags whose value is optional in llama-server (`-fa` alone means on).
_OPTIONAL_VALUES = {"flash_attn": ("on", "off", "auto")}


class CommandLineError(ValueError):
    pass


def to_argv(
    profile: LaunchProfile,
    binary: str,
    *,
    slot_save_path: str | None = None,
    default_verbosity: int | None = None,
    include_secrets: bool = False,
) -> list[str]:
    """The exact argv to launch (``argv[0]`` is the binary).

    The API key is never put on the command line, where ``ps`` shows it: the
    supervisor passes it as ``LLAMA_API_KEY`` (see ``server_env``).
    ``include_secrets`` exists only for the round-trip of a user's own
    imported command line and is never used to launch.
    """
    argv = [binary]
    for opt in OPTIONS:
        value = getattr(profile, opt.field)
        if opt.field == "slot_save_path":
            value = slot_save_path if slot_save_path is not None else value
            if value is not None and not value.endswith("/"):
                # llama-server concatenates DIR + filename: keep the slash.
                value = value + "/"
        if opt.field == "verbosity" and value is None:
            value = default_verbosity
        if opt.field == "api_key" and not include_secrets:
            continue
        if value is None or (opt.field == "model" and not value):  # no model: a router (or not launchable)
            continue
        if opt.kind == "flag":
            if value:
                argv.append(opt.names[0])
        elif opt.kind == "toggle":
            argv.append(opt.names[0] if value else opt.negatives[0])
        else:
            argv += [opt.names[0], str(value)]
    argv += list(profile.extra_args)
    return argv


def server_env(profile: LaunchProfile, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for the server: the API key travels here, not in argv."""
    env = dict(base or {})
    env.pop("LLAMA_API_KEY", None)
    if profile.api_key:
        env["LLAMA_API_KEY"] = profile.api_key
    return env


def masked_argv(argv: Iterable[str]) -> list[str]:
    """argv with secrets replaced, for previews and logs."""
    out: list[str] = []
    hide_next = False
    for tok in argv:
        if hide_next:
            out.append("••••••")
            hide_next = False
        elif tok == "--api-key":
            out.append(tok)
            hide_next = True
        elif tok.startswith("--api-key="):
            out.append("--api-key=••••••")
        else:
            out.append(tok)
    return out


def preview(argv: Iterable[str]) -> str:
    """A copyable, shell-quoted command line with secrets masked."""
    return shlex.join(masked_argv(argv))


def parse_command_line(
    text: str,
    name: str = "imported",
    *,
    takes_value: Callable[[str], bool | None] | None = None,
) -> LaunchProfile:
    """Parse a llama-server command line as a user would type it in a shell.

    ``shlex`` only splits the words (quotes, backslashes); nothing is run.
    A leading program name (``llama-server``, ``./build/bin/llama-server``) is
    taken as the server binary. Line continuations are accepted.
    """
    text = text.replace("\\\r\n", " ").replace("\\\n", " ")
    try:
        words = shlex.split(text, posix=True)
    except ValueError as e:
        raise CommandLineError(f"cannot split the command line: {e}") from None
    profile = parse_argv(words, name, takes_value=takes_value)
    if not profile.model and not any(_names_model(w) for w in profile.extra_args):
        profile = profile.replace(router=True)  # what llama-server starts from a command line without a model
    return profile


def parse_argv(
    words: list[str],
    name: str = "imported",
    *,
    takes_value: Callable[[str], bool | None] | None = None,
) -> LaunchProfile:
    """Parse argv words into a profile; unknown flags are kept as extra args.

    ``takes_value(flag)`` (from the binary's --help, see app.core.helptext)
    says whether an unknown flag consumes the next word; without it a word
    that does not look like a flag is taken as the value.
    """
    values: dict[str, object] = {}
    extra: list[str] = []
    i = 0
    if words and not words[0].startswith("-"):
        # A bare program name is looked up the usual way (LLAMA_SERVER, PATH, ...).
        if "/" in words[0] or "\\" in words[0]:
            values["server_binary"] = words[0]
        i = 1
    while i < len(words):
        word = words[i]
        flag, inline = (word.split("=", 1) + [None])[:2] if word.startswith("--") and "=" in word else (word, None)
        known = _BY_NAME.get(flag)
        if known is None:
            extra.append(word)
            if inline is None and i + 1 < len(words) and _unknown_takes_value(flag, words[i + 1], takes_value):
                extra.append(words[i + 1])
                i += 1
            i += 1
            continue
        opt, positive = known
        if opt.kind in ("flag", "toggle"):
            values[opt.field] = positive
            i += 1
            continue
        if opt.kind == "optional":
            allowed = _OPTIONAL_VALUES[opt.field]
            if inline is not None:
                values[opt.field] = inline
            elif i + 1 < len(words) and words[i + 1] in allowed:
                values[opt.field] = words[i + 1]
                i += 1
            else:
                values[opt.field] = "on"
            i += 1
            continue
        if inline is None:
            if i + 1 >= len(words):
                raise CommandLineError(f"{flag} needs a value")
            inline = words[i + 1]
            i += 1
        if opt.kind == "int":
            try:
                values[opt.field] = int(inline)
            except ValueError:
                raise CommandLineError(f"{flag} needs a whole number, got '{inline}'") from None
        else:
            if opt.field == "slot_save_path" and not inline.endswith("/"):
                inline += "/"  # llama-server concatenates DIR + filename
            values[opt.field] = inline
        i += 1
    if extra:
        values["extra_args"] = tuple(extra)
    return LaunchProfile(name=name, **values)  # type: ignore[arg-type]


#: llama-server's other ways to name its model (a download, a Docker image): with one of them the
#: server is no router, but KV Valet, which reads the model file, cannot launch it either
MODEL_SOURCES = ("-hf", "-hfr", "--hf-repo", "-mu", "--model-url", "-dr", "--docker-repo")


def _names_model(word: str) -> bool:
    return word.split("=", 1)[0] in MODEL_SOURCES


def _unknown_takes_value(flag: str, nxt: str, takes_value: Callable[[str], bool | None] | None) -> bool:
    if takes_value is not None:
        answer = takes_value(flag)
        if answer is not None:
            return answer
    if not flag.startswith("-"):
        return False
    if nxt.startswith("-") and not _is_number(nxt):
        return False
    return True


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


#: Fields that a launch sets itself: a flag for one of them typed into the extra
#: arguments would be a second, conflicting copy (or, for the key, a secret on
#: the server's command line, where ``ps`` shows it to every user).
SECRET_FIELDS = frozenset({"api_key", "api_key_file"})


def absorb_extra_args(profile: LaunchProfile) -> tuple[LaunchProfile, list[str]]:
    """Move flags that belong to a profile field out of ``extra_args``.

    Returns the profile with those flags moved into their fields, and one
    message per flag that could not be moved because the field already holds
    another value (the caller refuses the profile then). The API key always
    goes to its field, never to the server's argv.
    """
    if not profile.extra_args:
        return profile, []
    try:
        # a bare program name first, so a stray leading value is not taken for the binary
        parsed = parse_argv(["llama-server", *profile.extra_args], profile.name)
    except CommandLineError:
        return profile, []
    moved: dict[str, object] = {}
    conflicts: list[str] = []
    defaults = {f.name: f.default for f in dataclasses.fields(LaunchProfile)}
    for f in dataclasses.fields(LaunchProfile):
        if f.name in ("name", "extra_args"):
            continue
        new = getattr(parsed, f.name)
        if new == defaults[f.name]:
            continue
        have = getattr(profile, f.name)
        flag = next((o.names[0] for o in OPTIONS if o.field == f.name), f.name)
        if have == defaults[f.name] or have == new or f.name in SECRET_FIELDS and not have:
            moved[f.name] = new
        elif f.name in SECRET_FIELDS:
            conflicts.append(f"{flag} in the extra arguments: the profile has its own key; remove it there")
        else:
            conflicts.append(f"{flag} {new} in the extra arguments conflicts with the field's value {have}")
    if not moved and not conflicts:
        return profile, []
    if conflicts:
        return profile, conflicts
    return profile.replace(extra_args=tuple(parsed.extra_args), **moved), []
