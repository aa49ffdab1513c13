"""Model identity and memory kind, read from the GGUF metadata.

The memory kind decides whether a parked session can resume cheaply: a dense
model keeps every position, so a restore is enough; a sliding-window or
recurrent/hybrid model can only roll back to a context checkpoint, which the
state file does not hold (PR #13194 comment, upstream #25913), so it needs a
checkpoint sidecar (turboquant PR #206). A state file also restores only into
the same model file, hence the cached SHA-256.

Metadata is read with ``gguf.GGUFReader`` (memory-mapped: tensors are not read).
``gguf`` and ``numpy`` are imported only when a model's metadata is read (about 120 ms):
the host-side CLI a move runs over SSH (``kv-valet sessions receive``) and the model
identity (size + hashes) never need them.
"""

from __future__ import annotations

import hashlib
import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from app.core.architectures import HYBRID_ARCHITECTURES, RECURRENT_ARCHITECTURES, SWA_ARCHITECTURES  # noqa: F401
from app.core.states import MemoryKind

if TYPE_CHECKING:
    from app.core.park_size import ModelShape

GGUF_MAGIC = b"GGUF"
HASH_CHUNK = 1024 * 1024


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    size: int
    mtime: float
    architecture: str
    name: str
    memory_kind: MemoryKind
    n_swa: int | None
    context_length: int | None
    file_type: int | None


class ModelFileError(Exception):
    """The model file is missing, unreadable or not GGUF (message is user-facing)."""


def _value(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        value = field.contents()
    except Exception:  # why: a malformed field reads as absent: the model's info says unknown for it
        return None
    if hasattr(value, "item"):
        value = value.item()
    return value


def _int(value) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError, OverflowError):  # OverflowError: a float field holding inf
        return None


def classify_memory(architecture: str, n_swa: int | None) -> MemoryKind:
    """The memory kind llama.cpp gives ``architecture``: recurrent or hybrid by its own lists (the
    recurrent state dominates a sliding window), else sliding-window when the architecture slides
    and the file gives a window, else dense."""
    if architecture in RECURRENT_ARCHITECTURES or architecture in HYBRID_ARCHITECTURES:
        return MemoryKind.RECURRENT_HYBRID
    if n_swa and architecture in SWA_ARCHITECTURES:
        return MemoryKind.SLIDING_WINDOW
    return MemoryKind.DENSE


def kind_from_server_log(architecture: str | None, is_swa_any: bool | None) -> MemoryKind | None:
    """The memory kind the running server itself reports at load (``print_info: arch`` and
    ``print_info: is_swa_any``), or None when its log has not said."""
    if not architecture:
        return None
    if architecture in RECURRENT_ARCHITECTURES or architecture in HYBRID_ARCHITECTURES:
        return MemoryKind.RECURRENT_HYBRID
    if is_swa_any is None:
        return None
    return MemoryKind.SLIDING_WINDOW if is_swa_any else MemoryKind.DENSE


_READER_CLASS: type | None = None


def _metadata_reader_class() -> type:
    """:class:`_MetadataReader`, made on first use (gguf and numpy are imported then)."""
    global _READER_CLASS
    if _READER_CLASS is not None:
        return _READER_CLASS
    import gguf
    import numpy as np

    class _MetadataReader(gguf.GGUFReader):
        """gguf's own reader, told not to unpack array *contents* item by item.

        ``GGUFReader`` builds a numpy view per element of every metadata array: 12 s
        for Gemma 3's 262,144-entry vocabulary, for keys KV Valet never reads. Here
        numeric arrays are one view and string arrays are skipped by walking their
        lengths; every scalar key is parsed by gguf exactly as before.
        """

        def _get_field_parts(self, orig_offs, raw_type):
            gtype = gguf.GGUFValueType(raw_type)
            if gtype != gguf.GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            offs = orig_offs
            raw_itype = self._get(offs, np.uint32)
            offs += int(raw_itype.nbytes)
            alen = self._get(offs, np.uint64)
            offs += int(alen.nbytes)
            itype = gguf.GGUFValueType(raw_itype[0])
            count = int(alen[0])
            nptype = self.gguf_scalar_to_np.get(itype)
            if nptype is not None:
                values = self._get(offs, nptype, count)
                return offs + int(values.nbytes) - orig_offs, [raw_itype, alen, values], [2], [gtype, itype]
            if itype == gguf.GGUFValueType.STRING:
                data, end = self.data, len(self.data)
                for _ in range(count):  # u64 length + bytes, per string
                    if offs + 8 > end:  # a count past the file's end (up to 2^64): refuse, do not spin
                        raise ValueError(f"a string array of {count:,} items runs past the end of the file")
                    n = int.from_bytes(data[offs:offs + 8].tobytes(), "little")
                    offs += 8 + n
                return offs - orig_offs, [raw_itype, alen], [], [gtype, itype]
            return super()._get_field_parts(orig_offs, raw_type)  # nested arrays: rare, keep gguf's way

    _READER_CLASS = _MetadataReader
    return _MetadataReader


