"""``kv-valet sessions copy|move`` on parked files without a server: progress on stderr, the refusals
with their remedies and exit 1, the JSON of the target's side (``receive --describe``) and a move's
host process (``move-host``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.unit.move_helpers import model_file, open_catalog, park_file, profile


def cli(*args, input: str | None = None):
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, timeout=120,
                          env=os.environ.copy(), input=input)


def test_copy_then_a_clash_then_move_renamed(tmp_path):
    model = model_file(tmp_path)
    a, b = profile(tmp_path, "a", model), profile(tmp_path, "b", model)
    with open_catalog() as cat:
        park_file(cat, a, "chat")
    out = cli("sessions", "copy", "chat", "--to", "b")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("copied 'chat' from profile 'a' to profile 'b' as 'chat'")
    assert "copying 'chat':" in out.stderr and "(100%)" in out.stderr
    again = cli("sessions", "copy", "chat", "--from", "a", "--to", "b")
    assert again.returncode == 1 and "profile 'b' already has a session named 'chat'" in again.stderr
    assert "--rename" in again.stderr
    moved = cli("sessions", "move", "chat", "--from", "a", "--to", "b", "--rename", "chat 2", "--json")
    assert moved.returncode == 0, moved.stderr
    d = json.loads(moved.stdout)
    assert d["moved"] and d["record"]["name"] == "chat 2" and d["restore"] is None
    with open_catalog() as cat:
        assert sorted(r.name for r in cat.list("b")) == ["chat", "chat 2"] and cat.list("a") == []


def test_the_target_side_answers_json(tmp_path):
    model = model_file(tmp_path)
    b = profile(tmp_path, "b", model)
    out = cli("sessions", "receive", "b", "--describe", "--json")
    assert out.returncode == 0, out.stderr
    t = json.loads(out.stdout)["target"]
    assert t["profile"] == "b" and t["n_ctx_slot"] == 2048 and t["save_dir"] == b.slot_save_path.rstrip("/")
    assert t["model_size"] == os.path.getsize(model) and t["model_quick_id"]
    bad = cli("sessions", "receive", "b", "--commit", "../etc", "--json")
    assert bad.returncode == 1 and "not a move id" in bad.stderr


def test_a_moves_host_process_answers_each_request_on_its_line(tmp_path):
    """``sessions move-host PROFILE`` (app.move.host_side): one answer line per request, an error as an
    answer (the process goes on), no answer to ``written``; the end of its input ends it."""
    model = model_file(tmp_path)
    b = profile(tmp_path, "b", model)
    requests = [{"op": "describe"}, {"op": "written", "move_id": "0123456789ab", "suffix": "", "upto": 10},
                {"op": "commit", "manifest": {"move_id": "../etc"}}, {"op": "facts", "name": "nobody"},
                {"op": "fly"}, {"op": "abort", "move_id": "0123456789ab"}]
    out = cli("sessions", "move-host", "b", input="".join(json.dumps(r) + "\n" for r in requests))
    assert out.returncode == 0, out.stderr
    described, commit, facts, fly, abort = [json.loads(line) for line in out.stdout.splitlines()]
    assert described["ok"]["target"]["save_dir"] == b.slot_save_path.rstrip("/")
    assert "not a move id" in commit["error"] and "nobody" in facts["error"] and "unknown request" in fly["error"]
    assert abort == {"ok": {"committed": None, "messages": []}}


def test_the_host_side_of_a_move_imports_no_gguf_nor_numpy(tmp_path):
    """What a move runs on the other machine over SSH (``sessions move-host``) reads no GGUF
    metadata: app.server.gguf_info imports gguf and numpy (~120 ms) only when a model is read."""
    model = model_file(tmp_path)
    a, _b = profile(tmp_path, "a", model), profile(tmp_path, "b", model)
    with open_catalog() as cat:
        park_file(cat, a, "chat")
    asked = "".join(json.dumps(r) + "\n" for r in ({"op": "describe"}, {"op": "facts", "name": "chat"}))
    for argv in (["sessions", "move-host", "b"], ["sessions", "list", "--json"]):
        out = subprocess.run([sys.executable, "-X", "importtime", "-m", "app.cli", *argv], capture_output=True,
                             text=True, timeout=120, env=os.environ.copy(), input=asked)
        assert out.returncode == 0, out.stderr
        imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()
                    if line.startswith("import time:")}
        assert "app.server.gguf_info" in imported or argv[1] != "move-host"  # the module itself is there
        assert "httpx" not in imported or argv[1] != "move-host"  # nor the HTTP client (app.move.facts)
        assert not {m for m in imported if m.split(".")[0] in ("gguf", "numpy")}, argv


def test_a_moves_folder_is_the_one_the_launcher_gives_the_server():
    """app.move.facts reads the save folder without importing the launcher (and the HTTP client)."""
    from pathlib import Path

    from app.core.profile import LaunchProfile
    from app.move.facts import _folder_and_model
    from app.server.launcher import slot_save_path_for

    for p in (LaunchProfile(name="plain"), LaunchProfile(name="set", slot_save_path="~/slots"),
              LaunchProfile(name="extra", extra_args=("--slot-save-path", "/srv/kv"))):
        assert _folder_and_model(p)[1] == Path(slot_save_path_for(_folder_and_model(p)[0])).expanduser()


def test_host_flag_is_taken_off_what_the_host_runs():
    from app.cli.hosts import without_host

    assert without_host(["sessions", "show", "x", "--host", "box", "--json"]) == ["sessions", "show", "x", "--json"]
    assert without_host(["park", "p", "--host=box", "--slot", "0"]) == ["park", "p", "--slot", "0"]
    assert without_host(["-v", "check", "p", "s", "--ho", "box"]) == ["-v", "check", "p", "s"]
    assert without_host(["resume", "p", "--", "--host"]) == ["resume", "p", "--", "--host"]
