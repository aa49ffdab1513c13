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
  that :func:`recover_interrupted` finishes or rolls back after a crash.
* The old state file and sidecar are renamed aside (same folder: cheap) until
  the catalog row is written, so any failure before that puts them back
  byte-identical.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from app import paths
from app.jobs.target import ServerTarget
from app.server.client import ServerError, ServerUnreachable
from app.server.sidecar import SidecarReport, SidecarStatus, inspect_sidecar
from app.server.statefile import StateFileError, read_state_header
from app.store.catalog import Catalog, SessionRecord

TMP_PREFIX = "kvv-tmp-"
#: Sidecar conventions stored next to the state file: turboquant #206 / upstream
#: PR #24028 use ``.ckpt``, upstream PR #20819 a ``.checkpoints`` companion.
SIDECAR_SUFFIXES = (".ckpt", ".checkpoints")
CHECKPOINTED_KINDS = ("sliding-window", "recurrent-hybrid")

ProgressFn = Callable[[str], None]

# Journal ids of parks running in this process: recover_interrupted leaves them alone.
_IN_FLIGHT: set[int] = set()


class ParkError(Exception):
    """A park that was refused or failed; the message is user-facing."""


@dataclass
class ParkResult:
    record: SessionRecord | None
    sidecar: SidecarReport | None
    warnings: list[str] = field(default_factory=list)
    slot_id: int | None = None
    error: str | None = None  # park_all: this slot failed (the others went on)

    @property
    def ok(self) -> bool:
        return self.error is None and self.record is not None


# --------------------------------------------------------------------------- slots


async def fetch_slots(target: ServerTarget) -> list[dict]:
    slots = await target.client.slots()
    if not isinstance(slots, list):
        raise ParkError("GET /slots did not answer a list")
    return slots


def slot_ids_text(slots: list[dict]) -> str:
    ids = sorted(int(s.get("id", i)) for i, s in enumerate(slots))
    if not ids:
        return "no slots"
    if ids == list(range(ids[0], ids[-1] + 1)):
        return f"slots {ids[0]}-{ids[-1]}" if len(ids) > 1 else f"slot {ids[0]}"
    return "slots " + ", ".join(map(str, ids))


def find_slot(slots: list[dict], slot_id: int) -> dict:
    """The /slots entry of ``slot_id``; refuses ids the server would wrap around."""
    for i, s in enumerate(slots):
        if int(s.get("id", i)) == slot_id:
            return s
    raise ParkError(f"slot {slot_id} does not exist: this server has {slot_ids_text(slots)}")


def slot_tokens(target: ServerTarget, slot: dict) -> int:
    """Tokens the slot holds: the restore count while no task ran since a
    restore (/slots does not show it), else n_prompt_tokens (n_tokens on
    older builds)."""
    sid = int(slot.get("id", -1))
    restored = target.restored.get(sid)
    # No task since the restore: id_task unchanged (build 11434) or absent.
    if restored is not None and slot.get("id_task") in (None, restored[2]):
        return int(restored[0] or 0)
    for key in ("n_prompt_tokens", "n_tokens"):
        v = slot.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return 0


# --------------------------------------------------------------------------- names


def default_name(slot_id: int, now: float | None = None) -> str:
    return time.strftime("%Y-%m-%d %H-%M", time.localtime(now)) + f" slot {slot_id}"


def slugify(name: str) -> str:
    """A file name the server accepts: word characters, '.', '-', '_' only, no
    '..', no leading dot or dash (llama.cpp fs_validate_filename)."""
    slug = re.sub(r"[^\w.-]+", "-", name.strip(), flags=re.UNICODE)
    slug = re.sub(r"\.{2,}", ".", slug)
    slug = re.sub(r"-{2,}", "-", slug).strip("-._")
    slug = slug[:120] or "session"
    if slug.startswith(TMP_PREFIX):
        slug = "s-" + slug
    return slug


def pick_state_file(catalog: Catalog, save_dir: Path, profile: str, name: str) -> str:
    """``<slug>.bin``, unless another session (or a file we do not know) owns it."""
    own = catalog.get(profile, name)
    if own is not None and Path(own.save_dir) == save_dir:
        return own.state_file
    taken = {r.state_file for r in catalog.list() if Path(r.save_dir) == save_dir}
    base = slugify(name)
    for i in range(1, 1000):
        candidate = f"{base}.bin" if i == 1 else f"{base}-{i}.bin"
        if candidate not in taken and not (save_dir / candidate).exists():
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
    cache[path] = {"stamp": stamp, "kind": kind}
    with contextlib.suppress(OSError):
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_name(cache_file.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, cache_file)
    return kind


