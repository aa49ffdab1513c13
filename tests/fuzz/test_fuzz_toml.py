"""Profile TOML (app.store.profiles ProfileStore.load) and settings TOML (app.settings.load)
under random and corrupted files: random bytes and text, every key with a value of every TOML
type (strings, integers past 64 bits, inf/nan, dates, arrays, tables, deep nesting), valid
files written by the app and then cut, extended or given a wrong byte.

Refusal types: ProfileError and SettingsError, one sentence naming the file. A file the app
wrote itself loads back to the same profile or settings.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import string

from hypothesis import example, given, strategies as st

from app import settings as settings_mod
from app.core.profile import LaunchProfile, ProfileError, field_names
from app.settings import AutoResume, Settings, SettingsError
from app.store.profiles import ProfileStore, to_toml
from tests.fuzz.fuzzkit import outcome

BARE_KEY = st.text(string.ascii_letters + string.digits + "_-", min_size=1, max_size=12)


def toml_string(s: str) -> str:
    return json.dumps(s)  # a JSON string is a TOML basic string (a lone surrogate is refused)


scalars = st.one_of(
    st.text(max_size=20).map(toml_string),
    st.integers(-(2**70), 2**70).map(str),  # past i64: tomllib takes them, the app must cope
    st.floats(allow_nan=True, allow_infinity=True).map(lambda f: "nan" if f != f else repr(f)),
    st.booleans().map(lambda b: "true" if b else "false"),
    st.dates().map(datetime.date.isoformat),
    st.datetimes().map(lambda d: d.isoformat()),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4).map(lambda xs: "[" + ", ".join(xs) + "]"),
        st.dictionaries(BARE_KEY, inner, max_size=3).map(
            lambda d: "{" + ", ".join(f"{k} = {v}" for k, v in d.items()) + "}"),
    ),
    max_leaves=8,
)


def document(keys, draw) -> str:
    chosen = draw(st.lists(st.one_of(st.sampled_from(keys), BARE_KEY), unique=True, max_size=8))
    return "\n".join(f"{k} = {draw(values)}" for k in chosen) + "\n"


def corrupt(text: str, draw) -> str:
    how = draw(st.sampled_from(["none", "cut", "append", "char"]))
    if how == "cut" and text:
        return text[:draw(st.integers(0, len(text) - 1))]
    if how == "append":
        return text + draw(st.text(max_size=20))
    if how == "char" and text:
        at = draw(st.integers(0, len(text) - 1))
        return text[:at] + draw(st.characters()) + text[at + 1:]
    return text


# -- profiles ----------------------------------------------------------------------------------

PROFILE_KEYS = field_names()

profiles = st.builds(
    LaunchProfile,
    name=st.just("p"),
    model=st.text(max_size=20),
    host=st.text(max_size=12),
    port=st.integers(-(2**63), 2**63 - 1),
    ctx_size=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
    gpu_layers=st.one_of(st.none(), st.text(max_size=5)),
    kv_unified=st.one_of(st.none(), st.booleans()),
    api_key=st.one_of(st.none(), st.text(max_size=12)),
    extra_args=st.lists(st.text(max_size=8), max_size=3).map(tuple),
    swa_full=st.booleans(),
)


def load_profile(files, data) -> None:
    path = files.write("p.toml", data)
    store = ProfileStore(path.parent)
    kind, got = outcome("profile TOML", lambda: store.load("p"), ProfileError, names=path)
    return kind, got


@given(st.one_of(st.binary(max_size=200), st.text(max_size=200)))
def test_profile_random_bytes_and_text(files, data):
    load_profile(files, data)


@st.composite
def profile_documents(draw):
    text = document(PROFILE_KEYS, draw)
    if draw(st.booleans()):
        text = 'name = "p"\n' + text.replace("\nname = ", "\nxname = ")
    return corrupt(text, draw)


@given(profile_documents())
def test_profile_any_value_under_any_key(files, text):
    load_profile(files, text)


@given(profiles, st.data())
def test_profile_written_by_the_app_then_corrupted(files, profile, data):
    text = to_toml(profile)
    bad = corrupt(text, data.draw)
    kind, got = load_profile(files, bad)
    if bad == text:  # untouched: loads back as saved (the file may be edited by hand, not by us)
        assert kind == "parsed" and got == profile


@given(st.integers(1, 3000), st.sampled_from(["[", "{a = ", "[[", "{a = ["]))
def test_profile_deep_nesting(files, depth, opener):
    """tomllib recurses once per level: deep nesting is refused, not a RecursionError."""
    closer = {"[": "]", "{a = ": "}", "[[": "]]", "{a = [": "]}"}[opener]
    load_profile(files, 'name = "p"\nmodel = ' + opener * depth + "1" + closer * depth + "\n")


# -- settings ----------------------------------------------------------------------------------

SETTINGS_KEYS = [f.name for f in dataclasses.fields(Settings)]

settings_values = st.builds(
    Settings,
    data_folder=st.one_of(st.just(""), st.text(max_size=12).map(lambda t: "/" + t)),
    monitor_interval_s=st.floats(0.1, 60.0),
    monitor_busy_interval_s=st.floats(0.05, 0.1),
    auto_resume=st.sampled_from(list(AutoResume)),
    keep_in_tray=st.booleans(),
    notifications=st.booleans(),
    log_file_mib=st.integers(1, 4096),
    log_backups=st.integers(0, 100),
)


def load_settings(files, data):
    path = files.write("settings.toml", data)
    return outcome("settings TOML", lambda: settings_mod.load(path), SettingsError, names=path)


@given(st.one_of(st.binary(max_size=200), st.text(max_size=200)))
def test_settings_random_bytes_and_text(files, data):
    load_settings(files, data)


@st.composite
def settings_documents(draw):
    return corrupt(document(SETTINGS_KEYS, draw), draw)


@given(settings_documents())
def test_settings_any_value_under_any_key(files, text):
    load_settings(files, text)


@given(settings_values, st.data())
def test_settings_written_by_the_app_then_corrupted(files, value, data):
    folder = files.folder()
    path = folder / "settings.toml"
    # write the file as settings.save does, without creating the data folder it names
    settings_mod.save(dataclasses.replace(value, data_folder=""), path)
    text = path.read_text(encoding="utf-8")
    if value.data_folder:
        text += f"data_folder = {settings_mod.as_toml(value.data_folder)}\n"
    bad = corrupt(text, data.draw)
    path.write_text(bad, encoding="utf-8", errors="surrogatepass")
    kind, got = outcome("settings TOML", lambda: settings_mod.load(path), SettingsError, names=path)
    if bad == text:
        assert kind == "parsed" and got == value


@given(st.integers(1, 3000), st.sampled_from(["[", "{a = "]))
def test_settings_deep_nesting(files, depth, opener):
    closer = {"[": "]", "{a = ": "}"}[opener]
    load_settings(files, "data_folder = " + opener * depth + "1" + closer * depth + "\n")


@given(st.text(max_size=40))
@example("\x7f")
def test_any_text_the_app_writes_reads_back(text):
    """Both writers quote any text so that tomllib reads it back (DEL, U+007F, was written raw)."""
    import tomllib

    from app.store.profiles import _q

    assert tomllib.loads(f"a = {_q(text)}\nb = {settings_mod.as_toml(text)}\n") == {"a": text, "b": text}
