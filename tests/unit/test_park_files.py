"""A park knows what it wrote (issue #36 item 1): the one decision and its words (app.core.park_files),
the files read at a park and before a resume (app.sessions.files_check), the catalog's migration,
the verdict's rollback reason and doctor's finding."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from app.core.checkpoints import CheckpointFigures
from app.core.confirmation import NeedsConfirmation
from app.core.park_files import (NOT_RECORDED, FilesStatus, FoundFile, ParkedFile, ParkedFiles, compare,
                                 foreign_rollback)
from app.core.verdict import Reuse, VerdictKind, judge
from app.server.sidecar import Checkpoint, write_pkcl
from app.sessions import files_check
from app.store.catalog import SCHEMA_VERSION, Catalog, SessionRecord

X_POSITIONS = ((1024, 0, 1023), (1536, 512, 1535), (1924, 900, 1923))
Y_POSITIONS = ((1024, 0, 1023), (2048, 1024, 2047), (2186, 1162, 2185))


def _parked(positions=Y_POSITIONS, sidecar_size=300) -> ParkedFiles:
    return ParkedFiles((ParkedFile("", 1000, "a" * 64), ParkedFile(".ckpt", sidecar_size, "b" * 64, positions)))


def _found(positions=Y_POSITIONS, sha="b" * 64, size=300, state_sha="a" * 64) -> dict[str, FoundFile]:
    return {"": FoundFile("", "Y.bin", 1000, state_sha), ".ckpt": FoundFile(".ckpt", "Y.bin.ckpt", size, sha, positions)}


# --------------------------------------------------------------------------- the decision and its words


def test_another_chats_sidecar_is_named_with_both_last_positions():
    check = compare(_parked(), _found(positions=X_POSITIONS, sha=None))
    assert check.status is FilesStatus.CHANGED and check.refuses
    assert check.problems == ("not the sidecar this session parked (Y.bin.ckpt): last checkpoint at 1,923, "
                              "parked with 2,185",)
    assert check.sentence == check.problems[0]


def test_the_parked_files_pass_and_say_what_was_compared():
    check = compare(_parked(), _found())
    assert check.status is FilesStatus.AS_PARKED and not check.refuses
    assert check.sentence == "as parked (size, SHA-256 and checkpoint positions)"


def test_not_recorded_never_refuses():
    check = compare(None, {})
    assert check.status is FilesStatus.NOT_RECORDED and not check.refuses
    assert check.sentence == NOT_RECORDED and "not recorded" in check.sentence


@pytest.mark.parametrize("found, words", [
    (_found(size=301), "301 bytes, parked with 300"),
    (_found(sha="c" * 64), "the same size but other bytes (SHA-256 cccccccccccc…, parked with bbbbbbbbbbbb…)"),
    (_found(state_sha="d" * 64), "not the state file this session parked (Y.bin): the same size but other bytes"),
    (_found(positions=Y_POSITIONS[:2] + ((2186, 1100, 2185),)),
     "checkpoints at other positions than parked (the last at 2,185 in both)"),
    (_found(positions=Y_POSITIONS + ((2186, 1200, 2185),)), "4 checkpoints, parked with 3"),
])
def test_each_kind_of_other_file_is_refused_with_its_figures(found, words):
    check = compare(_parked(), found)
    assert check.refuses and words in check.sentence


def test_a_sidecar_where_the_park_had_none_is_refused():
    parked = ParkedFiles((ParkedFile("", 1000, "a" * 64),))
    check = compare(parked, _found(positions=X_POSITIONS))
    assert check.refuses
    assert check.problems == ("not the sidecar this session parked (Y.bin.ckpt): the park had no sidecar, this "
                              "one's last checkpoint is at 1,923",)


def test_a_gone_sidecar_is_said_but_not_refused_and_a_gone_state_file_is_refused():
    gone_sidecar = compare(_parked(), {"": _found()[""]}, state_name="Y.bin")
    assert not gone_sidecar.refuses and gone_sidecar.status is FilesStatus.AS_PARKED
    assert "the sidecar this session parked is gone (Y.bin.ckpt; parked with its last checkpoint at 2,185)" \
        in gone_sidecar.sentence
    assert compare(_parked(), {}, state_name="Y.bin").problems[0] == \
        "the state file this session parked is gone (Y.bin)"


def test_a_changed_file_not_hashed_is_not_verified_yet_not_refused():
    check = compare(_parked(), _found(sha=None))
    assert check.status is FilesStatus.NOT_VERIFIED and not check.refuses
    assert "changed on disk since it was last verified" in check.sentence


_positions = st.lists(st.tuples(st.integers(0, 2**40), st.integers(0, 2**31 - 1), st.integers(0, 2**31 - 1)),
                      max_size=5).map(tuple)
_file = st.builds(ParkedFile, st.sampled_from(["", ".ckpt", ".checkpoints"]), st.integers(0, 2**50),
                  st.text("0123456789abcdef", min_size=64, max_size=64), st.none() | _positions)


@given(st.lists(_file, min_size=1, max_size=3, unique_by=lambda f: f.suffix))
def test_the_catalog_text_reads_back_as_written(files):
    files = [ParkedFile("", files[0].size, files[0].sha256)] + [f for f in files if f.suffix]
    parked = ParkedFiles(tuple(sorted(files, key=lambda f: f.suffix)))
    assert ParkedFiles.from_json(parked.to_json()) == parked


@given(st.text(max_size=60))
def test_any_other_text_is_not_recorded_never_an_error(text):
    got = ParkedFiles.from_json(text)
    assert got is None or got.get("") is not None


# --------------------------------------------------------------------------- the rollback a restore got


def test_a_rollback_to_a_position_the_park_never_had_is_named():
    words = foreign_rollback(900, 1923, 2197, Y_POSITIONS)
    assert words == ("the server rolled back to a checkpoint at token 1,923, a position this park never had "
                     "(its sidecar's checkpoints end at 1,023, 2,047, 2,185): that checkpoint is another save's, "
                     "so the reused state may be another chat's")
    assert foreign_rollback(1162, 2185, 2197, Y_POSITIONS) is None  # its own
    assert foreign_rollback(0, 2196, 2197, Y_POSITIONS) is None  # the tip of the restored tokens
    assert foreign_rollback(900, 1923, 2197, None) is None  # not recorded: no claim
    assert "parked without checkpoints" in foreign_rollback(900, 1923, 2197, ())


def test_the_verdict_reason_calls_out_the_foreign_rollback():
    cp = CheckpointFigures(pos_min=900, pos_max=1923, n_tokens=1924, n_past=1923)
    v = judge(Reuse(2197, 1923, 285, restored=True, checkpoint_restored=cp, parked_positions=Y_POSITIONS))
    assert v.kind is VerdictKind.PARTIAL
    assert "a position this park never had" in v.reason and v.figures["foreign_rollback"] == 1923
    own = judge(Reuse(2197, 2185, 20, restored=True, checkpoint_restored=CheckpointFigures(
        pos_min=1162, pos_max=2185, n_past=2185), parked_positions=Y_POSITIONS))
    assert "never had" not in own.reason and "foreign_rollback" not in own.figures


# --------------------------------------------------------------------------- the files on disk


def _write_park(folder: Path, name: str, positions, n_tokens=2197, state_bytes=b"S" * 1000) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    state = folder / name
    state.write_bytes(state_bytes)
    write_pkcl(str(state) + ".ckpt", [(Checkpoint(n, lo, hi, 4, 0), b"t" * 4, b"") for n, lo, hi in positions])
    return state


@pytest.fixture
def catalog(tmp_path):
    c = Catalog(tmp_path / "catalog.sqlite3")
    yield c
    c.close()


def _record(catalog: Catalog, state: Path, name: str, **kw) -> SessionRecord:
    parked = files_check.digest(state)
    rec = catalog.add_or_replace(SessionRecord(name=name, profile="p", state_file=state.name,
                                               save_dir=str(state.parent), parked_files=parked.to_json(), **kw))
    files_check.stamp_files(catalog, rec)
    return catalog.get_by_id(rec.id)


def test_digest_keeps_sizes_hashes_and_positions(tmp_path):
    state = _write_park(tmp_path, "Y.bin", Y_POSITIONS)
    parked = files_check.digest(state)
    assert [f.suffix for f in parked.files] == ["", ".ckpt"]
    assert parked.get(".ckpt").checkpoints == Y_POSITIONS
    assert parked.get("").size == 1000 and len(parked.get("").sha256) == 64
    assert parked.positions() == Y_POSITIONS


def test_the_issues_case_on_disk_then_the_right_file_back(tmp_path, catalog):
    x = _write_park(tmp_path, "X.bin", X_POSITIONS)
    y = _write_park(tmp_path, "Y.bin", Y_POSITIONS)
    rec_y = _record(catalog, y, "Y")
    assert files_check.look(catalog, rec_y).status is FilesStatus.AS_PARKED
    original = (tmp_path / "Y.bin.ckpt").read_bytes()
    shutil.copyfile(str(x) + ".ckpt", str(y) + ".ckpt")  # X's sidecar copied over Y's
    check = files_check.look(catalog, catalog.get_by_id(rec_y.id))
    assert check.refuses and check.problems[0].endswith("last checkpoint at 1,923, parked with 2,185")
    with pytest.raises(NeedsConfirmation) as e:
        files_check.confirm(catalog, catalog.get_by_id(rec_y.id), False, "the check")
    assert "not the sidecar this session parked (Y.bin.ckpt)" in e.value.warnings[0]
    assert files_check.confirm(catalog, catalog.get_by_id(rec_y.id), True, "the check").refuses  # --yes
    (tmp_path / "Y.bin.ckpt").write_bytes(original)  # put back: same bytes, a new stamp, hashed once
    assert files_check.look(catalog, catalog.get_by_id(rec_y.id)).status is FilesStatus.AS_PARKED


def test_a_copy_that_keeps_the_mtime_is_still_hashed(tmp_path, catalog):
    """``cp -p`` of a same-size sidecar with the same positions: the stamp's ctime changed, so it is hashed."""
    y = _write_park(tmp_path, "Y.bin", Y_POSITIONS)
    rec = _record(catalog, y, "Y")
    ckpt = Path(str(y) + ".ckpt")
    before = ckpt.stat()
    data = bytearray(ckpt.read_bytes())
    data[-3] ^= 0xFF  # a payload byte: same size, same positions
    ckpt.write_bytes(bytes(data))
    os.utime(ckpt, ns=(before.st_atime_ns, before.st_mtime_ns))
    rec = catalog.get_by_id(rec.id)
    assert files_check.look(catalog, rec, hash_changed=False).status is FilesStatus.NOT_VERIFIED
    check = files_check.look(catalog, rec)
    assert check.refuses and "the same size but other bytes" in check.sentence


