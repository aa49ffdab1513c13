"""Resume a parked session into a slot, after checking it can work.

Why a preflight: llama-server **clears the target slot when a restore fails**
and answers a missing or foreign file with the generic "No available space in
KV cache or invalid slot save file"; a state file also loads only into the
same model, the same ``-ctk/-ctv``, a slot whose ``n_ctx`` holds its tokens,
and a build writing the same state version (``llama_state_seq_load_file``
wants an exact match). So everything that can be checked is checked first.

Why the warnings: on a sliding-window or recurrent/hybrid model the restore
alone buys nothing after a restart unless the checkpoints come back from a
sidecar (turboquant PR #206; upstream #25913, #28194, #26676): the first query
re-prefills the whole session. The user is told how long that will take.
"""

from __future__ import annotations

import asyncio
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from app.core.confirmation import NeedsConfirmation
from app.core.park_files import FilesCheck
from app.core.sidecar_behaviour import Behaviour, LoadPrediction
from app.core.states import SidecarStatus
from app.core.timings import Timings
from app.core.verdict import RESTORED_NOT_JUDGED
from app.sessions import files_check, sidecar_check
from app.sessions.behaviour import predict_for_target, resume_prediction, resume_warning
from app.core.restore_needs import CHECKPOINTED_KINDS, effective_kind
from app.sessions.model_identity import model_identity
from app.sessions.records import AmbiguousName
from app.sessions.slots import Purpose, SlotError, default_slot, find_row, no_default_reason
from app.sessions.target import HeldSession, ServerTarget
from app.monitor.slots import RestoredSlot, SlotRow, held_tokens
from app.server.client import ServerError, ServerUnreachable
from app.server.statefile import StateFileError, StateHeader, read_state_header, version_mismatch_reason
from app.store.catalog import Catalog, HistoryEvent, PendingVerdict, RestoreNoted, SessionRecord


class ResumeRefused(Exception):
    def __init__(self, reasons: list[str]):
        self.reasons = list(reasons)
        super().__init__("; ".join(self.reasons))


class ResumeHazard(ResumeRefused):
    """Refused because the restore would roll back onto another chat's context checkpoints (a build
    that keeps a slot's checkpoints across a restore, and no usable sidecar): asked for by a caller
    that re-processes instead (the conversation proxy)."""

    def __init__(self, hazard: str):
        self.hazard = hazard
        super().__init__([hazard])


class ResumeUseless(ResumeRefused):
    """Refused because the resume matrix measured that a restore buys nothing on this server (this model
    family, build and flags): the next turn re-prefills everything all the same. Asked for by a caller
    that can process the prompt instead and keep the park (the conversation proxy)."""

    def __init__(self, prediction=None, *, reason: str | None = None):
        """From the matrix's ``prediction``, or, said by a host's kv-valet, from its ``reason`` alone."""
        self.prediction = prediction
        if prediction is not None:
            reason = prediction.sentence + (f"; to resume: {prediction.remedy}" if prediction.remedy else "")
        super().__init__([reason or "a restore buys nothing on this server"])


