"""Move or copy a parked session to another target: a profile here, or ``HOST:PROFILE``.

A parked session is a catalog row, a state file in the profile's ``--slot-save-path``
folder and maybe its checkpoint sidecar (``<state>.ckpt``). A move:

1. asks the source for the session (row, file sizes, header facts) and the target for
   its facts (profile, model identity, binary, folder: :mod:`app.move.facts`), and runs
   the compatibility rules (:mod:`app.core.compat`) **before any byte moves**: a refusal
   names its remedy;
2. streams each file in chunks to a temporary name in the target folder
   (``kvv-move-<id>.state.part``, ``kvv-move-<id>.ckpt.part``), reporting bytes done / total.
   The SHA-256 each file must have is the one its park recorded (every park hashes its files:
   app.sessions.park); only a session without them, or a move forced past a refusal, has the
   sender hash what it sends. Hashing on both sides cost a 1 GiB move a fifth of its time on two
   cores (``tests/bench/bench_move.py``);
3. commits at the target: the target checks each temporary file's size and SHA-256
   (read back from its disk) and the state file's header, then, under the catalog's
   files lock, renames the sidecar and the state file into place (both or neither) and
   writes the target catalog's row (:func:`app.move.receive.adopt`: the same code runs on
   a remote host, in the move's one ``kv-valet sessions move-host`` process there,
   :mod:`app.move.host_side`, which reads each chunk back as soon as it is written);
4. for a move (not a copy), deletes the source only after the target confirmed.

The commit is journaled (``catalog.pending``, kind ``move-in``: app.sessions.journal) before the
first rename: a process killed between the renames and the row leaves an entry that the
next move, ``kv-valet sessions ...``, ``kv-valet receive`` and the app's connect
(:func:`app.sessions.move_in.recover_moves`) finish (every file in place or still at its
temporary name, size and SHA-256 as sent: the session is listed) or roll back (the files are
removed). A commit that listed the session leaves a receipt (its move id) at the target.

A commit whose answer the sender lost (the SSH connection cut, the host's ``move-host`` process
killed, at any step) is settled: the sender asks the target again, on a new connection
(``receive --abort ID``: :func:`app.sessions.move_in.settle_move`, which waits for a commit of it
still running there). Listed there (its receipt, or its row written): the sender deletes its
source and says the answer was lost (a warning). Not listed: it is rolled back there and the
source is kept (the error says so). Either way one listed copy. Only a target that cannot be
asked leaves the outcome open: the error says so and how to tell. The sender itself killed
after the target listed the session and before the source was deleted leaves two copies:
both are whole and listed, as after a copy; nothing is lost (the CLI says so).

A checksum mismatch at the target against the park's own SHA-256 (the file changed here since
the park, or was damaged on the way) refuses the move as a changed file would (MoveRefused, the
remedy: ``--yes`` or park again). A failure or an interruption anywhere before the commit (an
exception, a cancelled task, Ctrl-C, a checksum mismatch, a full disk) removes the temporary files and leaves
the source as it was; nothing is listed at the target until its row is written. A
temporary file a crash left behind is never listed (listings read the catalog) and is
removed by the next move into that folder once nobody has written it for
:data:`app.move.receive.STALE_AFTER_S`.

This module is the transfer itself: the rules, the copy with its progress and cancellation,
the commit and the settling of one whose answer was lost. The two sides it runs between are
:mod:`app.move.endpoints` (a profile here, or one on a host over SSH). Front ends call
:func:`preview` (the rules only, e.g. while dragging) and :func:`move_session`.
"""

from __future__ import annotations

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
from dataclasses import asdict
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from app.core.compat import Compatibility, Problem, TargetFacts, check_move
from app.core.park_files import FoundFile, ParkedFiles, compare
from app.move.endpoints import Endpoint
from app.move.values import ChecksumMismatch, MoveError, MoveRefused, MoveResult, SourceSession
from app.store.catalog import SessionRecord

log = logging.getLogger(__name__)

CHUNK = 4 << 20

ProgressFn = Callable[[int, int], None]


def _files_problems(src: SourceSession, sent: list[dict[str, Any]] | None = None) -> list[str]:
    """The source's files against what its park wrote (app.core.park_files): their sizes before the copy,
    their SHA-256 as sent (``sent``) after it. Empty when they are the parked ones or none were recorded."""
    state = Path(src.record.state_file).name
    by_suffix = {f.suffix: f for f in src.files}
    found = {f["suffix"]: FoundFile(f["suffix"], state + f["suffix"], int(f["size"]), str(f["sha256"]))
             for f in sent} if sent is not None else \
        {sfx: FoundFile(sfx, state + sfx, f.size) for sfx, f in by_suffix.items()}
    return list(compare(ParkedFiles.from_json(src.record.parked_files), found, state_name=state).problems)