def test_an_unchanged_file_is_not_read_again(tmp_path, catalog, monkeypatch):
    rec = _record(catalog, _write_park(tmp_path, "Y.bin", Y_POSITIONS), "Y")

    def no_reads(*_a, **_k):
        raise AssertionError("read a file whose stamp did not change")

    monkeypatch.setattr(files_check, "sha256_of", no_reads)
    monkeypatch.setattr(files_check, "read_facts", no_reads)
    assert files_check.look(catalog, rec).status is FilesStatus.AS_PARKED


def test_an_unchanged_park_is_told_from_its_stamps_and_a_changed_one_is_left_to_look(tmp_path, catalog):
    """look_unchanged (a restore's path, on the event loop): the same answer as look while no file of the
    park was written since it was verified, from stamps alone; None (look must read) as soon as one was,
    or a sidecar came or went."""
    y = _write_park(tmp_path, "Y.bin", Y_POSITIONS)
    rec = _record(catalog, y, "Y")
    quick = files_check.look_unchanged(rec)
    assert quick is not None and quick == files_check.look(catalog, rec)
    assert quick.status is FilesStatus.AS_PARKED
    ckpt = Path(str(y) + ".ckpt")
    x = _write_park(tmp_path / "x", "X.bin", X_POSITIONS)
    shutil.copyfile(str(x) + ".ckpt", ckpt)  # another chat's sidecar over this one's
    assert files_check.look_unchanged(catalog.get_by_id(rec.id)) is None
    assert files_check.look(catalog, catalog.get_by_id(rec.id)).refuses
    ckpt.unlink()  # gone
    assert files_check.look_unchanged(catalog.get_by_id(rec.id)) is None
    bare = _record(catalog, _write_park(tmp_path / "b", "B.bin", ()), "B")
    Path(str(bare.state_path) + ".checkpoints").write_bytes(b"x")  # a sidecar where the park had none
    assert files_check.look_unchanged(catalog.get_by_id(bare.id)) is None


