"""State file headers: the real build-11434 header and files written like it."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from app.server.statefile import (
    StateFileError,
    StateHeader,
    encode_state_file,
    read_state_header,
    read_state_tokens,
    version_mismatch_reason,
    write_state_file,
)

HEX = Path(__file__).parents[1] / "fixtures" / "llama-server-b11434" / "state-file-header.hex"
# The first ten tokens in the real capture's packed payload (after -1, 1, 2892).
REAL_FIRST_TOKENS = [2, 105, 2364, 107, 36370, 1239, 10797, 236761, 107, 27711]


def real_header_bytes() -> bytes:
    """The 64 bytes of the xxd dump."""
    out = b""
    for line in HEX.read_text().splitlines():
        hex_part = line.split(":", 1)[1][:40]
        out += bytes.fromhex(hex_part.replace(" ", ""))
    assert len(out) == 64
    return out


def real_like_file(tmp_path: Path, payload: int = 1000) -> Path:
    """The real first 64 bytes, the rest of the token words as zeros, then a state."""
    head = real_header_bytes()
    path = tmp_path / "real.bin"
    path.write_bytes(head + bytes(12 + 4 * 2896 - len(head)) + b"S" * payload)
    return path


def test_parses_the_real_header(tmp_path):
    h = read_state_header(real_like_file(tmp_path))
    assert h == StateHeader(
        path=tmp_path / "real.bin",
        file_size=12 + 4 * 2896 + 1000,
        version=4,
        n_words=2896,
        token_count=2892,
        packed=True,
        payload_version=1,
        header_bytes=12 + 4 * 2896,
    )


def test_real_tokens_skip_marker_version_and_count(tmp_path):
    tokens = read_state_tokens(real_like_file(tmp_path))
    assert len(tokens) == 2892
    assert tokens[:10] == REAL_FIRST_TOKENS


def test_writer_reproduces_the_real_layout(tmp_path):
    tokens = REAL_FIRST_TOKENS + [7] * (2892 - len(REAL_FIRST_TOKENS))
    path = tmp_path / "w.bin"
    size = write_state_file(path, tokens, b"\1" * 100)
    data = path.read_bytes()
    assert data[:64] == real_header_bytes()
    assert size == len(data) == 12 + 4 * 2896 + 100
    # packed payload ends with the media chunk count (0) after the tokens
    assert struct.unpack_from("<i", data, 12 + 4 * 2895)[0] == 0
    assert read_state_tokens(path) == tokens


def test_plain_tokens_of_older_builds(tmp_path):
    path = tmp_path / "old.bin"
    write_state_file(path, [5, 6, 7], b"state", version=3, packed=False)
    h = read_state_header(path)
    assert (h.version, h.n_words, h.token_count, h.packed, h.payload_version) == (3, 3, 3, False, None)
    assert read_state_tokens(path) == [5, 6, 7]


def test_truncated_inside_the_token_words(tmp_path):
    path = real_like_file(tmp_path)
    path.write_bytes(path.read_bytes()[:812])
    with pytest.raises(StateFileError, match=r"truncated: header says 2,896 token words but file has only 812 bytes"):
        read_state_header(path)


def test_header_only_file_is_truncated(tmp_path):
    path = tmp_path / "h.bin"
    path.write_bytes(encode_state_file([1, 2], b"x")[:-1])
    with pytest.raises(StateFileError, match="truncated"):
        read_state_header(path)


def test_foreign_file(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(StateFileError, match=r"not a llama.cpp slot state file \(magic b'GGUF'"):
        read_state_header(path)


def test_empty_and_missing_files(tmp_path):
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(StateFileError, match="not a llama.cpp slot state file"):
        read_state_header(tmp_path / "empty.bin")
    with pytest.raises(StateFileError, match="state file not found"):
        read_state_header(tmp_path / "nope.bin")


def test_absurd_word_count(tmp_path):
    path = tmp_path / "big.bin"
    path.write_bytes(struct.pack("<III", 0x67677371, 4, 17_000_000) + bytes(64))
    with pytest.raises(StateFileError, match="corrupt header"):
        read_state_header(path)


def test_packed_count_larger_than_its_words(tmp_path):
    path = tmp_path / "p.bin"
    words = [-1, 1, 10, 5, 6]
    path.write_bytes(struct.pack("<III", 0x67677371, 4, len(words)) + struct.pack("<5i", *words) + b"state")
    with pytest.raises(StateFileError, match="claims 10 tokens in 5 words"):
        read_state_header(path)


def test_reads_only_the_header_of_a_huge_file(tmp_path):
    path = tmp_path / "huge.bin"
    write_state_file(path, [9] * 10, b"s")
    with open(path, "r+b") as f:
        f.truncate(8 * 1024**3)  # sparse: reading it whole would take seconds and 8 GB
    h = read_state_header(path)
    assert h.file_size == 8 * 1024**3 and h.token_count == 10


def test_version_mismatch_reason(tmp_path):
    path = tmp_path / "v.bin"
    write_state_file(path, [1], b"s", version=3)
    h = read_state_header(path)
    assert version_mismatch_reason(h, 3) is None
    assert "version 3" in version_mismatch_reason(h, 4) and "version 4" in version_mismatch_reason(h, 4)
    assert version_mismatch_reason(h, None) is None
    write_state_file(path, [1], b"s", version=9)
    assert "unknown state file version 9" in version_mismatch_reason(read_state_header(path), None)
