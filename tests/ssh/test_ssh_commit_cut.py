"""A move to a host cut during its commit, at every step of it, over a real SSH connection
(tests/ssh/conftest.py): the commit in the move's host process (``sessions move-host``) stops at the step
(tests/ssh/host_pause.py says where it is and blocks), the test SIGKILLs the server side of that
connection (its sshd processes) and either the receiving process too, or lets it go on. The
sender, its commit's answer lost, asks the host on a new connection what became of the move
(``receive --abort ID``: app.sessions.move_in.settle_move) and deletes its source only when the
host listed the session. Whatever the step: exactly one listed copy, and the move says which.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib

import psutil
import pytest

from app.move.endpoints import LocalEndpoint, RemoteEndpoint
from app.move.transfer import move_session
from app.move.values import MoveError
from tests.ssh.conftest import connection_processes
from tests.ssh.host_pause import POINTS
from tests.ssh.test_ssh_move import remote_profile
from tests.unit.move_helpers import model_file, open_catalog, park_file, profile

#: where a killed commit ends: rolled back (the source is kept) or listed (the source is deleted)
LISTED_WHEN_KILLED = {"verified": False, "journaled": False, "sidecar-placed": False, "renamed": False,
                      "listed": True, "answered": True}


@pytest.mark.parametrize("receiver", ["killed", "goes-on"])
@pytest.mark.parametrize("point", POINTS)
def test_a_move_cut_during_its_commit_ends_with_one_listed_copy(sshd, tmp_path, point, receiver):
    model = model_file(tmp_path)
    a = profile(tmp_path, "a", model)
    r = remote_profile(sshd, model, "cut")
    fifos = sshd.remote_home / "pause"
    sshd.run("sh", "-c", 'mkdir -p "$1" && rm -f "$1/at" "$1/go" && mkfifo "$1/at" "$1/go"', "sh", str(fifos))
    wrapper = sshd.remote_home / f"kv-valet-paused-{point}"
    sshd.write(wrapper, f'#!/bin/sh\nexec python -m tests.ssh.host_pause {point} {fifos} "$@"\n', mode="755")
    cat = open_catalog()
    rec = park_file(cat, a, "chat")  # a state file and its sidecar: every rename step exists
    digest = hashlib.sha256(rec.state_path.read_bytes()).hexdigest()

    async def cut_at_the_point() -> str:
        line = (await asyncio.to_thread(sshd.run, "cat", str(fifos / "at"))).stdout.decode().split()
        assert line[:2] == ["at", point], line
        pid = int(line[2])
        server_side = [psutil.Process(p) for p in connection_processes(sshd, pid)]
        for p in server_side:  # the connection's server side, as when the network or sshd goes
            with contextlib.suppress(psutil.NoSuchProcess):  # the monitor exits when its child is killed
                p.kill()
        psutil.wait_procs(server_side, timeout=30)
        if receiver == "killed":
            psutil.Process(pid).kill()
        else:  # the receiving process lives on, its output going nowhere, and finishes or fails
            await asyncio.to_thread(sshd.run, "sh", "-c", 'echo go > "$1"', "sh", str(fifos / "go"))
        return line[1]

    async def go():
        async with sshd.remote_host(kv_valet=str(wrapper)) as host:
            cutter = asyncio.create_task(cut_at_the_point())
            try:
                result = await move_session(LocalEndpoint(cat, "a"), "chat", RemoteEndpoint(host, "box", "cut"))
                error = None
            except MoveError as e:
                result, error = None, e
            assert await cutter == point
        async with sshd.remote_host() as host:  # a fresh connection, the plain kv-valet
            there = await host.run_cli(["sessions", "list", "--profile", "cut", "--json"])
        return result, error, there

    try:
        result, error, there = asyncio.run(go())
        here = cat.get("a", "chat")
        # exactly one listed copy, whole
        assert (here is not None) + len(there) == 1, (here, there, error)
        if there:
            [t] = there
            assert result is not None and result.moved and error is None
            assert result.record.name == t["name"] == "chat" and result.record.state_file == t["state_file"]
            assert any("had listed 'chat'" in w for w in result.warnings), result.warnings  # said so
            assert sshd.sha256(f"{t['save_dir']}/{t['state_file']}") == digest
            assert not rec.state_path.exists()
        else:
            assert result is None and "rolled it back" in str(error) and "'chat' is kept at profile 'a'" in str(error)
            assert hashlib.sha256(here.state_path.read_bytes()).hexdigest() == digest
            assert [n for n in sshd.listdir(r.slot_save_path)] == []  # nothing left there
        if receiver == "killed":
            assert bool(there) is LISTED_WHEN_KILLED[point]
        elif point != "verified":  # it held the files lock: the host's answer waited for its commit
            assert there
    finally:
        cat.close()
