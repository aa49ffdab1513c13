"""Park a slot: save its KV state to disk without ever losing the previous copy.

Why it is more than one ``POST /slots/{id}?action=save``:

* **Slot ids wrap around** in llama-server ("allow id_slot to be out of
  bounds"): ``/slots/7`` on a 2-slot server saves slot 1. Ids are checked
  against ``GET /slots`` first.
* **The server overwrites in place, non-atomically**, and turboquant PR #206
  writes the ``<state>.ckpt`` sidecar *after* the state file, never removes an
  older one, and ties nothing to its state file: a stale sidecar can be paired
  with a new save. So the server saves to a temporary name
  (``kvv-tmp-<hex>.bin``: no leading dot, llama.cpp's fs_validate_filename
  refuses some), the file is verified (magic, version, token count ==
  ``n_saved``, size == ``n_written``), and only then are the state file and
  its sidecar swapped in *together*, under a journal (``catalog.add_pending``)
  that :func:`recover_parks` finishes or rolls back after a crash.
* The old state file and sidecar are renamed aside (same folder: cheap) until
  the catalog row is written, so any failure before that puts them back
  byte-identical.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from app import paths
from app.core.background import say_progress
from app import files
from app.core.restore_needs import CHECKPOINTED_KINDS, effective_kind
from app.core.states import SidecarStatus
from app.core.timings import Timings
from app.core.resume_matrix import ResumePrediction
from app.sessions import behaviour, files_check, sidecar_check
from app.sessions.files_lock import FilesLock
from app.sessions.slots import SlotError, find_row, held
from app.sessions.journal import Journal, JournalKind, Owner, ParkJournal, ParkPhase, Recovery, recover, recovers, replay
from app.sessions.target import HeldSession, ServerTarget
from app.monitor.slots import SlotRow
from app.server.client import ServerError, ServerUnreachable
from app.server.sidecar import SidecarReport
from app.server.statefile import StateFileError, read_state_header
from app.store.catalog import Catalog, CatalogError, SessionRecord

log = logging.getLogger(__name__)

TMP_PREFIX = "kvv-tmp-"
#: Sidecar conventions stored next to the state file: turboquant #206 / upstream
#: PR #24028 use ``.ckpt``, upstream PR #20819 a ``.checkpoints`` companion.
SIDECAR_SUFFIXES = (".ckpt", ".checkpoints")

ProgressFn = Callable[[str], None]


class ParkError(Exception):
    """A park that was refused or failed; the message is user-facing."""


@dataclass
class ParkResult:
    record: SessionRecord | None
    sidecar: SidecarReport | None
    warnings: list[str] = field(default_factory=list)
    slot_id: int | None = None
    error: str | None = None  # park_all: this slot failed (the others went on)
    unchanged: bool = False  # park_all: already parked as ``record`` and nothing ran since: not saved again

    @property
    def ok(self) -> bool:
        return self.error is None and self.record is not None


# --------------------------------------------------------------------------- names


def default_name(slot_id: int, now: float | None = None) -> str:
    return time.strftime("%Y-%m-%d %H-%M", time.localtime(now)) + f" slot {slot_id}"


def slugify(name: str) -> str:
    """A file name the server accepts: word characters, '.', '-', '_' only, no
    '..', no leading dot or dash (llama.cpp fs_validate_filename)."""
    slug = re.sub(r"[^\w.-]+", "-", name.strip(), flags=re.UNICODE)
    slug = re.sub(r"\.{2,}", ".", slug)
    slug = re.sub(r"-{2,}", "-", slug).strip("-._")
    # at most 120 characters and 200 bytes (a file name holds 255, with "-999.bin.checkpoints"),
    # stripped again after the cut: a trailing '.' would make "<slug>..bin", which the server refuses
    slug = slug[:120].encode()[:200].decode(errors="ignore").strip("-._") or "session"
    if slug.startswith(TMP_PREFIX):
        slug = "s-" + slug
    return slug


def pick_state_file(catalog: Catalog, save_dir: Path, profile: str, name: str) -> str:
    """``<slug>.bin``, unless another session (or a file we do not know) owns it."""
    own = catalog.get(profile, name)
    if own is not None and Path(own.save_dir) == save_dir:
        if (save_dir / own.state_file).is_symlink():  # a link may point anywhere: never park over one
            raise ParkError(f"{own.state_file} in {save_dir} is a symbolic link, not the file '{name}' was "
                            "parked to: KV Valet does not park over a link; remove it, or park under another name")
        return own.state_file
    taken = {r.state_file for r in catalog.list() if Path(r.save_dir) == save_dir}
    base = slugify(name)
    for i in range(1, 1000):
        candidate = f"{base}.bin" if i == 1 else f"{base}-{i}.bin"
        if candidate not in taken and not os.path.lexists(save_dir / candidate):  # lexists: a dangling link too
            return candidate
    raise ParkError(f"no free file name for '{name}' in {save_dir}")


# --------------------------------------------------------------------------- model identity


def model_hash_cache() -> Path:
    return paths.data_dir() / "model-hashes.json"


def model_kind_cache() -> Path:
    return paths.data_dir() / "model-kinds.json"


def _cached_memory_kind(model_path: str) -> str:
    """read_model_info's memory kind, cached by (path, size, mtime_ns).

    gguf.GGUFReader parses every metadata array in Python: 13 s for Gemma 3
    270M's 262,144-entry vocabulary, which would dominate every park/resume.
    """
    import json

    from app.server.gguf_info import read_model_info

    path = os.path.abspath(model_path)
    st = os.stat(path)
    stamp = [st.st_size, st.st_mtime_ns]
    cache_file = model_kind_cache()
    try:
        cache = json.loads(cache_file.read_text(encoding="utf-8"))
        if not isinstance(cache, dict):
            cache = {}
    except (OSError, ValueError):
        cache = {}
    entry = cache.get(path)
    if isinstance(entry, dict) and entry.get("stamp") == stamp and isinstance(entry.get("kind"), str):
        return entry["kind"]
    info = read_model_info(path)
    kind = getattr(info.memory_kind, "value", str(info.memory_kind))
    with contextlib.suppress(OSError):  # re-read under its lock: another process may have added entries
        files.update_json(cache_file, lambda cache: cache.__setitem__(path, {"stamp": stamp, "kind": kind}))
    return kind


@dataclass(frozen=True)
class ModelIdentity:
    """What is known about a model file now: its size and quick id at once, the
    full SHA-256 only once computed (in the background: minutes for 20 GB)."""

    size: int = 0
    quick_id: str = ""
    sha256: str = ""  # "" until computed
    memory_kind: str = "unknown"


async def model_identity(model_path: str, *, full: bool = False, kind: bool = True) -> ModelIdentity:
    """The model's identity without waiting for the full hash (unless ``full``), or an
    empty identity when the file is not readable here (attach mode to another machine).
    The memory kind is read from the GGUF metadata, cached by size + mtime."""
    from app.server.gguf_info import cached_model_sha256, model_quick_id, model_sha256

    if not model_path or not os.path.isfile(model_path):
        return ModelIdentity()
    def quick() -> tuple[int, str, str]:
        size = os.path.getsize(model_path)
        digest = model_sha256(model_path, model_hash_cache()) if full else \
            cached_model_sha256(model_path, model_hash_cache()) or ""
        return size, model_quick_id(model_path), digest

    try:
        size, quick_id, digest = await asyncio.to_thread(quick)
    except Exception:  # report: unreadable: identity unknown, not an error for the park (logged)
        log.warning("cannot identify the model file %s: its identity stays unknown", model_path, exc_info=True)
        return ModelIdentity()
    memory_kind = "unknown"
    if kind:
        try:
            memory_kind = await asyncio.to_thread(_cached_memory_kind, model_path)
        except Exception:  # report: the memory kind stays "unknown", not an error for the park (logged)
            log.warning("cannot read the memory kind of the model %s: it stays unknown", model_path, exc_info=True)
    return ModelIdentity(size, quick_id, digest, memory_kind)


# --------------------------------------------------------------------------- journal


def _rm(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _save_companions(tmp: Path) -> list[Path]:
    """What a save to ``tmp`` may write besides it: its sidecars, and the file KV Valet's
    sidecar build writes a PKCL v2 sidecar through (``<state>.ckpt.tmp``, renamed when whole).
    A server killed mid-sidecar leaves that one: a failed park removes it too, and recovery
    counts it as the park's own (another process's park in flight must keep it)."""
    return [Path(str(tmp) + s + t) for s in SIDECAR_SUFFIXES for t in ("", ".tmp")]


def _rollback(p: ParkJournal) -> None:
    """Undo a park whose new state file is not in place: old files back, temps gone."""
    d, tmp, final, backup = p.paths
    if backup.exists():
        os.replace(backup, final)
    for suf in SIDECAR_SUFFIXES:
        bak = Path(str(backup) + suf)
        if bak.exists():
            os.replace(bak, Path(str(final) + suf))
    for companion in _save_companions(tmp):  # first: a sidecar never outlives its state file
        _rm(companion)
    _rm(tmp)


def _finish(catalog: Catalog, p: ParkJournal) -> SessionRecord:
    """Complete a park whose new state file is in place: its sidecars, its record, the previous
    copy dropped. The end of every park's commit (:func:`_commit`), and of one a crash interrupted."""
    stored = _list_new(catalog, p)
    _drop_previous(p)
    return stored


