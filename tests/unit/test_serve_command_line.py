"""``kv-valet serve --command-line LINE [--name NAME]``: the command line imported as a profile in the
same process (replacing one of that name, as ``kv-valet profiles import --force``), then served. A line
that cannot be imported is refused with exit 1 and the reason ``profiles import`` gives, before
anything starts (issue #35: llama.cpp's server tests start one Python per server, not two)."""

from __future__ import annotations

import pytest

from app.cli import main
from app.store.profiles import ProfileStore


def _err_lines(capsys) -> list[str]:
    return [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]


@pytest.mark.parametrize("line", ["llama-server -m x.gguf -np two",  # not a number
                                  'llama-server -m "x.gguf',  # cannot be split
                                  "llama-server -m x.gguf --port 99999"])  # a value the profile refuses
def test_a_bad_line_is_refused_with_the_reason_profiles_import_gives(line, capsys):
    assert main(["profiles", "import", "--force", "--name", "imp", line]) == 1
    said = _err_lines(capsys)
    assert said and "Traceback" not in " ".join(said)
    assert main(["serve", "--command-line", line, "--name", "imp", "--proxy", "--no-park"]) == 1
    assert _err_lines(capsys) == said
    assert ProfileStore().names() == []  # nothing saved, nothing started


def test_the_line_is_imported_as_profiles_import_force_would_and_replaces_a_profile_of_that_name(capsys):
    line = "llama-server -m /nonexistent/m.gguf -c 4096 -np 2 --jinja --api-key s3cret"
    assert main(["profiles", "import", "--name", "by-import", line]) == 0
    store = ProfileStore()
    store.save(store.load("by-import").replace(name="by-serve", ctx_size=512))  # an older profile of that name
    # the model file is missing: imported, then refused at launch (the profile check of every start)
    assert main(["serve", "--command-line", line, "--name", "by-serve", "--no-park"]) == 1
    err = capsys.readouterr().err
    assert "imported the command line as profile 'by-serve'" in err
    assert "model file not found: /nonexistent/m.gguf" in err
    assert "s3cret" not in err
    assert store.load("by-serve").replace(name="x") == store.load("by-import").replace(name="x")
    assert store.load("by-serve").ctx_size == 4096


def test_without_a_name_the_profile_is_named_after_the_model(capsys):
    assert main(["serve", "--command-line", "llama-server -m /nonexistent/Some_Model.gguf", "--no-park"]) == 1
    assert ProfileStore().names() == ["Some_Model"]


@pytest.mark.parametrize("argv, said", [
    (["serve"], "give PROFILE or --command-line LINE"),
    (["serve", "default", "--command-line", "llama-server -m x.gguf"], "give PROFILE or --command-line LINE"),
    (["serve", "default", "--name", "x"], "--name names the profile of --command-line"),
])
def test_profile_and_command_line_are_one_or_the_other(argv, said, capsys):
    assert main(argv) == 2
    assert said in capsys.readouterr().err
    assert ProfileStore().names() == []
