"""Checkpoint sidecars, checked against the real PKCL layout of build 11434 + PR #206."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from app.core.states import SidecarStatus
from app.server.sidecar import (
    Checkpoint,
    SidecarError,
    appended_checkpoints,
    inspect_sidecar,
    read_lsckpt2,
    read_pkcl,
    sidecar_candidates,
    write_lsckpt2,
    write_pkcl,
)

LAYOUT = Path(__file__).parents[1] / "fixtures" / "sidecar-build-b11434" / "sidecar-layout.txt"
REAL_SIZE = 31_483_580
REAL_N_TGT = 7_870_860
REAL_SAVED_TOKENS = 2892
# (n_tokens, pos_min, pos_max, header offset) from sidecar-layout.txt
REAL = [(2345, 1321, 2344, 12), (2857, 1833, 2856, 7870904), (2864, 1840, 2863, 15741796), (2881, 1857, 2880, 23612688)]
REAL_CHECKPOINTS = tuple(Checkpoint(n, lo, hi, REAL_N_TGT, 0) for n, lo, hi, _ in REAL)


def small_items(size: int = 40):
    return [(Checkpoint(n, lo, hi, size, 0), bytes([i]) * size, b"") for i, (n, lo, hi, _) in enumerate(REAL)]


def state_with_pkcl(tmp_path: Path, items=None) -> Path:
    state = tmp_path / "s1.bin"
    state.write_bytes(b"state")
    write_pkcl(tmp_path / "s1.bin.ckpt", small_items() if items is None else items)
    return state


def real_sparse_sidecar(path: Path, size: int = REAL_SIZE) -> None:
    """Exactly the real file's headers at the real offsets, payloads left as holes."""
    with open(path, "wb") as f:
        f.write(struct.pack("<III", 0x4C434B50, 1, 4))
        for n, lo, hi, offset in REAL:
            f.seek(offset)
            f.write(struct.pack("<qiiQQ", n, lo, hi, REAL_N_TGT, 0))
        f.truncate(size)


def test_layout_fixture_matches_our_constants():
    text = LAYOUT.read_text()
    assert f"file size {REAL_SIZE} bytes" in text
    for n, lo, hi, offset in REAL:
        assert f"header at offset {offset}: n_tokens {n}, pos_min {lo}, pos_max {hi}, n_tgt {REAL_N_TGT}, n_dft 0" in text


def test_real_sized_sparse_sidecar_parses(tmp_path):
    path = tmp_path / "s1.bin.ckpt"
    real_sparse_sidecar(path)
    assert read_pkcl(path) == REAL_CHECKPOINTS
    # the first 44 bytes (file header + first checkpoint header) equal the real dump's
    dump = LAYOUT.read_text().split("first 76 bytes:\n")[1].split()
    assert path.read_bytes()[:44] == bytes(int(b, 16) for b in dump[:44])


def test_real_sized_sidecar_report(tmp_path):
    state = tmp_path / "s1.bin"
    state.write_bytes(b"state")
    real_sparse_sidecar(tmp_path / "s1.bin.ckpt")
    r = inspect_sidecar(state, REAL_SAVED_TOKENS, "sliding-window")
    assert r.status is SidecarStatus.PRESENT_VALID
    assert (r.kind, r.size, r.checkpoints) == ("PKCL v1", REAL_SIZE, REAL_CHECKPOINTS)
    assert r.reason == "4 checkpoints, the last at token 2,880 of 2,892"


@pytest.mark.parametrize("size, added", [(REAL_SIZE - 32, None), (REAL_SIZE + 32, REAL_SIZE)])
def test_sizes_must_add_up_exactly(tmp_path, size, added):
    state = tmp_path / "s1.bin"
    state.write_bytes(b"state")
    real_sparse_sidecar(tmp_path / "s1.bin.ckpt", size)
    r = inspect_sidecar(state, REAL_SAVED_TOKENS, "sliding-window")
    assert r.status is SidecarStatus.INVALID
    if added is None:
        assert "checkpoint 4 of 4 needs bytes up to 31,483,580 but the file has 31,483,548" in r.reason
    else:
        assert r.reason == "invalid: s1.bin.ckpt: sizes add up to 31,483,580 bytes but the file has 31,483,612"