def _list_new(catalog: Catalog, p: ParkJournal) -> SessionRecord:
    """The new sidecars next to the state file in place, then the session's record written."""
    d, tmp, final, backup = p.paths
    for suf in SIDECAR_SUFFIXES:
        new = Path(str(tmp) + suf)
        if new.exists():
            os.replace(new, Path(str(final) + suf))
    files.fsync_dir(d)  # the renames are durable before the row says the session is there
    rec = SessionRecord(**(p.record or {}))
    rec.id = None
    return catalog.add_or_replace(rec)


def _drop_previous(p: ParkJournal) -> None:
    d, tmp, final, backup = p.paths
    _rm(backup)
    for suf in SIDECAR_SUFFIXES:
        _rm(Path(str(backup) + suf))


def _listed_as_is(catalog: Catalog, p: ParkJournal, final: Path) -> bool:
    """The catalog lists ``final`` as it is on disk now (size and token count)."""
    rec = catalog.get(p.profile, p.name)
    if rec is None or rec.state_file != p.final or Path(rec.save_dir) != Path(p.save_dir):
        return False
    try:
        header = read_state_header(final)
    except (StateFileError, OSError):
        return False
    return header.file_size == rec.state_size and header.token_count == rec.n_tokens


def _discard(p: ParkJournal) -> None:
    """Remove what an interrupted park left aside: its previous copy and its temporary files."""
    d, tmp, final, backup = p.paths
    for f in [backup, *(Path(str(backup) + s) for s in SIDECAR_SUFFIXES), tmp, *_save_companions(tmp)]:
        _rm(f)


