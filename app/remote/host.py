"""One remote host, over SSH: its ``kv-valet`` CLI, SFTP, and HTTP to its loopback server.

* Host keys are verified as OpenSSH does: ``~/.ssh/known_hosts`` (and
  ``/etc/ssh/ssh_known_hosts``), hashed entries, markers and ``[host]:port`` entries
  included. An unknown host is refused with the remedy (``ssh HOST`` once, or
  ``ssh-keyscan``); a key that differs from the one known is refused loudly. Never
  auto-accepted.
* Authentication is SSH's: the agent, ``~/.ssh/config`` (aliases, User, Port,
  IdentityFile), the default keys, or the host's ``identity_file``.
* Commands: ``[kv_valet, *args]`` quoted with :func:`shlex.join` here, never text a
  user typed for the remote shell; ``--json`` output parsed.
* The server: :meth:`RemoteHost.llama_client` sends HTTP through SSH ``direct-tcpip``
  channels to the address as the host sees it (its loopback); nothing listens on a
  new port, on either machine.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
from pathlib import Path
from typing import Any, Iterable

import asyncssh

from app.core.states import Health
from app.remote.batched_writes import batch_writes
from app.remote.unit import unit_name
from app.server.client import LlamaClient
from app.store.hosts import HostConfig

__all__ = ["HostConfig", "RemoteError", "RemoteHost", "unit_name"]

CONNECT_TIMEOUT = 20.0
#: exit status of a shell that did not find the command
COMMAND_NOT_FOUND = 127


class RemoteError(Exception):
    """What failed on or on the way to a host, and the remedy, in the message.

    ``kind``: ``host-key-unknown``, ``host-key-changed``, ``auth``, ``unreachable``,
    ``timeout``, ``not-found`` (kv-valet missing on the host), ``command`` (it failed:
    ``exit_status`` and ``stderr``), ``output`` (it did not answer JSON)."""

    def __init__(self, message: str, *, kind: str = "command", host: str = "", exit_status: int | None = None,
                 stderr: str = "", output: Any = None):
        super().__init__(message)
        self.kind = kind
        self.host = host
        self.exit_status = exit_status
        self.stderr = stderr
        self.output = output  # parsed JSON the failed command printed, if any


def default_known_hosts() -> list[str]:
    """The files OpenSSH reads: the user's, then the system's, those that exist."""
    files = [Path.home() / ".ssh" / "known_hosts", Path("/etc/ssh/ssh_known_hosts")]
    return [str(f) for f in files if f.is_file()]


#: AES-GCM before asyncssh's own first choice (chacha20-poly1305, computed in Python's event loop
#: per packet): OpenSSL's AES-GCM made raw SFTP 1.2-1.7x faster here; the rest of asyncssh's
#: defaults follow, for a server that offers neither. A ``Ciphers`` line in the user's ssh config wins.
PREFERRED_CIPHERS = "^aes128-gcm@openssh.com,aes256-gcm@openssh.com"


def _config_sets_ciphers(files: list[str] | None) -> bool:
    """Whether an OpenSSH client config (``files``; None: ``~/.ssh/config``) names its ciphers anywhere:
    then asyncssh takes them from it, as ssh would."""
    paths = [os.path.expanduser("~/.ssh/config")] if files is None else files
    for path in paths:
        try:
            text = Path(path).read_text(errors="replace")
        except OSError:
            continue
        if any(line.strip().lower().startswith("ciphers") for line in text.splitlines()):
            return True
    return False


class RemoteHost:
    """One SSH connection to a host, made on first use (or by :meth:`connect`), reused by
    every command, the SFTP client and the server's HTTP channels. An async context manager."""

    def __init__(self, cfg: HostConfig, *, known_hosts: str | Iterable[str] | None = None,
                 ssh_config: Iterable[str] | None = None, use_agent: bool = True,
                 connect_timeout: float = CONNECT_TIMEOUT):
        """``known_hosts``: a file (or files) in OpenSSH's format; default ``~/.ssh/known_hosts``
        and ``/etc/ssh/ssh_known_hosts``. ``ssh_config``: OpenSSH client config files; None:
        ``~/.ssh/config`` as ssh reads it, ``[]``: none. ``use_agent``: offer the agent's keys."""
        self.cfg = cfg
        if known_hosts is None:
            self._known_hosts = default_known_hosts()
        elif isinstance(known_hosts, (str, os.PathLike)):
            self._known_hosts = [str(known_hosts)]
        else:
            self._known_hosts = [str(k) for k in known_hosts]
        self._ssh_config = None if ssh_config is None else list(ssh_config)
        self._use_agent = use_agent
        self._connect_timeout = connect_timeout
        self._conn: asyncssh.SSHClientConnection | None = None
        self._sftp: asyncssh.SFTPClient | None = None
        self._lock = asyncio.Lock()

    # -- the connection ----------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.cfg.name

    @property
    def label(self) -> str:
        return f"host '{self.cfg.name}' ({self.cfg.destination}{f':{self.cfg.port}' if self.cfg.port else ''})"

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.is_closed()

    @property
    def cipher(self) -> str | None:
        """The cipher the open connection sends with (None: not connected)."""
        return self._conn.get_extra_info("send_cipher") if self.connected else None

    async def connect(self) -> None:
        await self._connection()

    async def _connection(self) -> asyncssh.SSHClientConnection:
        async with self._lock:
            if self._conn is not None and not self._conn.is_closed():
                return self._conn
            self._conn, self._sftp = None, None
            self._conn = await self._open()
            batch_writes(self._conn)
            return self._conn

    def _options(self) -> dict[str, Any]:
        cfg = self.cfg
        opts: dict[str, Any] = {"known_hosts": self._load_known_hosts(), "connect_timeout": self._connect_timeout}
        if cfg.user:
            opts["username"] = cfg.user
        if cfg.port is not None:
            opts["port"] = cfg.port
        if cfg.identity_file:
            opts["client_keys"] = [os.path.expanduser(cfg.identity_file)]
        if not self._use_agent:
            opts["agent_path"] = None
        if self._ssh_config is not None:
            opts["config"] = self._ssh_config or None
        if not _config_sets_ciphers(self._ssh_config):
            opts["encryption_algs"] = PREFERRED_CIPHERS
        return opts

    def _load_known_hosts(self) -> asyncssh.SSHKnownHosts:
        """Every known_hosts file, read now (the user may have just added the key), as one list."""
        data = []
        for path in self._known_hosts:
            try:
                data.append(Path(path).read_bytes())
            except FileNotFoundError:
                continue
            except OSError as e:
                raise RemoteError(f"cannot read {path}: {e.strerror}", kind="host-key-unknown",
                                  host=self.cfg.name) from None
        try:
            return asyncssh.import_known_hosts(b"\n".join(data).decode("utf-8", "replace"))
        except (ValueError, asyncssh.Error) as e:
            raise RemoteError(f"{', '.join(self._known_hosts)}: not in known_hosts format ({e})",
                              kind="host-key-unknown", host=self.cfg.name) from None

    async def _open(self) -> asyncssh.SSHClientConnection:
        cfg = self.cfg
        if not self._known_hosts:
            raise self._unknown_key("no known_hosts file (~/.ssh/known_hosts) to check its key against")
        try:
            return await asyncssh.connect(cfg.hostname, **self._options())
        except asyncssh.HostKeyNotVerifiable as e:
            if self._has_known_key():
                raise RemoteError(
                    f"REFUSED: the host key of {self.label} is not the one in {', '.join(self._known_hosts)}. "
                    "Someone may be intercepting the connection (or the host was reinstalled). Check the key "
                    "with the host's owner; if it really changed, remove the old entry with "
                    f"`ssh-keygen -R {self._known_hosts_pattern()}` and connect once with `ssh {self._ssh_hint()}`.",
                    kind="host-key-changed", host=cfg.name) from None
            raise self._unknown_key(str(e)) from None
        except asyncssh.PermissionDenied as e:
            raise RemoteError(
                f"authentication failed for {self.label}: {e.reason or e}. KV Valet logs in as `ssh "
                f"{self._ssh_hint()}` does: load your key into the agent (ssh-add), install it on the host "
                "(ssh-copy-id), or set identity_file for the host (kv-valet hosts add --identity-file).",
                kind="auth", host=cfg.name) from None
        except asyncssh.Error as e:
            raise RemoteError(f"SSH to {self.label} failed: {e.reason if hasattr(e, 'reason') else e}",
                              kind="unreachable", host=cfg.name) from None
        except (asyncio.TimeoutError, TimeoutError):
            raise RemoteError(f"SSH to {self.label}: no answer in {self._connect_timeout:.0f} s (host down or "
                              "a firewall?)", kind="timeout", host=cfg.name) from None
        except OSError as e:
            raise RemoteError(f"cannot reach {self.label}: {e.strerror or e} (is sshd running there, and the "
                              "name and port right?)", kind="unreachable", host=cfg.name) from None

    def _unknown_key(self, detail: str) -> RemoteError:
        return RemoteError(
            f"REFUSED: the host key of {self.label} is not known ({detail}). KV Valet never accepts a key "
            f"by itself: connect once with `ssh {self._ssh_hint()}` and check the fingerprint it shows, or "
            f"add it with `ssh-keyscan {'-p ' + str(self.cfg.port) + ' ' if self.cfg.port else ''}"
            f"{self.cfg.hostname} >> ~/.ssh/known_hosts` after checking it with the host's owner.",
            kind="host-key-unknown", host=self.cfg.name)

    def _ssh_hint(self) -> str:
        return shlex.join((["-p", str(self.cfg.port)] if self.cfg.port else []) + [self.cfg.destination])

    def _known_hosts_pattern(self) -> str:
        h = self.cfg.hostname
        return f"[{h}]:{self.cfg.port}" if self.cfg.port and self.cfg.port != 22 else h

    def _has_known_key(self) -> bool:
        """Whether a known_hosts file names this host at all (then a refused key is a changed key)."""
        try:
            found = self._load_known_hosts().match(self.cfg.hostname, "", self.cfg.port)
        except RemoteError:
            return False
        return bool(found[0] or found[1])  # trusted host keys, CA keys

    async def close(self) -> None:
        conn, sftp = self._conn, self._sftp
        self._conn, self._sftp = None, None
        if sftp is not None:
            sftp.exit()
        if conn is not None:
            conn.close()
            await conn.wait_closed()

    async def __aenter__(self) -> "RemoteHost":
        await self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- commands ----------------------------------------------------------------------------

    async def run_cli(self, args: list[str], *, stdin: bytes | None = None, timeout: float = 60,
                      ok_exits: Iterable[int] = (0,)) -> Any:
        """Run ``[kv_valet, *args]`` on the host and return its parsed JSON output (None when it
        printed nothing). ``args`` include ``--json`` where the command has it. An exit status not
        in ``ok_exits`` raises :class:`RemoteError` with the command's stderr (and ``output``, the
        JSON it printed, if any)."""
        status, out, err, shown = await self._exec(args, stdin, timeout)
        parsed, json_error = None, None
        if out.strip():
            try:
                parsed = json.loads(out)
            except ValueError as e:
                json_error = e
        self._check_exit(shown, status, out, err, ok_exits, parsed)
        if json_error is not None:
            raise RemoteError(f"`{shown}` on {self.label} did not answer JSON ({json_error}): "
                              f"{out.strip()[:200]!r}. Is kv-valet there as recent as this one?",
                              kind="output", host=self.cfg.name, exit_status=status, stderr=err)
        return parsed

    async def run_cli_as_is(self, args: list[str], *, timeout: float = 60) -> tuple[int, str, str]:
        """Run ``[kv_valet, *args]`` on the host and return (its exit status, stdout, stderr) as they
        are, whatever the status (``kv-valet --host``'s pass-through); a missing kv-valet still
        raises :class:`RemoteError` (``not-found``), as an SSH failure does."""
        status, out, err, shown = await self._exec(args, None, timeout)
        self._check_exit(shown, status, out, err, (status,), None)
        return status, out, err

    async def run_cli_text(self, args: list[str], *, timeout: float = 60, ok_exits: Iterable[int] = (0,)) -> str:
        """:meth:`run_cli` for a command's text output (what the host prints for a person)."""
        status, out, err, shown = await self._exec(args, None, timeout)
        self._check_exit(shown, status, out, err, ok_exits, None)
        return out

    async def _exec(self, args: list[str], stdin: bytes | None, timeout: float) -> tuple[int, str, str, str]:
        argv = [self.cfg.kv_valet, *[str(a) for a in args]]
        shown = shlex.join(argv)
        conn = await self._connection()
        try:
            r = await asyncio.wait_for(conn.run(shown, input=stdin, encoding=None, check=False), timeout)
        except (asyncio.TimeoutError, TimeoutError):
            raise RemoteError(f"`{shown}` on {self.label} did not finish in {timeout:.0f} s",
                              kind="timeout", host=self.cfg.name) from None
        except (asyncssh.Error, OSError) as e:
            raise RemoteError(f"`{shown}` on {self.label}: the SSH connection failed: {e}",
                              kind="unreachable", host=self.cfg.name) from None
        out = (r.stdout or b"").decode("utf-8", "replace")
        err = (r.stderr or b"").decode("utf-8", "replace").strip()
        return (r.exit_status if r.exit_status is not None else -1), out, err, shown

    def _check_exit(self, shown: str, status: int, out: str, err: str, ok_exits: Iterable[int], parsed: Any) -> None:
        if status == COMMAND_NOT_FOUND or (status != 0 and "command not found" in err and not out):
            raise RemoteError(
                f"kv-valet was not found on {self.label} (`{self.cfg.kv_valet}`: {err or 'command not found'}). "
                "Install KV Valet there, or give its full path: kv-valet hosts add "
                f"{self.cfg.name} {self.cfg.destination} --kv-valet /path/to/.venv/bin/kv-valet --force "
                "(a login over SSH without a terminal may not read the PATH your shell profile sets).",
                kind="not-found", host=self.cfg.name, exit_status=status, stderr=err)
        if status not in tuple(ok_exits):
            raise RemoteError(f"`{shown}` failed on {self.label} (exit {status}): "
                              f"{err or out.strip()[:500] or 'no message'}",
                              kind="command", host=self.cfg.name, exit_status=status, stderr=err, output=parsed)

    async def sftp(self) -> asyncssh.SFTPClient:
        """The connection's SFTP client (one, reused)."""
        conn = await self._connection()
        if self._sftp is None:
            try:
                self._sftp = await conn.start_sftp_client()
            except (asyncssh.Error, OSError) as e:
                raise RemoteError(f"SFTP on {self.label} failed: {e} (is the sftp subsystem enabled in its sshd?)",
                                  kind="unreachable", host=self.cfg.name) from None
        return self._sftp

    def llama_client(self, url: str, api_key: str | None = None) -> LlamaClient:
        """A client of the server at ``url`` as the host sees it (``http://127.0.0.1:8080``: its
        loopback), its HTTP sent through SSH channels of this connection (made on first use)."""
        from app.remote.tunnel import SSHNetworkBackend

        return LlamaClient(url, api_key, network_backend=SSHNetworkBackend(self._connection, self.label))

    # -- what a host shows -------------------------------------------------------------------

    async def profiles(self) -> list[dict]:
        """The host's profiles (``kv-valet profiles list --json``): name, url, model, ... per profile."""
        data = await self.run_cli(["profiles", "list", "--json"])
        return list(data or [])

    async def sessions(self, profile: str | None = None) -> list[dict]:
        """The host's parked sessions (``kv-valet sessions list --json``), most recent first."""
        args = ["sessions", "list", "--json"] + (["--profile", profile] if profile else [])
        return list(await self.run_cli(args) or [])

    async def status(self, profile: str) -> dict:
        """``kv-valet status PROFILE --json`` there: health, slots, GPUs (VRAM per GPU), process and
        host figures. A server that is down answers too (its health not Health.OK)."""
        return dict(await self.run_cli(["status", profile, "--json"], ok_exits=(0, 1)) or {})

    async def servers(self) -> list[dict]:
        """Every profile of the host with its server's figures: ``{"profile": <profiles list entry>,
        "status": <status --json>, "running": bool}``, the statuses asked at once (one SSH channel each)."""
        profiles = await self.profiles()
        statuses = await asyncio.gather(*(self.status(p["name"]) for p in profiles))
        return [{"profile": p, "status": st, "running": Health.parse(st.get("health"))[0] is Health.OK}
                for p, st in zip(profiles, statuses)]

    async def systemd(self, action: str, profile: str) -> dict:
        """start | stop | status of the host's ``kv-valet-<profile>.service`` user unit, through
        ``kv-valet service ACTION PROFILE --json`` there (app.remote.unit: where no user manager
        runs, it starts ``kv-valet serve PROFILE`` detached instead, and says so). Returns its
        answer: ``{"unit", "manager": "systemd"|"detached", "active": bool, ...}``."""
        if action not in ("start", "stop", "status"):
            raise ValueError(f"systemd action must be start, stop or status, not {action!r}")
        return dict(await self.run_cli(["service", action, profile, "--json"], timeout=180) or {})
