"""Files and secrets on disk (issue #21, part 4), on the fake llama-server:

* every folder KV Valet creates (data, state, config, the save folder) is 0700 and every file
  it writes there 0600, the parked state file and sidecar (written by the server, with its
  umask) and the catalog (with its -wal and -shm) included;
* a symbolic link in the save folder that points outside it is never followed: not listed as a
  session, not parked over, not deleted through;
* a session name cannot put its file outside the save folder.
"""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import httpx
import pytest

from app import paths
from app import files as fileio
from app import settings as settings_mod
from app.core.profile import LaunchProfile
from app.sessions.park import ParkError, park_slot
from app.cli.connect import connect  # the one resolver, as `kv-valet park` reaches a profile
from app.sessions.service import ServiceError, SessionService
from app.sessions.records import delete_session, list_sessions
from app.server.launcher import make_supervisor, plan_launch
from app.server.statefile import write_state_file
from app.store.catalog import Catalog
from app.store.profiles import ProfileStore
from tests.conftest import free_port
from tests.fake_server.test_supervisor_fake import FAKE

PROMPT = "the quiet valet parks the cache " * 40


def modes(*roots: Path) -> dict[str, int]:
    """Every folder and file under ``roots`` (the roots included) -> its permission bits."""
    out = {}
    for root in roots:
        out[str(root)] = stat.S_IMODE(root.stat().st_mode)
        for dirpath, dirnames, filenames in os.walk(root):
            for n in dirnames + filenames:
                p = os.path.join(dirpath, n)
                out[p] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


def not_private(found: dict[str, int]) -> list[str]:
    return [f"{p}: {oct(m)}" for p, m in sorted(found.items())
            if m != (fileio.PRIVATE_DIR_MODE if os.path.isdir(p) else fileio.PRIVATE_FILE_MODE)]


@pytest.fixture
def fake_profile(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(64))
    return LaunchProfile(name="fake", model=str(model), server_binary=FAKE, port=free_port(), ctx_size=4096,
                         parallel=2)


async def fill(profile: LaunchProfile, slot: int) -> None:
    async with httpx.AsyncClient(base_url=profile.url, timeout=30, trust_env=False) as c:
        r = await c.post("/completion", json={"prompt": PROMPT, "id_slot": slot, "n_predict": 2,
                                              "cache_prompt": True})
        r.raise_for_status()


async def test_a_park_leaves_every_folder_0700_and_every_file_0600(fake_profile, monkeypatch):
    monkeypatch.setenv("FAKE_SIDECAR", "1")  # the server writes a checkpoint sidecar too
    old_umask = os.umask(0o022)  # the usual one: the server's files would be 0644, our folders 0755
    try:
        await _park_everything(fake_profile)
    finally:
        os.umask(old_umask)


async def _park_everything(fake_profile):
    ProfileStore().save(fake_profile)
    settings_mod.save(settings_mod.Settings(log_backups=2))
    plan = await asyncio.to_thread(plan_launch, fake_profile)
    sup = make_supervisor(plan)
    await sup.start()
    try:
        with Catalog(paths.catalog_path()) as cat:
            svc = await connect(cat, fake_profile.name)
            try:
                await fill(fake_profile, 0)
                await fill(fake_profile, 1)
                await svc.park(0, "chat")
                await svc.park_all("all", remember=True)  # the resume plan too
                assert svc.sessions()[0].sidecar_file
                data, state, config = paths.data_dir(), paths.state_dir(), paths.config_dir()
                found = modes(data, state, config)  # while the catalog is open: -wal and -shm
                assert any(p.endswith("catalog.sqlite3-wal") for p in found)
            finally:
                await svc.aclose()
    finally:
        await sup.aclose()
    save_dir = Path(plan.slot_save_path)
    parked = [p for p in found if p.startswith(str(save_dir))]
    assert any(p.endswith(".bin") for p in parked) and any(p.endswith(".bin.ckpt") for p in parked)
    for kind in ("catalog.sqlite3", "run", "resume-plans", "logs", "settings.toml", "fake.toml"):
        assert any(Path(p).name == kind or f"/{kind}/" in p for p in found), kind
    assert not_private(found) == []


def test_files_written_with_a_loose_umask_are_private_all_the_same(tmp_path):
    old = os.umask(0)
    try:
        fileio.write_private(tmp_path / "a" / "b" / "f.json", "{}")
        with fileio.open_private(tmp_path / "a" / "log", "a") as f:
            f.write("x")
        loose = tmp_path / "a" / "state.bin"
        loose.write_bytes(b"x")  # as a server with umask 0 writes it
        fileio.make_private(loose)
    finally:
        os.umask(old)
    assert not_private({k: v for k, v in modes(tmp_path / "a").items()}) == []


# -- symbolic links in the save folder ------------------------------------------------------------


def outside_state_file(tmp_path: Path) -> Path:
    """A valid state file outside every folder of KV Valet's: what a link points to."""
    secret = tmp_path / "elsewhere" / "precious.bin"
    secret.parent.mkdir()
    write_state_file(secret, list(range(50)), b"precious")
    return secret