async def model_identity(model_path: str) -> tuple[int, str, str]:
    """(size, sha256, memory kind) of a model file, or (0, "", "unknown") when it
    is not readable here (attach mode to a remote server). Hash and kind are
    cached by size + mtime, so only the first park of a model pays for them."""
    from app.server.gguf_info import model_sha256

    if not model_path or not os.path.isfile(model_path):
        return 0, "", "unknown"
    try:
        size = os.path.getsize(model_path)
        digest = await asyncio.to_thread(model_sha256, model_path, model_hash_cache())
    except Exception:  # unreadable: identity unknown, not an error
        return 0, "", "unknown"
    try:
        kind = await asyncio.to_thread(_cached_memory_kind, model_path)
    except Exception:
        kind = "unknown"
    return size, digest, kind


# --------------------------------------------------------------------------- journal


def _rm(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _process_stamp() -> tuple[int, float]:
    try:
        import psutil

        return os.getpid(), psutil.Process().create_time()
    except Exception:
        return os.getpid(), 0.0


def _journal_owner_alive(payload: dict) -> bool:
    pid, ctime = payload.get("pid"), payload.get("pid_ctime")
    if not pid or pid == os.getpid():
        return False
    try:
        import psutil

        p = psutil.Process(int(pid))
        return abs(p.create_time() - float(ctime or 0)) < 0.05
    except Exception:
        return False


def _paths(p: dict) -> tuple[Path, Path, Path, Path]:
    d = Path(p["save_dir"])
    return d, d / p["tmp"], d / p["final"], d / p["backup"]


def _rollback(p: dict) -> None:
    """Undo a park whose new state file is not in place: old files back, temps gone."""
    d, tmp, final, backup = _paths(p)
    if backup.exists():
        os.replace(backup, final)
    for suf in SIDECAR_SUFFIXES:
        bak = Path(str(backup) + suf)
        if bak.exists():
            os.replace(bak, Path(str(final) + suf))
    _rm(tmp)
    for suf in SIDECAR_SUFFIXES:
        _rm(Path(str(tmp) + suf))


def _finish(catalog: Catalog, p: dict) -> None:
    """Complete a park whose new state file is in place: sidecar, record, cleanup."""
    d, tmp, final, backup = _paths(p)
    for suf in SIDECAR_SUFFIXES:
        new = Path(str(tmp) + suf)
        if new.exists():
            os.replace(new, Path(str(final) + suf))
    rec = SessionRecord(**p["record"])
    rec.id = None
    catalog.add_or_replace(rec)
    _rm(backup)
    for suf in SIDECAR_SUFFIXES:
        _rm(Path(str(backup) + suf))


def recover_interrupted(catalog: Catalog, save_dirs) -> list[str]:
    """Finish or roll back parks a crash interrupted; delete orphaned temp files.

    Call at app/CLI start. A journaled park whose temp state file still exists
    is rolled back (old state file and sidecar restored); one whose new state
    file is already in place (same inode as journaled) is finished (sidecar
    moved, record written). Parks of another live process are left alone.
    """
    messages: list[str] = []
    dirs = {Path(d) for d in save_dirs if d}
    # List files before reading the journal: a temp file seen here was journaled
    # before it was created, so a concurrent park cannot lose its file.
    leftovers = {p for d in dirs if d.is_dir() for p in d.glob(TMP_PREFIX + "*")}
    referenced: set[Path] = set()
    entries = [e for e in catalog.list_pending() if e[1] == "park"]
    committing = {e[2].get("tmp") for e in entries if e[2].get("phase") == "commit"}
    for pid_, _kind, p, _at in entries:
        try:
            d, tmp, final, backup = _paths(p)
        except (KeyError, TypeError):
            catalog.remove_pending(pid_)
            messages.append(f"dropped a malformed park journal entry #{pid_}")
            continue
        family = [tmp, backup] + [Path(str(x) + s) for x in (tmp, backup) for s in SIDECAR_SUFFIXES]
        if pid_ in _IN_FLIGHT or _journal_owner_alive(p):
            referenced.update(family)
            continue
        referenced.update(family)
        name = p.get("name", p["final"])
        try:
            if p.get("phase") != "commit":
                if p.get("tmp") in committing:
                    catalog.remove_pending(pid_)  # its commit entry decides
                    continue
                _rollback(p)
                messages.append(f"park of '{name}' was interrupted while saving: temporary files removed")
            elif tmp.exists():
                _rollback(p)
                messages.append(f"park of '{name}' was interrupted: rolled back, the previous copy is kept")
            elif final.exists() and final.stat().st_ino == p.get("ino"):
                _finish(catalog, p)
                messages.append(f"park of '{name}' was interrupted after the state file was moved: finished")
            else:
                _rollback(p)
                messages.append(f"park of '{name}' was interrupted and its new file is gone: rolled back")
            catalog.remove_pending(pid_)
        except OSError as e:
            messages.append(f"could not recover the park of '{name}': {e}")
    for f in sorted(leftovers - referenced):
        if f.exists():
            with contextlib.suppress(OSError):
                f.unlink()
                messages.append(f"deleted leftover temporary file {f}")
    return messages


def known_save_dirs(catalog: Catalog, extra=()) -> list[Path]:
    """Folders to sweep in recover_interrupted: journaled, catalogued, profile folders."""
    dirs = {Path(r.save_dir) for r in catalog.list()}
    dirs |= {Path(p["save_dir"]) for _i, k, p, _a in catalog.list_pending() if k == "park" and "save_dir" in p}
    sessions = paths.data_dir() / "sessions"
    if sessions.is_dir():
        dirs |= {d for d in sessions.iterdir() if d.is_dir()}
    dirs |= {Path(x) for x in extra if x}
    return sorted(dirs)


# --------------------------------------------------------------------------- park


def _say(cb: ProgressFn | None, text: str) -> None:
    if cb is not None:
        with contextlib.suppress(Exception):
            cb(text)


def _verify(tmp: Path, resp: dict) -> int:
    """Token count of the saved file; raises ParkError when it is not what the server said."""
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
                    on_progress: ProgressFn | None = None) -> ParkResult:
    """Save slot ``slot_id`` as session ``name`` (replacing a session of that name)."""
    return await target.queue.run(f"Park slot {slot_id}",
                                  lambda: _park(target, slot_id, name, on_progress))