def test_small_synthetic_sidecar_round_trip(tmp_path):
    state = state_with_pkcl(tmp_path)
    cps = read_pkcl(tmp_path / "s1.bin.ckpt")
    assert [(c.n_tokens, c.pos_min, c.pos_max, c.size_tgt) for c in cps] == [(n, lo, hi, 40) for n, lo, hi, _ in REAL]
    r = inspect_sidecar(state, None, "sliding-window")
    assert r.status is SidecarStatus.PRESENT_VALID
    assert r.reason == "4 checkpoints, the last at token 2,880"


def test_stale_sidecar_from_a_longer_save_is_invalid(tmp_path):
    state = state_with_pkcl(tmp_path)
    r = inspect_sidecar(state, 2500, "sliding-window")
    assert r.status is SidecarStatus.INVALID
    assert "checkpoint 2 reaches token 2,857 but the state file holds 2,500" in r.reason
    # pos_max must be below the saved count too
    r = inspect_sidecar(state, 2880, "sliding-window")
    assert r.status is SidecarStatus.INVALID


def test_corrupt_positions(tmp_path):
    items = [(Checkpoint(10, 9, 3, 4, 0), b"abcd", b"")]
    r = inspect_sidecar(state_with_pkcl(tmp_path, items), 100, "sliding-window")
    assert r.status is SidecarStatus.INVALID and "corrupt" in r.reason


def test_bad_version_count_and_magic(tmp_path):
    state = tmp_path / "s1.bin"
    ckpt = tmp_path / "s1.bin.ckpt"
    ckpt.write_bytes(struct.pack("<III", 0x4C434B50, 7, 0))
    r = inspect_sidecar(state, None, "sliding-window")
    assert r.status is SidecarStatus.PRESENT_UNVERIFIED and r.reason.startswith("present, unverified (version 7)")
    ckpt.write_bytes(struct.pack("<III", 0x4C434B50, 1, 5000))
    assert "5,000 checkpoints" in inspect_sidecar(state, None, "sliding-window").reason
    ckpt.write_bytes(b"NOPE" + bytes(20))
    r = inspect_sidecar(state, None, "sliding-window")
    assert r.status is SidecarStatus.INVALID and "unknown sidecar format" in r.reason
    with pytest.raises(SidecarError):
        read_pkcl(ckpt)


def test_lsckpt2_round_trip(tmp_path):
    state = tmp_path / "s1.bin"
    write_lsckpt2(tmp_path / "s1.bin.ckpt", small_items(8))
    raw = (tmp_path / "s1.bin.ckpt").read_bytes()
    assert raw[:8] == b"LSCKPT2\0" and struct.unpack_from("<Q", raw, 8)[0] == 4
    assert struct.unpack_from("<iiq", raw, 16) == (1321, 2344, 2345)  # pos_min, pos_max, n_tokens
    assert [c.n_tokens for c in read_lsckpt2(tmp_path / "s1.bin.ckpt")] == [2345, 2857, 2864, 2881]
    r = inspect_sidecar(state, 2892, "recurrent-hybrid")
    assert (r.status, r.kind) == (SidecarStatus.PRESENT_VALID, "LSCKPT2")


def test_companion_file_is_present_but_unverified(tmp_path):
    state = tmp_path / "s1.bin"
    (tmp_path / "s1.bin.checkpoints").write_bytes(b"?" * 10)
    r = inspect_sidecar(state, 100, "sliding-window")
    assert (r.status, r.kind, r.size) == (SidecarStatus.PRESENT_UNVERIFIED, "companion", 10)
    assert "format is not documented" in r.reason


def test_missing_sidecar_reasons(tmp_path):
    state = tmp_path / "s1.bin"
    r = inspect_sidecar(state, 100, "sliding-window")
    assert r.status is SidecarStatus.MISSING and r.path is None
    assert r.reason == ("no sidecar next to the state file: this model uses sliding-window attention, "
                        "so the first query after a restart will re-prefill")
    r = inspect_sidecar(state, 100, "recurrent-hybrid")
    assert r.status is SidecarStatus.MISSING and "recurrent state" in r.reason


def test_dense_models_need_no_sidecar(tmp_path):
    state = tmp_path / "s1.bin"
    assert inspect_sidecar(state, 100, "dense").status is SidecarStatus.NOT_NEEDED
    state_with_pkcl(tmp_path)
    r = inspect_sidecar(state, 2892, "dense")
    assert r.status is SidecarStatus.NOT_NEEDED and len(r.checkpoints) == 4
    assert "not needed" in r.reason