def test_recheck_shows_the_foreign_sidecar_as_invalid_with_the_parks_sentence(tmp_path, catalog):
    from app.sessions.sidecar_check import recheck

    x = _write_park(tmp_path, "X.bin", X_POSITIONS)
    y = _write_park(tmp_path, "Y.bin", Y_POSITIONS)
    rec = _record(catalog, y, "Y")
    rec = catalog.get_by_id(rec.id)
    rec.memory_kind = "sliding-window"
    shutil.copyfile(str(x) + ".ckpt", str(y) + ".ckpt")
    shown = recheck(catalog, rec, verify_hash=False)
    assert shown.sidecar_status == "invalid"
    assert shown.sidecar_reason == "not the sidecar this session parked (Y.bin.ckpt): last checkpoint at 1,923, " \
                                   "parked with 2,185"


# --------------------------------------------------------------------------- the catalog


def test_an_older_catalog_is_migrated_and_its_parks_are_not_recorded(tmp_path):
    path = tmp_path / "old.sqlite3"
    with Catalog(path) as c:
        c.add_or_replace(SessionRecord(name="old", profile="p", state_file="old.bin", save_dir=str(tmp_path)))
    raw = sqlite3.connect(path)  # back to version 4: the columns this version added are gone
    raw.execute("ALTER TABLE sessions DROP COLUMN parked_files")
    raw.execute("ALTER TABLE sessions DROP COLUMN files_verified")
    raw.execute("PRAGMA user_version = 4")
    raw.commit()
    raw.close()
    (tmp_path / "old.bin").write_bytes(b"S" * 10)
    with Catalog(path) as c:
        assert c.schema_version == SCHEMA_VERSION == 5
        rec = c.get("p", "old")
        assert rec.parked_files == "" and rec.files_verified == ""
        check = files_check.look(c, rec)
        assert check.status is FilesStatus.NOT_RECORDED and not check.refuses
        files_check.confirm(c, rec, False, "the resume")  # never refused