class ResumeMismatch(ResumeRefused):
    """Refused because a file of the park is not the one parked (another chat's sidecar copied over
    this one's, a state file written by something else: :mod:`app.core.park_files`): asked for by a
    caller that re-processes instead and leaves the park as it is (the conversation proxy, Resume all)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__(self.problems)


class ResumeFailed(Exception):
    """The server refused the restore (the slot is now empty: a failed restore clears it)."""


@dataclass
class Preflight:
    refusals: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    reprefill_tokens: int | None = None
    reprefill_seconds: float | None = None
    slot: SlotRow | None = field(default=None, repr=False)  # the /slots row checked
    prediction: LoadPrediction | None = None  # what this build's loader does with the sidecar
    hazard: str | None = None  # another chat's checkpoints in the slot (a build that keeps them)
    files: FilesCheck | None = None  # the park's files against what it wrote (app.core.park_files)

    @property
    def ok(self) -> bool:
        return not self.refusals


@dataclass
class ResumeResult:
    record: SessionRecord
    slot_id: int
    n_restored: int
    restore_ms: float
    warnings: list[str] = field(default_factory=list)
    prediction: LoadPrediction | None = None
    hazard: str | None = None  # the resume went on into a slot holding another chat's checkpoints
    files: FilesCheck | None = None  # the park's files against what it wrote (went on with --yes when not)
    noted: RestoreNoted | None = None  # what the catalog kept of it: its event, its pending verdict
    restored_at: float = 0.0  # time.time() once the server answered the restore (its log after it is the next task's)


def find_session(catalog: Catalog, profile: str, name: str) -> SessionRecord:
    """The session ``name`` of ``profile``; else the only session of that name in
    any profile (attach mode names the profile by its URL)."""
    rec = catalog.get(profile, name)
    if rec is not None:
        return rec
    matches = [r for r in catalog.list() if r.name == name]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise ResumeRefused([f"no parked session named '{name}'"])
    raise ResumeRefused([str(AmbiguousName(name, [r.profile for r in matches]))])


def _fmt_seconds(s: float) -> str:
    from app.core.units import fmt_duration  # the app's one duration formatter

    return fmt_duration(s)


def _expected_version(catalog: Catalog, build: str, skip: SessionRecord) -> int | None:
    """The state version ``build`` writes, learned from another file it parked."""
    for r in catalog.list():
        if r.server_build == build and r.id != skip.id:
            try:
                return read_state_header(r.state_path).version
            except StateFileError:
                continue
    return None


async def _same_model(target: ServerTarget, rec: SessionRecord, live_path: str) -> str | None:
    """Why the server's model is not the one the session was parked from, or None.

    Uses what is known now, and says which: the full SHA-256 when both sides
    have it; else the quick identity (size + the first 16 MiB: header and
    metadata) while the full hash is still being computed in the background."""
    if not rec.model_path and not rec.model_sha256 and not rec.model_quick_id:
        return None
    same_path = bool(live_path) and os.path.abspath(live_path) == os.path.abspath(rec.model_path)
    # A session from before quick ids knows only the full hash: then compute it (once, cached).
    live = await model_identity(live_path, full=bool(rec.model_sha256 and not rec.model_quick_id), kind=False)
    what = "the model file changed since the park" if same_path else "a different model file"
    if live.sha256 and rec.model_sha256:
        if live.sha256 == rec.model_sha256:
            return None  # a moved or copied file with the same bytes is fine
        return (f"{what} (compared by the SHA-256 of the whole file): the server runs {live_path} "
                f"({live.sha256[:12]}…), the session was parked from {rec.model_path} ({rec.model_sha256[:12]}…)")
    if live.quick_id and rec.model_quick_id:
        if live.quick_id == rec.model_quick_id:
            return None
        return (f"{what} (compared by size and the SHA-256 of the first 16 MiB, the header and metadata; the "
                f"whole-file hash is not known yet): the server runs {live_path} ({live.size:,} bytes), the "
                f"session was parked from {rec.model_path} ({rec.model_size:,} bytes)")
    if same_path:
        if live.size and rec.model_size and live.size != rec.model_size:
            return (f"the model file {live_path} changed size since the park ({rec.model_size:,} → "
                    f"{live.size:,} bytes)")
        return None
    return (f"a different model file: the server runs {live_path or 'an unknown model'}, the session "
            f"was parked from {rec.model_path}")


async def preflight(target: ServerTarget, record: SessionRecord, slot_id: int, *,
                    rows: list[SlotRow] | None = None, held_known: bool = True) -> Preflight:
    """What would stop a restore of ``record`` into ``slot_id`` (refusals), and what
    it would cost (warnings). ``rows``: the slot rows the caller just read; ``held_known`` False:
    rows read earlier (which slots there are and their n_ctx), not what the slot holds now."""
    pf = Preflight()
    rows = rows if rows is not None else await target.slot_rows()
    try:
        slot = pf.slot = find_row(rows, slot_id)
    except SlotError as e:
        pf.refusals.append(str(e))
        slot = None
    # the model the server loaded, as /props said when the service connected (a restarted
    # server is a new connection): no second HTTP call per resume
    live_model = str(target.model_path or "")
    # a park this server process made is of the model it runs, whatever the file on disk became since (the
    # process is known: a launched server's start time, and the parks it made are forgotten with it)
    here = target.started_at is not None and record.updated_at >= target.started_at and \
        target.parked_here.get(record.name) == (record.id, record.updated_at)
    why = None if here else await _same_model(target, record, live_model)
    if why:
        pf.refusals.append(why)
    for which, want, have in (("K", record.cache_type_k, target.cache_type_k),
                              ("V", record.cache_type_v, target.cache_type_v)):
        if want and have and want != have:
            pf.refusals.append(f"different {which} cache type: the session was parked with {want}, "
                               f"this server uses {have} (-ct{which.lower()} {want} is needed)")
    if slot is not None and slot.n_ctx and record.n_tokens > slot.n_ctx:
        pf.refusals.append(f"slot {slot_id} holds at most {slot.n_ctx:,} tokens, the session has "
                           f"{record.n_tokens:,} (raise -c or lower -np)")

    path = record.state_path
    if target.save_dir is None:
        pf.refusals.append("the server's --slot-save-path folder is not known: choose it first")
    elif str(record.save_dir) != str(target.save_dir) and \
            Path(record.save_dir).resolve() != Path(target.save_dir).resolve():
        pf.refusals.append(f"the session's file is in {record.save_dir}, but this server reads "
                           f"{target.save_dir} (--slot-save-path)")
    header = None
    # the park's files as they were when found to be the parked ones (a stat of each, no read; None: one was
    # written since, or came or went)
    unchanged = files_check.look_unchanged(record)
    try:
        st = path.stat()
    except OSError:
        st = None
    if st is None or not stat.S_ISREG(st.st_mode):
        pf.refusals.append(f"the state file is missing: {path}")
    else:
        size = st.st_size
        # the state file the park verified (its header: this build's version, the parked token count), not
        # written since: not read again (issue #38: it is on a returning request's path)
        verified = unchanged is not None and not unchanged.problems and record.server_build == target.build
        try:
            header = None if verified else _state_header(path, st)
        except StateFileError as e:
            pf.refusals.append(f"the state file is unusable: {e}")
        if record.state_size and size < record.state_size:
            pf.refusals.append(f"the state file is truncated: {size:,} bytes, {record.state_size:,} when parked")
            header = None
    if header is not None:
        expected = header.version if record.server_build == target.build else \
            _expected_version(target.catalog, target.build, record)
        reason = version_mismatch_reason(header, expected)
        if reason:
            pf.refusals.append(reason)
        if record.n_tokens and header.token_count != record.n_tokens:
            pf.refusals.append(f"the state file holds {header.token_count:,} tokens but {record.n_tokens:,} "
                               "were parked: it was overwritten by something else")
    if pf.refusals:
        return pf
    # the files are the ones this park wrote (a sidecar copied over from another chat is not): the
    # sidecar's positions every time, a hash only of a file written since it was last verified
    pf.files = unchanged  # no file written since it was verified: no read, no thread
    if pf.files is None:
        pf.files = await asyncio.to_thread(files_check.look, target.catalog, record)
    pf.warnings.extend(pf.files.problems)

    # -- warnings
    n_held = held_tokens(slot) if slot is not None and held_known else 0
    if n_held > 0:
        pf.warnings.append(f"slot {slot_id} holds {n_held:,} tokens; resuming replaces them")
    # what the restoring server needs: a sliding-window model under --swa-full keeps every position
    kind = effective_kind(record.memory_kind, swa_full=target.swa_full)
    if kind in CHECKPOINTED_KINDS and target.behaviour is not Behaviour.UNKNOWN:
        # this build's own loader decides: what the fork accepts, v2 refuses, and the reverse
        pf.prediction = await asyncio.to_thread(predict_for_target, target, path, record.n_tokens)
        cause = resume_warning(target, pf.prediction, kind)
        if pf.prediction.loads is False:
            pf.hazard = checkpoint_hazard(target, slot_id, record)
            if pf.hazard:
                pf.warnings.append(pf.hazard)
        if cause:
            _reprefill_warning(pf, target, record, cause)
        return pf
    if kind in CHECKPOINTED_KINDS:
        # a PKCL v2 sidecar of an older save is caught here, before the restore (hash cached per file change)
        report = await asyncio.to_thread(sidecar_check.inspect, path, record.n_tokens, kind, verify_hash=True)
        persists = target.catalog.build_persists_checkpoints(target.build)
        cause = None
        if report.status in (SidecarStatus.MISSING, SidecarStatus.INVALID):
            cause = f"sidecar {report.status.value}: {report.reason}"
        elif target.ctx_checkpoints == 0:
            cause = "this server runs with --ctx-checkpoints 0, so it does not load the sidecar"
        elif persists is False:
            cause = (f"this build ({target.build}) never wrote a checkpoint sidecar when it parked a "
                     "sliding-window/hybrid slot, so it will not read one either")
        if cause:
            _reprefill_warning(pf, target, record, cause, per_build=False)
    return pf


#: state file headers read, by path, with the file's stamp then (a restore's preflight reads one per request)
_HEADERS: dict[str, tuple[tuple[int, int, int], StateHeader]] = {}
_HEADERS_KEPT = 256


def _state_header(path: Path, st: os.stat_result) -> StateHeader:
    """:func:`read_state_header` of ``path`` (whose ``stat`` is ``st``), not read again while its stamp (inode,
    size, mtime) is the one it had when it was read."""
    stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
    kept = _HEADERS.get(str(path))
    if kept is not None and kept[0] == stamp:
        return kept[1]
    header = read_state_header(path)
    if len(_HEADERS) >= _HEADERS_KEPT:
        _HEADERS.pop(next(iter(_HEADERS)))
    _HEADERS[str(path)] = (stamp, header)
    return header


def _reprefill_warning(pf: Preflight, target: ServerTarget, record: SessionRecord, cause: str, *,
                       per_build: bool = True) -> None:
    pf.reprefill_tokens = record.n_tokens
    rate = target.catalog.prefill_rate(target.profile_name)
    if rate:
        pf.reprefill_seconds = record.n_tokens / rate
        est = (f"about {_fmt_seconds(pf.reprefill_seconds)} at this server's measured prefill rate "
               f"of {rate:,.0f} tokens/s")
    else:
        est = "no prefill rate measured on this server yet"
    if per_build:
        pf.warnings.append(f"{cause.rstrip('.')} (about {record.n_tokens:,} tokens: {est})")
    else:
        pf.warnings.append(f"{cause}; the first query will re-prefill about {record.n_tokens:,} tokens ({est})")


def checkpoint_hazard(target: ServerTarget, slot_id: int, record: SessionRecord) -> str | None:
    """On a build that keeps a slot's checkpoints across restores (the fork), a session
    without a usable sidecar restored into a slot holding another chat's checkpoints can
    roll back onto that chat's checkpoint (positions are checked, not tokens)."""
    if target.behaviour is not Behaviour.FORK:
        return None
    owner = target.checkpoint_owners.get(slot_id)
    if not owner or owner == record.name:
        return None
    who = owner if owner.startswith("the chat of") else f"session '{owner}'"
    return (f"slot {slot_id} still holds the context checkpoints of {who}: this build keeps them across a "
            "restore, and with no usable sidecar a rollback can land on that chat's checkpoint and answer "
            "from the wrong conversation. Restart the server first, resume into a slot without checkpoints, "
            "or go on with that risk")


