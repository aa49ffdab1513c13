"""The one atomic-write helper (app.files.write_atomic / atomic_writer) and the locked
read-modify-write of the JSON caches (app.files.update_json)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from app import paths
from app import files as fileio

ROOT = Path(__file__).resolve().parents[2]


def test_concurrent_writers_use_unique_temp_names_and_leave_nothing_behind(tmp_path, monkeypatch):
    target = tmp_path / "f.json"
    names: list[str] = []
    real_mkstemp = tempfile.mkstemp

    def recording_mkstemp(*a, **kw):
        fd, name = real_mkstemp(*a, **kw)
        names.append(name)
        return fd, name

    monkeypatch.setattr(fileio.tempfile, "mkstemp", recording_mkstemp)
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def writer(n: int) -> None:
        try:
            start.wait()
            for i in range(100):
                fileio.write_atomic(target, json.dumps({"writer": n, "i": i, "pad": "x" * 4096}))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(names) == 400 and len(set(names)) == 400  # never the same temporary file twice
    assert all(Path(n).parent == tmp_path and Path(n).name.startswith(".f.json.") and n.endswith(".tmp")
               for n in names)
    assert json.loads(target.read_text())["i"] == 99  # whole: one writer's last write
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]  # no temporary file left
    assert stat.S_IMODE(target.stat().st_mode) == 0o600


def test_the_file_and_its_folder_are_fsynced(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    target = tmp_path / "sub" / "settings.toml"
    fileio.write_atomic(target, "a = 1\n")
    assert target.read_text() == "a = 1\n"
    assert len(synced) == 2
    assert Path(synced[0]).parent == target.parent and Path(synced[0]).name.startswith(".settings.toml.")  # the data
    assert synced[1] == str(target.parent)  # then the rename, in its folder
    assert stat.S_IMODE(target.parent.stat().st_mode) == 0o700  # a missing folder is made private


def test_a_failure_mid_write_leaves_the_old_file_and_no_temp_file(tmp_path, monkeypatch):
    target = tmp_path / "profile.toml"
    target.write_text("old\n")
    with pytest.raises(RuntimeError):
        with fileio.atomic_writer(target) as f:
            f.write(b"half of the new")
            raise RuntimeError("the disk went away")
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["profile.toml"]

    def failing_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="No space left"):
        fileio.write_atomic(target, "new\n")
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["profile.toml"]


def test_mode_is_exact_whatever_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        p = fileio.write_atomic(tmp_path / "share" / "entry.desktop", b"[Desktop Entry]\n", mode=0o644)
    finally:
        os.umask(old)
    assert stat.S_IMODE(p.stat().st_mode) == 0o644


def test_locked_serialises_read_modify_write_across_threads(tmp_path):
    cache = tmp_path / "c.json"
    errors: list[BaseException] = []

    def add(n: int) -> None:
        try:
            for i in range(25):
                fileio.update_json(cache, lambda d: d.__setitem__(f"{n}-{i}", i))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=add, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(json.loads(cache.read_text())) == 100
    assert stat.S_IMODE((tmp_path / "c.json.lock").stat().st_mode) == 0o600


def test_locked_times_out_with_an_oserror(tmp_path):
    cache = tmp_path / "c.json"
    with fileio.locked(cache):
        with pytest.raises(TimeoutError):  # an OSError: the callers that ignore a failed cache write go on
            with fileio.locked(cache, timeout=0.05):
                pass
    with fileio.locked(cache, timeout=0.05):  # released
        pass


ADD_50 = """
import sys, time
from pathlib import Path
from app.server.gguf_info import model_sha256
folder, cache, who, go = Path(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4])
files = []
for i in range(50):
    f = folder / f"{who}-{i}.gguf"
    f.write_bytes(f"{who} {i}".encode())
    files.append(f)
while not go.exists():
    time.sleep(0.001)
for f in files:
    model_sha256(f, cache)
"""


def test_two_processes_adding_to_one_cache_lose_nothing(tmp_path):
    """The window and a CLI hashing models at the same time: each adds 50 entries to
    model-hashes.json through the real cache function; all 100 are there after."""
    cache = tmp_path / "model-hashes.json"
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", ADD_50, str(tmp_path), str(cache), who, str(go)], env=env,
                              cwd=ROOT, stderr=subprocess.PIPE, text=True) for who in ("window", "cli")]
    time.sleep(0.2)  # a head start for both imports; the files are ready before "go" either way
    go.touch()
    for p in procs:
        _out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    data = json.loads(cache.read_text())
    assert sorted(data) == sorted(str((tmp_path / f"{who}-{i}.gguf").absolute())
                                  for who in ("window", "cli") for i in range(50))
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
