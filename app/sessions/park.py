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
  that :func:`app.sessions.park_commit.recover_parks` finishes or rolls back after a crash.
* The old state file and sidecar are renamed aside (same folder: cheap) until
  the catalog row is written, so any failure before that puts them back
  byte-identical.

This module parks: one slot (:func:`park_slot`), or every slot :func:`app.sessions.park_choice.choose_parks`
picks (:func:`park_all`), and names the files. Beside it: the commit and its recovery
(:mod:`app.sessions.park_commit`), the size before a park (:mod:`app.sessions.park_prediction`), the
model's identity (:mod:`app.sessions.model_identity`).
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

from app.core.background import say_progress
from app import files
from app.core.restore_needs import CHECKPOINTED_KINDS, effective_kind
from app.core.states import SidecarStatus
from app.core.timings import Timings
from app.core.resume_matrix import ResumePrediction
from app.sessions import behaviour, files_check, sidecar_check
from app.sessions.files_lock import FilesLock
from app.sessions.model_identity import model_identity
from app.sessions.park_choice import choose_parks
from app.sessions.park_commit import SIDECAR_SUFFIXES, TMP_PREFIX, commit_park, roll_back_park
from app.sessions.park_prediction import describe_size, predict_park_size
from app.sessions.slots import Purpose, SlotError, default_slot, find_row, no_default_reason
from app.sessions.journal import Journal, JournalKind, Owner, ParkJournal, ParkPhase, Recovery, recover
from app.sessions.target import HeldSession, ServerTarget
from app.monitor.slots import SlotRow, held_tokens
from app.server.client import ServerError, ServerUnreachable
from app.server.sidecar import SidecarReport
from app.server.statefile import StateFileError, read_state_header
from app.store.catalog import Catalog, CatalogError, SessionRecord

log = logging.getLogger(__name__)

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


async def park_slot(target: ServerTarget, slot_id: int | None, name: str | None = None, *,
                    on_progress: ProgressFn | None = None, rows: list[SlotRow] | None = None,
                    budget_bytes: int | None = None) -> ParkResult:
    """Save slot ``slot_id`` (None: the default slot, :func:`app.sessions.slots.default_slot`) as session
    ``name`` (replacing a session of that name). A park reads ``/slots`` once, in its turn of the slot
    queue: that read checks the id, picks the default slot and sizes the park; ``rows``: the ``/slots``
    the caller already read (a park of every slot). ``budget_bytes``: the most this park may take (the
    conversation proxy's disk budget); a park predicted larger, or larger than the free space of the save
    folder, is refused before the server is asked."""
    label = "Park" if slot_id is None else f"Park slot {slot_id}"
    return await target.queue.run(label, lambda: _park(target, slot_id, name, on_progress, rows, budget_bytes))


async def _park(target: ServerTarget, slot_id: int | None, name: str | None, on_progress,
                rows: list[SlotRow] | None = None, budget_bytes: int | None = None) -> ParkResult:
    rows = rows if rows is not None else await target.slot_rows()
    if slot_id is None:
        slot_id = default_slot(rows, Purpose.PARK)
        if slot_id is None:
            raise ParkError(no_default_reason(rows, Purpose.PARK))
    try:
        slot = find_row(rows, slot_id)
    except SlotError as e:
        raise ParkError(str(e)) from None
    n_live = held_tokens(slot)
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
            stored = commit_park(catalog, commit)
            journal.end(jid)
        finally:
            lock.release()
    except BaseException as exc:
        with contextlib.suppress(OSError):
            roll_back_park(entry)
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
    target.parked_here[stored.name] = (stored.id, stored.updated_at)
    return ParkResult(stored, report, warnings, slot_id)


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