def __getattr__(name: str):
    """``_MetadataReader`` (app.tools.diagnose reads it) without importing gguf at import time."""
    if name == "_MetadataReader":
        return _metadata_reader_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@contextlib.contextmanager
def _open_gguf(path: Path):
    """(the file's stat, a metadata reader over it, its architecture); the memory map closed after.
    Raises ModelFileError with a user-facing message for anything that is not a readable GGUF."""
    try:
        st = path.stat()
        with open(path, "rb") as f:
            magic = f.read(4)
    except FileNotFoundError:
        raise ModelFileError(f"model file not found: {path}") from None
    except IsADirectoryError:
        raise ModelFileError(f"model path is a folder, not a GGUF file: {path}") from None
    except OSError as exc:
        raise ModelFileError(f"cannot read model file {path}: {exc.strerror or exc}") from None
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"not a GGUF model file (magic {magic!r}): {path}")

    reader_class = _metadata_reader_class()  # gguf + numpy: imported only when a model is actually read
    try:
        reader = reader_class(path, "r")
    except Exception as exc:
        raise ModelFileError(f"cannot parse GGUF file {path}: {exc}") from exc
    try:
        arch = _value(reader, "general.architecture")
        if not isinstance(arch, str) or not arch:
            raise ModelFileError(f"GGUF file has no general.architecture: {path}")
        yield st, reader, arch
    finally:
        mmap_obj = getattr(getattr(reader, "data", None), "_mmap", None)
        if mmap_obj is not None:
            try:
                mmap_obj.close()
            except Exception:  # why: best-effort close in a finally: must not mask the read's result or its error
                pass


def read_model_info(path: str | os.PathLike) -> ModelInfo:
    path = Path(path)
    with _open_gguf(path) as (st, reader, arch):
        name = _value(reader, "general.name")
        n_swa = _int(_value(reader, f"{arch}.attention.sliding_window"))
        return ModelInfo(
            path=path,
            size=st.st_size,
            mtime=st.st_mtime,
            architecture=arch,
            name=name if isinstance(name, str) and name else path.stem,
            memory_kind=classify_memory(arch, n_swa),
            n_swa=n_swa if n_swa else None,
            context_length=_int(_value(reader, f"{arch}.context_length")),
            file_type=_int(_value(reader, "general.file_type")),
        )


#: M-RoPE / IMROPE architectures: each KV cell carries llama_kv_cell_ext (llama_model_rope_type)
MROPE_ARCHITECTURES = frozenset({"qwen2vl", "paddleocr", "qwen3vl", "qwen3vlmoe", "qwen35", "qwen35moe", "clef"})
#: hybrids whose recurrent layers are those without KV heads (lfm2, jamba: ``n_head_kv(il) == 0``)
RECURRENT_BY_NO_KV_HEADS = frozenset({"lfm2", "lfm2moe", "jamba"})
#: hybrids whose every ``full_attention_interval``-th layer is attention (default 4), the rest recurrent
RECURRENT_BY_INTERVAL = frozenset({"qwen3next", "qwen35", "qwen35moe"})
#: the sliding pattern llama.cpp gives an architecture whose file has no ``sliding_window_pattern``
#: (``set_swa_pattern(n)``: layer il slides unless ``il % n == n - 1``)
DEFAULT_SWA_PATTERN = {"gemma2": 2, "gemma3": 6, "cohere2": 4, "cohere2moe": 4, "gpt-oss": 2, "exaone4": 4}
#: recurrent layouts laid out in app.core.park_size: (conv, ssm) elements of one layer
_SSM_ARCHITECTURES = frozenset({"mamba", "mamba2", "jamba", "qwen3next", "qwen35", "qwen35moe", "granitehybrid",
                                "falcon-h1", "nemotron_h", "nemotron_h_moe"})


