"""The user's remote hosts: ``<config>/hosts.toml``, edited in place (tomlkit).

One table per host, as a person would write it::

    [hosts.gpu-box]
    destination = "me@gpu-box.lan"   # "user@host", "host" or an ~/.ssh/config alias
    port = 2222                       # optional: else ~/.ssh/config's, else 22
    kv_valet = "/home/me/kv-valet/.venv/bin/kv-valet"   # optional: the command on the host
    identity_file = "~/.ssh/id_ed25519_gpu"             # optional: else agent, config, defaults

Nothing secret is kept here: authentication is SSH's (keys, agent, ~/.ssh/config).
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from app import paths
from app import files

HEADER = "# KV Valet remote hosts (reached over SSH). Edit freely: one [hosts.NAME] table per host."
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_FIELDS = ("destination", "port", "kv_valet", "identity_file")


class HostsError(ValueError):
    """The hosts file or an entry is wrong; the message says which and how to fix it."""


@dataclass(frozen=True)
class HostConfig:
    name: str
    destination: str  # "user@host", "host" or an ~/.ssh/config alias
    port: int | None = None
    kv_valet: str = "kv-valet"  # the command on the remote (a path allowed)
    identity_file: str | None = None

    def __post_init__(self):
        if not _NAME.match(self.name):
            raise HostsError(f"host name {self.name!r}: letters, digits, '.', '_' and '-' only (up to 64)")
        if not self.destination or self.destination.startswith("-") or any(c.isspace() for c in self.destination):
            raise HostsError(f"host {self.name}: destination {self.destination!r} is not user@host, host or an alias")
        if self.port is not None and not (isinstance(self.port, int) and 0 < self.port < 65536):
            raise HostsError(f"host {self.name}: port {self.port!r} is not 1-65535")
        if not self.kv_valet or not isinstance(self.kv_valet, str):
            raise HostsError(f"host {self.name}: kv_valet must be a command or a path")

    @property
    def user(self) -> str | None:
        return self.destination.rpartition("@")[0] or None

    @property
    def hostname(self) -> str:
        return self.destination.rpartition("@")[2]

    def to_dict(self) -> dict:
        return {"name": self.name, "destination": self.destination, "port": self.port,
                "kv_valet": self.kv_valet, "identity_file": self.identity_file}


def hosts_path() -> Path:
    return paths.config_dir() / "hosts.toml"


class HostStore:
    def __init__(self, path: Path | None = None):
        self.path = path or hosts_path()

    def _read(self) -> dict:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except (OSError, UnicodeDecodeError) as e:
            raise HostsError(f"cannot read {self.path}: {e}") from None
        try:
            data = tomllib.loads(text)
        except (tomllib.TOMLDecodeError, RecursionError) as e:
            raise HostsError(f"{self.path} is not valid TOML: {e}") from None
        hosts = data.get("hosts", {})
        if not isinstance(hosts, dict):
            raise HostsError(f"{self.path}: 'hosts' must be a table of [hosts.NAME] tables")
        return hosts

    def all(self) -> list[HostConfig]:
        return [self._entry(name, raw) for name, raw in sorted(self._read().items())]

    def names(self) -> list[str]:
        return sorted(self._read())

    def get(self, name: str) -> HostConfig:
        hosts = self._read()
        if name not in hosts:
            known = ", ".join(sorted(hosts)) or "none yet"
            raise HostsError(f"no host named '{name}' (known: {known}); add it with "
                             f"kv-valet hosts add {name} USER@HOST")
        return self._entry(name, hosts[name])

    def _entry(self, name: str, raw: object) -> HostConfig:
        if not isinstance(raw, dict):
            raise HostsError(f"{self.path}: hosts.{name} must be a table")
        unknown = sorted(set(raw) - set(_FIELDS))
        if unknown:
            raise HostsError(f"{self.path}: hosts.{name}: unknown key(s) {', '.join(unknown)} "
                             f"(known: {', '.join(_FIELDS)})")
        if not isinstance(raw.get("destination"), str):
            raise HostsError(f"{self.path}: hosts.{name} needs destination = \"user@host\"")
        port = raw.get("port")
        if port is not None and (not isinstance(port, int) or isinstance(port, bool)):
            raise HostsError(f"{self.path}: hosts.{name}.port must be a whole number")
        for key in ("kv_valet", "identity_file"):
            if key in raw and not isinstance(raw[key], str):
                raise HostsError(f"{self.path}: hosts.{name}.{key} must be text")
        return HostConfig(name=name, destination=raw["destination"], port=port,
                          kv_valet=raw.get("kv_valet", "kv-valet"), identity_file=raw.get("identity_file"))

    def save(self, cfg: HostConfig, *, overwrite: bool = False) -> Path:
        """Add (or with ``overwrite`` replace) one host; the rest of the file, comments included, stays."""
        import tomlkit

        with files.locked(self.path):
            try:
                text = self.path.read_text(encoding="utf-8")
            except FileNotFoundError:
                text = None
            doc = tomlkit.parse(text) if text else tomlkit.document()
            if text is None:
                doc.add(tomlkit.comment(HEADER.removeprefix("# ")))
            hosts = doc.setdefault("hosts", tomlkit.table(is_super_table=True))
            if cfg.name in hosts and not overwrite:
                raise HostsError(f"a host named '{cfg.name}' exists in {self.path} (--force replaces it)")
            entry = tomlkit.table()
            entry["destination"] = cfg.destination
            if cfg.port is not None:
                entry["port"] = cfg.port
            if cfg.kv_valet != "kv-valet":
                entry["kv_valet"] = cfg.kv_valet
            if cfg.identity_file:
                entry["identity_file"] = cfg.identity_file
            hosts[cfg.name] = entry
            return files.write_atomic(self.path, tomlkit.dumps(doc))

    def remove(self, name: str) -> bool:
        import tomlkit

        with files.locked(self.path):
            try:
                doc = tomlkit.parse(self.path.read_text(encoding="utf-8"))
            except FileNotFoundError:
                return False
            hosts = doc.get("hosts")
            if hosts is None or name not in hosts:
                return False
            del hosts[name]
            files.write_atomic(self.path, tomlkit.dumps(doc))
            return True
