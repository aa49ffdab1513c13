"""Checkpoint sidecars (app.server.sidecar) under random and corrupted files: PKCL v1, PKCL v2
and LSCKPT2, each written well-formed and then mutated (a header field, a checkpoint's sizes or
count, a truncation, trailing bytes), plus random bytes after each magic.

* ``read_pkcl`` / ``read_lsckpt2`` refuse with SidecarError, one sentence naming the file;
* ``inspect_sidecar`` never raises: a bad sidecar is a report (invalid, unverified or "not
  needed"), and an invalid one's reason names the file;
* ``read_facts`` (the lax walk for the per-build predictions) never raises;
* an untouched well-formed sidecar reads back the checkpoints it was written with.
"""

from __future__ import annotations

import struct

from hypothesis import given, strategies as st

from app.core.states import SidecarStatus
from app.server.sidecar import (LSCKPT2_MAGIC, PKCL_MAGIC, Checkpoint, SidecarError, inspect_sidecar, read_facts, read_lsckpt2, read_pkcl)
from tests.fuzz.fuzzkit import bounded_memory, outcome

I32 = st.integers(-(2**31), 2**31 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)
U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
KINDS = st.sampled_from(["dense", "sliding-window", "recurrent-hybrid"])


def _pos(draw):
    lo = draw(st.integers(0, 500))
    return draw(st.integers(lo + 1, lo + 600)), lo, draw(st.integers(lo, lo + 500))


@st.composite
def checkpoints(draw, blocks: int):
    out = []
    for _ in range(draw(st.integers(0, 4))):
        n_tokens, pos_min, pos_max = (_pos(draw) if draw(st.booleans())
                                      else (draw(I64), draw(I32), draw(I32)))
        out.append((n_tokens, pos_min, pos_max, [draw(st.binary(max_size=24)) for _ in range(blocks)]))
    return out


def encode_pkcl1(items) -> bytes:
    out = struct.pack("<III", PKCL_MAGIC, 1, len(items))
    for n, lo, hi, (tgt, dft) in items:
        out += struct.pack("<qiiQQ", n, lo, hi, len(tgt), len(dft)) + tgt + dft
    return out


def encode_pkcl2(items, state_hash: int) -> bytes:
    out = struct.pack("<IIQI", PKCL_MAGIC, 2, state_hash, len(items))
    for n, lo, hi, blocks in items:
        out += struct.pack("<qii", n, lo, hi)
        for b in blocks:
            out += struct.pack("<Q", len(b)) + b
    return out


def encode_lsckpt2(items) -> bytes:
    out = struct.pack("<8sQ", LSCKPT2_MAGIC, len(items))
    for n, lo, hi, (tgt, dft) in items:
        out += struct.pack("<iiqQQ", lo, hi, n, len(tgt), len(dft)) + tgt + dft
    return out


def mutate(data: bytes, draw) -> bytes:
    how = draw(st.sampled_from(["none", "truncate", "append", "u32", "u64", "byte"]))
    if how == "truncate" and data:
        return data[:draw(st.integers(0, len(data) - 1))]
    if how == "append":
        return data + draw(st.binary(min_size=1, max_size=40))
    if how in ("u32", "u64"):
        fmt, strat = ("<I", U32) if how == "u32" else ("<Q", U64)
        width = struct.calcsize(fmt)
        if len(data) >= width:  # a count, a size, a position: any aligned-or-not field
            at = draw(st.integers(0, len(data) - width))
            return data[:at] + struct.pack(fmt, draw(strat)) + data[at + width:]
    if how == "byte" and data:
        at = draw(st.integers(0, len(data) - 1))
        return data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1:]
    return data


@st.composite
def sidecars(draw):
    """(bytes, the checkpoints an untouched file must read back as, or None; the format)."""
    fmt = draw(st.sampled_from(["PKCL v1", "PKCL v2", "LSCKPT2"]))
    if fmt == "PKCL v2":
        items = draw(checkpoints(3))
        data = encode_pkcl2(items, draw(U64))
    else:
        items = draw(checkpoints(2))
        data = encode_pkcl1(items) if fmt == "PKCL v1" else encode_lsckpt2(items)
    mutated = mutate(data, draw)
    want = None
    if mutated == data:
        want = tuple(Checkpoint(n, lo, hi, *(len(b) for b in blocks)) for n, lo, hi, blocks in items)
    return mutated, want, fmt


