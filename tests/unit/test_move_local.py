"""Moves between two profiles on this machine (app.move.transfer), on parked files without a server:
the files arrive whole (SHA-256 checked at the target), the sidecar travels with its state file,
and a failure or an interruption leaves the source intact and nothing listed at the target."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import time
from pathlib import Path

import pytest

from app.move.endpoints import LocalEndpoint
from app.move.transfer import move_session, preview
from app.move.values import MoveCancelled, MoveError, MoveRefused
from app.sessions.move_in import MOVE_PREFIX, temp_name
from app.sessions.records import list_sessions
from tests.unit.move_helpers import folder_names, model_file, open_catalog, park_file, profile


@pytest.fixture
def two(tmp_path):
    model = model_file(tmp_path)
    a, b = profile(tmp_path, "a", model), profile(tmp_path, "b", model)
    cat = open_catalog()
    yield cat, a, b
    cat.close()


def digest(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def move(cat, name, src="a", dst="b", **kw):
    return asyncio.run(move_session(LocalEndpoint(cat, src), name, LocalEndpoint(cat, dst), **kw))


def test_move_lands_whole_with_its_sidecar_and_leaves_the_source(two):
    cat, a, b = two
    rec = park_file(cat, a, "chat")
    sums = {s: digest(str(rec.state_path) + s) for s in ("", ".ckpt")}
    seen = []
    result = move(cat, "chat", on_progress=lambda done, total: seen.append((done, total)), chunk=64 * 1024)
    moved = result.record
    assert result.moved and moved.profile == "b" and moved.name == "chat"
    assert Path(moved.save_dir) == Path(b.slot_save_path) and moved.n_tokens == rec.n_tokens
    assert moved.sidecar_file == moved.state_file + ".ckpt"
    assert {s: digest(str(moved.state_path) + s) for s in ("", ".ckpt")} == sums
    total = rec.state_size + rec.sidecar_size
    assert seen[0] == (0, total) and seen[-1] == (total, total) and len(seen) > 3
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert cat.get("a", "chat") is None and folder_names(a.slot_save_path) == []
    assert folder_names(b.slot_save_path) == [moved.state_file, moved.state_file + ".ckpt"]
    [listed] = list_sessions(cat, "b")
    assert listed.sidecar_status == "present" and listed.sidecar_count == 1
    assert oct(os.stat(moved.state_path).st_mode & 0o777) == "0o600"
    assert moved.notes == "copied from profile 'a'"


def test_copy_keeps_the_source_and_rename_avoids_a_clash(two):
    cat, a, b = two
    park_file(cat, a, "chat")
    park_file(cat, b, "chat", sidecar=False)
    with pytest.raises(MoveRefused) as e:
        move(cat, "chat", keep_source=True)
    assert [p.rule for p in e.value.compat.refusals] == ["name"] and "--rename" in str(e.value)
    result = move(cat, "chat", keep_source=True, new_name="chat from a")
    assert not result.moved and result.record.name == "chat from a"
    assert result.record.state_file == "chat-from-a.bin"
    assert cat.get("a", "chat") is not None and cat.get("b", "chat") is not None
    assert sorted(r.name for r in cat.list("b")) == ["chat", "chat from a"]


def test_a_refusal_moves_no_byte(two, tmp_path):
    cat, a, _ = two
    other = profile(tmp_path, "c", model_file(tmp_path, "other.gguf", seed=b"XXXX"), cache_type_k="q8_0")
    park_file(cat, a, "chat")
    with pytest.raises(MoveRefused) as e:
        move(cat, "chat", dst="c")
    assert [p.rule for p in e.value.compat.refusals] == ["model", "cache types"]
    assert folder_names(other.slot_save_path) == [] and cat.get("a", "chat") is not None


def test_preview_says_what_a_move_would_meet_without_copying(two):
    cat, a, b = two
    park_file(cat, a, "chat")
    src, facts, compat = asyncio.run(preview(LocalEndpoint(cat, "a"), "chat", LocalEndpoint(cat, "b")))
    assert compat.ok and facts.n_ctx_slot == 2048 and facts.profile == "b"
    # the binary is not there: its build, state version and sidecar reading are not known: warnings
    assert sorted(p.rule for p in compat.warnings) == ["sidecar version", "state version"]
    assert src.total_bytes == sum(f.size for f in src.files) and folder_names(b.slot_save_path) == []
    same = asyncio.run(preview(LocalEndpoint(cat, "a"), "chat", LocalEndpoint(cat, "a")))[2]
    assert not same.ok and same.refusals[0].rule == "target"


def assert_untouched(cat, a, b, sums):
    rec = cat.get("a", "chat")
    assert rec is not None and {s: digest(str(rec.state_path) + s) for s in ("", ".ckpt")} == sums
    assert cat.list("b") == [] and list_sessions(cat, "b") == []
    assert folder_names(b.slot_save_path) == []  # no half file, no temporary file


def test_a_move_cancelled_mid_copy_leaves_the_source_and_nothing_at_the_target(two):
    cat, a, b = two
    rec = park_file(cat, a, "chat")
    sums = {s: digest(str(rec.state_path) + s) for s in ("", ".ckpt")}
    temps = []

    def cancel(done, total):
        temps.extend(n for n in os.listdir(b.slot_save_path) if n.startswith(MOVE_PREFIX))
        if done > total // 2:
            raise MoveCancelled("stopped by the user")

    with pytest.raises(MoveCancelled):
        move(cat, "chat", on_progress=cancel, chunk=32 * 1024)
    assert temps  # it was writing a temporary file when it stopped
    assert_untouched(cat, a, b, sums)


def test_a_task_cancelled_mid_copy_cleans_up_too(two):
    """Ctrl-C: asyncio.run cancels the main task; the move removes its temporary files first."""
    cat, a, b = two
    rec = park_file(cat, a, "chat")
    sums = {s: digest(str(rec.state_path) + s) for s in ("", ".ckpt")}

    async def go():
        half = asyncio.Event()
        task = asyncio.ensure_future(move_session(
            LocalEndpoint(cat, "a"), "chat", LocalEndpoint(cat, "b"), chunk=16 * 1024,
            on_progress=lambda d, t: half.set() if d > t // 2 else None))
        await half.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert_untouched(cat, a, b, sums)


class Faulty(LocalEndpoint):
    """A target whose disk does ``fault(data, n)`` to the n-th chunk it is sent: returns the bytes
    it really writes, or raises."""

    def __init__(self, cat, profile, fault):
        super().__init__(cat, profile)
        self.fault = fault

    async def open_temp(self, move_id, suffix):
        w = await super().open_temp(move_id, suffix)
        real, calls = w.write, [0]

        async def write(data):
            calls[0] += 1
            await real(self.fault(data, calls[0]))

        w.write = write
        return w


def flip_first_byte(data, n):  # what the SHA-256 check is for
    return bytes([data[0] ^ 0xFF]) + data[1:] if n == 1 else data


def full_after_two(data, n):
    if n > 2:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return data


def test_a_checksum_mismatch_is_refused_at_the_target(two):
    cat, a, b = two
    rec = park_file(cat, a, "chat")
    sums = {s: digest(str(rec.state_path) + s) for s in ("", ".ckpt")}
    with pytest.raises(MoveError, match="checksum mismatch"):
        asyncio.run(move_session(LocalEndpoint(cat, "a"), "chat", Faulty(cat, "b", flip_first_byte)))
    assert_untouched(cat, a, b, sums)


def test_a_park_that_recorded_its_sums_is_checked_against_them_at_the_target(two):
    """The sender of a park that recorded its files' SHA-256 (every park does) does not hash: the target
    checks what reached it against the park's own sums. Bytes damaged on the way are then refused as
    not the parked ones, with the remedy; forced, the sender hashes what it sends, and the target
    catches the damage against that."""
    cat, a, b = two
    rec = park_file(cat, a, "chat", hashed=True)
    sums = {s: digest(str(rec.state_path) + s) for s in ("", ".ckpt")}
    with pytest.raises(MoveRefused) as refused:
        asyncio.run(move_session(LocalEndpoint(cat, "a"), "chat", Faulty(cat, "b", flip_first_byte)))
    [reason] = refused.value.reasons
    assert reason.startswith("the state file reached profile 'b' with SHA-256 ")
    assert f"not the parked {sums[''][:12]}…: the file changed here since the park, or was damaged on the way; " \
           "nothing was added there (move it anyway with --yes, or park the chat again)" in reason
    assert_untouched(cat, a, b, sums)
    with pytest.raises(MoveError, match="checksum mismatch") as forced:
        asyncio.run(move_session(LocalEndpoint(cat, "a"), "chat", Faulty(cat, "b", flip_first_byte), force=True))
    assert not isinstance(forced.value, MoveRefused)
    assert_untouched(cat, a, b, sums)


def test_a_recorded_park_whose_bytes_changed_here_is_refused_and_moves_when_forced(two):
    cat, a, b = two
    rec = park_file(cat, a, "chat", hashed=True)
    data = bytearray(rec.state_path.read_bytes())
    data[-1] ^= 0xFF  # the same size, other bytes: only a hash sees it
    rec.state_path.write_bytes(bytes(data))
    with pytest.raises(MoveRefused, match="not the parked"):
        move(cat, "chat")
    assert cat.get("b", "chat") is None and cat.get("a", "chat") is not None
    assert not any(n.startswith(MOVE_PREFIX) for n in folder_names(b.slot_save_path))
    result = move(cat, "chat", force=True)
    assert result.moved and any("the same size but other bytes" in w for w in result.warnings)
    assert digest(result.record.state_path) == hashlib.sha256(bytes(data)).hexdigest()


def test_a_file_read_back_as_it_came_is_read_again_whole_when_it_changed_after(tmp_path):
    """The target hashes each chunk as it is written (app.move.receive.ReadBack); a file replaced or
    grown after that is not vouched for by those reads: the commit reads it back whole."""
    from app.move.receive import ReadBack

    p = tmp_path / "f"
    p.write_bytes(b"abc" * 1000)
    rb = ReadBack(p)
    rb.advance(1500)
    assert rb.digest(3000) == hashlib.sha256(b"abc" * 1000).hexdigest()
    for change in (lambda: p.write_bytes(p.read_bytes() + b"x"),  # grown
                   lambda: (p.unlink(), p.write_bytes(b"abc" * 1000))):  # replaced: another inode
        rb = ReadBack(p)
        rb.advance(3000)
        change()
        assert rb.digest(3000) is None
        rb.close()
    assert ReadBack(tmp_path / "missing").digest(3) is None


def test_what_is_read_back_goes_to_the_disks_writeback_at_once(tmp_path, monkeypatch):
    """Each range ReadBack has read is handed to the kernel's writeback (sync_file_range), so the
    commit's fsync of a 1 GiB file no longer writes it all at the end (tests/bench/bench_move.py); a
    kernel that refuses the hint costs nothing but the hint."""
    from app.move import receive

    assert receive.start_writeback is not None  # Linux: the suite's machines
    p = tmp_path / "f"
    p.write_bytes(os.urandom(3 << 20))
    fd = os.open(p, os.O_RDONLY)
    try:
        receive.start_writeback(fd, 0, 3 << 20)  # the real call takes a read-only fd
    finally:
        os.close(fd)
    told = []
    monkeypatch.setattr(receive, "start_writeback", lambda fd, off, n: told.append((off, n)))
    rb = receive.ReadBack(p)
    rb.advance(1 << 20)
    rb.advance(1 << 20)  # nothing new: nothing told
    assert rb.digest(3 << 20) == digest(p)
    rb.close()
    assert told == [(0, 1 << 20), (1 << 20, 2 << 20)]

    def refused(fd, off, n):
        told.append("refused")
        raise OSError(22, "Invalid argument")
    monkeypatch.setattr(receive, "start_writeback", refused)
    rb = receive.ReadBack(p)
    rb.advance(1 << 20)
    rb.advance(2 << 20)  # asked once, then no more
    assert rb.digest(3 << 20) == digest(p) and told.count("refused") == 1
    rb.close()


def test_a_full_disk_mid_copy_fails_cleanly(two):
    cat, a, b = two
    rec = park_file(cat, a, "chat")
    sums = {s: digest(str(rec.state_path) + s) for s in ("", ".ckpt")}
    with pytest.raises(MoveError, match="No space left on device.*source is kept"):
        asyncio.run(move_session(LocalEndpoint(cat, "a"), "chat", Faulty(cat, "b", full_after_two), chunk=16 * 1024))
    assert_untouched(cat, a, b, sums)


def test_a_crash_leftover_is_not_listed_and_the_next_move_removes_it(two):
    cat, a, b = two
    park_file(cat, a, "chat")
    folder = Path(b.slot_save_path)
    old = folder / temp_name("0123456789ab", "")
    old.write_bytes(b"half a state file")
    long_ago = time.time() - 3600
    os.utime(old, (long_ago, long_ago))
    fresh = folder / temp_name("ba9876543210", ".ckpt")  # another move's, in flight right now
    fresh.write_bytes(b"being written")
    user_file = folder / "kvv-move-notes.txt"  # not a move's name: never touched
    user_file.write_text("mine")
    assert list_sessions(cat, "b") == []
    result = move(cat, "chat")
    assert not old.exists() and fresh.exists() and user_file.exists()
    assert [r.name for r in list_sessions(cat, "b")] == ["chat"] and result.moved


def test_a_session_without_sidecar_moves_alone(two):
    cat, a, b = two
    park_file(cat, a, "plain", sidecar=False)
    result = move(cat, "plain")
    assert result.record.sidecar_file is None
    assert folder_names(b.slot_save_path) == [result.record.state_file]


def test_a_stray_sidecar_at_the_target_never_pairs_with_the_moved_file(two):
    cat, a, b = two
    park_file(cat, a, "plain", sidecar=False)
    stray = Path(b.slot_save_path) / "plain.bin.ckpt"  # left by some old save: no state file of its own
    stray.write_bytes(b"PKCL stale")
    result = move(cat, "plain")
    assert result.record.state_file == "plain-2.bin" and stray.read_bytes() == b"PKCL stale"


def test_a_task_cancelled_while_the_target_commits_waits_for_the_commit(two):
    """The commit renames and lists together: a cancellation arriving then waits for its outcome,
    tells on_committed (both copies exist: the source was not deleted) and goes on as a cancellation."""
    cat, a, b = two
    rec = park_file(cat, a, "chat")
    started, release = asyncio.Event(), asyncio.Event()

    class SlowTarget(LocalEndpoint):
        async def commit(self, manifest):
            started.set()
            await release.wait()
            return await super().commit(manifest)

    seen = []

    async def go():
        task = asyncio.create_task(move_session(LocalEndpoint(cat, "a"), "chat", SlowTarget(cat, "b"),
                                                on_committed=seen.append))
        await started.wait()
        task.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    [result] = seen
    assert result.target == "profile 'b'" and not result.moved and result.record.name == "chat"
    assert cat.get("a", "chat") is not None and rec.state_path.is_file()
    [there] = cat.list("b")
    assert digest(there.state_path) == digest(rec.state_path)
    assert [p for p in cat.list_pending() if p[1] == "move-in"] == []
