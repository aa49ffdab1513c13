"""Read the header of a llama.cpp slot state file without loading the file.

``POST /slots/{id}?action=save`` writes ``llama_state_seq_save_file`` output:
little-endian ``u32 magic 0x67677371`` (bytes ``qsgg``), ``u32 version``
(2, later 3, 4 in build 11434), ``u32 n``, then ``n`` i32 token words and the
sequence state. Since upstream PR #26640 the token words are a packed payload:
``[-1 (LLAMA_TOKEN_NULL), payload_version, token_count, tokens..., media chunk
count, zero padding]``; older builds and the turboquant fork write plain tokens.

A state file can be gigabytes: we read 12 bytes plus the token words, never the
sequence state. A loader requires an exact version match, so the app checks the
version before asking a server to restore (a failed restore clears the slot).

Stdlib only: the fake llama-server imports :func:`write_state_file`.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

STATE_MAGIC = 0x67677371  # bytes b"qsgg" on disk
STATE_MAGIC_BYTES = struct.pack("<I", STATE_MAGIC)
CURRENT_STATE_VERSION = 4  # what build 11434 writes
KNOWN_STATE_VERSIONS = (2, 3, 4)
PACKED_MARKER = -1  # LLAMA_TOKEN_NULL: first word of a packed payload (PR #26640)
PACKED_PAYLOAD_VERSION = 1
MAX_TOKEN_WORDS = 16 * 1024 * 1024  # anything above is a corrupt or foreign file
_HEADER = struct.Struct("<III")


class StateFileError(Exception):
    """A file that is not, or no longer, a usable slot state file."""


@dataclass(frozen=True)
class StateHeader:
    path: Path
    file_size: int
    version: int
    n_words: int
    token_count: int
    packed: bool
    payload_version: int | None
    header_bytes: int  # 12 + 4 * n_words: where the sequence state begins


def _read_words(f, path: Path, count: int, file_size: int) -> tuple[int, ...]:
    data = f.read(4 * count)
    if len(data) != 4 * count:
        raise StateFileError(
            f"truncated: {path.name} ends inside its token words ({file_size:,} bytes)"
        )
    return struct.unpack(f"<{count}i", data)


def _open_header(path: Path):
    """Open ``path`` and validate the fixed part; returns (file, header fields)."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise StateFileError(f"state file not found: {path}") from None
    except OSError as exc:
        raise StateFileError(f"cannot read state file {path}: {exc.strerror or exc}") from None
    try:
        file_size = os.fstat(f.fileno()).st_size
        raw = f.read(_HEADER.size)
        if len(raw) < 4 or raw[:4] != STATE_MAGIC_BYTES:
            raise StateFileError(
                f"{path.name} is not a llama.cpp slot state file (magic {raw[:4]!r}, "
                f"expected {STATE_MAGIC_BYTES!r})"
            )
        if len(raw) < _HEADER.size:
            raise StateFileError(f"{path.name} is truncated: it has only {file_size} bytes")
        _, version, n_words = _HEADER.unpack(raw)
        if n_words > MAX_TOKEN_WORDS:
            raise StateFileError(
                f"{path.name} has a corrupt header: {n_words:,} token words is more than any context holds"
            )
        header_bytes = _HEADER.size + 4 * n_words
        if file_size <= header_bytes:
            raise StateFileError(
                f"{path.name} is truncated: header says {n_words:,} token words but file has only "
                f"{file_size:,} bytes"
            )
        return f, file_size, version, n_words, header_bytes
    except BaseException:
        f.close()
        raise


def _parse(path: Path, want_tokens: bool) -> tuple[StateHeader, list[int]]:
    path = Path(path)
    f, file_size, version, n_words, header_bytes = _open_header(path)
    with f:
        first = _read_words(f, path, 1, file_size)[0] if n_words else None
        if first == PACKED_MARKER:
            if n_words < 3:
                raise StateFileError(f"{path.name} has a corrupt header: packed token payload shorter "
                                     "than 3 words")
            payload_version, token_count = _read_words(f, path, 2, file_size)
            if token_count < 0 or token_count > n_words - 3:
                raise StateFileError(
                    f"{path.name} has a corrupt header: packed payload claims {token_count:,} tokens "
                    f"in {n_words:,} words"
                )
            tokens = list(_read_words(f, path, token_count, file_size)) if want_tokens else []
            packed = True
        else:
            payload_version, token_count, packed = None, n_words, False
            tokens = []
            if want_tokens and n_words:
                tokens = [first, *_read_words(f, path, n_words - 1, file_size)]
    header = StateHeader(
        path=path,
        file_size=file_size,
        version=version,
        n_words=n_words,
        token_count=token_count,
        packed=packed,
        payload_version=payload_version,
        header_bytes=header_bytes,
    )
    return header, tokens


def read_state_header(path: str | os.PathLike) -> StateHeader:
    """Validate and describe a state file (reads at most 24 bytes)."""
    return _parse(Path(path), want_tokens=False)[0]


def read_state_tokens(path: str | os.PathLike) -> list[int]:
    """The saved tokens (without the packed payload's marker, version and media words)."""
    return _parse(Path(path), want_tokens=True)[1]


def version_mismatch_reason(header: StateHeader, expected_version: int | None) -> str | None:
    """Why a server writing ``expected_version`` would refuse this file, or None.

    ``llama_state_seq_load_file`` requires an exact version match, and a refused
    restore clears the target slot, so refuse before asking. ``None`` as the
    expected version (build unknown) only flags versions no build ever wrote.
    """
    if expected_version is None:
        if header.version not in KNOWN_STATE_VERSIONS:
            return f"unknown state file version {header.version} (known: 2, 3, 4)"
        return None
    if header.version != expected_version:
        return (
            f"state file version {header.version} but this llama-server reads only "
            f"version {expected_version}: it was saved by a different llama.cpp build"
        )
    return None


def pack_token_words(tokens: list[int], packed: bool = True) -> list[int]:
    """Token words as build 11434 writes them: marker, payload version, count,
    tokens, media chunk count (0)."""
    if not packed:
        return list(tokens)
    return [PACKED_MARKER, PACKED_PAYLOAD_VERSION, len(tokens), *tokens, 0]


def encode_state_file(
    tokens: list[int],
    payload: bytes,
    version: int = CURRENT_STATE_VERSION,
    packed: bool = True,
) -> bytes:
    """The bytes of a file laid out like ``llama_state_seq_save_file`` output.

    ``payload`` stands in for the sequence state and must not be empty (a real
    state never is, and :func:`read_state_header` rejects a header-only file).
    """
    words = pack_token_words(tokens, packed)
    return (
        _HEADER.pack(STATE_MAGIC, version, len(words))
        + struct.pack(f"<{len(words)}i", *words)
        + bytes(payload)
    )


def write_state_file(
    path: str | os.PathLike,
    tokens: list[int],
    payload: bytes,
    version: int = CURRENT_STATE_VERSION,
    packed: bool = True,
) -> int:
    """Write a state file (for the fake llama-server and tests); returns its size."""
    data = encode_state_file(tokens, payload, version, packed)
    with open(path, "wb") as f:
        f.write(data)
    return len(data)