def test_candidates_and_appended_checkpoints(tmp_path):
    assert sidecar_candidates(tmp_path / "a.bin") == [tmp_path / "a.bin.ckpt", tmp_path / "a.bin.checkpoints"]
    assert appended_checkpoints() is None


# -- PKCL version 2: written here with struct, from the reference's layout ---------

def fnv1a(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) % (1 << 64)
    return h


def write_v2(path, state_hash: int, cps, trailing: bytes = b"") -> None:
    """cps: (n_tokens, pos_min, pos_max, target bytes, draft bytes, speculative bytes)."""
    out = struct.pack("<IIQI", 0x4C434B50, 2, state_hash, len(cps))
    for n, lo, hi, tgt, dft, spec in cps:
        out += struct.pack("<qii", n, lo, hi)
        for block in (tgt, dft, spec):
            out += struct.pack("<Q", len(block)) + block
    path.write_bytes(out + trailing)


V2_CPS = [(2345, 1321, 2344, b"t" * 300, b"", b"s" * 7), (2857, 1833, 2856, b"u" * 300, b"d" * 5, b"")]


def test_fnv1a_of_the_state_file_matches_the_reference_constants(tmp_path):
    from app.server.sidecar import fnv1a64_file

    f = tmp_path / "s.bin"
    f.write_bytes(b"")
    assert fnv1a64_file(f) == 0xCBF29CE484222325
    f.write_bytes(b"a")
    assert fnv1a64_file(f) == 0xAF63DC4C8601EC8C  # the published FNV-1a 64 test vector for "a"
    data = bytes(range(256)) * 5000
    f.write_bytes(data)
    assert fnv1a64_file(f, chunk=4096) == fnv1a(data)


def test_v2_sidecar_with_the_right_hash_is_present(tmp_path):
    state = tmp_path / "s1.bin"
    state.write_bytes(b"qsgg" + bytes(200))
    write_v2(tmp_path / "s1.bin.ckpt", fnv1a(state.read_bytes()), V2_CPS)
    r = inspect_sidecar(state, 2892, "sliding-window", state_hash=lambda: fnv1a(state.read_bytes()))
    assert r.status is SidecarStatus.PRESENT_VALID and r.kind == "PKCL v2" and r.version == 2
    assert [(c.n_tokens, c.size_tgt, c.size_dft, c.size_spec) for c in r.checkpoints] == [
        (2345, 300, 0, 7), (2857, 300, 5, 0)]
    assert "not checked" not in r.reason
    unchecked = inspect_sidecar(state, 2892, "sliding-window")
    assert unchecked.status is SidecarStatus.PRESENT_VALID and "hash is not checked yet" in unchecked.reason


def test_v2_sidecar_of_an_older_state_file_is_stale(tmp_path):
    state = tmp_path / "s1.bin"
    state.write_bytes(b"qsgg" + bytes(200))
    write_v2(tmp_path / "s1.bin.ckpt", fnv1a(b"an older save"), V2_CPS)
    r = inspect_sidecar(state, 2892, "sliding-window", state_hash=lambda: fnv1a(state.read_bytes()))
    assert r.status is SidecarStatus.INVALID and "stale" in r.reason


@pytest.mark.parametrize("cps, trailing, why", [
    (V2_CPS, b"x", "1 trailing bytes"),
    ([(2345, 1321, 2344, b"t" * 300, b"", b"")], b"", None),
    ([(2345, 2344, 1321, b"t", b"", b"")], b"", "corrupt"),
    ([(9999, 1321, 2344, b"t", b"", b"")], b"", "the state file holds"),
])
def test_v2_sidecar_refusals(tmp_path, cps, trailing, why):
    state = tmp_path / "s1.bin"
    write_v2(tmp_path / "s1.bin.ckpt", 1, cps, trailing)
    r = inspect_sidecar(state, 2892, "sliding-window")
    if why is None:
        assert r.status is SidecarStatus.PRESENT_VALID
    else:
        assert r.status is SidecarStatus.INVALID and why in r.reason, r.reason


def test_v2_block_longer_than_the_file_is_truncated(tmp_path):
    state = tmp_path / "s1.bin"
    write_v2(tmp_path / "s1.bin.ckpt", 1, V2_CPS)
    raw = (tmp_path / "s1.bin.ckpt").read_bytes()
    (tmp_path / "s1.bin.ckpt").write_bytes(raw[:-50])
    r = inspect_sidecar(state, 2892, "sliding-window")
    assert r.status is SidecarStatus.INVALID and "truncated" in r.reason
