"""``kv-valet COMMAND ... --host NAME``: the command run by the host's own kv-valet over a real sshd
on loopback (tests/ssh/conftest.py), with a real llama-server (Gemma 3 270M) on that host: park,
show, du, resume, status, doctor, rename and rm, each with the host's output and exit status as
they are. The host's profile sets no -c: a move to it learns what a slot holds from its running
server (the host's ``receive --describe`` asks it), as its ``status --json`` shows."""

from __future__ import annotations

import asyncio

import pytest

from app.core.profile import LaunchProfile
from app.move.endpoints import RemoteEndpoint
from tests.conftest import free_port
from tests.ssh.test_ssh_end_to_end import cli, cli_json, user_ssh  # noqa: F401  (user_ssh: fixture)

pytestmark = pytest.mark.real_server

CHAT = "The valet parks each car in a numbered bay and writes the bay on a ticket. " * 4


async def _fill_and_describe(sshd, there: LaunchProfile) -> int | None:
    """A chat in slot 0 of the host's server (through SSH channels); what a move to it sees."""
    async with sshd.remote_host() as host:
        async with host.llama_client(there.url) as client:
            await client.completion(CHAT, slot_id=0, n_predict=4)
        return (await RemoteEndpoint(host, "box", there.name).describe()).n_ctx_slot


def test_park_show_resume_and_the_rest_run_on_the_host(real_binary, real_model, user_ssh):
    sshd = user_ssh
    there = LaunchProfile(name="flags", model=real_model, server_binary=real_binary, port=free_port(), parallel=1,
                          slot_save_path=str(sshd.remote_home / "slots-flags") + "/")  # no -c
    assert there.ctx_size is None
    sshd.save_profile(there)
    started = cli_json("hosts", "start", "box", there.name, "--json")
    assert started["active"] is True and started["ready"] is True, started
    try:
        n_ctx_seen_by_a_move = asyncio.run(_fill_and_describe(sshd, there))
        up = cli("hosts", "status", "box", there.name)
        assert up.returncode == 0 and "health" in up.stdout.lower(), (up.stdout, up.stderr)
        status = cli_json("status", there.name, "--host", "box", "--json")
        assert status["health"] == "ok" and status["url"] == there.url
        [slot] = status["slots"]
        assert slot["n_ctx"] > 0 and n_ctx_seen_by_a_move == slot["n_ctx"]

        parked = cli("park", there.name, "--slot", "0", "--name", "chat", "--host", "box")
        assert parked.returncode == 0, parked.stderr
        assert parked.stdout.startswith("parked slot 0 as 'chat': ")

        shown = cli_json("sessions", "show", "chat", "--host", "box", "--json")
        assert shown["profile"] == there.name and shown["n_tokens"] > 0 and shown["history"] == []
        assert shown["save_dir"] == str(sshd.remote_home / "slots-flags")
        text = cli("sessions", "show", "chat", "--host", "box")
        assert text.returncode == 0 and text.stdout.startswith("name:        chat\nprofile:     flags\n")
        du = cli_json("sessions", "du", "--host", "box", "--json")
        assert list(du) == [there.name] and du[there.name]["sessions"] == 1

        resumed = cli("resume", there.name, "chat", "--slot", "0", "--yes", "--host", "box")
        assert resumed.returncode == 0, resumed.stderr
        assert resumed.stdout.startswith(f"resumed 'chat' into slot 0: {shown['n_tokens']:,} tokens in ")
        # a failure there is a failure here: its message on stderr, its exit status
        missing = cli("resume", there.name, "no-such-chat", "--host", "box")
        assert missing.returncode == 1 and missing.stdout == ""
        assert "no-such-chat" in missing.stderr and missing.stderr.startswith("error: ")

        doctor = cli("doctor", there.name, "--host", "box", "--json")
        assert doctor.returncode in (0, 1) and '"flags"' in doctor.stdout, doctor.stderr

        renamed = cli("sessions", "rename", "chat", "chat 2", "--host", "box")
        assert renamed.returncode == 0 and renamed.stdout == "renamed 'chat' to 'chat 2'\n", renamed.stderr
        removed = cli_json("sessions", "rm", "chat 2", "--host", "box", "--json")
        assert removed["deleted"] == "chat 2" and len(removed["files"]) >= 1
        assert cli_json("sessions", "list", "--host", "box", "--json") == []
    finally:
        stopped = cli_json("hosts", "stop", "box", there.name, "--json")
    assert stopped["active"] is False
    down = cli("status", there.name, "--host", "box")
    assert down.returncode == 1  # as `kv-valet status` says of a server that does not answer, there
    down_h = cli("hosts", "status", "box", there.name)
    assert down_h.returncode == 1, (down_h.stdout, down_h.stderr)  # the same exit status through `hosts`
    unknown = cli("park", there.name, "--host", "no-such-host")
    assert unknown.returncode == 1 and "no host named 'no-such-host'" in unknown.stderr