def _per_layer(value, n_layer: int) -> list[int] | None:
    """A key that is a scalar or a per-layer array, as n_layer ints (None: absent or malformed)."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        items = [_int(v) for v in value]
        if len(items) < n_layer or any(v is None for v in items):
            return None
        return [int(v) for v in items[:n_layer]]  # type: ignore[arg-type]
    v = _int(value)
    return None if v is None else [v] * n_layer


def shape_from_metadata(arch: str, get) -> "ModelShape | None":
    """The :class:`app.core.park_size.ModelShape` of a model from its metadata (``get(key)`` gives a
    key's value or None), laid out as llama.cpp b11434 loads these architectures; None where the
    layout is not known here (then a park's size is calibrated from earlier parks)."""
    from app.core.park_size import ModelShape

    n_layer = _int(get(f"{arch}.block_count"))
    n_embd = _int(get(f"{arch}.embedding_length"))
    if not n_layer or not n_embd or n_layer <= 0:
        return None
    heads = _per_layer(get(f"{arch}.attention.head_count"), n_layer) or [0] * n_layer
    heads_kv = _per_layer(get(f"{arch}.attention.head_count_kv"), n_layer) or heads
    head = max(heads) or 1
    k_len = _int(get(f"{arch}.attention.key_length")) or n_embd // head
    v_len = _int(get(f"{arch}.attention.value_length")) or n_embd // head

    if arch in RECURRENT_ARCHITECTURES:
        recurrent = [True] * n_layer
    elif arch in RECURRENT_BY_NO_KV_HEADS:
        recurrent = [h == 0 for h in heads_kv]
    elif arch in RECURRENT_BY_INTERVAL:
        recurrent = [bool(v) for v in _per_layer(get(f"{arch}.attention.recurrent_layers"), n_layer) or []]
        if not recurrent:
            interval = _int(get(f"{arch}.full_attention_interval")) or 4
            recurrent = [(il + 1) % interval != 0 for il in range(n_layer)]
    elif arch in HYBRID_ARCHITECTURES:
        return None  # a hybrid laid out some other way
    else:
        recurrent = [False] * n_layer

    n_swa = _int(get(f"{arch}.attention.sliding_window")) or 0
    swa = [False] * n_layer
    if n_swa > 0 and (arch in SWA_ARCHITECTURES or arch in RECURRENT_BY_NO_KV_HEADS):
        if arch in RECURRENT_BY_NO_KV_HEADS:
            swa = [not r for r in recurrent]  # lfm2: every attention layer slides when a window is given
        else:
            pattern = get(f"{arch}.attention.sliding_window_pattern")
            if isinstance(pattern, (list, tuple)):
                flags = _per_layer(pattern, n_layer)
                if flags is None:
                    return None
                swa = [bool(f) for f in flags]
            else:
                n = _int(pattern) or DEFAULT_SWA_PATTERN.get(arch)
                if n is None:
                    return None  # a sliding layout not known here (llama4's chunks, ...)
                swa = [n == 0 or il % n < n - 1 for il in range(n_layer)]
    else:
        n_swa = 0

    kv, kv_swa = [], []
    for il in range(n_layer):
        if recurrent[il]:
            continue
        cell = (heads_kv[il] * k_len, heads_kv[il] * v_len)
        (kv_swa if swa[il] else kv).append(cell)

    rec: list[tuple[int, int]] = []
    if any(recurrent):
        if arch in ("lfm2", "lfm2moe"):
            l_cache = _int(get(f"{arch}.shortconv.l_cache")) or 0
            if l_cache <= 0:
                return None
            layer = (n_embd * (l_cache - 1), 0)
        elif arch in _SSM_ARCHITECTURES:
            d_conv = _int(get(f"{arch}.ssm.conv_kernel")) or 0
            d_inner = _int(get(f"{arch}.ssm.inner_size")) or 0
            d_state = _int(get(f"{arch}.ssm.state_size")) or 0
            n_group = _int(get(f"{arch}.ssm.group_count")) or 0
            if not d_inner or not d_state:
                return None
            layer = (max(d_conv - 1, 0) * (d_inner + 2 * n_group * d_state), d_state * d_inner)
        elif arch in ("rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"):
            shift = _int(get(f"{arch}.token_shift_count")) or 2
            wkv = _int(get(f"{arch}.wkv.head_size")) or 0
            if not wkv:
                return None
            layer = (shift * n_embd, n_embd * wkv)
        else:
            return None
        rec = [layer] * sum(recurrent)

    return ModelShape(architecture=arch, kv=tuple(kv), kv_swa=tuple(kv_swa), n_swa=n_swa, recurrent=tuple(rec),
                      iswa=n_swa > 0 and bool(kv_swa), cell_ext=arch in MROPE_ARCHITECTURES)


def read_model_shape(path: str | os.PathLike) -> "ModelShape | None":
    """What decides the size of a park of this model (app.core.park_size), from its GGUF metadata;
    None where its layout is not known here. Raises ModelFileError as :func:`read_model_info`."""
    with _open_gguf(Path(path)) as (_st, reader, arch):
        return shape_from_metadata(arch, lambda key: _value(reader, key))


def _load_cache(cache_file: Path) -> dict:
    try:
        data = json.loads(cache_file.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


QUICK_ID_BYTES = 16 * 1024 * 1024


_QUICK_IDS: dict[tuple[str, int, int], str] = {}


def model_quick_id(path: str | os.PathLike) -> str:
    """A model's identity available at once: its size and a SHA-256 of its first
    16 MiB (the GGUF header and metadata: architecture, hyper-parameters,
    vocabulary, tensor directory). Two files that differ there are different
    models; the full SHA-256 (:func:`model_sha256`, minutes for a big model)
    settles the rest when it is done. Remembered per (path, size, mtime) in this
    process: a resume's preflight asks for it every time."""
    try:
        st = os.stat(path)
        key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    except OSError as exc:
        raise ModelFileError(f"cannot read model file {path}: {exc.strerror or exc}") from None
    if key in _QUICK_IDS:
        return _QUICK_IDS[key]
    value = _quick_id(path)
    _QUICK_IDS[key] = value
    return value


def _quick_id(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            h.update(size.to_bytes(8, "little"))
            h.update(f.read(QUICK_ID_BYTES))
    except OSError as exc:
        raise ModelFileError(f"cannot read model file {path}: {exc.strerror or exc}") from None
    return "q1:" + h.hexdigest()


_KNOWN_SHA: dict[tuple[str, int, int], str] = {}
#: files whose digest the hash cache did not have, with that cache file's (size, mtime_ns) then
_NO_SHA: dict[tuple[str, int, int], tuple[int, int] | None] = {}


def known_identity(path: str | os.PathLike, cache_file: str | os.PathLike) -> tuple[int, str, str] | None:
    """The model's size, quick id and full SHA-256 ("" while not computed) when this process already knows
    them for the file as it is now (size, mtime): its quick id from :func:`model_quick_id`, its digest from
    :func:`cached_model_sha256`, or that function's finding that ``cache_file`` had none and has not been
    written since. Else None. A ``stat`` or two, no file read: cheap enough for a request's path."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    quick = _QUICK_IDS.get((os.path.abspath(path), st.st_size, st.st_mtime_ns))
    if quick is None:
        return None
    key = (str(Path(path).absolute()), st.st_size, st.st_mtime_ns)
    digest = _KNOWN_SHA.get(key)
    if digest is not None:
        return st.st_size, quick, digest
    if key in _NO_SHA and _NO_SHA[key] == _file_stamp(cache_file):
        return st.st_size, quick, ""
    return None


def _file_stamp(path: str | os.PathLike) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def cached_model_sha256(path: str | os.PathLike, cache_file: str | os.PathLike) -> str | None:
    """The full SHA-256 if it was computed for this file as it is now (size, mtime), else None."""
    path = Path(path).absolute()
    try:
        st = path.stat()
    except OSError:
        return None
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key in _KNOWN_SHA:
        return _KNOWN_SHA[key]
    stamp = _file_stamp(cache_file)  # before the read: a write after it makes the next call read again
    entry = _load_cache(Path(cache_file)).get(str(path))
    if isinstance(entry, dict) and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns:
        digest = entry.get("sha256")
        if isinstance(digest, str) and len(digest) == 64:
            _KNOWN_SHA[key] = digest
            return digest
    _NO_SHA[key] = stamp  # not there: known_identity needs no read while the cache file stays as it was
    return None


def model_sha256(
    path: str | os.PathLike,
    cache_file: str | os.PathLike,
    on_progress: Callable[[int, int], None] | None = None,
) -> str:
    """SHA-256 of the model file, computed once per (absolute path, size, mtime_ns).

    Hashing a 100 GB model takes minutes, so the digest is cached in a small JSON
    file; any change of size or mtime invalidates it.
    """
    path = Path(path).absolute()
    cache_file = Path(cache_file)
    try:
        st = path.stat()
    except OSError as exc:
        raise ModelFileError(f"cannot read model file {path}: {exc.strerror or exc}") from None
    key = str(path)
    stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    cache = _load_cache(cache_file)
    entry = cache.get(key)
    if isinstance(entry, dict) and entry.get("size") == stamp["size"] and entry.get("mtime_ns") == stamp["mtime_ns"]:
        digest = entry.get("sha256")
        if isinstance(digest, str) and len(digest) == 64:
            return digest

    h = hashlib.sha256()
    done = 0
    try:
        with open(path, "rb") as f:
            while chunk := f.read(HASH_CHUNK):
                h.update(chunk)
                done += len(chunk)
                if on_progress is not None:
                    on_progress(done, st.st_size)
    except OSError as exc:
        raise ModelFileError(f"cannot read model file {path}: {exc.strerror or exc}") from None
    digest = h.hexdigest()

    from app import files

    # re-read under the cache's lock: another process may have added entries meanwhile
    files.update_json(cache_file, lambda cache: cache.__setitem__(key, {**stamp, "sha256": digest}))
    return digest