def _recorded_sums(src: SourceSession) -> dict[str, str] | None:
    """Per file suffix, the SHA-256 the park recorded, when it recorded one for every file to send and
    their sizes still agree (else None: the sender hashes what it sends)."""
    parked = ParkedFiles.from_json(src.record.parked_files)
    if parked is None:
        return None
    sums = {}
    for f in src.files:
        pf = parked.get(f.suffix)
        if pf is None or not pf.sha256 or pf.size != f.size:
            return None
        sums[f.suffix] = pf.sha256
    return sums


def _files_problem(text: str) -> Problem:
    return Problem("parked files", text, "move it anyway with --yes, or park the chat again")


async def preview(source: Endpoint, name: str, target: Endpoint, *, new_name: str | None = None,
                  force: bool = False) -> tuple[SourceSession, TargetFacts, Compatibility]:
    """The rules only, nothing copied: what a move of ``name`` to ``target`` would meet. A file that is
    not the one parked is a refusal (a warning with ``force``). A host's endpoint keeps its process
    for the move that follows: a caller that stops here ends it (``end()``)."""
    src = await source.session(name)
    facts = await target.describe()
    compat = check_move(src.facts, facts, name=new_name or src.record.name)
    if source.where == target.where:
        compat = Compatibility((Problem("target", f"'{name}' is in {target.where} already",
                                        "choose another profile or host"), *compat.refusals), compat.warnings)
    problems = src.files_problems if src.files_problems is not None else _files_problems(src)
    foreign = tuple(_files_problem(p) for p in problems)
    if foreign:
        compat = Compatibility(compat.refusals, (*foreign, *compat.warnings)) if force else \
            Compatibility((*foreign, *compat.refusals), compat.warnings)
    return src, facts, compat


def _tell(on_progress: ProgressFn | None, done: int, total: int) -> None:
    if on_progress is not None:
        on_progress(done, total)  # may raise (MoveCancelled): the move stops and cleans up


async def move_session(source: Endpoint, name: str, target: Endpoint, *, keep_source: bool = False,
                       new_name: str | None = None, on_progress: ProgressFn | None = None,
                       chunk: int = CHUNK, on_committed: Callable[[MoveResult], None] | None = None,
                       force: bool = False) -> MoveResult:
    """Copy session ``name`` from ``source`` to ``target`` (as ``new_name``), then, unless
    ``keep_source``, delete it at the source. Raises MoveRefused before anything is
    copied, MoveError (or the callback's, or the task's cancellation) after cleaning up.

    A cancellation that arrives while the target commits waits for the commit's outcome
    (it renames and lists together, or not at all); ``on_committed(result)`` is called as
    soon as the target listed the session, before the source is deleted: a caller that is
    interrupted after that knows both copies exist. A host's side runs in one process for the whole
    move (app.move.host_side), ended here whatever the outcome."""
    try:
        return await _move(source, name, target, keep_source=keep_source, new_name=new_name,
                           on_progress=on_progress, chunk=chunk, on_committed=on_committed, force=force)
    finally:
        for side in (source, target):
            try:
                await asyncio.shield(side.end())
            except Exception:  # report: the move's outcome stands; its host process ends with its connection (logged)
                log.warning("move: could not end the move's process at %s", side.where, exc_info=True)


