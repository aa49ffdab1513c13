"""The session list and `sessions show` look at the sidecar on disk each time."""

from __future__ import annotations

import struct

from app import paths
from app.cli import main as cli_main
from app.sessions.records import get_session, list_sessions
from app.core.states import SidecarStatus
from app.store.catalog import Catalog, SessionRecord
from tests.unit.test_sidecar import V2_CPS, fnv1a, write_v2


def pkcl_v1(path, n_tokens=2345, size=100):
    path.write_bytes(struct.pack("<III", 0x4C434B50, 1, 1) + struct.pack("<qiiQQ", n_tokens, 1321, 2344, size, 0)
                     + bytes(size))


def make_session(tmp_path) -> tuple[Catalog, SessionRecord]:
    folder = tmp_path / "slots"
    folder.mkdir()
    (folder / "chat.bin").write_bytes(b"qsgg" + bytes(500))
    pkcl_v1(folder / "chat.bin.ckpt")
    cat = Catalog(paths.catalog_path())
    rec = cat.add_or_replace(SessionRecord(
        name="chat", profile="p", state_file="chat.bin", save_dir=str(folder), n_tokens=2892,
        memory_kind="sliding-window", sidecar_status="present", sidecar_file="chat.bin.ckpt",
        sidecar_reason="1 checkpoint", sidecar_count=1, sidecar_size=(folder / "chat.bin.ckpt").stat().st_size))
    return cat, rec


def test_a_sidecar_removed_after_the_park_shows_as_missing(tmp_path, capsys):
    cat, rec = make_session(tmp_path)
    try:
        assert list_sessions(cat)[0].sidecar_status is SidecarStatus.PRESENT_VALID
        (tmp_path / "slots" / "chat.bin.ckpt").unlink()
        got = list_sessions(cat)[0]
        assert got.sidecar_status is SidecarStatus.MISSING and got.sidecar_count == 0 and got.sidecar_file is None
        assert cat.get("p", "chat").sidecar_status is SidecarStatus.MISSING  # stored, not only shown
    finally:
        cat.close()
    assert cli_main(["sessions", "list"]) == 0
    assert "sidecar missing" in capsys.readouterr().out


def test_a_v2_sidecar_of_an_older_save_is_named_stale_by_sessions_show(tmp_path, capsys):
    cat, rec = make_session(tmp_path)
    state = tmp_path / "slots" / "chat.bin"
    write_v2(state.with_name("chat.bin.ckpt"), fnv1a(b"another save"), V2_CPS)
    try:
        quick = get_session(cat, "chat")  # the window's refresh: headers only
        assert quick.sidecar_status is SidecarStatus.PRESENT_VALID and "not checked yet" in quick.sidecar_reason
    finally:
        cat.close()
    assert cli_main(["sessions", "show", "chat"]) == 0
    out = capsys.readouterr().out
    assert "sidecar:     invalid" in out and "stale" in out
    # the right hash: present, and the hash is cached until the state file changes
    write_v2(state.with_name("chat.bin.ckpt"), fnv1a(state.read_bytes()), V2_CPS)
    assert cli_main(["sessions", "show", "chat"]) == 0
    assert "sidecar:     present (2 checkpoints)" in capsys.readouterr().out
    with Catalog(paths.catalog_path()) as cat:
        assert "not checked" not in get_session(cat, "chat").sidecar_reason  # from the cache, no hashing