def test_a_link_in_the_save_folder_is_not_listed_as_a_session(tmp_path):
    save_dir = tmp_path / "slots"
    save_dir.mkdir()
    target = outside_state_file(tmp_path)
    (save_dir / "stray.bin").symlink_to(target)
    with Catalog(paths.catalog_path()) as cat:
        assert list_sessions(cat) == []
        # a catalogued session whose file was replaced by a link out of the folder: not listed either
        add_session(cat, save_dir, "chat", "chat.bin")
        (save_dir / "chat.bin").symlink_to(target)
        assert list_sessions(cat) == []
        # a link that stays inside the folder is an ordinary session
        write_state_file(save_dir / "real.bin", [1, 2, 3], b"s")
        add_session(cat, save_dir, "inside", "inside.bin")
        (save_dir / "inside.bin").symlink_to(save_dir / "real.bin")
        assert [r.name for r in list_sessions(cat)] == ["inside"]
    assert target.read_bytes().endswith(b"precious")


def add_session(cat: Catalog, save_dir: Path, name: str, state_file: str):
    from app.store.catalog import SessionRecord

    return cat.add_or_replace(SessionRecord(name=name, profile="fake", state_file=state_file,
                                            save_dir=str(save_dir), n_tokens=50, state_size=1))


def test_deleting_a_session_whose_file_is_a_link_removes_the_link_not_its_target(tmp_path):
    save_dir = tmp_path / "slots"
    save_dir.mkdir()
    target = outside_state_file(tmp_path)
    side = target.with_name(target.name + ".ckpt")
    side.write_bytes(b"precious sidecar")
    before = target.read_bytes()
    with Catalog(paths.catalog_path()) as cat:
        add_session(cat, save_dir, "chat", "chat.bin")
        (save_dir / "chat.bin").symlink_to(target)
        (save_dir / "chat.bin.ckpt").symlink_to(side)
        delete_session(cat, "chat", "fake")
        assert cat.get("fake", "chat") is None
    assert sorted(os.listdir(save_dir)) == []  # the links are gone
    assert target.read_bytes() == before and side.read_bytes() == b"precious sidecar"


async def test_parking_over_a_link_is_refused_and_the_target_is_untouched(fake_server, tmp_path):
    from app.sessions.target import ServerTarget
    from app.server.client import LlamaClient

    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    target_file = outside_state_file(tmp_path)
    before = target_file.read_bytes()
    with fake_server() as (url, _):
        cat = Catalog(paths.catalog_path())
        t = await ServerTarget.connect(LlamaClient(url), cat, save_dir=tmp_path / "slots")
        t.profile_name = "fake"
        try:
            await t.client.completion(PROMPT, slot_id=0, n_predict=2)
            first = await park_slot(t, 0, "chat")
            state = tmp_path / "slots" / first.record.state_file
            state.unlink()
            state.symlink_to(target_file)  # the session's file swapped for a link out of the folder
            with pytest.raises(ParkError, match="symbolic link"):
                await park_slot(t, 0, "chat")
            # a new name whose file name is taken by a dangling link gets another file
            (tmp_path / "slots" / "fresh.bin").symlink_to(tmp_path / "nowhere.bin")
            fresh = await park_slot(t, 0, "fresh")
            assert fresh.record.state_file == "fresh-2.bin"
            assert (tmp_path / "slots" / "fresh.bin").is_symlink() and not (tmp_path / "nowhere.bin").exists()
        finally:
            await t.client.aclose()
            cat.close()
    assert target_file.read_bytes() == before
    assert sorted(p.name for p in target_file.parent.iterdir()) == ["precious.bin"]


# -- names that try to leave the folder -----------------------------------------------------------

HOSTILE_NAMES = ["../escape", "../../../../tmp/kvv-escape", "/etc/passwd", "/", "a/../../b", "x\0y", "\x01\x1b[2J",
                 "..", ".", "kvv-tmp-0123456789ab", "\u202egnp.exe", "é" * 300, "\U0001d49c" * 120 + ".b"]


async def test_hostile_session_names_park_inside_the_save_folder(fake_server, tmp_path):
    from app.sessions.target import ServerTarget
    from app.server.client import LlamaClient

    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    before = sorted(os.listdir(tmp_path))
    with fake_server() as (url, _):
        cat = Catalog(paths.catalog_path())
        t = await ServerTarget.connect(LlamaClient(url), cat, save_dir=tmp_path / "slots")
        t.profile_name = "fake"
        try:
            await t.client.completion(PROMPT, slot_id=0, n_predict=2)
            for name in HOSTILE_NAMES:
                res = await park_slot(t, 0, name)
                state = tmp_path / "slots" / res.record.state_file
                assert state.is_file() and state.resolve().parent == (tmp_path / "slots").resolve()
                assert cat.get("fake", name.strip() or name).state_file == res.record.state_file
            files = sorted(os.listdir(tmp_path / "slots"))
        finally:
            await t.client.aclose()
            cat.close()
    assert len([f for f in files if f.endswith(".bin")]) == len(HOSTILE_NAMES)
    assert not Path("/tmp/kvv-escape.bin").exists()
    # nothing appeared next to the save folder but KV Valet's own folders and the fake's files
    new = {p for p in os.listdir(tmp_path) if p not in before and not p.startswith(("server-", "model.gguf"))}
    assert new <= {"slots", "data", "state", "config"}
