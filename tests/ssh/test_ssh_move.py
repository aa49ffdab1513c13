"""Moves to and from a host over a real SSH server (tests/ssh/conftest.py: another user, its own
network namespace and home): the remote side is the real ``kv-valet`` of this checkout, one
``kv-valet sessions move-host PROFILE`` process per move on the move's SSH connection
(app.move.host_side), and SFTP. Parked files without a server: the real-server move is
tests/real/test_real_move.py."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest

from app.core.profile import LaunchProfile
from app.move.endpoints import LocalEndpoint, RemoteEndpoint
from app.move.transfer import move_session
from app.move.values import MoveCancelled, MoveRefused
from tests.unit.move_helpers import model_file, open_catalog, park_file, profile


def remote_profile(sshd, model: Path, name: str, **kw) -> LaunchProfile:
    """A profile on the "other machine": its own config folder, save folder and copy of the model
    (the same bytes as ``model`` here, at the same path under the host's home), written through SSH."""
    kw = {"ctx_size": 4096, "parallel": 2, **kw}
    there = sshd.remote_home / "models" / model.name
    if not sshd.exists(there):
        sshd.put(model, there)
    p = LaunchProfile(name=name, model=str(there), server_binary="/nonexistent/llama-server",
                      slot_save_path=str(sshd.remote_home / f"{name}-slots") + "/", **kw)
    sshd.save_profile(p)
    sshd.mkdir(p.slot_save_path)
    return p


def sums(state: Path) -> dict[str, str]:
    return {s: hashlib.sha256(Path(str(state) + s).read_bytes()).hexdigest()
            for s in ("", ".ckpt") if Path(str(state) + s).exists()}


def test_move_there_and_back_over_ssh(sshd, tmp_path):
    model = model_file(tmp_path)
    a, b = profile(tmp_path, "a", model), profile(tmp_path, "b", model)
    r = remote_profile(sshd, model, "there")
    cat = open_catalog()
    rec = park_file(cat, a, "chat", hashed=True)  # as every park records them: the host checks against its sums
    before = sums(rec.state_path)
    runs = sshd.remote_home / "kv-valet-runs"  # each command the host's kv-valet is asked to run, a line
    wrapper = sshd.remote_home / "kv-valet-counted"
    sshd.write(wrapper, f'#!/bin/sh\necho "$*" >> {runs}\nexec kv-valet "$@"\n', mode="755")

    async def go():
        async with sshd.remote_host(kv_valet=str(wrapper)) as host:
            seen = []
            out = await move_session(LocalEndpoint(cat, "a"), "chat", RemoteEndpoint(host, "box", "there"),
                                     on_progress=lambda d, t: seen.append((d, t)), chunk=64 * 1024)
            listed = await host.run_cli(["sessions", "list", "--profile", "there", "--json"])
            back = await move_session(RemoteEndpoint(host, "box", "there"), "chat", LocalEndpoint(cat, "b"),
                                      new_name="chat again")
            after = await host.run_cli(["sessions", "list", "--profile", "there", "--json"])
            return out, seen, listed, back, after

    try:
        out, seen, listed, back, after = asyncio.run(go())
        assert out.moved and out.target == "box:there" and out.record.profile == "there"
        assert seen[-1] == (rec.state_size + rec.sidecar_size,) * 2
        [there] = listed
        assert there["name"] == "chat" and there["sidecar_status"] == "present" and there["n_tokens"] == rec.n_tokens
        assert Path(there["save_dir"]) == Path(r.slot_save_path) and there["model_path"] == r.model
        # here the source is gone; back here under another name, the same bytes
        assert cat.get("a", "chat") is None and back.moved and after == []
        assert back.record.name == "chat again" and back.record.notes == "copied from box:there"
        assert sums(back.record.state_path) == before
        assert sshd.listdir(r.slot_save_path) == []  # moved away again: nothing left there
        # one host process per move, whichever way (the lists are the test's own)
        assert sshd.read(runs).decode().splitlines() == ["sessions move-host there",
                                                          "sessions list --profile there --json"] * 2
    finally:
        cat.close()


def test_a_park_changed_here_since_it_was_parked_is_refused_by_the_hosts_check(sshd, tmp_path):
    """The sender does not hash a park that recorded its sums: the host's read-back is checked against
    them, and its answer says which file differs; the move is refused as a changed park, with the
    remedy, and nothing is left there. Forced, the sender hashes, and the file lands."""
    model = model_file(tmp_path)
    a = profile(tmp_path, "a", model)
    r = remote_profile(sshd, model, "there")
    cat = open_catalog()
    rec = park_file(cat, a, "chat", hashed=True)
    data = bytearray(rec.state_path.read_bytes())
    data[-1] ^= 0xFF  # the same size, other bytes
    rec.state_path.write_bytes(bytes(data))

    async def go(**kw):
        async with sshd.remote_host() as host:
            return await move_session(LocalEndpoint(cat, "a"), "chat", RemoteEndpoint(host, "box", "there"), **kw)

    try:
        with pytest.raises(MoveRefused) as e:
            asyncio.run(go())
        [reason] = e.value.reasons
        assert reason.startswith("the state file reached box:there with SHA-256 ") and "(move it anyway with --yes" in reason
        assert sshd.listdir(r.slot_save_path) == [] and cat.get("a", "chat") is not None
        forced = asyncio.run(go(force=True))
        assert forced.moved and any("the same size but other bytes" in w for w in forced.warnings)
        assert sshd.read(f"{r.slot_save_path}/{forced.record.state_file}") == bytes(data)
    finally:
        cat.close()


def test_an_interrupted_move_to_a_host_leaves_nothing_there(sshd, tmp_path):
    model = model_file(tmp_path)
    a = profile(tmp_path, "a", model)
    r = remote_profile(sshd, model, "stopped")
    cat = open_catalog()
    rec = park_file(cat, a, "chat")
    before = sums(rec.state_path)

    def stop(done, total):
        if done > total // 2:
            raise MoveCancelled("stopped")

    async def go():
        async with sshd.remote_host() as host:
            with pytest.raises(MoveCancelled):
                await move_session(LocalEndpoint(cat, "a"), "chat", RemoteEndpoint(host, "box", "stopped"),
                                   on_progress=stop, chunk=32 * 1024)
            return await host.run_cli(["sessions", "list", "--profile", "stopped", "--json"])

    try:
        assert asyncio.run(go()) == []
        assert sshd.listdir(r.slot_save_path) == []  # the temporary files were removed there
        assert cat.get("a", "chat") is not None and sums(rec.state_path) == before
    finally:
        cat.close()


def test_a_host_whose_profile_cannot_take_the_session_refuses_before_copying(sshd, tmp_path):
    model = model_file(tmp_path)
    a = profile(tmp_path, "a", model)
    r = remote_profile(sshd, model, "small", cache_type_v="q8_0", ctx_size=256)
    cat = open_catalog()
    park_file(cat, a, "chat")

    async def go():
        async with sshd.remote_host() as host:
            return await move_session(LocalEndpoint(cat, "a"), "chat", RemoteEndpoint(host, "box", "small"))

    try:
        with pytest.raises(MoveRefused) as e:
            asyncio.run(go())
        assert [p.rule for p in e.value.compat.refusals] == ["cache types", "slot context"]
        assert "box:small" in str(e.value)
        assert sshd.listdir(r.slot_save_path) == [] and cat.get("a", "chat") is not None
    finally:
        cat.close()