def check(files, data: bytes, *, saved_tokens=None, kind="sliding-window", state_hash=None, want=None, fmt=None):
    folder = files.folder()
    state = folder / "chat.bin"
    state.write_bytes(b"state")
    ckpt = folder / "chat.bin.ckpt"
    ckpt.write_bytes(data)

    # the strict readers: SidecarError, naming the file
    got = {}
    for name, reader in (("sidecar read_pkcl", read_pkcl), ("sidecar read_lsckpt2", read_lsckpt2)):
        k, value = outcome(name, lambda r=reader: r(ckpt), SidecarError, names=ckpt.name)
        got[name] = value if k == "parsed" else None
    # the report: never an exception; an invalid sidecar's reason names the file
    k, report = outcome("sidecar inspect_sidecar",
                        lambda: inspect_sidecar(state, saved_tokens, kind, state_hash=lambda: state_hash),
                        rejects=lambda r: r.status is SidecarStatus.INVALID or "invalid" in r.reason)
    assert k == "parsed" and report.reason.strip() and "\n" not in report.reason
    if report.status is SidecarStatus.INVALID:
        assert ckpt.name in report.reason, report.reason
    # the lax walk of the per-build predictions: never an exception
    k, facts = outcome("sidecar read_facts", lambda: read_facts(state))
    assert k == "parsed" and facts.size == len(data)

    if want is not None:  # untouched: read back as written
        reader = "sidecar read_lsckpt2" if fmt == "LSCKPT2" else "sidecar read_pkcl"
        if fmt != "PKCL v2":
            assert got[reader] == want
        if report.status is SidecarStatus.PRESENT_VALID:
            assert report.checkpoints == want and report.kind == fmt


@given(sidecars(), st.one_of(st.none(), st.integers(0, 2000)), KINDS, st.one_of(st.none(), U64))
def test_structured_but_corrupted(files, case, saved_tokens, kind, state_hash):
    data, want, fmt = case
    check(files, data, saved_tokens=saved_tokens, kind=kind, state_hash=state_hash, want=want, fmt=fmt)


MAGICS = st.sampled_from([struct.pack("<II", PKCL_MAGIC, 1), struct.pack("<II", PKCL_MAGIC, 2),
                          struct.pack("<I", PKCL_MAGIC), LSCKPT2_MAGIC, b""])


@given(MAGICS, st.binary(max_size=200), KINDS)
def test_random_bytes_after_each_magic(files, magic, data, kind):
    check(files, magic + data, kind=kind)


@given(st.binary(max_size=64))
def test_companion_and_random_files(files, data):
    """The PR #20819 companion (layout unknown) is reported, never parsed; random bytes under
    the .ckpt name are refused."""
    folder = files.folder()
    state = folder / "chat.bin"
    (folder / "chat.bin.checkpoints").write_bytes(data)
    k, report = outcome("sidecar inspect_sidecar", lambda: inspect_sidecar(state, None, "sliding-window"))
    assert k == "parsed" and report.status is SidecarStatus.PRESENT_UNVERIFIED
    k, facts = outcome("sidecar read_facts", lambda: read_facts(state))
    assert k == "parsed" and facts.kind == "companion"
    check(files, data)


@given(fmt=st.sampled_from(["PKCL v1", "PKCL v2", "LSCKPT2"]), count=st.integers(0, 2**32 - 1),
       size=st.integers(2**31, 2**64 - 1), tail=st.binary(max_size=32))
def test_huge_claims_do_not_allocate(files, fmt, count, size, tail):
    """A count of up to 2^32 checkpoints or a block of up to 2^64 bytes, in a file of a few
    dozen bytes: refused (or walked header by header), never allocated."""
    if fmt == "PKCL v1":
        data = struct.pack("<III", PKCL_MAGIC, 1, count) + struct.pack("<qiiQQ", 10, 0, 5, size, size)
    elif fmt == "PKCL v2":
        data = struct.pack("<IIQI", PKCL_MAGIC, 2, 0, count) + struct.pack("<qiiQ", 10, 0, 5, size)
    else:
        data = struct.pack("<8sQ", LSCKPT2_MAGIC, count * (2**32 if count % 2 else 1)) + \
            struct.pack("<iiqQQ", 0, 5, 10, size, 0)
    with bounded_memory():
        check(files, data + tail)
