"""A move killed (SIGKILL) at an exact point of its commit, then the next command.

The move runs as its own process (``kv-valet sessions move``, with one function wrapped so it
stops at a point, says ``at POINT`` on stdout and blocks on stdin: the kill lands there every
time, as in tests/faults/driver.py). The points:

* ``renamed``: the copied files are renamed into place at the target, its catalog row is not
  written (the crash window the move journal covers);
* ``half``: the sidecar is renamed into place, the state file is still at its temporary name;
* ``source``: the target listed the session, the source is not deleted yet.

Then a new process, as a user would run it: ``kv-valet sessions list`` (or ``receive --abort``)
finishes the commit (the session is listed, its files' SHA-256 as the source's) or rolls it
back (the files are gone), and says which on stderr.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT
from tests.unit.move_helpers import folder_names, model_file, open_catalog, park_file, profile

DRIVER = r"""
import os, sys
point, argv = sys.argv[1], sys.argv[2:]

def freeze():
    print(f"at {point}", flush=True)
    sys.stdin.readline()  # the test kills us here

if point == "renamed":
    from app.store.catalog import Catalog
    original_add = Catalog.add_or_replace
    def add_or_replace(self, rec):
        freeze()
        return original_add(self, rec)
    Catalog.add_or_replace = add_or_replace
elif point == "half":
    original_replace = os.replace
    def replace(src, dst, *a, **kw):
        if str(src).endswith(".state.part") and "kvv-move-" in str(src):
            freeze()
        return original_replace(src, dst, *a, **kw)
    os.replace = replace
elif point == "source":
    import app.sessions.records as sessions
    original_delete = sessions.delete_session
    def delete_session(*a, **kw):
        freeze()
        return original_delete(*a, **kw)
    sessions.delete_session = delete_session

