"""Checkpoint sidecars: the files that make a parked SWA/hybrid session resumable.

A model whose memory cannot be truncated (sliding-window attention, recurrent or
hybrid state) can only roll back to a *context checkpoint*. Checkpoints live in
process memory and are not in the state file, so after a restart the server
re-prefills everything (upstream #25913, #28194, #26676). Builds that persist
them write a sidecar; there is no upstream format yet, so each convention is
recognised by its magic:

* turboquant PR #206 (merged in the fork): ``<state>.ckpt``, ``u32 magic
  0x4C434B50`` (bytes ``PKCL``), ``u32 version = 1``, ``u32 count`` (<= 1024),
  then per checkpoint ``i64 n_tokens, i32 pos_min, i32 pos_max, u64 n_tgt,
  u64 n_dft`` followed by ``n_tgt + n_dft`` bytes. Written after the state
  file, not atomically, never removed: a stale one can sit next to a new save.
* PKCL version 2 (upstream work after #206): ``u32 magic``, ``u32 version = 2``,
  ``u64 state_hash`` (64-bit FNV-1a of every byte of the state file), ``u32
  count``, per checkpoint ``i64 n_tokens, i32 pos_min, i32 pos_max`` and three
  blocks (target, draft, speculative), each ``u64 size`` and its bytes. The
  hash ties the sidecar to its state file: a sidecar of an older save is named
  stale here, before the server would refuse it at restore. A PKCL file of a
  version this app does not know is "present, unverified", not invalid.
* upstream PR #24028 (open): ``<state>.ckpt``, ``magic[8] = "LSCKPT2\\0"``,
  ``u64 count``, per checkpoint ``i32 pos_min, i32 pos_max, i64 n_tokens,
  u64 size_tgt, u64 size_dft``, then the bytes.
* upstream PR #20819 (open): a ``<state>.checkpoints`` companion file whose
  layout is not documented: reported as present but unverified.
* upstream PR #26004 (open): checkpoints appended inside the state file; see
  :func:`appended_checkpoints`.

Headers are walked with ``seek()``; checkpoint payloads (7.5 MB each for a
270M model, far more for big ones) are never read. Stdlib only: the fake
llama-server imports the writers.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

from app.core.states import SidecarStatus

PKCL_MAGIC = 0x4C434B50  # bytes b"PKCL" on disk
PKCL_MAGIC_BYTES = struct.pack("<I", PKCL_MAGIC)
PKCL_VERSION = 1
PKCL_VERSION_2 = 2
FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
LSCKPT2_MAGIC = b"LSCKPT2\0"
MAX_CHECKPOINTS = 1024

_PKCL_HEADER = struct.Struct("<III")
_PKCL_ENTRY = struct.Struct("<qiiQQ")  # n_tokens, pos_min, pos_max, n_tgt, n_dft
_PKCL2_HEADER = struct.Struct("<IIQI")  # magic, version, state_hash, count
_PKCL2_ENTRY = struct.Struct("<qii")  # n_tokens, pos_min, pos_max; then 3 x (u64 size, bytes)
_U64 = struct.Struct("<Q")
_LS_HEADER = struct.Struct("<8sQ")
_LS_ENTRY = struct.Struct("<iiqQQ")  # pos_min, pos_max, n_tokens, size_tgt, size_dft

KIND_PKCL = "PKCL v1"
KIND_PKCL2 = "PKCL v2"
KIND_LSCKPT2 = "LSCKPT2"
KIND_COMPANION = "companion"


@dataclass(frozen=True)
class Checkpoint:
    n_tokens: int
    pos_min: int
    pos_max: int
    size_tgt: int
    size_dft: int
    size_spec: int = 0  # PKCL v2's speculative-decoding block

    @property
    def size(self) -> int:
        return self.size_tgt + self.size_dft + self.size_spec


@dataclass(frozen=True)
class SidecarReport:
    status: SidecarStatus
    kind: str | None
    path: Path | None
    size: int
    checkpoints: tuple[Checkpoint, ...]
    reason: str  # one user-facing sentence, for every status
    version: int | None = None  # PKCL version
    state_hash: int | None = None  # PKCL v2: FNV-1a of the state file it belongs to


class SidecarError(Exception):
    """The sidecar is not what its magic claims (message is user-facing)."""


def sidecar_candidates(state_path: str | os.PathLike) -> list[Path]:
    """Where a build may have put the checkpoints of ``state_path``."""
    state_path = Path(state_path)
    return [
        state_path.with_name(state_path.name + ".ckpt"),
        state_path.with_name(state_path.name + ".checkpoints"),
    ]


def appended_checkpoints() -> None:
    """Checkpoints appended inside the state file (upstream PR #26004, open).

    They are only visible as ``n_written`` / ``n_read`` larger than a plain
    state would be, which nothing on disk lets us tell apart reliably; so this
    detector always answers None ("unknown") until that PR settles a layout.
    """
    return None


def _walk(f, file_size: int, start: int, count: int, entry: struct.Struct, decode) -> tuple[Checkpoint, ...]:
    checkpoints = []
    offset = start
    for i in range(count):
        f.seek(offset)
        raw = f.read(entry.size)
        if len(raw) != entry.size:
            raise SidecarError(
                f"truncated: checkpoint {i + 1} of {count} has no complete header "
                f"(file ends at {file_size:,} bytes)"
            )
        cp = decode(entry.unpack(raw))
        end = offset + entry.size + cp.size
        if end > file_size:
            raise SidecarError(
                f"truncated: checkpoint {i + 1} of {count} needs bytes up to {end:,} "
                f"but the file has {file_size:,}"
            )
        checkpoints.append(cp)
        offset = end
    if offset != file_size:
        raise SidecarError(f"sizes add up to {offset:,} bytes but the file has {file_size:,}")
    return tuple(checkpoints)


def _check_count(count: int) -> None:
    if count > MAX_CHECKPOINTS:
        raise SidecarError(f"corrupt header: {count:,} checkpoints (at most {MAX_CHECKPOINTS})")


def _read_pkcl(f, file_size: int) -> tuple[Checkpoint, ...]:
    raw = f.read(_PKCL_HEADER.size)
    if len(raw) != _PKCL_HEADER.size:
        raise SidecarError(f"truncated: {file_size} bytes, shorter than the PKCL header")
    magic, version, count = _PKCL_HEADER.unpack(raw)
    if magic != PKCL_MAGIC:
        raise SidecarError(f"not a PKCL sidecar (magic {raw[:4]!r})")
    if version != PKCL_VERSION:
        raise SidecarError(f"PKCL version {version}, only version {PKCL_VERSION} is known")
    _check_count(count)
    return _walk(f, file_size, _PKCL_HEADER.size, count, _PKCL_ENTRY,
                 lambda v: Checkpoint(n_tokens=v[0], pos_min=v[1], pos_max=v[2], size_tgt=v[3], size_dft=v[4]))


class UnknownVersion(Exception):
    def __init__(self, version: int):
        self.version = version
        super().__init__(f"PKCL version {version}")


def _read_pkcl2(f, file_size: int) -> tuple[int, tuple[Checkpoint, ...]]:
    raw = f.read(_PKCL2_HEADER.size)
    if len(raw) != _PKCL2_HEADER.size:
        raise SidecarError(f"truncated: {file_size} bytes, shorter than the PKCL v2 header")
    _magic, _version, state_hash, count = _PKCL2_HEADER.unpack(raw)
    _check_count(count)
    checkpoints = []
    offset = _PKCL2_HEADER.size
    for i in range(count):
        f.seek(offset)
        head = f.read(_PKCL2_ENTRY.size)
        if len(head) != _PKCL2_ENTRY.size:
            raise SidecarError(f"truncated: checkpoint {i + 1} of {count} has no complete header "
                               f"(file ends at {file_size:,} bytes)")
        n_tokens, pos_min, pos_max = _PKCL2_ENTRY.unpack(head)
        offset += _PKCL2_ENTRY.size
        sizes = []
        for block in ("target", "draft", "speculative"):
            f.seek(offset)
            rawsize = f.read(_U64.size)
            if len(rawsize) != _U64.size:
                raise SidecarError(f"truncated: checkpoint {i + 1}'s {block} block has no size")
            (size,) = _U64.unpack(rawsize)
            offset += _U64.size
            if offset + size > file_size:
                raise SidecarError(f"truncated: checkpoint {i + 1}'s {block} block is {size:,} bytes, longer "
                                   f"than the {file_size - offset:,} bytes left")
            offset += size
            sizes.append(size)
        checkpoints.append(Checkpoint(n_tokens, pos_min, pos_max, sizes[0], sizes[1], sizes[2]))
    if offset != file_size:
        raise SidecarError(f"{file_size - offset:,} trailing bytes after the last checkpoint")
    return state_hash, tuple(checkpoints)


def _read_lsckpt2(f, file_size: int) -> tuple[Checkpoint, ...]:
    raw = f.read(_LS_HEADER.size)
    if len(raw) != _LS_HEADER.size:
        raise SidecarError(f"truncated: {file_size} bytes, shorter than the LSCKPT2 header")
    magic, count = _LS_HEADER.unpack(raw)
    if magic != LSCKPT2_MAGIC:
        raise SidecarError(f"not an LSCKPT2 sidecar (magic {magic!r})")
    _check_count(count)
    return _walk(f, file_size, _LS_HEADER.size, count, _LS_ENTRY,
                 lambda v: Checkpoint(n_tokens=v[2], pos_min=v[0], pos_max=v[1], size_tgt=v[3], size_dft=v[4]))


def _read_any(path: Path) -> tuple[str, int | None, int | None, tuple[Checkpoint, ...]]:
    """(kind, PKCL version, state hash, checkpoints); raises SidecarError or UnknownVersion."""
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        f.seek(0)
        if head[:4] == PKCL_MAGIC_BYTES:
            version = struct.unpack("<I", head[4:8])[0] if len(head) == 8 else None
            if version == PKCL_VERSION_2:
                state_hash, cps = _read_pkcl2(f, file_size)
                return KIND_PKCL2, 2, state_hash, cps
            if version is not None and version != PKCL_VERSION:
                raise UnknownVersion(version)
            return KIND_PKCL, 1, None, _read_pkcl(f, file_size)
        if head == LSCKPT2_MAGIC:
            return KIND_LSCKPT2, None, None, _read_lsckpt2(f, file_size)
        raise SidecarError(f"unknown sidecar format (magic {head[:8]!r})")


def fnv1a64_file(path: str | os.PathLike, chunk: int = 1 << 20) -> int:
    """64-bit FNV-1a of every byte of ``path`` (PKCL v2's state hash). About 16 MB/s
    in Python: call it off the GUI thread, and cache it (app.sessions.sidecar_check)."""
    h, prime, mask = FNV_OFFSET, FNV_PRIME, (1 << 64) - 1
    with open(path, "rb") as f:
        while True:
            data = f.read(chunk)
            if not data:
                return h
            for b in data:
                h = ((h ^ b) * prime) & mask


def _named(path: str | os.PathLike, exc: SidecarError) -> SidecarError:
    """The same refusal, naming the file it is about."""
    name = Path(path).name
    text = str(exc)
    return exc if name in text else SidecarError(f"{name}: {text}")


def read_pkcl(path: str | os.PathLike) -> tuple[Checkpoint, ...]:
    """Checkpoint headers of a turboquant PR #206 sidecar; raises SidecarError."""
    with open(path, "rb") as f:
        try:
            return _read_pkcl(f, os.fstat(f.fileno()).st_size)
        except SidecarError as exc:
            raise _named(path, exc) from None


def read_lsckpt2(path: str | os.PathLike) -> tuple[Checkpoint, ...]:
    """Checkpoint headers of an upstream PR #24028 sidecar; raises SidecarError."""
    with open(path, "rb") as f:
        try:
            return _read_lsckpt2(f, os.fstat(f.fileno()).st_size)
        except SidecarError as exc:
            raise _named(path, exc) from None


def validate_checkpoints(checkpoints: tuple[Checkpoint, ...], saved_tokens: int | None) -> None:
    """Checks that tie a sidecar to its state file (nothing else does, PR #206)."""
    for i, cp in enumerate(checkpoints, 1):
        if cp.pos_min < 0 or cp.pos_min > cp.pos_max or cp.n_tokens < 0:
            raise SidecarError(
                f"checkpoint {i} is corrupt (pos_min {cp.pos_min:,}, pos_max {cp.pos_max:,}, "
                f"n_tokens {cp.n_tokens:,})"
            )
        if saved_tokens is not None and (cp.n_tokens > saved_tokens or cp.pos_max >= saved_tokens):
            raise SidecarError(
                f"checkpoint {i} reaches token {cp.n_tokens:,} but the state file holds "
                f"{saved_tokens:,}: the sidecar is stale or belongs to another save"
            )


def _missing_reason(memory_kind: str) -> str:
    if memory_kind == "recurrent-hybrid":
        why = "this model keeps recurrent state that cannot be rolled back"
    else:
        why = "this model uses sliding-window attention"
    return (
        f"no sidecar next to the state file: {why}, so the first query after a "
        "restart will re-prefill"
    )


def _valid_reason(checkpoints: tuple[Checkpoint, ...], saved_tokens: int | None) -> str:
    n = len(checkpoints)
    if n == 0:
        return "the sidecar holds no checkpoints, so the first query after a restart will re-prefill"
    last = max(cp.pos_max for cp in checkpoints)
    of = f" of {saved_tokens:,}" if saved_tokens is not None else ""
    return f"{n} checkpoint{'s' if n != 1 else ''}, the last at token {last:,}{of}"


def inspect_sidecar(state_path: str | os.PathLike, saved_tokens: int | None, memory_kind: str, *,
                    state_hash=None) -> SidecarReport:
    """Find and check the sidecar of ``state_path`` for a model of ``memory_kind``
    ("dense", "sliding-window" or "recurrent-hybrid").

    ``state_hash``: for a PKCL v2 sidecar, a callable giving the state file's
    FNV-1a (or None when not computed yet): called only for such a sidecar.
    Without it the hash is not checked and the reason says so."""
    memory_kind = getattr(memory_kind, "value", memory_kind)
    dense = memory_kind == "dense"
    ckpt, companion = sidecar_candidates(state_path)
    if ckpt.is_file():
        size = ckpt.stat().st_size
        version = stored_hash = None
        try:
            kind, version, stored_hash, checkpoints = _read_any(ckpt)
            validate_checkpoints(checkpoints, saved_tokens)
            hash_note = ""
            if version == PKCL_VERSION_2:
                actual = state_hash() if callable(state_hash) else state_hash
                if actual is None:
                    hash_note = " (the state file's hash is not checked yet)"
                elif actual != stored_hash:
                    raise SidecarError(f"stale: it belongs to another save of this state file (its state hash "
                                       f"{stored_hash:016x}, the file's {actual:016x}); the server would "
                                       "refuse it")
        except UnknownVersion as exc:
            status = SidecarStatus.NOT_NEEDED if dense else SidecarStatus.PRESENT_UNVERIFIED
            return SidecarReport(status, "PKCL", ckpt, size, (),
                                 f"present, unverified (version {exc.version}): a PKCL sidecar of a version "
                                 "this KV Valet does not know", version=exc.version)
        except SidecarError as exc:
            exc = _named(ckpt, exc)
            if dense:
                return SidecarReport(SidecarStatus.NOT_NEEDED, None, ckpt, size, (),
                                     f"not needed for a dense model (and the sidecar there is invalid: {exc})")
            return SidecarReport(SidecarStatus.INVALID, None, ckpt, size, (), f"invalid: {exc}")
        except OSError as exc:
            return SidecarReport(SidecarStatus.INVALID, None, ckpt, size, (),
                                 f"invalid: cannot read {ckpt.name}: {exc.strerror or exc}")
        reason = _valid_reason(checkpoints, saved_tokens) + hash_note
        if dense:
            return SidecarReport(SidecarStatus.NOT_NEEDED, kind, ckpt, size, checkpoints,
                                 f"not needed for a dense model ({reason})", version, stored_hash)
        return SidecarReport(SidecarStatus.PRESENT_VALID, kind, ckpt, size, checkpoints, reason, version,
                             stored_hash)
    if companion.is_file():
        size = companion.stat().st_size
        status = SidecarStatus.NOT_NEEDED if dense else SidecarStatus.PRESENT_UNVERIFIED
        return SidecarReport(status, KIND_COMPANION, companion, size, (),
                             f"{companion.name} is present ({size:,} bytes) but its format is not "
                             "documented (upstream PR #20819), so it cannot be checked")
    if dense:
        return SidecarReport(SidecarStatus.NOT_NEEDED, None, None, 0, (),
                             "no sidecar needed: a dense model keeps every position in the state file")
    return SidecarReport(SidecarStatus.MISSING, None, None, 0, (), _missing_reason(memory_kind))


def write_pkcl(path: str | os.PathLike, checkpoints) -> int:
    """Write a PKCL v1 sidecar from ``(Checkpoint, bytes_tgt, bytes_dft)`` items;
    sizes come from the byte strings. Returns the file size. For the fake
    server and tests."""
    items = list(checkpoints)
    with open(path, "wb") as f:
        f.write(_PKCL_HEADER.pack(PKCL_MAGIC, PKCL_VERSION, len(items)))
        for cp, tgt, dft in items:
            f.write(_PKCL_ENTRY.pack(cp.n_tokens, cp.pos_min, cp.pos_max, len(tgt), len(dft)))
            f.write(tgt)
            f.write(dft)
        return f.tell()


def write_lsckpt2(path: str | os.PathLike, checkpoints) -> int:
    """Write an upstream PR #24028 LSCKPT2 sidecar (same items as write_pkcl)."""
    items = list(checkpoints)
    with open(path, "wb") as f:
        f.write(_LS_HEADER.pack(LSCKPT2_MAGIC, len(items)))
        for cp, tgt, dft in items:
            f.write(_LS_ENTRY.pack(cp.pos_min, cp.pos_max, cp.n_tokens, len(tgt), len(dft)))
            f.write(tgt)
            f.write(dft)
        return f.tell()


# --------------------------------------------------------------------------- facts (per-build loaders)

def read_facts(state_path: str | os.PathLike):
    """The sidecar of ``state_path`` as :class:`app.core.sidecar_behaviour.SidecarFacts`:
    a lax walk that records trailing bytes, checkpoints past the tokens and a short
    file instead of refusing, so each build's own loader can be predicted
    (:func:`app.core.sidecar_behaviour.predict_load`). Headers only, with ``seek()``."""
    from app.core.sidecar_behaviour import MISSING, CheckpointFacts, SidecarFacts

    ckpt, companion = sidecar_candidates(state_path)
    if not ckpt.is_file():
        if companion.is_file():
            return SidecarFacts(path=str(companion), kind="companion", size=companion.stat().st_size)
        return MISSING
    with open(ckpt, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if head[:4] != PKCL_MAGIC_BYTES or len(head) < 8:
            kind = "LSCKPT2" if head == LSCKPT2_MAGIC else "other"
            return SidecarFacts(path=str(ckpt), kind=kind, size=size)
        version = struct.unpack("<I", head[4:8])[0]
        if version not in (PKCL_VERSION, PKCL_VERSION_2):
            return SidecarFacts(path=str(ckpt), kind="PKCL", version=version, size=size)
        f.seek(0)
        hdr = _PKCL2_HEADER if version == PKCL_VERSION_2 else _PKCL_HEADER
        raw = f.read(hdr.size)
        if len(raw) != hdr.size:
            return SidecarFacts(path=str(ckpt), kind="PKCL", version=version, size=size,
                                short=f"the file ends inside the header ({size:,} bytes)")
        state_hash = None
        if version == PKCL_VERSION_2:
            _m, _v, state_hash, count = hdr.unpack(raw)
        else:
            _m, _v, count = hdr.unpack(raw)
        offset, cps, short, largest = hdr.size, [], None, 0
        for i in range(min(count, MAX_CHECKPOINTS)):
            f.seek(offset)
            if version == PKCL_VERSION_2:
                e = f.read(_PKCL2_ENTRY.size)
                if len(e) != _PKCL2_ENTRY.size:
                    short = f"the file ends inside checkpoint {i + 1} of {count}"
                    break
                n_tokens, pos_min, pos_max = _PKCL2_ENTRY.unpack(e)
                offset += _PKCL2_ENTRY.size
                sizes = []
                for _block in range(3):
                    if offset > size:  # a block size past the end: no seek there (EINVAL, OverflowError)
                        break
                    f.seek(offset)
                    s = f.read(_U64.size)
                    if len(s) != _U64.size:
                        break
                    (n,) = _U64.unpack(s)
                    sizes.append(n)
                    offset += _U64.size + n
                if len(sizes) != 3 or offset > size:
                    short = f"the file ends inside checkpoint {i + 1} of {count}"
                    break
            else:
                e = f.read(_PKCL_ENTRY.size)
                if len(e) != _PKCL_ENTRY.size:
                    short = f"the file ends inside checkpoint {i + 1} of {count}"
                    break
                n_tokens, pos_min, pos_max, n_tgt, n_dft = _PKCL_ENTRY.unpack(e)
                sizes = [n_tgt, n_dft]
                offset += _PKCL_ENTRY.size + n_tgt + n_dft
                if offset > size:
                    short = f"the file ends inside checkpoint {i + 1} of {count}"
                    break
            largest = max([largest, *sizes])
            cps.append(CheckpointFacts(n_tokens, pos_min, pos_max, sum(sizes)))
        trailing = max(0, size - offset) if short is None and count <= MAX_CHECKPOINTS else 0
        return SidecarFacts(path=str(ckpt), kind="PKCL", version=version, count=count, size=size,
                            state_hash=state_hash, checkpoints=tuple(cps), trailing=trailing, short=short,
                            largest_blob=largest)