@recovers(JournalKind.PARK)
def recover_parks(run: Recovery) -> list[str]:
    """Finish or roll back parks a crash interrupted; delete orphaned temp files in ``run.save_dirs``.

    Run at app/CLI start (:func:`app.sessions.journal.recover`) and by a park before its commit.
    A journaled park whose temp state file still exists is rolled back (old state file and
    sidecar restored); one whose new state file is already in place (same inode as journaled)
    is finished (sidecar moved, record written). Parks still running, here or in another live
    process, are left alone.
    """
    catalog = run.catalog
    assert catalog is not None
    dirs = {Path(d) for d in run.save_dirs if d}
    # List files before reading the journal: a temp file seen here was journaled
    # before it was created, so a concurrent park cannot lose its file.
    leftovers = {p for d in dirs if d.is_dir() for p in d.glob(TMP_PREFIX + "*")}
    referenced: set[Path] = set()
    parks = [e.entry for e in Journal(catalog).entries(JournalKind.PARK) if isinstance(e.entry, ParkJournal)]
    committing = {p.tmp for p in parks if p.phase is ParkPhase.COMMIT}
    for p in parks:
        d, tmp, final, backup = p.paths
        referenced.update([tmp, backup, *_save_companions(tmp)] + [Path(str(backup) + s) for s in SIDECAR_SUFFIXES])

    def handle(p: ParkJournal) -> str | None:
        d, tmp, final, backup = p.paths
        name = p.name or p.final
        if p.phase is not ParkPhase.COMMIT:
            if p.tmp in committing:
                return None  # its commit entry decides
            _rollback(p)
            return f"park of '{name}' was interrupted while saving: temporary files removed"
        if tmp.exists():
            _rollback(p)
            return f"park of '{name}' was interrupted: rolled back, the previous copy is kept"
        if final.exists() and final.stat().st_ino == p.ino:
            _finish(catalog, p)
            return f"park of '{name}' was interrupted after the state file was moved: finished"
        if final.exists() and _listed_as_is(catalog, p, final):
            # parked again since (another process): that copy and its row stand; restoring this
            # park's previous copy over it would pair the newer row with an older file
            _discard(p)
            return f"park of '{name}' was interrupted and parked again since: leftovers removed"
        _rollback(p)
        return f"park of '{name}' was interrupted and its new file is gone: rolled back"

    messages = replay(catalog, JournalKind.PARK, handle, lambda p: f"the park of '{p.name or p.final}'")
    for f in sorted(leftovers - referenced):
        if f.exists():
            with contextlib.suppress(OSError):
                f.unlink()
                messages.append(f"deleted leftover temporary file {f}")
    return messages