async def _move(source: Endpoint, name: str, target: Endpoint, *, keep_source: bool, new_name: str | None,
                on_progress: ProgressFn | None, chunk: int, on_committed: Callable[[MoveResult], None] | None,
                force: bool) -> MoveResult:
    src, facts, compat = await preview(source, name, target, new_name=new_name, force=force)
    if not compat.ok:
        raise MoveRefused(compat)
    move_id = secrets.token_hex(6)
    total, done = src.total_bytes, 0
    sent: list[dict[str, Any]] = []
    recorded = None if force else _recorded_sums(src)  # the target checks the bytes against the park's sums
    try:
        _tell(on_progress, 0, total)
        for f in src.files:
            writer = await target.open_temp(move_id, f.suffix)
            h, n = (None if recorded else hashlib.sha256()), 0
            try:
                async with contextlib.aclosing(source.read(f, chunk)) as chunks:
                    # the next chunk is read while this one is written (and hashed, off the loop, when
                    # the park recorded no sums): they overlap (tests/bench/bench_move.py)
                    upcoming = await anext(chunks, None)
                    while upcoming is not None:
                        data = upcoming
                        if h is None:
                            upcoming, _ = await _together(_next(chunks), writer.write(data))
                        else:
                            upcoming, _, _ = await _together(_next(chunks), asyncio.to_thread(h.update, data),
                                                             writer.write(data))
                        n += len(data)
                        done += len(data)
                        _tell(on_progress, done, total)
            finally:
                await writer.close()
            if n != f.size:
                raise MoveError(f"the {f.role} file of '{name}' changed size during the move ({f.size:,} → "
                                f"{n:,} bytes): parked again meanwhile? Try again")
            sent.append({"suffix": f.suffix, "size": n, "sha256": recorded[f.suffix] if recorded else h.hexdigest()})
        # the bytes sent are the parked ones (hashed as they went): else nothing is listed (``force``: said)
        foreign = tuple(_files_problem(p) for p in _files_problems(src, sent))
        if foreign and not force:
            raise MoveRefused(Compatibility(foreign, ()))
        compat = Compatibility(compat.refusals, (*compat.warnings, *(p for p in foreign
                                                                      if p not in compat.warnings)))
        manifest = {"move_id": move_id, "name": new_name or src.record.name, "source": source.where,
                    "record": asdict(src.record), "files": sent}
    except BaseException as exc:
        await _abort(target, move_id)
        if isinstance(exc, OSError):
            raise MoveError(f"the copy to {target.where} failed: {exc.strerror or exc} (the source is kept; "
                            "nothing was added there)") from None
        raise
    warnings = [str(p) for p in compat.warnings]
    cancelled: BaseException | None = None
    commit = asyncio.create_task(target.commit(manifest))  # awaited below, even when cancelled
    try:
        try:
            stored = await asyncio.shield(commit)
        except asyncio.CancelledError as e:
            cancelled = e
            stored = await commit  # its outcome decides what the move did; the cancellation goes on below
    except BaseException as exc:  # why: the commit failed or its answer was lost: _settle asks, re-raises unless listed
        try:
            stored = await _settle(target, move_id, exc, name, source.where)
        except ChecksumMismatch as e:
            if not recorded:
                raise
            raise MoveRefused(Compatibility((_not_as_parked(e, target.where),), ())) from None
        warnings.append(f"the answer of the commit at {target.where} was lost ({_why(exc)}); asked again, "
                        f"{target.where} had listed '{stored.name}'")
        if cancelled is None and isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt)):
            cancelled = exc
    result = MoveResult(stored, source.where, target.where, False, done, warnings)
    _committed(on_committed, result)
    if cancelled is not None:
        raise cancelled
    if not keep_source:
        try:
            await source.delete(src.record.name)
            result.moved = True
        except Exception as e:  # report: the copy stands; the source is kept, and the result says why (logged)
            log.warning("move of %r: copied to %s but the source could not be deleted", name, target.where,
                        exc_info=True)
            result.source_kept = f"copied, but the source could not be deleted: {e}"
    return result


def _not_as_parked(e: ChecksumMismatch, where: str) -> Problem:
    return _files_problem(f"{e.file} reached {where} with SHA-256 {e.got[:12]}…, not the parked {e.expected[:12]}…: "
                          "the file changed here since the park, or was damaged on the way; nothing was added there")


def _committed(on_committed: Callable[[MoveResult], None] | None, result: MoveResult) -> None:
    if on_committed is None:
        return
    try:
        on_committed(result)
    except Exception:  # report: a broken display must not undo a committed move (logged)
        log.exception("move: the on_committed callback failed")


async def _next(chunks: AsyncIterator[bytes]) -> bytes | None:
    return await anext(chunks, None)


async def _together(*coros) -> list:
    """Run ``coros`` at once and return their results; the first failure (or a cancellation)
    cancels the others, waits for them, and is raised as it is."""
    tasks = [asyncio.create_task(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _abort(target: Endpoint, move_id: str) -> None:
    try:
        listed = await asyncio.shield(target.abort(move_id))
    except Exception:  # report: the move's own error goes on; a leftover is cleaned by the next move (logged)
        log.warning("move %s: could not remove the temporary files at %s", move_id, target.where, exc_info=True)
        return
    if listed is not None:  # cannot be: no commit was asked for (logged)
        log.error("move %s: %s listed '%s' before any commit", move_id, target.where, listed.name)


def _why(exc: BaseException) -> str:
    if isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt)):
        return "interrupted"
    return str(exc) or type(exc).__name__


async def _settle(target: Endpoint, move_id: str, exc: BaseException, name: str, source: str) -> SessionRecord:
    """The commit of ``move_id`` failed or its answer was lost: ask the target (again, on a new
    connection for a host) what became of it. Returns the row it listed (the caller goes on as
    after a commit: the source is deleted), or raises: the target rolled it back (the source is
    kept), or could not be asked (both copies may exist: the message says how to tell)."""
    try:
        listed = await asyncio.shield(target.abort(move_id))
    except Exception as e:  # report: the outcome is unknown; the move fails and says so (logged)
        log.warning("move %s: cannot ask %s what became of the commit", move_id, target.where, exc_info=True)
        raise MoveError(f"the commit at {target.where} was cut ({_why(exc)}) and {target.where} could not be asked "
                        f"what became of it ({e}): '{name}' is kept at {source}; if {target.where} lists it "
                        "too, the commit finished there: delete one of the two copies") from None
    if listed is not None:
        return listed
    if isinstance(exc, (MoveError, asyncio.CancelledError, KeyboardInterrupt)):
        raise exc
    raise MoveError(f"the commit at {target.where} failed ({_why(exc)}); {target.where} rolled it back: "
                    f"'{name}' is kept at {source}, nothing was added there") from None