from app.cli import main
sys.exit(main(argv))
"""


def cli(*args):
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, timeout=120,
                          env=os.environ.copy(), cwd=ROOT)


def killed_at(point: str, *argv: str) -> str:
    """Run ``kv-valet *argv`` until it reaches ``point``, SIGKILL it there; returns its stderr."""
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, point, *argv], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy(), cwd=ROOT)
    try:
        for line in proc.stdout:
            if line.strip() == f"at {point}":
                break
        else:
            proc.wait(60)
            raise AssertionError(f"the move never reached {point}: exit {proc.returncode}: {proc.stderr.read()}")
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
        return proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)


def sums(state: Path) -> dict[str, str]:
    return {s: hashlib.sha256(Path(str(state) + s).read_bytes()).hexdigest()
            for s in ("", ".ckpt") if Path(str(state) + s).exists()}


def two_profiles(tmp_path):
    model = model_file(tmp_path)
    a, b = profile(tmp_path, "a", model), profile(tmp_path, "b", model)
    with open_catalog() as cat:
        rec = park_file(cat, a, "chat")
    return a, b, rec


def pending_moves() -> list[dict]:
    with open_catalog() as cat:
        return [p for _id, kind, p, _at in cat.list_pending() if kind == "move-in"]


def test_killed_between_the_renames_and_the_row_the_next_list_finishes_it(tmp_path):
    a, b, rec = two_profiles(tmp_path)
    before = sums(rec.state_path)
    killed_at("renamed", "sessions", "move", "chat", "--to", "b", "--json")
    # the crash window: the files are in place at the target, unlisted, and journaled
    assert folder_names(b.slot_save_path) == ["chat.bin", "chat.bin.ckpt"]
    [entry] = pending_moves()
    assert entry["final"] == "chat.bin" and set(entry["files"]) == {"", ".ckpt"}
    with open_catalog() as cat:
        assert cat.list("b") == []

    out = cli("sessions", "list", "--json")
    assert out.returncode == 0, out.stderr
    assert "the move of 'chat' into profile 'b' was interrupted after its files were copied and checked: " \
           "finished" in out.stderr
    listed = {(r["profile"], r["name"]): r for r in json.loads(out.stdout)}
    # listed at the target with the source's bytes; the source was never deleted: two copies, both whole
    assert set(listed) == {("a", "chat"), ("b", "chat")}
    there = listed["b", "chat"]
    assert sums(Path(there["save_dir"]) / there["state_file"]) == before == sums(rec.state_path)
    assert there["notes"] == "copied from profile 'a'"
    assert pending_moves() == [] and folder_names(b.slot_save_path) == ["chat.bin", "chat.bin.ckpt"]
    again = cli("sessions", "list", "--json")
    assert again.returncode == 0 and again.stderr == "" and len(json.loads(again.stdout)) == 2


def test_killed_half_renamed_the_next_move_finishes_it_first(tmp_path):
    a, b, rec = two_profiles(tmp_path)
    before = sums(rec.state_path)
    killed_at("half", "sessions", "copy", "chat", "--to", "b", "--json")
    names = folder_names(b.slot_save_path)
    assert "chat.bin.ckpt" in names and "chat.bin" not in names
    assert [n for n in names if n.endswith(".state.part")]
    # the next move into b recovers before it picks its name: the first copy is listed as
    # 'chat', this one clashes with it (a name is never listed twice)
    out = cli("sessions", "copy", "chat", "--from", "a", "--to", "b")
    assert out.returncode == 1 and "profile 'b' already has a session named 'chat'" in out.stderr
    with open_catalog() as cat:
        [there] = cat.list("b")
    assert there.state_file == "chat.bin" and sums(there.state_path) == before
    assert pending_moves() == [] and folder_names(b.slot_save_path) == ["chat.bin", "chat.bin.ckpt"]


def test_a_file_changed_after_the_crash_is_rolled_back_not_listed(tmp_path):
    a, b, rec = two_profiles(tmp_path)
    killed_at("renamed", "sessions", "move", "chat", "--to", "b", "--json")
    state = Path(b.slot_save_path) / "chat.bin"
    with open(state, "r+b") as f:  # same inode, same size, other bytes: the SHA-256 read back decides
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    out = cli("sessions", "list", "--json")
    assert out.returncode == 0, out.stderr
    assert "was interrupted before it was listed: its files there were removed (the source still has it)" \
           in out.stderr
    assert [(r["profile"], r["name"]) for r in json.loads(out.stdout)] == [("a", "chat")]
    assert folder_names(b.slot_save_path) == [] and pending_moves() == []
    assert rec.state_path.is_file()


def test_the_senders_abort_rolls_back_a_killed_commit(tmp_path):
    """``receive --abort ID`` (what the sending side runs after a failed commit over SSH):
    the commit it gave up on is undone, so its "nothing was added there" holds."""
    a, b, rec = two_profiles(tmp_path)
    killed_at("renamed", "sessions", "copy", "chat", "--to", "b", "--json")
    [entry] = pending_moves()
    out = cli("sessions", "receive", "b", "--abort", entry["move_id"], "--json")
    assert out.returncode == 0, out.stderr
    assert "its files there were removed" in out.stderr
    assert folder_names(b.slot_save_path) == [] and pending_moves() == []
    with open_catalog() as cat:
        assert cat.list("b") == [] and cat.get("a", "chat") is not None


def test_killed_before_the_source_is_deleted_leaves_two_whole_copies(tmp_path):
    a, b, rec = two_profiles(tmp_path)
    before = sums(rec.state_path)
    err = killed_at("source", "sessions", "move", "chat", "--to", "b")
    assert "'chat' is listed at profile 'b': deleting it at profile 'a' (interrupted now, both copies remain)" \
        in err
    out = cli("sessions", "list", "--json")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    listed = {(r["profile"], r["name"]): r for r in json.loads(out.stdout)}
    assert set(listed) == {("a", "chat"), ("b", "chat")}
    for r in listed.values():
        assert sums(Path(r["save_dir"]) / r["state_file"]) == before
    assert pending_moves() == []