def known_save_dirs(catalog: Catalog, extra=()) -> list[Path]:
    """Folders to sweep in recover_parks: journaled, catalogued, profile folders."""
    dirs = {Path(r.save_dir) for r in catalog.list()}
    dirs |= {Path(e.entry.save_dir) for e in Journal(catalog).entries(JournalKind.PARK)
             if isinstance(e.entry, ParkJournal)}
    sessions = paths.data_dir() / "sessions"
    if sessions.is_dir():
        dirs |= {d for d in sessions.iterdir() if d.is_dir()}
    dirs |= {Path(x) for x in extra if x}
    return sorted(dirs)


# --------------------------------------------------------------------------- sizes before a park


_SHAPES: dict[tuple[str, int, int], object] = {}


def _model_shape(model_path: str):
    """app.server.gguf_info.read_model_shape, remembered per (path, size, mtime) in this process; None
    when the file is not readable here or its layout is not known."""
    from app.server.gguf_info import ModelFileError, read_model_shape

    try:
        st = os.stat(model_path)
    except (OSError, TypeError, ValueError):
        return None
    key = (os.path.abspath(model_path), st.st_size, st.st_mtime_ns)
    if key not in _SHAPES:
        try:
            _SHAPES[key] = read_model_shape(model_path)
        except (ModelFileError, OSError, ValueError) as e:
            log.info("park size: the model %s gives no shape (%s): earlier parks are used instead", model_path, e)
            _SHAPES[key] = None
    return _SHAPES[key]


def _park_samples(catalog: Catalog, target: ServerTarget, quick_id: str) -> list:
    """This model's earlier parks with these KV types (any profile): what calibrates a prediction."""
    from app.core.park_size import ParkSample

    out = []
    for r in catalog.list():
        same_model = (quick_id and r.model_quick_id == quick_id) or \
            (not quick_id and target.model_path and r.model_path == target.model_path)
        if same_model and (r.cache_type_k or "f16") == (target.cache_type_k or "f16") and \
                (r.cache_type_v or "f16") == (target.cache_type_v or "f16") and r.state_size > 0:
            out.append(ParkSample(r.n_tokens, r.state_size, r.sidecar_size or 0, r.sidecar_count or 0))
    return out


def predict_park_size(target: ServerTarget, n_tokens: int, *, name: str | None = None, quick_id: str = ""):
    """The predicted size of a park of a slot holding ``n_tokens`` on ``target``
    (:class:`app.core.park_size.ParkSize`), or None when nothing tells. The model's metadata first
    (exact for the layouts app.core.park_size knows), else this model's earlier parks (catalog), else the
    session's previous copy; the checkpoint count is the previous copy's when it had more than one
    prompt makes. The source is in ``.source``."""
    from app.core import park_size as ps
    from app.core.sidecar_behaviour import Behaviour

    behaviour = target.behaviour
    writes = behaviour is not Behaviour.NONE  # not known yet: as if it wrote them (the larger figure)
    version = 1 if behaviour in (Behaviour.FORK, Behaviour.PORT) else 2
    prev = target.catalog.get(target.profile_name, name) if name else None
    shape = _model_shape(target.model_path) if target.model_path else None
    size = None
    if shape is not None:
        # --swa-full: the server makes no checkpoints of a sliding-window model (app.core.restore_needs)
        none_made = target.swa_full and not shape.recurrent
        size = ps.predict(shape, n_tokens, ctk=target.cache_type_k, ctv=target.cache_type_v,
                          ctx_checkpoints=target.ctx_checkpoints, writes_sidecar=writes,
                          n_checkpoints=0 if none_made else None, sidecar_version=version)
        if size is not None and none_made:
            size = replace(size, sidecar_max=size.sidecar)
    if size is None:
        size = ps.calibrate(_park_samples(target.catalog, target, quick_id), n_tokens,
                            ctx_checkpoints=target.ctx_checkpoints)
    if size is None and prev is not None and prev.n_tokens > 0 and prev.state_size > 0:
        size = ps.calibrate([ps.ParkSample(prev.n_tokens, prev.state_size, prev.sidecar_size or 0,
                                           prev.sidecar_count or 0)], n_tokens,
                            ctx_checkpoints=target.ctx_checkpoints, source=ps.SOURCE_PREVIOUS)
    if size is not None and prev is not None and writes:
        size = ps.with_previous(size, prev.sidecar_count)
    return size


def describe_size(size) -> str:
    """``about 1.2 MiB (state 1.0 MiB + sidecar 0.2 MiB: 2 checkpoints of 100.0 KiB), from the model metadata``"""
    from app.core.units import fmt_bytes

    side = ""
    if size.sidecar:
        side = f" + sidecar {fmt_bytes(size.sidecar)}"
        if size.n_checkpoints:
            side += f": {size.n_checkpoints} checkpoint{'' if size.n_checkpoints == 1 else 's'} of " \
                    f"{fmt_bytes(size.per_checkpoint)}"
    return f"about {fmt_bytes(size.total)} (state {fmt_bytes(size.state)}{side}), from {size.source}"