def test_a_repark_forgets_the_old_stamps(tmp_path, catalog):
    rec = _record(catalog, _write_park(tmp_path, "Y.bin", Y_POSITIONS), "Y")
    assert json.loads(rec.files_verified)
    again = catalog.add_or_replace(SessionRecord(name="Y", profile="p", state_file="Y.bin", save_dir=str(tmp_path),
                                                 parked_files=rec.parked_files))
    assert again.id == rec.id and again.files_verified == ""


# --------------------------------------------------------------------------- doctor


def test_doctor_names_a_park_whose_sidecar_is_not_its_own():
    from app.core.profile import LaunchProfile
    from app.core.rules import Facts, diagnose

    facts = Facts(foreign_parks=("'Y': not the sidecar this session parked (Y.bin.ckpt): last checkpoint at "
                                 "1,923, parked with 2,185",))
    found = [f for f in diagnose(LaunchProfile(name="p", model="/m.gguf"), facts) if f.rule_id == "park-files-changed"]
    assert len(found) == 1
    assert found[0].message.startswith("1 parked session of this profile holds files that are not the ones parked: "
                                       "'Y': not the sidecar this session parked (Y.bin.ckpt)")
    assert not [f for f in diagnose(LaunchProfile(name="p", model="/m.gguf"), Facts())
                if f.rule_id == "park-files-changed"]


def test_doctor_facts_read_the_catalog(tmp_path, catalog):
    from app.tools.diagnose import _foreign_parks

    x = _write_park(tmp_path, "X.bin", X_POSITIONS)
    y = _write_park(tmp_path, "Y.bin", Y_POSITIONS)
    rec = _record(catalog, y, "Y")
    assert _foreign_parks(catalog, [rec]) == ()
    shutil.copyfile(str(x) + ".ckpt", str(y) + ".ckpt")
    assert _foreign_parks(catalog, [catalog.get_by_id(rec.id)]) == (
        "'Y': not the sidecar this session parked (Y.bin.ckpt): last checkpoint at 1,923, parked with 2,185",)


# --------------------------------------------------------------------------- the proxy and a move


def test_the_proxy_says_why_it_left_the_park_parked():
    from app.core.conversation import Cause
    from app.proxy.explain import FOREIGN_FILES, SlotContext, explain
    from tests.unit.test_proxy_explain import CUR, PREV

    named = "not the sidecar this session parked (p.bin.ckpt): last checkpoint at 1,923, parked with 2,185"
    e = explain(VerdictKind.MISS, PREV, CUR, SlotContext(avoided=f"{FOREIGN_FILES}: {named}", parked_as="proxy-p"),
                cache_n=0, reusable=1000)
    assert e.cause is Cause.PARK_NOT_ITS_OWN
    assert e.detail.startswith(f"The proxy did not restore 'proxy-p': {named}. Restoring it could answer from "
                               "another chat's state, so the prompt was processed anew and the park stays")