async def _park(target: ServerTarget, slot_id: int, name: str | None, on_progress) -> ParkResult:
    slots = await fetch_slots(target)
    slot = find_slot(slots, slot_id)
    n_live = slot_tokens(target, slot)
    if n_live <= 0:
        raise ParkError(f"slot {slot_id} is empty: there is nothing to park")
    name = (name or "").strip() or default_name(slot_id)
    save_dir = Path(target.save_dir)
    if not save_dir.is_dir():
        raise ParkError(f"the server's --slot-save-path folder {save_dir} is not visible here")
    catalog = target.catalog
    final_name = pick_state_file(catalog, save_dir, target.profile_name, name)
    hexid = secrets.token_hex(6)
    tmp_name = f"{TMP_PREFIX}{hexid}.bin"
    journal = {"phase": "saving", "save_dir": str(save_dir), "tmp": tmp_name, "final": final_name,
               "backup": f"{TMP_PREFIX}{hexid}.prev.bin", "name": name, "profile": target.profile_name}
    journal["pid"], journal["pid_ctime"] = _process_stamp()

    # Model identity first (the first hash of a big model takes minutes): nothing on disk yet.
    _say(on_progress, "identifying the model")
    model_size, model_sha, memory_kind = await model_identity(target.model_path)

    jid = catalog.add_pending("park", journal)
    _IN_FLIGHT.add(jid)
    d, tmp, final, backup = _paths(journal)
    try:
        _say(on_progress, f"saving slot {slot_id} ({n_live:,} tokens)")
        try:
            resp = await target.client.save_slot(slot_id, tmp_name)
        except ServerUnreachable as e:
            raise ParkError(f"the server stopped answering during the save ({e.reason})") from None
        except ServerError as e:
            raise ParkError(f"the server refused to save slot {slot_id}: {e.message}") from None
        _say(on_progress, "verifying the saved file")
        n_tokens = _verify(tmp, resp)
        sidecar = inspect_sidecar(tmp, n_tokens, memory_kind)
        state_size = tmp.stat().st_size
        now = time.time()
        record = SessionRecord(
            name=name, profile=target.profile_name, state_file=final_name, save_dir=str(save_dir),
            sidecar_file=(final_name + sidecar.path.name[len(tmp_name):]) if sidecar.path else None,
            state_size=state_size, sidecar_size=sidecar.size, n_tokens=n_tokens,
            save_ms=float((resp.get("timings") or {}).get("save_ms") or 0.0),
            server_build=target.build, model_path=target.model_path, model_size=model_size,
            model_sha256=model_sha, cache_type_k=target.cache_type_k, cache_type_v=target.cache_type_v,
            n_ctx_slot=int(slot.get("n_ctx") or 0), flash_attn=target.flash_attn, swa_full=target.swa_full,
            memory_kind=memory_kind, sidecar_status=sidecar.status.value, sidecar_reason=sidecar.reason,
            sidecar_count=len(sidecar.checkpoints), slot_id=slot_id, updated_at=now,
        )
        _say(on_progress, "moving the files into place")
        commit = dict(journal, phase="commit", ino=tmp.stat().st_ino, record=asdict(record))
        cid = catalog.add_pending("park", commit)
        _IN_FLIGHT.add(cid)
        catalog.remove_pending(jid)
        _IN_FLIGHT.discard(jid)
        jid = cid
        stored = _commit(catalog, commit)
        catalog.remove_pending(jid)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            _rollback(journal)
        with contextlib.suppress(Exception):
            catalog.remove_pending(jid)
        _IN_FLIGHT.discard(jid)
        if isinstance(exc, OSError):
            raise ParkError(f"could not write the parked files in {save_dir}: {exc.strerror or exc}") from None
        raise
    _IN_FLIGHT.discard(jid)

    if memory_kind in CHECKPOINTED_KINDS:
        catalog.record_sidecar_observation(target.build, sidecar.status in (
            SidecarStatus.PRESENT_VALID, SidecarStatus.PRESENT_UNVERIFIED), memory_kind)
    report = inspect_sidecar(final, n_tokens, memory_kind)
    warnings = park_warnings(report, memory_kind, n_tokens, resp)
    return ParkResult(stored, report, warnings, slot_id)


