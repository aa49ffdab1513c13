"""A real llama-server on the remote host: started through its unit path, watched through its
CLI, driven through SSH channels (nothing listens on a new port; its URL straight from here reaches
nothing: it is the host's loopback), parked there, stopped."""

from __future__ import annotations

import httpx
import psutil
import pytest

from app.core.profile import LaunchProfile
from tests.conftest import free_port

pytestmark = pytest.mark.real_server


def listening_ports() -> set[int]:
    """TCP ports this test process listens on."""
    return {c.laddr.port for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}


async def test_start_watch_park_and_stop_a_server_on_the_host(sshd, real_binary, real_model):
    slots = sshd.remote_home / "slots"
    profile = LaunchProfile(name="remote-real", model=real_model, server_binary=real_binary, port=free_port(),
                            ctx_size=1024, parallel=1, slot_save_path=str(slots) + "/")
    sshd.save_profile(profile)
    listening_before = listening_ports()
    async with sshd.remote_host() as host:
        started = await host.systemd("start", "remote-real")
        try:
            # no user manager in this container: the host says so and runs `kv-valet serve` detached
            assert started["manager"] == "detached" and "no systemd user manager" in started["note"]
            assert started["active"] is True and started["ready"] is True, started
            assert started["unit"] == "kv-valet-remote-real.service"

            status = await host.status("remote-real")
            assert status["health"] == "ok" and status["url"] == profile.url
            assert len(status["slots"]) == 1 and "gpu" in status and status["process"]["pid"] > 0
            assert [s["status"]["health"] for s in await host.servers() if s["profile"]["name"] == "remote-real"] \
                == ["ok"]

            async with host.llama_client(profile.url) as client:
                assert (await client.health()).ok
                await client.completion("The capital of France is", slot_id=0, n_predict=4)
                [slot] = await client.slots()
                assert slot["id"] == 0
                saved = await client.save_slot(0, "through-ssh.bin")
                assert saved["n_saved"] > 0 and saved["n_written"] > 0
                assert listening_ports() == listening_before  # HTTP went through SSH channels only
            # the same URL straight from this side reaches nothing: the server listens on the host's
            # own loopback, in its network namespace (the port was free here when the test chose it)
            async with httpx.AsyncClient(trust_env=False, timeout=10) as direct:
                with pytest.raises(httpx.ConnectError):
                    await direct.get(profile.url + "/health")
            sftp = await host.sftp()
            assert (await sftp.stat(str(slots / "through-ssh.bin"))).size == saved["n_written"]

            # the host's own park: a session in its catalog, listed through its CLI
            text = await host.run_cli_text(["park", "remote-real", "--slot", "0", "--name", "parked-there"])
            assert "parked-there" in text
            sessions = await host.sessions("remote-real")
            assert [s["name"] for s in sessions] == ["parked-there"]
            assert sessions[0]["n_tokens"] == saved["n_saved"] and sessions[0]["save_dir"] == str(slots)
        finally:
            stopped = await host.systemd("stop", "remote-real")
        assert stopped["active"] is False
        down = await host.status("remote-real")
        assert down["health"] != "ok"