def _space_check(save_dir: Path, size, budget_bytes: int | None) -> None:
    """Refuse a park before it runs when the disk (or the disk budget) cannot hold its predicted size."""
    from app.core.units import fmt_bytes

    if size is None:
        return
    if budget_bytes is not None and size.total > budget_bytes:
        raise ParkError(f"the park would not fit in the disk budget of {fmt_bytes(budget_bytes)}: it needs "
                        f"{describe_size(size)}; nothing was saved (raise the budget in the preferences)")
    try:
        free = shutil.disk_usage(save_dir).free
    except OSError:
        return
    if free < size.total:
        raise ParkError(f"not enough space to park: the disk holding {save_dir} has {fmt_bytes(free)} free, the "
                        f"park needs {describe_size(size)}; nothing was saved (free some space first)")


# --------------------------------------------------------------------------- park


def _why_save_failed(save_dir: Path, n_tokens: int, catalog: Catalog, profile: str, name: str,
                     size=None) -> str | None:
    """What the folder says about a refused save. llama-server answers a full disk and a
    read-only folder alike with "Unable to save slot"; the folder is visible here. ``size``: the park's
    predicted size (:func:`predict_park_size`); without it, as many bytes per token as this session's
    previous copy."""
    from app.core.units import fmt_bytes

    if not os.access(save_dir, os.W_OK):
        return f"the folder {save_dir} is read-only"
    try:
        free = shutil.disk_usage(save_dir).free
    except OSError:
        return None
    if size is not None:
        if free < size.total:
            return f"the disk holding {save_dir} is full: {fmt_bytes(free)} free, the save needs {describe_size(size)}"
    else:
        prev = catalog.get(profile, name)
        need = int(prev.state_size / prev.n_tokens * n_tokens) if prev and prev.n_tokens > 0 else 0
        if need and free < need:
            return f"the disk holding {save_dir} is full: {fmt_bytes(free)} free, the save needs about {fmt_bytes(need)}"
    if free < 64 * 1024 * 1024:
        return f"the disk holding {save_dir} is almost full: {fmt_bytes(free)} free"
    return None


def _say(cb: ProgressFn | None, text: str) -> None:
    say_progress(cb, text, "park")


def _verify(tmp: Path, resp: dict) -> int:
    """Token count of the saved file; raises ParkError when it is not what the server said."""
    if resp.get("n_written") == 0:
        # the turboquant fork does not check its state write: a failed save answers success with
        # 0 bytes written (and still writes the checkpoint sidecar, which the rollback removes)
        raise ParkError("the server answered that it saved the slot but wrote 0 bytes: its state write "
                        "failed (this build does not report that as an error); nothing was parked")
    try:
        header = read_state_header(tmp)
    except StateFileError as e:
        raise ParkError(f"the saved file failed verification: {e}") from None
    n_saved, n_written = resp.get("n_saved"), resp.get("n_written")
    if isinstance(n_saved, int) and header.token_count != n_saved:
        raise ParkError(f"the saved file holds {header.token_count:,} tokens but the server said {n_saved:,}")
    if isinstance(n_written, int) and header.file_size != n_written:
        raise ParkError(f"the saved file has {header.file_size:,} bytes but the server wrote {n_written:,}")
    return header.token_count


async def park_slot(target: ServerTarget, slot_id: int, name: str | None = None, *,
                    on_progress: ProgressFn | None = None, rows: list[SlotRow] | None = None,
                    budget_bytes: int | None = None) -> ParkResult:
    """Save slot ``slot_id`` as session ``name`` (replacing a session of that name).
    ``rows``: the ``/slots`` the caller already read (a park reads it once). ``budget_bytes``: the most
    this park may take (the conversation proxy's disk budget); a park predicted larger, or larger than
    the free space of the save folder, is refused before the server is asked."""
    return await target.queue.run(f"Park slot {slot_id}",
                                  lambda: _park(target, slot_id, name, on_progress, rows, budget_bytes))