def _commit(catalog: Catalog, p: dict) -> SessionRecord:
    """Swap in the new state file and its sidecar, then write the record.

    Old state file and sidecars are renamed aside first; if anything fails
    before the record is written they go back (the caller's _rollback).
    """
    d, tmp, final, backup = _paths(p)
    for suf in SIDECAR_SUFFIXES:
        old = Path(str(final) + suf)
        if old.exists():  # stale or previous sidecar: never paired with the new state file
            os.replace(old, Path(str(backup) + suf))
    if final.exists():
        os.replace(final, backup)
    os.replace(tmp, final)
    try:
        for suf in SIDECAR_SUFFIXES:
            new = Path(str(tmp) + suf)
            if new.exists():
                os.replace(new, Path(str(final) + suf))
        rec = SessionRecord(**p["record"])
        rec.id = None
        stored = catalog.add_or_replace(rec)
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
    _rm(backup)
    for suf in SIDECAR_SUFFIXES:
        _rm(Path(str(backup) + suf))
    return stored


def park_warnings(report: SidecarReport, memory_kind: str, n_tokens: int, resp: dict) -> list[str]:
    out = []
    if report.status in (SidecarStatus.MISSING, SidecarStatus.INVALID):
        out.append(f"sidecar {report.status.value}: {report.reason} (about {n_tokens:,} tokens)")
    if memory_kind == "unknown":
        out.append("the model file is not readable here: its identity and memory kind are unknown, "
                   "so a resume cannot check that it goes into the same model")
    return out


# --------------------------------------------------------------------------- park all


async def park_all(target: ServerTarget, *, prefix: str | None = None,
                   on_progress: ProgressFn | None = None) -> list[ParkResult]:
    """Park every non-empty slot as "<prefix> slot N"; a failing slot is reported
    in its ParkResult.error and the others go on."""
    slots = await fetch_slots(target)
    prefix = (prefix or "").strip() or time.strftime("%Y-%m-%d %H-%M")
    results: list[ParkResult] = []
    for i, s in enumerate(slots):
        sid = int(s.get("id", i))
        if slot_tokens(target, s) <= 0:
            continue
        try:
            results.append(await park_slot(target, sid, f"{prefix} slot {sid}", on_progress=on_progress))
        except (ParkError, ServerError, ServerUnreachable, OSError) as e:
            results.append(ParkResult(None, None, [], sid, str(e)))
    return results


def describe(result: ParkResult) -> str:
    """One line for the CLI/log: name, tokens, size, sidecar status and reason."""
    if not result.ok:
        return f"slot {result.slot_id}: not parked: {result.error}"
    r = result.record
    assert r is not None
    sc = result.sidecar
    side = f"sidecar {sc.status.value}: {sc.reason}" if sc else "sidecar unknown"
    return (f"parked slot {r.slot_id} as '{r.name}': {r.n_tokens:,} tokens, "
            f"{(r.state_size + r.sidecar_size) / 1e6:,.1f} MB ({r.state_file}); {side}")


def record_dict(rec: SessionRecord) -> dict[str, Any]:
    return asdict(rec)
