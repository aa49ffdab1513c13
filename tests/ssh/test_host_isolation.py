"""The SSH tests' host is another machine as far as this side can tell (tests/ssh/conftest.py):
its server's URL is not reachable from here, its home is not readable from here (root included),
while the same request through the app's SSH channel and the same file through SFTP succeed.
If HTTP went straight to the server, or a test read the host's files directly, it would fail."""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest


HEALTH = {"status": "ok", "served_by": "the host"}


async def test_only_ssh_reaches_the_hosts_server_and_files(sshd):
    # a stand-in server on the host's own loopback (127.0.0.1 inside its network namespace), port 8080
    site = sshd.remote_home / "site"
    sshd.write(site / "health", json.dumps(HEALTH))
    secret = sshd.remote_home / ".config" / "kv-valet" / "profiles" / "secret.toml"
    sshd.write(secret, 'name = "secret"\n')
    server = await asyncio.create_subprocess_exec(
        *sshd.ssh_argv("sh", "-c", 'cd "$1" && echo "pid $$" && exec python -u -m http.server --bind 127.0.0.1 8080',
                       "sh", str(site)),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        pid = int((await server.stdout.readline()).split()[1])
        assert b"Serving HTTP on 127.0.0.1 port 8080" in await server.stdout.readline()  # listening
        url = "http://127.0.0.1:8080"

        # through the app's SSH channel (direct-tcpip to the host's loopback): it answers
        async with sshd.remote_host() as host:
            async with host.llama_client(url) as client:
                assert (await client.health()).ok
                assert await client._json("GET", "/health") == HEALTH
            sftp = await host.sftp()
            async with sftp.open(str(secret)) as f:
                assert await f.read() == 'name = "secret"\n'

        # straight from this side: neither this loopback (where nothing, or some other program,
        # listens on 8080) nor the host's address reaches it
        async with httpx.AsyncClient(trust_env=False, timeout=10) as c:
            for direct in (url, f"http://{sshd.host_addr}:8080"):
                try:
                    answer = (await c.get(direct + "/health")).text
                except httpx.TransportError:
                    answer = None
                assert answer is None or HEALTH["served_by"] not in answer, direct
            with pytest.raises(httpx.ConnectError):  # the host's address: nothing listens there but sshd
                await c.get(f"http://{sshd.host_addr}:8080/health")
        # and the host's home is an empty folder here, even for root
        assert os.getuid() == 0 and os.listdir(sshd.remote_home) == []
        assert not os.path.exists(secret) and sshd.exists(secret)
    finally:
        sshd.run("kill", str(pid), check=False)
        await server.wait()