async def _park(target: ServerTarget, slot_id: int, name: str | None, on_progress,
                rows: list[SlotRow] | None = None, budget_bytes: int | None = None) -> ParkResult:
    rows = rows if rows is not None else await target.slot_rows()
    try:
        slot = find_row(rows, slot_id)
    except SlotError as e:
        raise ParkError(str(e)) from None
    n_live = held(slot)
    if n_live <= 0:
        raise ParkError(f"slot {slot_id} is empty: there is nothing to park")
    name = (name or "").strip() or default_name(slot_id)
    if target.save_dir is None:
        raise ParkError("the server's --slot-save-path folder is not known: choose it first")
    save_dir = Path(target.save_dir)
    if not save_dir.is_dir():
        raise ParkError(f"the server's --slot-save-path folder {save_dir} is not visible here")
    catalog = target.catalog
    final_name = pick_state_file(catalog, save_dir, target.profile_name, name)
    hexid = secrets.token_hex(6)
    tmp_name = f"{TMP_PREFIX}{hexid}.bin"
    entry = ParkJournal(save_dir=str(save_dir), tmp=tmp_name, final=final_name,
                        backup=f"{TMP_PREFIX}{hexid}.prev.bin", name=name, profile=target.profile_name,
                        owner=Owner.me())

    # Model identity first (the first hash of a big model takes minutes): nothing on disk yet.
    _say(on_progress, "identifying the model")
    ident = await model_identity(target.model_path)
    memory_kind = target.model_kind_from_log or ident.memory_kind  # the running server's own word wins
    if target.model_kind_from_log and ident.memory_kind not in ("unknown", target.model_kind_from_log):
        log.info("park: the server reports a %s model, its GGUF reads as %s: the server's word is kept",
                 target.model_kind_from_log, ident.memory_kind)
    # what a restore of this park needs on a server with these flags (--swa-full: no checkpoints)
    restore_kind = effective_kind(memory_kind, swa_full=target.swa_full)
    # the size before the save: refused now when the disk (or the budget) cannot hold it
    size = await asyncio.to_thread(predict_park_size, target, n_live, name=name, quick_id=ident.quick_id)
    _space_check(save_dir, size, budget_bytes)

    journal = Journal(catalog)
    jid = journal.begin(entry)
    d, tmp, final, backup = entry.paths
    try:
        _say(on_progress, f"saving slot {slot_id} ({n_live:,} tokens)")
        try:
            resp = await target.client.save_slot(slot_id, tmp_name)
        except ServerUnreachable as e:
            raise ParkError(f"the server stopped answering during the save ({e.reason})") from None
        except ServerError as e:
            why = _why_save_failed(save_dir, n_live, catalog, target.profile_name, name, size)
            raise ParkError(f"the server refused to save slot {slot_id}: {e.message}"
                            + (f" ({why})" if why else "")) from None
        _say(on_progress, "verifying the saved file")
        n_tokens = _verify(tmp, resp)
        for f in (tmp, *(Path(str(tmp) + s) for s in SIDECAR_SUFFIXES)):
            files.make_private(f)  # the server wrote them with its umask: 0600, as every file of ours
        # off the loop: a PKCL v2 sidecar's state hash reads the whole file (fresh in the page cache now)
        sidecar = await asyncio.to_thread(sidecar_check.inspect, tmp, n_tokens, restore_kind, verify_hash=True)
        # what this park wrote (each file's SHA-256, the sidecar's checkpoint positions): a file put in
        # their place later is named before a resume, a check or a move (app.core.park_files)
        _say(on_progress, "hashing the saved files")
        written = await asyncio.to_thread(files_check.digest, tmp)
        state_size = tmp.stat().st_size
        now = time.time()
        _say(on_progress, "moving the files into place")
        # Under the catalog's files lock (app.sessions.files_lock): another KV Valet process may
        # re-park or delete this session, or pick this file name, at the same moment. The name
        # is picked again under it, and a commit a killed process left half-done in this
        # folder is finished or undone first, so this one never swaps its file over it.
        lock = await asyncio.to_thread(FilesLock(catalog).acquire)
        try:
            recovered = recover([JournalKind.PARK], Recovery(catalog, (save_dir,), lock_held=True))
            final_name = pick_state_file(catalog, save_dir, target.profile_name, name)
            record = SessionRecord(
                name=name, profile=target.profile_name, state_file=final_name, save_dir=str(save_dir),
                sidecar_file=(final_name + sidecar.path.name[len(tmp_name):]) if sidecar.path else None,
                state_size=state_size, sidecar_size=sidecar.size, n_tokens=n_tokens,
                save_ms=Timings.of(resp).save_ms or 0.0,
                server_build=target.build, model_path=target.model_path, model_size=ident.size,
                model_sha256=ident.sha256, model_quick_id=ident.quick_id, cache_type_k=target.cache_type_k,
                cache_type_v=target.cache_type_v, n_ctx_slot=int(slot.n_ctx or 0), flash_attn=target.flash_attn,
                swa_full=target.swa_full, memory_kind=memory_kind, sidecar_status=sidecar.status,
                sidecar_reason=sidecar.reason, sidecar_count=len(sidecar.checkpoints), slot_id=slot_id,
                updated_at=now, parked_files=written.to_json(),
            )
            commit = replace(entry, final=final_name, phase=ParkPhase.COMMIT, ino=tmp.stat().st_ino,
                             record=asdict(record))
            cid = journal.begin(commit)
            journal.end(jid)
            jid, entry = cid, commit
            d, tmp, final, backup = entry.paths
            stored = _commit(catalog, commit)
            journal.end(jid)
        finally:
            lock.release()
    except BaseException as exc:
        with contextlib.suppress(OSError):
            _rollback(entry)
        try:
            journal.end(jid)
        except Exception:  # report: the park's own error goes on below; this one must not replace it
            log.exception("park of %r in %s: cannot end journal entry %s while undoing it", name, save_dir, jid)
        if isinstance(exc, OSError):
            raise ParkError(f"could not write the parked files in {save_dir}: {exc.strerror or exc}") from None
        raise

    try:  # the files in place are the ones hashed: the next look at them is a stat(), not a hash
        await asyncio.to_thread(files_check.stamp_files, catalog, stored)
    except (OSError, CatalogError) as exc:
        log.info("park of %r: its files' stamps were not recorded (%s): the next check hashes them", name, exc)
    if restore_kind in CHECKPOINTED_KINDS:
        catalog.record_sidecar_observation(target.build, sidecar.status in (
            SidecarStatus.PRESENT_VALID, SidecarStatus.PRESENT_UNVERIFIED), restore_kind)
    report = await asyncio.to_thread(sidecar_check.inspect, final, n_tokens, restore_kind, verify_hash=True)
    usable = report.status in (SidecarStatus.PRESENT_VALID, SidecarStatus.PRESENT_UNVERIFIED, SidecarStatus.NOT_NEEDED)
    resume = behaviour.resume_prediction(target, sidecar_usable=usable)
    warnings = park_warnings(report, memory_kind, n_tokens, resp, resume) + recovered
    target.held_as[slot_id] = HeldSession(stored.name, n_tokens, slot.id_task)
    return ParkResult(stored, report, warnings, slot_id)