def clean_slot(target: ServerTarget, rows: list[SlotRow], record: SessionRecord) -> int | None:
    """An idle, empty slot holding no other chat's checkpoints (None: there is none)."""
    for row in rows:
        owner = target.checkpoint_owners.get(row.id)
        if not row.busy and held_tokens(row) == 0 and (not owner or owner == record.name):
            return row.id
    return None


async def resume_session(target: ServerTarget, name: str, slot_id: int | None = None, *,
                         force: bool = False, avoid_hazard: bool = False,
                         avoid_useless: str | None = None, avoid_mismatch: bool = False,
                         leased: bool = False, later: Callable[[Callable[[], None]], None] | None = None
                         ) -> ResumeResult:
    """Restore session ``name`` into ``slot_id`` (None: :func:`app.sessions.slots.default_slot`).

    Raises ResumeRefused (cannot work), NeedsConfirmation (would work, with
    costs, or a file of the park is not the one parked: pass force=True), ResumeFailed (the server
    refused the restore).
    ``avoid_hazard``: raise ResumeHazard rather than restore onto another chat's checkpoints;
    ``avoid_useless`` (a resume-matrix probe, ``chat`` or ``exact``): raise ResumeUseless rather than
    restore where the matrix measured that the restore buys that turn nothing;
    ``avoid_mismatch``: raise ResumeMismatch rather than restore files that are not the parked ones,
    whatever ``force`` says.
    ``leased``: the caller holds ``slot_id`` (the proxy's lease: nothing else runs there), so /slots is not
    read first when an earlier read of this server process showed the slot (its n_ctx is fixed). The slot's
    task id kept for the restore is then that read's: the slot's task id now, or an earlier one, which the
    restore's bookkeeping takes for a task run since (a copy parked again, never a task taken for none).
    ``later``: takes the catalog's note of the restore (its event, the verdict UNKNOWN, the pending verdict),
    to run once the caller sent the request the restore is for; ``ResumeResult.noted`` is set then. Without
    it the note is written before this returns.
    """
    record = find_session(target.catalog, target.profile_name, name)
    label = f"Resume '{name}'" + (f" into slot {slot_id}" if slot_id is not None else "")
    return await target.queue.run(label, lambda: _resume(target, record, slot_id, force, avoid_hazard,
                                                         avoid_useless, avoid_mismatch, leased, later))


