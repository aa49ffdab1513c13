"""The steps raise typed errors; the CLI words them (its flags are its own words)."""

from __future__ import annotations

import pytest

from app import paths
from app.cli import main as cli_main
from app.sessions.records import AmbiguousName, get_session
from app.store.catalog import Catalog, SessionRecord


def two_profiles_one_name(tmp_path) -> None:
    cat = Catalog(paths.catalog_path())
    try:
        for profile in ("b", "a"):
            folder = tmp_path / profile
            folder.mkdir()
            (folder / "chat.bin").write_bytes(b"qsgg" + bytes(100))
            cat.add_or_replace(SessionRecord(name="chat", profile=profile, state_file="chat.bin",
                                             save_dir=str(folder), n_tokens=10))
    finally:
        cat.close()


def test_an_ambiguous_name_is_a_typed_error_without_cli_words(tmp_path):
    two_profiles_one_name(tmp_path)
    cat = Catalog(paths.catalog_path())
    try:
        with pytest.raises(AmbiguousName) as ei:
            get_session(cat, "chat")
    finally:
        cat.close()
    assert ei.value.profiles == ["a", "b"]
    assert str(ei.value) == "several sessions are named 'chat' (profiles: a, b)"  # the window shows it as is


def test_the_cli_says_which_flag_names_the_profile(tmp_path, capsys):
    two_profiles_one_name(tmp_path)
    assert cli_main(["sessions", "show", "chat"]) == 1
    assert "error: several sessions are named 'chat' (profiles: a, b): pass --profile" in capsys.readouterr().err
    assert cli_main(["sessions", "show", "chat", "--profile", "a"]) == 0
