"""``kv-valet sessions copy|move`` on parked files without a server: progress on stderr, the refusals
with their remedies and exit 1, the JSON of the target's side (``receive --describe``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.unit.move_helpers import model_file, open_catalog, park_file, profile


def cli(*args):
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, timeout=120,
                          env=os.environ.copy())


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


def test_the_host_side_of_a_move_imports_no_gguf_nor_numpy(tmp_path):
    """What a move runs on the other machine over SSH (``sessions facts|receive``) reads no GGUF
    metadata: app.server.gguf_info imports gguf and numpy (~120 ms) only when a model is read."""
    model = model_file(tmp_path)
    a, _b = profile(tmp_path, "a", model), profile(tmp_path, "b", model)
    with open_catalog() as cat:
        park_file(cat, a, "chat")
    for argv in (["sessions", "receive", "b", "--describe", "--json"], ["sessions", "facts", "chat", "--json"],
                 ["sessions", "list", "--json"]):
        out = subprocess.run([sys.executable, "-X", "importtime", "-m", "app.cli", *argv], capture_output=True,
                             text=True, timeout=120, env=os.environ.copy())
        assert out.returncode == 0, out.stderr
        imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()
                    if line.startswith("import time:")}
        assert "app.server.gguf_info" in imported or argv[1] != "receive"  # the module itself is there
        assert not {m for m in imported if m.split(".")[0] in ("gguf", "numpy")}, argv


def test_host_flag_is_taken_off_what_the_host_runs():
    from app.cli.hosts import without_host

    assert without_host(["sessions", "show", "x", "--host", "box", "--json"]) == ["sessions", "show", "x", "--json"]
    assert without_host(["park", "p", "--host=box", "--slot", "0"]) == ["park", "p", "--slot", "0"]
    assert without_host(["-v", "check", "p", "s", "--ho", "box"]) == ["-v", "check", "p", "s"]
    assert without_host(["resume", "p", "--", "--host"]) == ["resume", "p", "--", "--host"]