def useless_restore(target: ServerTarget, pf: Preflight, probe: str):
    """The resume-matrix prediction when a restore buys ``probe``'s turn nothing here, else None. Only
    for a checkpointed model on a known build (``pf.prediction`` set): a dense model keeps every position."""
    if pf.prediction is None:
        return None
    rp = resume_prediction(target, sidecar_usable=not pf.prediction.rolls_back_nowhere, probe=probe)
    return rp if rp.buys_nothing else None


async def _resume(target: ServerTarget, record: SessionRecord, slot_id: int | None, force: bool,
                  avoid_hazard: bool = False, avoid_useless: str | None = None,
                  avoid_mismatch: bool = False, leased: bool = False,
                  later: Callable[[Callable[[], None]], None] | None = None) -> ResumeResult:
    known = target.last_rows if leased and slot_id is not None else None
    # (a slot that had run no task then has no task id to keep: read now)
    earlier = known is not None and any(r.id == slot_id and r.id_task is not None for r in known)
    rows = known if earlier else await target.slot_rows()
    chosen = slot_id is None
    if slot_id is None:
        slot_id = default_slot(rows, Purpose.RESUME, record.slot_id)
        if slot_id is None:
            raise ResumeRefused([no_default_reason(rows, Purpose.RESUME)])
    pf = await preflight(target, record, slot_id, rows=rows, held_known=not earlier)
    if chosen and pf.hazard:
        # the app picked the slot: pick one without another chat's checkpoints when there is one
        other = clean_slot(target, rows, record)
        if other is not None and other != slot_id:
            slot_id = other
            pf = await preflight(target, record, slot_id, rows=rows)
    if pf.refusals:
        raise ResumeRefused(pf.refusals)
    if avoid_mismatch and pf.files is not None and pf.files.refuses:
        raise ResumeMismatch(list(pf.files.problems))
    if avoid_hazard and pf.hazard:
        raise ResumeHazard(pf.hazard)
    if avoid_useless is not None:
        useless = useless_restore(target, pf, avoid_useless)
        if useless is not None:
            raise ResumeUseless(useless)
    if pf.warnings and not force:
        raise NeedsConfirmation(pf.warnings)
    id_task_before = pf.slot.id_task if pf.slot is not None else None
    try:
        resp = await target.client.restore_slot(slot_id, record.state_file)
    except ServerError as e:
        target.restored.pop(slot_id, None)
        target.held_as.pop(slot_id, None)
        raise ResumeFailed(f"the server refused to restore '{record.name}' into slot {slot_id}: "
                           f"{e.message} (the slot is now empty)") from None
    except ServerUnreachable as e:
        raise ResumeFailed(f"the server stopped answering during the restore ({e.reason})") from None
    n_restored = int(resp.get("n_restored") or 0)
    restore_ms = Timings.of(resp).restore_ms or 0.0
    warnings = list(pf.warnings)
    if record.n_tokens and n_restored != record.n_tokens:
        warnings.append(f"the server restored {n_restored:,} tokens, {record.n_tokens:,} were parked")
    now = time.time()
    target.restored[slot_id] = RestoredSlot(n_restored, record.name, id_task_before)
    target.held_as[slot_id] = HeldSession(record.name, n_restored, id_task_before)
    loads = pf.prediction.loads if pf.prediction is not None else None
    if loads or not target.checkpoint_owners.get(slot_id) or target.behaviour is not Behaviour.FORK:
        target.checkpoint_owners[slot_id] = record.name  # its sidecar replaced the list, or it was cleared
    result = ResumeResult(record, slot_id, n_restored, restore_ms, warnings, pf.prediction, pf.hazard, pf.files,
                          restored_at=now)
    if record.id is None:
        return result
    def note() -> None:  # its verdict UNKNOWN until the next query on the slot is judged, by whoever watches the
        # log (the pending note): in one commit, which a leased restore does not wait on the disk for
        pending = pending_verdict(target, record, slot_id, n_restored, now)
        result.noted = target.catalog.note_restore(HistoryEvent(
            session_id=record.id, kind="resume", at=now, server_build=target.build, restore_ms=restore_ms,
            details={"slot": slot_id, "n_restored": n_restored, "profile": target.profile_name,
                     "reprefill_tokens": pf.reprefill_tokens, "warnings": warnings}),
            n_restored, RESTORED_NOT_JUDGED, pending=pending, durable=not leased)
    if later is None:
        note()
    else:
        later(note)
    return result


