"""Which server a name means: a profile name, a profile or a URL resolved into a
:class:`TargetSpec` (where it is, with which API key, which ``--slot-save-path`` and log
file, and whether an earlier KV Valet left its server running), and a client of its own for
a caller that reaches a server once.

The one resolver of the app. It sits in the server layer, below sessions, moves and the
server service, so each of them resolves a target the same way without importing upwards;
the faces reach it through :mod:`app.servers.service`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from app import paths
from app.core.lifecycle import TargetKind
from app.core.profile import LaunchProfile
from app.server.client import LlamaClient
from app.server.launcher import pid_record_path, resolve_api_key, slot_save_path_for
from app.server.supervisor import PidRecord, find_leftover_server


@dataclass(frozen=True)
class TargetSpec:
    """A server as the user named it, resolved: where it is and how to talk to it."""

    id: str  # "profile:NAME" or "url:URL": the key of everything this service returns
    kind: TargetKind
    url: str
    profile: LaunchProfile | None = None
    api_key: str | None = field(default=None, repr=False)  # never in a log line or a traceback
    save_dir: Path | None = None  # the server's --slot-save-path, when known
    log_path: Path | None = None  # the log file KV Valet writes for it, when there is one
    leftover: PidRecord | None = None  # a server an earlier KV Valet launched (stoppable by pid + start time)

    @property
    def name(self) -> str:
        return self.profile.name if self.profile is not None else self.url


def profile_target_id(name: str) -> str:
    return f"profile:{name}"


def url_target_id(url: str) -> str:
    return f"url:{url.rstrip('/')}"


def load_profile(name: str, store=None) -> LaunchProfile:
    """A profile by name ("default" is written first when missing). Raises ProfileError."""
    from app.store.profiles import ProfileStore

    store = store or ProfileStore()
    return store.ensure_default() if name == "default" else store.load(name)


def resolve_target(arg: str | LaunchProfile, *, store=None, save_dir: str | Path | None = None,
                   api_key: str | None = None, log_file: str | Path | None = None) -> TargetSpec:
    """The one resolver: a server URL, a profile name or a profile. For a profile, the server an
    earlier KV Valet launched and left running (pid + start time) is the one meant; the key is the
    given one, else the profile's (key, key file), else ``$LLAMA_API_KEY``; the log file is the one
    KV Valet writes for the profile's server, when it exists. Raises ProfileError."""
    if isinstance(arg, str) and "://" in arg:
        url = arg.rstrip("/")
        return TargetSpec(url_target_id(url), TargetKind.URL, url, None,
                          api_key if api_key is not None else resolve_api_key(None),
                          Path(save_dir) if save_dir else None, Path(log_file) if log_file else None)
    profile = arg if isinstance(arg, LaunchProfile) else load_profile(arg, store)


    rec = find_leftover_server(pid_record_path(profile.name))
    log_path = Path(log_file) if log_file else paths.server_log_path(profile.name)
    return TargetSpec(profile_target_id(profile.name), TargetKind.LEFTOVER if rec else TargetKind.PROFILE,
                      rec.url if rec else profile.url, profile,
                      api_key if api_key is not None else resolve_api_key(profile),
                      Path(save_dir or slot_save_path_for(profile)),
                      log_path if log_file or log_path.is_file() else None, rec)


def listening_pid(url: str) -> int | None:
    """The pid of the process listening on ``url``'s port on this machine, when it can be seen."""
    from urllib.parse import urlparse

    import psutil

    port = urlparse(url).port
    if not port:
        return None
    try:
        for c in psutil.net_connections(kind="tcp"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                return c.pid
    except (psutil.Error, OSError):  # not allowed to see other users' sockets: unknown
        return None
    return None


#: Ports below the system's ephemeral range are never handed to an outgoing connection, so a port
#: chosen there stays free until the server binds it (one from bind(0) is ephemeral: a client's
#: connection made in between, a /health poll of another server, can take it as its source port).
LISTEN_PORTS_FROM = 20000
EPHEMERAL_DEFAULT = (32768, 60999)


def ephemeral_ports() -> tuple[int, int]:
    """The range the system takes outgoing connections' source ports from (Linux says so in
    /proc; elsewhere IANA's 49152–65535, what macOS and Windows use)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2]
        return int(low), int(high)
    except (OSError, ValueError):
        return (49152, 65535) if sys.platform != "linux" else EPHEMERAL_DEFAULT


def free_loopback_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now and outside the ephemeral range, so no connection takes it
    before the server behind the proxy (or a test's server) binds it. Falls back to one the system
    picks when the range below the ephemeral one is too small or taken."""
    import random
    import socket

    low = ephemeral_ports()[0]
    if low - 1 > LISTEN_PORTS_FROM + 100:
        for port in random.sample(range(LISTEN_PORTS_FROM, low), 64):
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def client_for(arg: str | LaunchProfile, *, api_key: str | None = None) -> LlamaClient:
    """A client of its own for a server the caller reaches once, without a service (a command,
    a dialog opened without the window's service): resolved by :func:`resolve_target`."""
    spec = resolve_target(arg, api_key=api_key)
    return LlamaClient(spec.url, spec.api_key)
