"""The command-line import (app.core.argv.parse_command_line, then what `kv-valet profiles
import` and the window's Import do with it: name, check, argv, preview, hazards) under random
text and under command lines built from the real flags with random values, quoting and
continuations.

Refusal types: CommandLineError (cannot be split, a flag without its value, not a number) and
ProfileError (a value the profile refuses); nothing else. A profile that passes its check
turns back into a command line that imports to the same profile.
"""

from __future__ import annotations

import shlex

from hypothesis import given, strategies as st

from app.core.argv import OPTIONS, CommandLineError, parse_command_line, preview, to_argv
from app.core.hazards import hazards
from app.core.profile import ProfileError
from app.core.profile_check import check
from app.servers.service import profile_name_from_model
from tests.fuzz.fuzzkit import outcome

FLAGS = sorted({n for o in OPTIONS for n in (*o.names, *o.negatives)} | {"-fa", "--flash-attn", "-ngl", "--jinja",
                                                                          "-ub", "--alias"})
VALUES = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.sampled_from(["on", "off", "auto", "all", "0.0.0.0", "q8_0", "turbo3", "x.gguf", "3,1", "²", "١٢",
                     "1_000", "-1", "nan", "inf", "", " ", "--", "-", "\\", "'", '"', "\n"]),
    st.text(max_size=10),
)
WORDS = st.one_of(
    st.sampled_from(FLAGS).map(lambda f: [f]),
    st.tuples(st.sampled_from(FLAGS), VALUES).map(list),  # a flag and its value
    st.tuples(st.sampled_from(FLAGS), VALUES).map(lambda fv: [f"{fv[0]}={fv[1]}"]),
    VALUES.map(lambda v: [v]),
)


@st.composite
def command_lines(draw):
    words = [w for group in draw(st.lists(WORDS, max_size=8)) for w in group]
    if draw(st.integers(0, 3)):  # mostly with a model, so that some pass the profile's check
        at = draw(st.integers(0, len(words)))
        words[at:at] = ["-m", draw(st.sampled_from(["gemma.gguf", "/m/x y.gguf", "a'b.gguf"]))]
    if draw(st.booleans()):
        words = ["llama-server" if draw(st.booleans()) else "./build/bin/llama-server", *words]
    how = draw(st.sampled_from(["shell", "raw", "continuations"]))
    if how == "shell":
        return shlex.join(words)
    if how == "continuations":
        return " \\\n  ".join(shlex.quote(w) for w in words)
    return " ".join(words)  # unbalanced quotes, backslashes: as pasted


def import_flow(text: str):
    """What `kv-valet profiles import TEXT` does before saving, and the preview it prints."""
    profile = parse_command_line(text, "imported")
    name = profile_name_from_model(profile.model) or "imported"
    profile = check(profile.replace(name=name), check_files=False)
    argv = to_argv(profile, "llama-server", include_secrets=True)
    preview(argv)
    hazards(profile)
    return profile, argv


def run(text: str):
    # a refusal may quote a value, and a pasted value may hold a line break
    kind, value = outcome("command-line import", lambda: import_flow(text), (CommandLineError, ProfileError),
                          one_line="\n" not in text and "\r" not in text)
    if kind == "parsed":
        profile, argv = value
        # the command line the profile stands for imports back to the same profile
        again = parse_command_line(shlex.join(argv), profile.name)  # (a line without a model: a router again)
        assert again.replace(server_binary=profile.server_binary) == profile


@given(st.text(max_size=200))
def test_random_text(text):
    run(text)


@given(command_lines())
def test_command_lines_from_the_real_flags(text):
    run(text)