def pending_verdict(target: ServerTarget, record: SessionRecord, slot_id: int, n_restored: int,
                    at: float) -> PendingVerdict:
    """The note a restore of ``record`` leaves for whoever watches the server's log and judges the slot's next
    query (app.sessions.wiring): the one place it is made."""
    return PendingVerdict(session_id=record.id or 0, profile=target.profile_name, server_url=target.url,
                          slot_id=slot_id, n_restored=n_restored, sidecar_status=str(record.sidecar_status),
                          sidecar_count=record.sidecar_count or None, ctx_checkpoints=target.ctx_checkpoints,
                          build_persists=target.catalog.build_persists_checkpoints(target.build), created_at=at)


@dataclass(frozen=True)
class FollowUp:
    """What a completion on a resumed slot cost (:func:`follow_up`)."""

    cache_n: int  # prompt tokens reused from the slot (0 when the server did not say)
    prompt_n: int  # prompt tokens processed
    prompt_ms: float
    content: str
    timings: Timings
    id_slot: int


async def follow_up(target: ServerTarget, slot_id: int, text_or_tokens: str | list[int],
                    n_predict: int = 4) -> FollowUp:
    """Send a completion on ``slot_id`` reusing its cache and return what it cost.

    ``cache_n`` ≈ the restored tokens and a small ``prompt_n`` mean the resume
    worked; ``cache_n`` 0 and ``prompt_n`` = the whole prompt mean it re-prefilled.
    The prefill is kept as a sample of this server's prefill rate.
    """
    result = await target.client.completion(text_or_tokens, slot_id=slot_id, n_predict=n_predict,
                                            cache_prompt=True)
    t = Timings.of(result)
    out = FollowUp(cache_n=t.cache_n or 0, prompt_n=t.prompt_n or 0, prompt_ms=t.prompt_ms or 0.0,
                   content=str(result.get("content", "")), timings=t, id_slot=result.get("id_slot", slot_id))
    target.catalog.record_prefill(target.profile_name, out.prompt_n, out.prompt_ms)
    return out
