"""Header-only paths on 2.5 GB sparse files: a truncated or foreign file is refused without reading it."""

from __future__ import annotations

import struct

import pytest

from app.sessions import sidecar_check
from app.core.states import SidecarStatus
from app.server.statefile import StateFileError, read_state_header

GB25 = 2_500_000_000


def sparse(path, head: bytes, size: int = GB25):
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)
    return path


def state_head(n_tokens: int) -> bytes:
    return (struct.pack("<IIIii", 0x67677371, 4, n_tokens + 3, -1, 1) + struct.pack("<i", n_tokens)
            + struct.pack(f"<{n_tokens}i", *range(n_tokens)))


def test_a_valid_big_state_file_is_read_from_its_header(tmp_path):
    h = read_state_header(sparse(tmp_path / "ok.bin", state_head(100_000)))
    assert (h.token_count, h.version, h.file_size) == (100_000, 4, GB25)


def test_a_foreign_big_file_is_refused(tmp_path):
    with pytest.raises(StateFileError, match="not a llama.cpp state file|magic"):
        read_state_header(sparse(tmp_path / "foreign.bin", b"GGUF" + bytes(60)))


def test_a_truncated_file_is_refused(tmp_path):
    # the header promises 100,000 token words; the file was cut off after 1,000 bytes
    with pytest.raises(StateFileError, match="truncated"):
        read_state_header(sparse(tmp_path / "trunc.bin", state_head(100_000)[:1000], size=1000))
    # and an absurd word count is caught from the header alone, without reading 2.5 GB
    head = struct.pack("<IIIii", 0x67677371, 4, 900_000_003, -1, 1) + struct.pack("<i", 900_000_000)
    with pytest.raises(StateFileError, match="corrupt header"):
        read_state_header(sparse(tmp_path / "huge.bin", head))


def test_a_big_sidecar_is_checked_from_its_headers(tmp_path):
    state = sparse(tmp_path / "s.bin", state_head(100_000))
    per = 75_000_000
    with open(tmp_path / "s.bin.ckpt", "wb") as f:
        f.write(struct.pack("<III", 0x4C434B50, 1, 4))
        for i in range(4):
            f.write(struct.pack("<qiiQQ", 90_000 + i * 2_000, 80_000 + i * 2_000, 89_999 + i * 2_000, per, 0))
            f.seek(per, 1)
        f.truncate(f.tell())
    r = sidecar_check.inspect(state, 100_000, "sliding-window", verify_hash=True)
    assert r.status is SidecarStatus.PRESENT_VALID and len(r.checkpoints) == 4 and r.size == 12 + 4 * (32 + per)
    with open(tmp_path / "s.bin.ckpt", "r+b") as f:  # cut off: the last checkpoint's bytes are missing
        f.truncate(200_000_000)
    r = sidecar_check.inspect(state, 100_000, "sliding-window", verify_hash=True)
    assert r.status is SidecarStatus.INVALID and "truncated" in r.reason
