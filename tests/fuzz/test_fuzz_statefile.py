"""The slot state file header (app.server.statefile) under random and corrupted files.

Refusal type: StateFileError, one sentence that names the file. A file that parses has a
consistent header (its token words inside the file), and an untouched file gives back the
tokens it was written with, packed or plain.
"""

from __future__ import annotations

import struct

from hypothesis import given, strategies as st

from app.server.statefile import (MAX_TOKEN_WORDS, STATE_MAGIC, StateFileError, encode_state_file,
                                  read_state_header, read_state_tokens)
from tests.fuzz.fuzzkit import bounded_memory, outcome

I32 = st.integers(-(2**31), 2**31 - 1)
U32 = st.integers(0, 2**32 - 1)


def mutate(data: bytes, draw) -> bytes:
    """A structured file, then one of: nothing, a truncation, trailing bytes, a changed word or
    byte (a field of the header, a token count, a token)."""
    how = draw(st.sampled_from(["none", "truncate", "append", "word", "byte"]))
    if how == "truncate" and data:
        return data[:draw(st.integers(0, len(data) - 1))]
    if how == "append":
        return data + draw(st.binary(min_size=1, max_size=64))
    if how == "word" and len(data) >= 4:
        at = draw(st.integers(0, min(len(data) // 4 - 1, 8))) * 4  # the header and first words
        return data[:at] + struct.pack("<I", draw(U32)) + data[at + 4:]
    if how == "byte" and data:
        at = draw(st.integers(0, len(data) - 1))
        return data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1:]
    return data


@st.composite
def state_files(draw):
    tokens = draw(st.lists(I32, max_size=40))
    packed = draw(st.booleans())
    version = draw(st.one_of(st.sampled_from([2, 3, 4]), U32))
    payload = draw(st.binary(min_size=1, max_size=64))
    data = encode_state_file(tokens, payload, version=version, packed=packed)
    mutated = mutate(data, draw)
    # plain tokens that start with -1 read as a packed payload: the format cannot tell them apart
    ambiguous = not packed and tokens[:1] == [-1]
    return mutated, (tokens if mutated == data and not ambiguous else None)


def check(files, data: bytes, tokens=None) -> None:
    path = files.write("session.bin", data)
    kind, header = outcome("state file header", lambda: read_state_header(path), StateFileError,
                           names=path.name)
    kind_t, got = outcome("state file tokens", lambda: read_state_tokens(path), StateFileError,
                          names=path.name)
    assert kind == kind_t  # both read the same header
    if kind == "parsed":
        assert 0 <= header.token_count <= header.n_words <= MAX_TOKEN_WORDS
        assert header.header_bytes == 12 + 4 * header.n_words < header.file_size == len(data)
        assert len(got) == header.token_count
    if tokens is not None:  # an untouched file gives back its tokens
        assert kind == "parsed" and got == tokens


@given(st.binary(max_size=256))
def test_random_bytes(files, data):
    check(files, data)


@given(st.binary(max_size=128))
def test_random_bytes_after_the_magic(files, data):
    check(files, struct.pack("<I", STATE_MAGIC) + data)


@given(state_files())
def test_structured_but_corrupted(files, case):
    data, tokens = case
    check(files, data, tokens)


@given(n_words=st.integers(MAX_TOKEN_WORDS - 2, 2**32 - 1), packed_count=I32,
       tail=st.binary(max_size=64), packed=st.booleans())
def test_huge_claims_do_not_allocate(files, n_words, packed_count, tail, packed):
    """A header that claims up to 2^32 token words, or a packed payload that claims 2^31
    tokens, in a file of a few bytes: refused from the header, nothing allocated for it."""
    words = struct.pack("<iii", -1, 1, packed_count) if packed else struct.pack("<i", 7)
    data = struct.pack("<III", STATE_MAGIC, 4, n_words) + words + tail
    path = files.write("huge.bin", data)
    with bounded_memory():
        kind, _ = outcome("state file tokens", lambda: read_state_tokens(path), StateFileError,
                          names=path.name)
    assert kind == "refused"