def test_a_move_refuses_another_chats_sidecar_before_copying_and_goes_on_with_yes(tmp_path, catalog):
    from app.move.facts import source_session
    from app.move.transfer import _files_problems

    x = _write_park(tmp_path, "X.bin", X_POSITIONS)
    y = _write_park(tmp_path, "Y.bin", Y_POSITIONS)
    rec = _record(catalog, y, "Y")
    assert source_session(catalog, "Y", "p").files_problems == []
    shutil.copyfile(str(x) + ".ckpt", str(y) + ".ckpt")
    src = source_session(catalog, "Y", "p")
    assert src.files_problems == [
        "not the sidecar this session parked (Y.bin.ckpt): last checkpoint at 1,923, parked with 2,185"]
    # another machine's source: its sizes before the copy, its bytes as they were sent
    src.files_problems = None
    assert _files_problems(src) == []  # same size: not claimed before the copy
    sent = [{"suffix": f.suffix, "size": f.size, "sha256": files_check.sha256_of(Path(f.path))} for f in src.files]
    assert "the same size but other bytes" in _files_problems(src, sent)[0]
    assert rec.parked_files == src.record.parked_files


def test_sessions_show_names_the_foreign_sidecar(tmp_path, capsys):
    from app import paths
    from app.cli import main as cli_main

    with Catalog(paths.catalog_path()) as cat:
        x = _write_park(tmp_path, "X.bin", X_POSITIONS)
        y = _write_park(tmp_path, "Y.bin", Y_POSITIONS)
        _record(cat, y, "Y", memory_kind="sliding-window", n_tokens=2197)
    assert cli_main(["sessions", "show", "Y"]) == 0
    assert "files:       as parked (size, SHA-256 and checkpoint positions)" in capsys.readouterr().out
    shutil.copyfile(str(x) + ".ckpt", str(y) + ".ckpt")
    assert cli_main(["sessions", "show", "Y"]) == 0
    out = capsys.readouterr().out
    named = "not the sidecar this session parked (Y.bin.ckpt): last checkpoint at 1,923, parked with 2,185"
    assert f"sidecar:     invalid (3 checkpoints): {named}" in out
    assert f"files:       {named} (a resume, check or move asks for --yes)" in out
    assert cli_main(["sessions", "show", "Y", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["files_check"]
    assert shown["refuses"] and shown["status"] == "not as parked" and shown["problems"] == [named]


def test_a_move_of_a_park_whose_sidecar_was_replaced_is_refused_then_goes_on_with_yes(tmp_path):
    """Between two profiles here: the replaced sidecar (same size, other bytes and positions) is named
    before anything is copied; ``force`` (``--yes``) moves it, saying so, and the files arrive as they are."""
    import asyncio

    from app.move.endpoints import LocalEndpoint
    from app.move.transfer import move_session
    from app.move.values import MoveRefused
    from tests.unit.move_helpers import model_file, open_catalog, park_file, profile

    model = model_file(tmp_path)
    a, b = profile(tmp_path, "a", model), profile(tmp_path, "b", model)
    with open_catalog() as cat:
        rec = park_file(cat, a, "chat")
        cat.add_or_replace(SessionRecord(**{**rec.__dict__, "id": None,
                                            "parked_files": files_check.digest(rec.state_path).to_json()}))
        ckpt = Path(str(rec.state_path) + ".ckpt")
        other = Checkpoint(n_tokens=100, pos_min=0, pos_max=99, size_tgt=0, size_dft=0)
        write_pkcl(str(ckpt), [(other, os.urandom(50_000), b"")])  # another save's sidecar, the same size

        def go(**kw):
            return asyncio.run(move_session(LocalEndpoint(cat, "a"), "chat", LocalEndpoint(cat, "b"), **kw))

        with pytest.raises(MoveRefused) as refused:
            go()
        assert refused.value.reasons == ["not the sidecar this session parked (chat.bin.ckpt): last checkpoint at "
                                         "99, parked with 289 (move it anyway with --yes, or park the chat again)"]
        assert cat.get("b", "chat") is None and cat.get("a", "chat") is not None
        result = go(force=True)
        assert result.moved and any("not the sidecar this session parked" in w for w in result.warnings)
        assert result.record.files_verified == ""  # the sender's stamps do not travel
