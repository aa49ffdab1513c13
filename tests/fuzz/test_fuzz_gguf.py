"""The GGUF metadata subset KV Valet reads (app.server.gguf_info.read_model_info): the
architecture, name, sliding window, context length and file type, and the keys that mark a
recurrent model. Files are built field by field (any value type under any key, arrays of
numbers and of strings, tensor infos) and then corrupted (a count, a length or a type changed,
a truncation, trailing bytes), plus random bytes after the magic.

Refusal type: ModelFileError, naming the file. A file that parses gives a memory kind; an
untouched file gives back the architecture, window and context length it was written with.
"""

from __future__ import annotations

import struct

from hypothesis import given, strategies as st

from app.core.states import MemoryKind
from app.server.gguf_info import ModelFileError, read_model_info
from tests.fuzz.fuzzkit import bounded_memory, outcome

U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
# GGUF value types
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
SCALAR = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i", FLOAT32: "<f",
          BOOL: "<?", UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}
ARCHS = st.sampled_from(["gemma3", "llama", "mamba2", "qwen3next", "lfm2", "x", ""])


def gstr(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


@st.composite
def scalar(draw, vtype: int):
    fmt = SCALAR[vtype]
    if vtype in (FLOAT32, FLOAT64):
        value = draw(st.floats(width=32 if vtype == FLOAT32 else 64, allow_nan=True, allow_infinity=True))
    elif vtype == BOOL:
        value = draw(st.booleans())
    else:
        size = struct.calcsize(fmt)
        signed = fmt[1].islower()
        lo, hi = (-(2 ** (8 * size - 1)), 2 ** (8 * size - 1) - 1) if signed else (0, 2 ** (8 * size) - 1)
        value = draw(st.integers(lo, hi))
    return struct.pack(fmt, value)


@st.composite
def value(draw, depth: int = 0):
    """(type, encoded value)"""
    vtype = draw(st.sampled_from([STRING, ARRAY] + list(SCALAR)) if depth < 2 else st.sampled_from(list(SCALAR)))
    if vtype == STRING:
        return vtype, gstr(draw(st.one_of(ARCHS.map(str.encode), st.binary(max_size=12))))
    if vtype == ARRAY:
        items = draw(st.lists(value(depth + 1), max_size=4))
        itype = items[0][0] if items else draw(st.sampled_from(list(SCALAR) + [STRING]))
        items = [v for t, v in items if t == itype]
        return vtype, struct.pack("<IQ", itype, len(items)) + b"".join(items)
    return vtype, draw(scalar(vtype))


@st.composite
def gguf_files(draw):
    arch = draw(ARCHS)
    keys = st.sampled_from(["general.architecture", "general.name", "general.file_type", "general.alignment",
                            f"{arch}.attention.sliding_window", f"{arch}.context_length", f"{arch}.ssm.d_state",
                            "tokenizer.ggml.tokens", "x"])
    kvs = []
    want = {}
    if draw(st.booleans()):
        kvs.append(gstr(b"general.architecture") + struct.pack("<I", STRING) + gstr(arch.encode()))
        want["arch"] = arch
        if draw(st.booleans()):
            window = draw(st.integers(0, 2**32 - 1))
            kvs.append(gstr(f"{arch}.attention.sliding_window".encode()) + struct.pack("<II", UINT32, window))
            want["n_swa"] = window or None
    seen = {"general.architecture"} if kvs else set()
    for _ in range(draw(st.integers(0, 5))):
        key = draw(st.one_of(keys, st.text(max_size=8)))
        if key in seen:
            continue  # a duplicate key is refused: keep the untouched files valid
        seen.add(key)
        vtype, enc = draw(value())
        kvs.append(gstr(key.encode()) + struct.pack("<I", vtype) + enc)
        want = None if key.startswith(("general.", arch)) else want
    tensors = b""
    n_tensors = draw(st.integers(0, 2))
    for i in range(n_tensors):
        dims = draw(st.lists(st.integers(1, 8), min_size=1, max_size=3))
        tensors += gstr(f"t{i}".encode()) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        tensors += struct.pack("<IQ", 0, 0)  # F32 at offset 0 of the data
    version = draw(st.sampled_from([3, 2, 1, 4]))  # the reader knows 2 and 3
    if version not in (2, 3):
        want = {}
    head = b"GGUF" + struct.pack("<IQQ", version, n_tensors, len(kvs))
    body = head + b"".join(kvs) + tensors
    body += bytes(-len(body) % 32) + bytes(4 * 8 * 8 * 8)  # aligned tensor data, enough for any dims above
    return body, want


def mutate(data: bytes, draw) -> bytes:
    how = draw(st.sampled_from(["none", "truncate", "append", "u32", "u64", "byte"]))
    if how == "truncate":
        return data[:draw(st.integers(4, len(data) - 1))]
    if how == "append":
        return data + draw(st.binary(min_size=1, max_size=40))
    if how in ("u32", "u64"):
        fmt, strat = ("<I", U32) if how == "u32" else ("<Q", U64)
        width = struct.calcsize(fmt)
        at = draw(st.integers(4, len(data) - width))
        return data[:at] + struct.pack(fmt, draw(strat)) + data[at + width:]
    if how == "byte":
        at = draw(st.integers(4, len(data) - 1))
        return data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1:]
    return data


def check(files, data: bytes, want=None):
    path = files.write("model.gguf", data)
    kind, info = outcome("GGUF metadata", lambda: read_model_info(path), ModelFileError, names=path.name)
    if kind == "parsed":
        assert isinstance(info.memory_kind, MemoryKind) and info.architecture
        assert info.n_swa is None or isinstance(info.n_swa, int)
    if want is not None:
        if "arch" not in want or not want["arch"]:
            assert kind == "refused"
        else:
            assert kind == "parsed" and info.architecture == want["arch"]
            if "n_swa" in want:
                assert info.n_swa == want["n_swa"]


@st.composite
def corrupted(draw):
    data, want = draw(gguf_files())
    mutated = mutate(data, draw)
    return mutated, (want if mutated == data else None)


@given(corrupted())
def test_structured_but_corrupted(files, case):
    data, want = case
    check(files, data, want)


@given(st.binary(max_size=300))
def test_random_bytes_after_the_magic(files, data):
    check(files, b"GGUF" + data)


@given(st.binary(max_size=64))
def test_random_bytes(files, data):
    check(files, data)


@given(count=st.integers(2**20, 2**64 - 1), itype=st.sampled_from([STRING, UINT8, FLOAT64, ARRAY]),
       strlen=st.integers(2**20, 2**64 - 1), where=st.sampled_from(["array", "string", "kv_count", "tensors"]))
def test_huge_claims_do_not_allocate_or_hang(files, count, itype, strlen, where):
    """An array of up to 2^64 items, a string of up to 2^64 bytes, 2^64 keys or tensors, in a
    file of a few dozen bytes: refused, without reading or allocating what is claimed."""
    arch = gstr(b"general.architecture") + struct.pack("<I", STRING) + gstr(b"gemma3")
    if where == "array":
        kv = gstr(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", ARRAY, itype, count) + gstr(b"a")
        data = b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + arch + kv
    elif where == "string":
        data = b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + arch + struct.pack("<Q", strlen) + b"general.name"
    elif where == "kv_count":
        data = b"GGUF" + struct.pack("<IQQ", 3, 0, count) + arch
    else:
        data = b"GGUF" + struct.pack("<IQQ", 3, count, 1) + arch + gstr(b"t0") + struct.pack("<IQ", 1, strlen)
    with bounded_memory():
        check(files, data)