def _commit(catalog: Catalog, p: ParkJournal) -> SessionRecord:
    """Swap in the new state file and its sidecar, then write the record.

    Old state file and sidecars are renamed aside first; if anything fails
    before the record is written they go back (the caller's _rollback).
    """
    d, tmp, final, backup = p.paths
    # durable: the new files' bytes on disk before they are renamed in, the renames on disk before
    # the row (FULL: on disk when it returns) says "parked"; a power cut then keeps this park
    for f in (tmp, *(Path(str(tmp) + s) for s in SIDECAR_SUFFIXES)):
        if f.exists():
            files.fsync_file(f)
    for suf in SIDECAR_SUFFIXES:
        old = Path(str(final) + suf)
        if old.exists():  # stale or previous sidecar: never paired with the new state file
            os.replace(old, Path(str(backup) + suf))
    if final.exists():
        os.replace(final, backup)
    os.replace(tmp, final)
    try:
        stored = _list_new(catalog, p)
    except BaseException:
        # Put the new files back under their temp names so _rollback sees "not moved"
        # (every old sidecar was renamed aside first, so what sits at final+suf is new).
        for suf in SIDECAR_SUFFIXES:
            moved = Path(str(final) + suf)
            if moved.exists():
                with contextlib.suppress(OSError):
                    os.replace(moved, Path(str(tmp) + suf))
        with contextlib.suppress(OSError):
            os.replace(final, tmp)
        raise
    _drop_previous(p)
    return stored


def park_warnings(report: SidecarReport, memory_kind: str, n_tokens: int, resp: dict,
                  resume: ResumePrediction | None = None) -> list[str]:
    """What the park says besides "parked". ``resume``: what the resume matrix measured for the first
    chat turn after a restart on this server (its family, build and flags, with or without this park's
    sidecar): no warning where it resumes, the measured cost and the remedy where it does not."""
    out = []
    if resume is not None and resume.known:
        if report.status is SidecarStatus.INVALID:
            out.append(f"sidecar {report.status.value}: {report.reason}")
        if not resume.resumes:
            out.append(f"{resume.sentence[0].upper()}{resume.sentence[1:]} (about {n_tokens:,} tokens)"
                       + (f"; to resume: {resume.remedy}" if resume.remedy else ""))
    elif report.status in (SidecarStatus.MISSING, SidecarStatus.INVALID):
        out.append(f"sidecar {report.status.value}: {report.reason} (about {n_tokens:,} tokens)")
    if memory_kind == "unknown":
        out.append("the model file is not readable here: its identity and memory kind are unknown, "
                   "so a resume cannot check that it goes into the same model")
    return out


