"""The resume matrix's measured cells are kept under a digest of every byte they depend on
(tests/real/resume_matrix.py measure_cached): a change to any of them measures again."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.real import resume_matrix as rm


def model_maker(salt: str):
    """A stand-in for test-llama-archs: a model file whose bytes name its architecture (and ``salt``)."""
    def make_model(tool, arch, folder):
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{arch}-dense.gguf"
        path.write_bytes(f"model {arch}{salt}".encode())
        return path
    return make_model


@pytest.fixture
def world(tmp_path, monkeypatch):
    """A stock server folder (a program and a library), a sidecar build, a model maker and the code files."""
    stock = tmp_path / "stock"
    stock.mkdir()
    (stock / "llama-server").write_bytes(b"stock server")
    (stock / "libllama.so.0.6.0").write_bytes(b"libllama")
    (stock / "libllama.so").symlink_to("libllama.so.0.6.0")
    sidecar = tmp_path / "sidecar" / "llama-server"
    sidecar.parent.mkdir()
    sidecar.write_bytes(b"sidecar server")
    code = tmp_path / "code.py"
    code.write_text("measuring code\n")
    bins = {"stock": str(stock / "llama-server"), "fork": str(sidecar), "v2": str(sidecar)}
    monkeypatch.setattr(rm, "binaries", lambda: bins)
    monkeypatch.setattr(rm, "archs_tool", lambda: tmp_path / "test-llama-archs")

    monkeypatch.setattr(rm, "make_model", model_maker(""))
    monkeypatch.setattr(rm, "MEASURING_CODE", (code,))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(rm.REMEASURE_ENV, raising=False)
    measured: list[int] = []

    def measure(work, progress):
        measured.append(1)
        return [rm.Cell("dense", "stock", "default", "chat", verdict="HIT", prompt_n=3, cache_n=90)]

    monkeypatch.setattr(rm, "measure", measure)
    return {"stock": stock, "sidecar": sidecar, "code": code, "measured": measured, "tmp": tmp_path}


def test_the_same_bytes_read_the_kept_cells_and_any_change_measures_again(world, monkeypatch):
    measured = world["measured"]
    cells, digest, kept = rm.measure_cached(world["tmp"] / "w1", progress=lambda s: None)
    assert not kept and len(measured) == 1 and cells[0].verdict == "HIT"
    assert (rm.cache_folder() / f"{digest}.json").is_file()

    again, same, kept = rm.measure_cached(world["tmp"] / "w2", progress=lambda s: None)
    assert kept and same == digest and len(measured) == 1 and again == cells  # nothing measured

    for change in (lambda: (world["stock"] / "libllama.so.0.6.0").write_bytes(b"libllama 2"),  # a library
                   lambda: world["sidecar"].write_bytes(b"sidecar server 2"),  # the sidecar build
                   lambda: world["code"].write_text("measuring code, changed\n")):  # the measuring code
        change()
        _, new, kept = rm.measure_cached(world["tmp"] / "w3", progress=lambda s: None)
        assert not kept and new != digest
        digest = new
    assert len(measured) == 4

    monkeypatch.setenv(rm.REMEASURE_ENV, "1")
    _, _, kept = rm.measure_cached(world["tmp"] / "w4", progress=lambda s: None)
    assert not kept and len(measured) == 5


def test_a_model_of_other_bytes_measures_again(world, monkeypatch):
    _, digest, _ = rm.measure_cached(world["tmp"] / "w1", progress=lambda s: None)

    monkeypatch.setattr(rm, "make_model", model_maker(", another seed"))
    _, new, kept = rm.measure_cached(world["tmp"] / "w2", progress=lambda s: None)
    assert not kept and new != digest


def test_a_measurement_with_an_error_is_not_kept_and_an_unreadable_one_is_measured_again(world, monkeypatch):
    monkeypatch.setattr(rm, "measure", lambda work, progress: [rm.Cell("dense", "stock", "default", "chat",
                                                                       error="RuntimeError: server exited 1")])
    _, digest, kept = rm.measure_cached(world["tmp"] / "w1", progress=lambda s: None)
    assert not kept and not (rm.cache_folder() / f"{digest}.json").exists()

    (rm.cache_folder()).mkdir(parents=True, exist_ok=True)
    (rm.cache_folder() / f"{digest}.json").write_text("{not json")
    said: list[str] = []
    _, _, kept = rm.measure_cached(world["tmp"] / "w2", progress=said.append)
    assert not kept and "unreadable" in said[0]


def test_the_digest_covers_the_real_measuring_code():
    names = {Path(p).name for p in rm.MEASURING_CODE}
    assert {"resume_matrix.py", "tiny_models.py", "verdict.py", "statefile.py"} <= names
    assert all(Path(p).is_file() for p in rm.MEASURING_CODE)
