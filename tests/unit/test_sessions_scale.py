"""Many sessions: the sidecar re-check remembers its looks, disk usage, "delete older than".

Timing is the benchmark's job (tests/bench/bench_sessions_scale.py); these
tests pin down behaviour: what is read again and when, what a listing shows
after a file changed, what is counted and what is deleted.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from app import paths
from app.cli import main as cli_main
from app.sessions import sidecar_check
from app.sessions.records import (DAY_S, delete_older_than, delete_session, describe_usage, disk_usage,
                               list_sessions, older_than, usage_of)
from app.core.states import SidecarStatus
from app.server.sidecar import Checkpoint, write_pkcl
from app.server.statefile import write_state_file
from app.store.catalog import Catalog, SessionRecord

NOW = 1_790_000_000.0  # a fixed "now" (2026-09-21)
PROFILES = ("gemma", "qwen", "llama")


def write_pkcl_sidecar(state: Path, n_tokens: int, count: int = 1, payload: int = 64) -> int:
    return write_pkcl(Path(str(state) + ".ckpt"), [
        (Checkpoint(n_tokens - 100 * k - 1, n_tokens - 100 * k - 50, n_tokens - 100 * k - 2, payload, 0),
         b"t" * payload, b"") for k in range(count)])


def park_many(cat: Catalog, n: int, *, days_apart: float = 1.0, now: float = NOW,
              profiles=PROFILES, sidecar_every: int = 2) -> list[SessionRecord]:
    """``n`` sessions, session ``i`` parked ``i * days_apart`` days before ``now`` (files' mtimes too):
    real state files; every ``sidecar_every``-th one a sliding-window model with a PKCL sidecar."""
    out = []
    for i in range(n):
        profile = profiles[i % len(profiles)]
        folder = paths.sessions_dir(profile)
        folder.mkdir(parents=True, exist_ok=True)
        state = folder / f"s{i:03d}.bin"
        n_tokens = 600 + 37 * i
        write_state_file(state, list(range(n_tokens)), bytes(1000 + i))
        swa = i % sidecar_every == 0
        side = write_pkcl_sidecar(state, n_tokens) if swa else 0
        parked = now - i * days_apart * DAY_S - 60
        for p in (state, Path(str(state) + ".ckpt")):
            if p.exists():
                os.utime(p, (parked, parked))
        out.append(cat.add_or_replace(SessionRecord(
            name=f"chat {i:03d}", profile=profile, state_file=state.name, save_dir=str(folder),
            state_size=state.stat().st_size, n_tokens=n_tokens, model_path=f"/models/{profile}-Q4_K_M.gguf",
            memory_kind="sliding-window" if swa else "dense",
            sidecar_status="present" if swa else "not needed",
            sidecar_file=state.name + ".ckpt" if swa else None, sidecar_size=side, sidecar_count=1 if swa else 0,
            sidecar_reason="", created_at=parked, updated_at=parked,
            last_verdict=("HIT", "PARTIAL", "DISCARDED", None)[i % 4])))
    return out


@pytest.fixture
def cat():
    sidecar_check.forget()  # looks remembered by another test's files must not count here
    c = Catalog(paths.catalog_path())
    yield c
    c.close()
    sidecar_check.forget()


@pytest.fixture
def header_reads(monkeypatch):
    """How many times a sidecar's headers were read (inspect_sidecar ran)."""
    calls: list[str] = []
    real = sidecar_check.inspect_sidecar

    def counting(state_path, *args, **kwargs):
        calls.append(os.fspath(state_path))
        return real(state_path, *args, **kwargs)

    monkeypatch.setattr(sidecar_check, "inspect_sidecar", counting)
    return calls


# -- the re-check remembers its looks ---------------------------------------------------------------


def test_a_second_listing_reads_no_header_when_no_file_changed(cat, header_reads):
    park_many(cat, 60)
    first = list_sessions(cat)
    assert len(first) == 60 and len(header_reads) == 60
    header_reads.clear()
    assert list_sessions(cat) == first
    assert header_reads == []


def test_a_changed_sidecar_is_read_again_and_shown(cat, header_reads):
    recs = park_many(cat, 6)
    list_sessions(cat)
    header_reads.clear()
    rec = recs[2]  # sliding-window, one checkpoint
    write_pkcl_sidecar(rec.state_path, rec.n_tokens, count=2)
    got = {r.name: r for r in list_sessions(cat)}
    assert header_reads == [str(rec.state_path)]
    assert got[rec.name].sidecar_count == 2 and got[rec.name].sidecar_status is SidecarStatus.PRESENT_VALID
    assert cat.get(rec.profile, rec.name).sidecar_count == 2  # stored, not only shown


def test_a_removed_sidecar_shows_as_missing_after_a_remembered_look(cat):
    recs = park_many(cat, 4)
    list_sessions(cat)
    Path(str(recs[0].state_path) + ".ckpt").unlink()
    got = {r.name: r for r in list_sessions(cat)}[recs[0].name]
    assert got.sidecar_status is SidecarStatus.MISSING and got.sidecar_file is None


def test_a_same_size_rewrite_that_keeps_the_mtime_is_still_seen(cat, header_reads):
    """In place, same size, mtime put back: the ctime in the stamp still changes."""
    recs = park_many(cat, 1)
    ckpt = Path(str(recs[0].state_path) + ".ckpt")
    list_sessions(cat)
    header_reads.clear()
    st = ckpt.stat()
    data = bytearray(ckpt.read_bytes())
    data[12:20] = (recs[0].n_tokens + 5000).to_bytes(8, "little")  # checkpoint 1 now claims too many tokens
    with open(ckpt, "r+b") as f:
        f.write(data)
    os.utime(ckpt, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert ckpt.stat().st_size == st.st_size and ckpt.stat().st_mtime_ns == st.st_mtime_ns
    got = list_sessions(cat)[0]
    assert header_reads == [str(recs[0].state_path)]
    assert got.sidecar_status is SidecarStatus.INVALID and "stale" in got.sidecar_reason


def test_a_replaced_state_file_is_looked_at_again(cat, header_reads):
    recs = park_many(cat, 1)
    list_sessions(cat)
    header_reads.clear()
    state = recs[0].state_path
    tmp = state.with_name("new.tmp")
    tmp.write_bytes(state.read_bytes())
    os.utime(tmp, (NOW, NOW))
    os.replace(tmp, state)  # a new inode, same bytes
    list_sessions(cat)
    assert header_reads == [str(state)]


def test_a_file_modified_just_now_is_not_remembered(cat, header_reads):
    """Within the timestamp granularity a same-size rewrite may not move the mtime: look again."""
    recs = park_many(cat, 1)
    ckpt = Path(str(recs[0].state_path) + ".ckpt")
    os.utime(ckpt, (time.time(), time.time()))
    list_sessions(cat)
    list_sessions(cat)
    assert len(header_reads) == 2
    os.utime(ckpt, (time.time() - 60, time.time() - 60))
    list_sessions(cat)
    list_sessions(cat)
    assert len(header_reads) == 3


# -- disk usage --------------------------------------------------------------------------------------


def test_disk_usage_per_profile_counts_a_shared_state_file_once(cat):
    recs = park_many(cat, 6)
    by_hand: dict[str, list[int]] = {}
    for r in recs:
        by_hand.setdefault(r.profile, [0, 0, 0])
        by_hand[r.profile][0] += 1
        by_hand[r.profile][1] += r.state_size
        by_hand[r.profile][2] += r.sidecar_size
    usage = disk_usage(cat)
    assert list(usage) == sorted(PROFILES)
    assert {p: [u.sessions, u.state_bytes, u.sidecar_bytes] for p, u in usage.items()} == by_hand
    # a second session of "gemma" naming the same state file: one more session, no more bytes
    first = recs[0]
    cat.add_or_replace(SessionRecord(name="alias", profile=first.profile, state_file=first.state_file,
                                     save_dir=first.save_dir, state_size=first.state_size,
                                     sidecar_size=first.sidecar_size, created_at=NOW, updated_at=NOW))
    again = disk_usage(cat, first.profile)
    assert list(again) == [first.profile]
    assert again[first.profile].sessions == by_hand[first.profile][0] + 1
    assert again[first.profile].total_bytes == sum(by_hand[first.profile][1:])


def test_describe_usage_reads_as_the_summary_line(cat):
    u = usage_of([SessionRecord(name="a", profile="p", state_file="a", save_dir="/x", state_size=3 << 30,
                                sidecar_size=512 << 20),
                  SessionRecord(name="b", profile="p", state_file="b", save_dir="/x", state_size=1 << 30)])
    assert describe_usage("p", u) == "profile p: 2 sessions, 4.5 GiB (state files 4.0 GiB, sidecars 512.0 MiB)"
    assert describe_usage(None, u).startswith("total: 2 sessions")


# -- delete older than -------------------------------------------------------------------------------


def test_older_than_lists_the_sessions_parked_before_the_cutoff_oldest_first(cat):
    park_many(cat, 10)  # parked 0..9 days (and a minute) ago
    assert [r.name for r in older_than(cat, 7, now=NOW)] == ["chat 009", "chat 008", "chat 007"]
    assert [r.name for r in older_than(cat, 7, "qwen", now=NOW)] == ["chat 007"]
    assert older_than(cat, 30, now=NOW) == []
    with pytest.raises(ValueError):
        older_than(cat, -1, now=NOW)


def test_delete_older_than_removes_rows_then_files_and_keeps_the_rest(cat):
    recs = park_many(cat, 10)
    removed = delete_older_than(cat, 5.5, now=NOW)
    assert sorted(r.name for r in removed) == ["chat 006", "chat 007", "chat 008", "chat 009"]
    left = {r.name for r in cat.list()}
    assert left == {f"chat {i:03d}" for i in range(6)}
    for r in recs:
        files = [r.state_path, Path(str(r.state_path) + ".ckpt")]
        if r.name in left:
            assert r.state_path.is_file()
        else:
            assert not any(p.exists() for p in files)
            assert cat.history(r.id) == []


def test_delete_older_than_in_one_profile_and_a_shared_state_file_stays(cat):
    recs = park_many(cat, 9)
    old = recs[8]  # "llama", 8 days old
    keeper = cat.add_or_replace(SessionRecord(name="fresh alias", profile="gemma", state_file=old.state_file,
                                              save_dir=old.save_dir, state_size=old.state_size,
                                              created_at=NOW, updated_at=NOW))
    removed = delete_older_than(cat, 4, "llama", now=NOW)
    assert [r.name for r in removed] == ["chat 008", "chat 005"]
    assert {r.profile for r in cat.list()} == set(PROFILES)
    assert old.state_path.is_file()  # "fresh alias" still uses it
    assert not recs[5].state_path.exists()
    assert cat.get("gemma", keeper.name) is not None


def test_delete_session_still_removes_its_files(cat):
    recs = park_many(cat, 2)
    removed = delete_session(cat, "chat 000")
    assert set(removed) == {recs[0].state_path, Path(str(recs[0].state_path) + ".ckpt")}
    assert [r.name for r in cat.list()] == ["chat 001"]


# -- the CLI -----------------------------------------------------------------------------------------


def park_recent(days_apart: float = 1.0) -> list[SessionRecord]:
    """Sessions parked 0..5 days before the real now (the CLI's cutoff is the real clock's)."""
    with Catalog(paths.catalog_path()) as c:
        return park_many(c, 6, days_apart=days_apart, now=time.time())


def test_cli_rm_older_than_without_yes_lists_and_deletes_nothing(capsys):
    recs = park_recent()
    assert cli_main(["sessions", "rm", "--older-than", "3.5"]) == 0
    out = capsys.readouterr().out
    assert "chat 004" in out and "chat 005" in out and "chat 003" not in out
    assert "2 sessions parked before" in out and "pass --yes to delete" in out
    assert all(r.state_path.is_file() for r in recs)
    with Catalog(paths.catalog_path()) as c:
        assert len(c.list()) == 6


def test_cli_rm_older_than_yes_deletes_in_one_profile(capsys):
    recs = park_recent()
    assert cli_main(["sessions", "rm", "--older-than", "0.5", "--profile", "qwen", "--yes"]) == 0
    out = capsys.readouterr().out
    assert "deleted 2 sessions in profile 'qwen'" in out and "freed" in out
    with Catalog(paths.catalog_path()) as c:
        assert sorted(r.name for r in c.list()) == ["chat 000", "chat 002", "chat 003", "chat 005"]
    assert not recs[1].state_path.exists() and not recs[4].state_path.exists()
    assert recs[0].state_path.exists()


def test_cli_rm_needs_a_name_or_older_than_not_both(capsys):
    park_recent()
    assert cli_main(["sessions", "rm"]) == 2
    assert cli_main(["sessions", "rm", "chat 000", "--older-than", "1"]) == 2
    assert cli_main(["sessions", "rm", "--older-than", "-1"]) == 2
    assert cli_main(["sessions", "rm", "--older-than", "100"]) == 0
    assert "no session was parked before" in capsys.readouterr().out


def test_cli_du_prints_one_line_per_profile_and_the_total(capsys):
    recs = park_recent()
    assert cli_main(["sessions", "du"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["profile gemma", "profile llama", "profile qwen", "total"]
    assert lines[-1].startswith("total: 6 sessions, ")
    assert cli_main(["sessions", "du", "--profile", "qwen", "--json"]) == 0
    import json

    data = json.loads(capsys.readouterr().out)
    qwen = [r for r in recs if r.profile == "qwen"]
    assert data == {"qwen": {"sessions": 2, "state_bytes": sum(r.state_size for r in qwen),
                             "sidecar_bytes": sum(r.sidecar_size for r in qwen),
                             "total_bytes": sum(r.state_size + r.sidecar_size for r in qwen)}}