# --------------------------------------------------------------------------- park all


@dataclass(frozen=True)
class ParkChoice:
    slot_id: int
    name: str
    unchanged: SessionRecord | None = None  # already parked as this session, nothing ran since: no new copy
    continues: bool = False  # the slot goes on from this session: the park updates it (no dated copy)


def _newest_on_slot(target: ServerTarget, slot_id: int) -> HeldSession | None:
    """What this server process last parked from or restored into ``slot_id``, this process's or
    another KV Valet process's (the catalog: parked or restored since the server started)."""
    mine = target.held_as.get(slot_id)
    if mine is not None or target.started_at is None:
        return mine
    best, best_at = None, target.started_at
    for rec in target.catalog.list(target.profile_name):
        if rec.slot_id != slot_id:
            continue
        for at, n in ((rec.updated_at, rec.n_tokens), (rec.last_restore_at, rec.last_n_restored)):
            if at is not None and n and at >= best_at:
                best, best_at = HeldSession(rec.name, int(n), None), at
    return best


def choose_parks(target: ServerTarget, rows: list[SlotRow], prefix: str | None = None) -> list[ParkChoice]:
    """Which slots a "park every slot" saves, and under which name: the one rule of every
    park-then-stop (the quit, a logout, shutdown and sleep, ``serve``'s Ctrl-C, Park all & stop).

    * A slot holding exactly the tokens it was just parked as or resumed as (no task ran on
      it since) is not parked again: a second, dated copy of the same chat buys nothing.
    * A slot whose last task went on from such a session (it reused at least half of that
      session's tokens from the cache) is parked *as that session*: the session is updated
      (its older copy is kept until the new one verifies) instead of adding a dated one.
    * Any other slot that holds tokens is parked as "<prefix> slot N" (prefix: the date).
    """
    prefix = (prefix or "").strip() or time.strftime("%Y-%m-%d %H-%M")
    out: list[ParkChoice] = []
    for row in rows:
        sid = row.id
        if sid is None or held(row) <= 0:
            continue
        before = _newest_on_slot(target, sid)
        if before is not None and held(row) == before.n_tokens and \
                (before.id_task is None or row.id_task == before.id_task):
            rec = target.catalog.get(target.profile_name, before.name)
            if rec is not None:
                out.append(ParkChoice(sid, before.name, unchanged=rec))
                continue
        if before is not None and held(row) > before.n_tokens and (row.n_cached or 0) * 2 >= before.n_tokens \
                and target.catalog.get(target.profile_name, before.name) is not None:
            out.append(ParkChoice(sid, before.name, continues=True))
            continue
        out.append(ParkChoice(sid, f"{prefix} slot {sid}"))
    return out


async def park_all(target: ServerTarget, *, prefix: str | None = None,
                   on_progress: ProgressFn | None = None) -> list[ParkResult]:
    """Park every slot that holds tokens, as :func:`choose_parks` names them (reading
    ``/slots`` once); a failing slot is reported in its ParkResult.error and the others go on."""
    rows = await target.slot_rows()
    results: list[ParkResult] = []
    for choice in choose_parks(target, rows, prefix):
        sid = choice.slot_id
        if choice.unchanged is not None:
            results.append(ParkResult(choice.unchanged, None, [], sid, unchanged=True))
            continue
        try:
            results.append(await park_slot(target, sid, choice.name, on_progress=on_progress, rows=rows))
        except (ParkError, ServerError, ServerUnreachable, OSError) as e:
            results.append(ParkResult(None, None, [], sid, str(e)))
    return results


def describe(result: ParkResult) -> str:
    """One line for the CLI/log: name, tokens, size, sidecar status and reason."""
    if not result.ok:
        return f"slot {result.slot_id}: not parked: {result.error}"
    from app.core.units import fmt_bytes

    r = result.record
    assert r is not None
    if result.unchanged:
        return f"slot {r.slot_id if result.slot_id is None else result.slot_id}: already parked as '{r.name}' " \
               f"({r.n_tokens:,} tokens, unchanged since): not saved again"
    sc = result.sidecar
    side = f"sidecar {sc.status.value}: {sc.reason}" if sc else "sidecar unknown"
    return (f"parked slot {r.slot_id} as '{r.name}': {r.n_tokens:,} tokens, "
            f"{fmt_bytes(r.state_size + r.sidecar_size)} ({r.state_file}); {side}")


def record_dict(rec: SessionRecord) -> dict[str, Any]:
    return asdict(rec)
