""""Check resume": prove whether a parked session really skips the prefill.

* :func:`check_resume` restores the session and sends one short question, twice:
  (a) the state file's exact tokens + the question's tokens (the best case), and
  (b) the saved tokens detokenised + the question as the chat's next user turn in the
  model's chat format (what a chat client does; re-tokenising can move the tail;
  :mod:`app.sessions.probe_turn`). Each probe starts from a fresh restore
  and is judged from the first query's ``cache_n`` / ``prompt_n``.
* :func:`app.sessions.ab.ab_check` runs the seed's A/B on the same state file: once with its
  checkpoint sidecar, once with the sidecar moved aside (``<state>.ckpt`` →
  ``<state>.ckpt.kvv-hidden``), optionally plus a baseline full prefill in an
  empty slot. Hiding is journaled in the catalog *before* the rename and always
  undone in ``finally``; :func:`app.sessions.sidecar_hide.recover_hidden_sidecars`
  undoes it after a crash.

  **Protocol.** As the seed ran it, each probe runs in a fresh server process
  (``restart``: KV Valet restarts the server it supervises, same binary, flags and
  state file), because a build that keeps a slot's checkpoints across restores
  (the turboquant fork) lets a later arm reuse what an earlier arm left: its
  sidecar-less arm then looks like a HIT and the A/B reports about 1x. Each arm's
  first query is what a chat client sends (the conversation as text, re-tokenised,
  so the usual rollback happens); the exact-append probe is a second row. On a
  server KV Valet does not run, the A/B runs in one process only when asked to,
  and an arm whose log shows it reused checkpoints no sidecar of its own brought
  is labelled *confounded*. Check resume follows the same rule.
* **The output check** (on by default; ``output_check=False`` / ``--no-output-check`` turns
  it off): each probe's first query is a greedy continuation of a few tokens with their top
  log-probs (:func:`app.core.output_check.sampling`), and the same prompt is then prefilled
  cold (``_cold``: the slot erased, ``cache_prompt: false``, so the server starts at
  ``n_past`` 0 and uses nothing the restore brought) and scored on the same prefixes (another
  cold prefill after each position where the cold side took another token). The two sides'
  log-probs are compared position by position (:func:`app.core.output_check.compare`) against
  the drift correct restores were measured to show (:mod:`app.core.output_drift`); a resume
  whose log-probs moved further is judged DIFFERS ("output differs from a cold prefill"),
  whatever it reused. One cold
  prefill per distinct prompt: the A/B's arms share it (both arms' outputs are compared with
  the same cold one). The cold prefills run after every probe (:func:`check_outputs`): on the
  fork a slot keeps its checkpoints across an erase and a restore, and a later probe would
  reuse the ones a cold prefill made.
* :func:`leaves_nothing`: a check or an A/B empties the slot it restored into when it ends, so
  a stop's park of every slot parks nothing of it as a new session.
* The reports are values (app.sessions.check_report); app.sessions.check_export writes them out
  as Markdown, CSV, JSON and text.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Awaitable, Callable

from app.core.background import say_progress
from app.core import output_check as oc
from app.core.output_drift import Bound, DriftDataError, bound_for, precision_of
from app.core.park_files import parked_positions
from app.core.sidecar_behaviour import MISSING, LoadPrediction, predict_load
from app.core.states import SidecarStatus
from app.core.timings import Timings
from app.sessions import sidecar_check
from app.sessions.behaviour import predict_for_target
from app.sessions.probe_turn import next_turn
from app.sessions.slots import SlotError, find_row
from app.sessions.target import ServerTarget
from app.monitor.slots import RestoredSlot, held_tokens
from app.core.verdict import Verdict, VerdictKind, worst
from app.sessions.watch import judge_from_completion, scan_events
from app.server.client import ServerError, ServerUnreachable
from app.server.gguf_info import ModelFileError, read_model_info
from app.server.logparse import Kind
from app.server.statefile import StateFileError, read_state_header, read_state_tokens
from app.store.catalog import Catalog, HistoryEvent, SessionRecord
from app.sessions.check_report import (DEFAULT_QUESTION, PROBE_EXACT, PROBE_TEXT, PROTOCOL_ONE_PROCESS, PROTOCOL_RESTARTS,
                                       CheckError, CheckReport, ProbeRow)


log = logging.getLogger(__name__)

Restarter = Callable[[], Awaitable[None]]
ProgressFn = Callable[[str], None]
#: how often a long query's prefill is asked about (GET /slots, else the server's log)
PROGRESS_POLL_S = 0.5
#: the "rollback" chat probe: the saved tokens less this many at the tail, then the question (what a
#: chat client's re-tokenised tail makes the server do: roll back a few tokens) in exact tokens
TAIL_ROLLBACK = 4


# --------------------------------------------------------------------------- preparation

@dataclass
class CheckContext:
    target: ServerTarget
    record: SessionRecord
    slot_id: int
    state_path: Path
    tokens: list[int]
    sidecar_status: str
    sidecar_count: int
    sidecar_path: Path | None
    build_persists: bool | None
    bos_text: str
    warnings: list[str]
    prediction: LoadPrediction | None = None  # what this build's loader does with the sidecar
    on_progress: ProgressFn | None = None  # where the check says what it is doing (a line of text)
    question_sent: str = ""  # how the chat probe sent the question (app.sessions.probe_turn.NextTurn.how)

    def say(self, text: str) -> None:
        _say(self.on_progress, text)


def state_path_of(target: ServerTarget, record: SessionRecord) -> Path:
    if target.save_dir is None:
        return record.state_path
    p = Path(target.save_dir) / record.state_file
    if not p.exists() and record.save_dir:
        alt = record.state_path
        if alt.exists():
            return alt
    return p


def _say(cb: ProgressFn | None, text: str) -> None:
    say_progress(cb, text, "check")


async def _prefill_text(ctx: CheckContext, what: str, n_prompt: int | None, seq: int | None) -> str | None:
    """How far the running query's prefill is: from ``GET /slots`` (build 11434 answers it between
    batches: ``is_processing``, ``n_prompt_tokens_processed``, ``n_prompt_tokens_cache``), else from
    the server's log (``prompt processing, n_tokens = N, progress = P``, printed after 3 s of it)."""
    try:
        row = find_row(await ctx.target.slot_rows(), ctx.slot_id)
    except (ServerError, SlotError):
        row = None
    if row is not None and row.busy and row.n_processed:  # 0: the server has not placed the task's cache yet
        total = n_prompt - (row.n_cached or 0) if n_prompt else row.n_prompt_tokens
        if total and total > 0:
            return f"{what}: prefilling {min(row.n_processed, total):,} of {total:,} tokens"
        return f"{what}: prefilling, {row.n_processed:,} tokens so far"
    if ctx.target.log is None or seq is None:
        return None
    progress = [ll.event for ll in ctx.target.log.since(seq)
                if ll.event.slot == ctx.slot_id and ll.event.kind == Kind.PROMPT_PROGRESS]
    if not progress:
        return None
    last = progress[-1]
    n = int(getattr(last, "n_tokens", 0) or 0)
    frac = float(getattr(last, "progress", 0.0) or 0.0)
    if n_prompt:
        return f"{what}: prefilling {n:,} tokens, {frac:.0%} of the {n_prompt:,}-token prompt"
    return f"{what}: prefilling {n:,} tokens ({frac:.0%})"


async def with_progress(ctx: CheckContext, what: str, n_prompt: int | None, query) -> dict:
    """Await ``query`` (a completion on the check's slot); meanwhile, every PROGRESS_POLL_S, say how
    far its prefill is when that changed (a 32K-token prefill takes minutes on a CPU)."""
    if ctx.on_progress is None:
        return await query
    seq = _log_seq(ctx.target)
    task = asyncio.create_task(query)  # awaited below (a bounded wait per poll), cancelled on the way out
    last = None
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=PROGRESS_POLL_S)
            if done:
                return task.result()
            if getattr(ctx.target.log, "poll", None) is not None:
                ctx.target.log.poll()
            text = await _prefill_text(ctx, what, n_prompt, seq)
            if text and text != last:
                last = text
                ctx.say(text)
    finally:
        if not task.done():
            task.cancel()


async def prepare(target: ServerTarget, record: SessionRecord, slot_id: int,
                   on_progress: ProgressFn | None = None) -> CheckContext:
    _say(on_progress, f"reading the state file of '{record.name}'")
    path = state_path_of(target, record)
    try:
        header = read_state_header(path)
        tokens = read_state_tokens(path)
    except StateFileError as exc:
        raise CheckError(f"session '{record.name}': {exc}") from None
    if not tokens:
        raise CheckError(f"session '{record.name}' holds no tokens")
    rows = await target.slot_rows()
    try:
        slot = find_row(rows, slot_id)
    except SlotError as e:
        raise CheckError(str(e)) from None
    if slot.busy:
        raise CheckError(f"slot {slot_id} is busy: wait until it is idle or pick another slot")
    n_ctx = int(slot.n_ctx or 0)
    if n_ctx and header.token_count + 64 > n_ctx:
        raise CheckError(f"session '{record.name}' holds {header.token_count:,} tokens but slot {slot_id} has "
                         f"only {n_ctx:,} of context (the question needs room too)")
    warnings = []
    if held_tokens(slot) > 0:
        warnings.append(f"slot {slot_id} held {held_tokens(slot):,} tokens; the check replaced them")
    report = await asyncio.to_thread(sidecar_check.inspect, path, header.token_count,
                                     record.memory_kind or "dense", verify_hash=True)
    status = report.status.value
    count = len(report.checkpoints)
    if report.status is SidecarStatus.INVALID:
        warnings.append(f"sidecar {report.reason}")
    sidecar_path = report.path
    build_persists = target.catalog.build_persists_checkpoints(target.build)
    if (build_persists is None and status == SidecarStatus.MISSING.value and record.server_build
            and record.server_build == target.build and (record.sidecar_count or 0) == 0):
        # this very build parked this SWA/hybrid session and wrote no sidecar
        build_persists = False
    bos_text = ""
    try:
        props = await target.client.props()
        bos_text = str(props.get("bos_token") or "")
    except ServerError:
        pass
    prediction = await asyncio.to_thread(predict_for_target, target, path, header.token_count)
    return CheckContext(target, record, slot_id, path, tokens, status, count, sidecar_path, build_persists, bos_text,
                warnings, prediction, on_progress)


def hidden_prediction(ctx: CheckContext) -> LoadPrediction:
    """The A/B's second arm: the same build with no sidecar next to the state file."""
    return predict_load(ctx.target.behaviour, MISSING, n_restored=len(ctx.tokens),
                        ctx_checkpoints=ctx.target.ctx_checkpoints)


def _log_seq(target: ServerTarget) -> int | None:
    if target.log is None:
        return None
    poll = getattr(target.log, "poll", None)
    if poll is not None:
        poll()
    return target.log.seq


async def _log_since(target: ServerTarget, seq: int | None, slot_id: int, wait_for_eval: bool) -> list | None:
    """The server log lines of this slot since ``seq`` (None without a log).
    The log is read asynchronously, so wait briefly for the query's timing line."""
    if target.log is None or seq is None:
        return None
    deadline = time.monotonic() + (2.0 if wait_for_eval else 0.0)
    while True:
        events = [ll.event for ll in target.log.since(seq) if ll.event.slot == slot_id]
        if not wait_for_eval or any(e.kind == Kind.PROMPT_EVAL for e in events) or time.monotonic() >= deadline:
            return events
        await asyncio.sleep(0.02)


async def _restore(ctx: CheckContext) -> tuple[float, int, int | None]:
    """Restore the session into the slot; (restore_ms, n_restored, log seq before)."""
    t = ctx.target
    seq = _log_seq(t)
    ctx.say(f"restoring {len(ctx.tokens):,} tokens into slot {ctx.slot_id}")
    _mark_used(ctx.slot_id)  # from here on the slot holds the check's tokens (a failed restore empties it)
    t0 = time.perf_counter()
    try:
        resp = await t.client.restore_slot(ctx.slot_id, ctx.record.state_file)
    except ServerError as exc:
        raise CheckError(f"restore of '{ctx.record.name}' into slot {ctx.slot_id} failed: {exc.message}") from None
    wall = (time.perf_counter() - t0) * 1000.0
    restore_ms = Timings.of(resp).restore_ms or wall
    n = int(resp.get("n_restored") or len(ctx.tokens))
    t.restored[ctx.slot_id] = RestoredSlot(n, ctx.record.name, None)
    return restore_ms, n, seq


async def _prompt_for(ctx: CheckContext, mode: str, question: str) -> tuple[Any, list[int] | None]:
    """The probe's prompt and, when known, its tokens (for the common prefix). The "text" probe sends
    the question as a chat client sends the next turn: through the model's chat format
    (:mod:`app.sessions.probe_turn`), else as raw text after the chat (``ctx.question_sent`` says which)."""
    client = ctx.target.client
    if mode in ("exact", "rollback"):
        q = await client.tokenize(question)
        kept = ctx.tokens if mode == "exact" else ctx.tokens[:max(1, len(ctx.tokens) - TAIL_ROLLBACK)]
        toks = list(kept) + list(q)
        return toks, toks
    text = await client.detokenize(list(ctx.tokens))
    had_bos = False
    if ctx.bos_text and text.startswith(ctx.bos_text):
        # the server adds BOS itself; keeping it in the text would give two
        text = text[len(ctx.bos_text):]
        had_bos = True
    turn = await next_turn(client, question)  # the question as the chat's next user turn, when it can be
    ctx.question_sent = turn.how
    prompt = turn.prompt(text, question)
    toks = None
    try:
        toks = await client.tokenize(prompt)
        if had_bos:
            toks = [ctx.tokens[0], *toks]
    except ServerError:
        toks = None
    return prompt, toks


def _confound(events: list | None, loaded: int | None, verdict: Verdict, behaviour: str, earlier: bool,
              fresh: bool) -> str:
    """Why this probe's result came from checkpoints an earlier probe left in the same
    server process, or "" when it is clean. The log says it when it is there: a
    checkpoint was used although no sidecar was loaded at this restore. Without the
    log, a build known to keep a slot's checkpoints across restores (the fork) makes
    any later sidecar-less HIT suspect."""
    if fresh or not earlier or not verdict.ok or loaded:
        return ""
    if events is not None:
        used = any(e.kind == Kind.CHECKPOINT_RESTORED for e in events)
        if used:
            return ("reused a context checkpoint that no sidecar brought at this restore: an earlier probe in "
                    "the same server process left it (this build keeps a slot's checkpoints across restores)")
        return ""
    if behaviour == "fork":
        return ("this build keeps a slot's checkpoints across restores, and an earlier probe ran in the same "
                "server process: the result may come from its checkpoints")
    return ""


@dataclass
class _Output:
    """The output check of one check or A/B: ``k`` positions compared against the measured drift
    ``bound`` of the model's architecture, one cold continuation per distinct prompt (the A/B's arms
    send the same prompts)."""

    k: int
    bound: Bound
    cold: dict[Any, oc.Continuation | str] = field(default_factory=dict)  # a str: why there is none


async def output_for(target: ServerTarget, record: SessionRecord, k: int) -> _Output:
    """The output check's settings for this server's model: the drift bound of its architecture
    (:mod:`app.core.output_drift`; the largest of all when the model file cannot be read here)."""
    arch = precision = None
    path = target.model_path or record.model_path
    if path:
        try:
            info = await asyncio.to_thread(read_model_info, path)
            arch, precision = info.architecture, precision_of(info.file_type)
        except ModelFileError as exc:
            log.info("the output check uses the largest drift bound: %s", exc)
    try:
        return _Output(k, bound_for(arch, precision))
    except DriftDataError as exc:
        raise CheckError(str(exc)) from None


def _key(prompt: Any) -> Any:
    return tuple(prompt) if isinstance(prompt, list) else prompt


async def _cold(ctx: CheckContext, prompt: Any, output: _Output, n_predict: int | None = None,
                what: str = "the same prompt") -> oc.Continuation | str:
    """The prompt prefilled cold and continued greedily for ``n_predict`` tokens (``k`` by
    default), or why it could not be: the slot erased, then ``cache_prompt: false``, so the server
    starts at ``n_past`` 0 (it removes the slot's cells and processes every token; checkpoints are
    consulted only when ``n_past`` > 0): nothing the restore brought, not even the checkpoints the
    fork keeps across an erase, takes part. Asked once per prompt."""
    key = _key(prompt)
    if key in output.cold:
        return output.cold[key]
    client = ctx.target.client
    try:
        await client.erase_slot(ctx.slot_id)
        ctx.target.restored.pop(ctx.slot_id, None)
        n = len(prompt) if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) else None
        ctx.say(f"output check: a cold prefill of {what}" + (f" ({n:,} tokens)" if n else ""))
        resp = await with_progress(ctx, "output check, cold prefill", n, client.completion(
            prompt, slot_id=ctx.slot_id, n_predict=output.k if n_predict is None else n_predict,
            cache_prompt=False, extra=oc.sampling()))
        cold: oc.Continuation | str = oc.continuation(resp)
    except ServerError as exc:
        cold = f"the cold prefill failed: {exc.message}"
    output.cold[key] = cold
    return cold


async def _output_check(ctx: CheckContext, prompt: Any, resp: dict, output: _Output) -> oc.OutputCheck:
    """The resumed continuation against cold prefills scored on the same prefixes: the first after
    the prompt, each next one after the prompt and the resumed side's tokens up to where the previous
    cold one took another token (:func:`app.core.output_check.next_cold`), until every position has
    a cold partner or one position already moved further than the measured drift."""
    warm = oc.continuation(resp)
    colds: list[oc.Continuation] = []
    start: int | None = 0
    while start is not None:
        what = "the same prompt" if start == 0 else f"the same prompt and the resumed side's first {start} tokens"
        cold = await _cold(ctx, oc.cold_prompt(prompt, warm, start), output, n_predict=output.k - start, what=what)
        if isinstance(cold, str):
            return oc.unknown(cold, output.k)
        if not cold.steps:
            break
        colds.append(cold)
        result = oc.compare(warm, colds, output.k, bound=output.bound)
        if result.differs:
            return result  # a position over the bound: the rest cannot make it right
        start = oc.next_cold(warm, colds, output.k)
    return oc.compare(warm, colds, output.k, bound=output.bound)


async def run_probe(ctx: CheckContext, name: str, mode: str, question: str, *, n_predict: int = 1,
                 sidecar_status: str | None = None, checkpoints_expected: int | None = None,
                 restart: Restarter | None = None, earlier: bool = False, prediction=None,
                 output: _Output | None = None) -> ProbeRow:
    if restart is not None:
        ctx.say(f"{name}: restarting the server (a fresh process for this probe)")
        await restart_server(ctx, restart)
    restore_ms, n_restored, seq = await _restore(ctx)
    prompt, toks = await _prompt_for(ctx, mode, question)
    extra = oc.sampling() if output is not None else None
    if output is not None:
        n_predict = max(n_predict, output.k)
    ctx.say(f"{name}: the first query" + (f" ({len(toks):,} tokens)" if toks else ""))
    try:
        resp = await with_progress(ctx, name, len(toks) if toks else None, ctx.target.client.completion(
            prompt, slot_id=ctx.slot_id, n_predict=n_predict, extra=extra))
    except ServerError as exc:
        raise CheckError(f"the probe query failed: {exc.message}") from None
    finally:
        ctx.target.restored.pop(ctx.slot_id, None)
    events = await _log_since(ctx.target, seq, ctx.slot_id, True)
    status = sidecar_status if sidecar_status is not None else ctx.sidecar_status
    # with a log, no "restored N context checkpoints from sidecar" line means none were loaded
    loaded = (scan_events(events).sidecar_loaded or 0) if events is not None else None
    v = judge_from_completion(
        n_restored, resp, sidecar_status=status, sidecar_loaded_count=loaded,
        build_persists=ctx.build_persists, ctx_checkpoints=ctx.target.ctx_checkpoints,
        log_events=events, saved_tokens=ctx.tokens, prompt_tokens=toks,
        sidecar_count=checkpoints_expected if checkpoints_expected is not None else ctx.sidecar_count,
        behaviour=ctx.target.behaviour, prediction=prediction if prediction is not None else ctx.prediction,
        parked_positions=parked_positions(ctx.record.parked_files),
    )
    t = Timings.of(resp)
    confounded = _confound(events, loaded, v, str(ctx.target.behaviour), earlier, restart is not None)
    if confounded:
        v = Verdict(v.kind, f"{v.reason} (confounded: {confounded})", n_restored=v.n_restored,
                    prompt_n=v.prompt_n, cache_n=v.cache_n, prompt_ms=v.prompt_ms,
                    rollback_tokens=v.rollback_tokens, checkpoints_loaded=v.checkpoints_loaded,
                    figures={**v.figures, "confounded": True})
    return ProbeRow(name=name, restore_ms=restore_ms, prompt_ms=t.prompt_ms, prompt_n=t.prompt_n,
                    cache_n=t.cache_n, ttft_ms=t.ttft_ms, n_restored=n_restored,
                    checkpoints_loaded=v.checkpoints_loaded, verdict=v,
                    prompt_tokens=resp.get("tokens_evaluated"), fresh_process=restart is not None,
                    confounded=confounded, pending=(prompt, resp) if output is not None else None)


async def check_outputs(ctx: CheckContext, rows: list[ProbeRow], output: _Output | None) -> None:
    """The output check of every probe, once all of them have run: the cold prefills come last,
    because on a build that keeps a slot's checkpoints across an erase and a restore (the fork)
    the checkpoints a cold prefill makes would otherwise be there for the next probe to reuse."""
    if output is None:
        return
    for row in rows:
        if row.pending is None:
            continue
        prompt, resp = row.pending
        row.pending = None
        row.output = await _output_check(ctx, prompt, resp, output)
        row.verdict = oc.with_output(row.verdict, row.output)


async def restart_server(ctx: CheckContext, restart: Restarter) -> None:
    """A fresh server process (same binary, flags, state file) before a probe."""
    try:
        await restart()
    except Exception as exc:
        log.exception("restarting the server for %s failed", ctx.record.name)
        raise CheckError(f"could not restart the server between probes: {exc}") from exc
    ctx.target.restored.clear()
    ctx.target.held_as.clear()
    ctx.target.last_rows = None
    ctx.target.last_tasks.clear()


def record_event(catalog: Catalog, record: SessionRecord, kind: str, build: str, row: ProbeRow,
                  extra: dict | None = None) -> None:
    if record.id is None:
        return
    details = {"probe": row.name, "n_restored": row.n_restored, "checkpoints_loaded": row.checkpoints_loaded,
               "rollback_tokens": row.verdict.rollback_tokens, "prompt_tokens": row.prompt_tokens,
               "output_check": row.output.to_dict() if row.output is not None else None}
    details.update(extra or {})
    catalog.add_event(HistoryEvent(session_id=record.id, kind=kind, server_build=build, restore_ms=row.restore_ms,
                                   prompt_ms=row.prompt_ms, prompt_n=row.prompt_n, cache_n=row.cache_n,
                                   ttft_ms=row.ttft_ms, verdict=row.verdict.kind.value, reason=row.verdict.reason,
                                   details=details))
    if row.verdict.kind is VerdictKind.DISCARDED and row.prompt_n and row.prompt_ms:
        catalog.record_prefill(record.profile, row.prompt_n, row.prompt_ms)


# --------------------------------------------------------------------------- nothing left behind

#: the slots the running check or A/B restored into (:func:`leaves_nothing`)
_USED: contextvars.ContextVar[set[int] | None] = contextvars.ContextVar("check_used_slots", default=None)


def _mark_used(slot_id: int) -> None:
    used = _USED.get()
    if used is not None:
        used.add(slot_id)


def leaves_nothing(target: ServerTarget, slot_id: int,
                   run: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[Any]]:
    """``run`` (a check or an A/B on ``slot_id``), then the slot emptied, whatever happened, once the
    check restored into it: what it holds then (the parked tokens, the question, a few answered
    tokens) is no chat of the user's, and a park of every slot (a stop, a quit, ``park --all``) would
    park it again as a new dated session. A check refused before its restore (a busy slot, a slot
    the server does not have) leaves the slot as it was."""

    async def wrapped() -> Any:
        used: set[int] = set()
        token = _USED.set(used)
        try:
            return await run()
        finally:
            _USED.reset(token)
            if slot_id in used:
                await _empty_slot(target, slot_id)

    return wrapped


async def _empty_slot(target: ServerTarget, slot_id: int) -> None:
    try:
        await target.client.erase_slot(slot_id)
    except (ServerError, ServerUnreachable) as exc:  # the server died or restarted: nothing is left in it
        log.info("emptying slot %s after the check: %s", slot_id, exc)
    target.restored.pop(slot_id, None)
    target.held_as.pop(slot_id, None)


# --------------------------------------------------------------------------- check resume

async def check_resume(target: ServerTarget, record: SessionRecord, slot_id: int, *,
                       question: str = DEFAULT_QUESTION, n_predict: int = 1,
                       variants: tuple[str, ...] = ("exact", "text"),
                       restart: Restarter | None = None, output_check: bool = True,
                       output_tokens: int = oc.OUTPUT_TOKENS, on_progress: ProgressFn | None = None) -> CheckReport:
    """Restore ``record`` into ``slot_id`` and judge a first query, once per variant
    ("exact": saved tokens + question tokens; "text": detokenised text + question).

    ``output_check``: compare each probe's greedy continuation of ``output_tokens`` tokens with
    a cold prefill's (the module's "output check"); a probe whose output differs is DIFFERS.

    ``restart``: run each probe in a fresh server process. Given only where it
    matters (a build that may keep a slot's checkpoints across restores); without
    it a later probe that reused an earlier one's checkpoints is labelled.

    ``on_progress(text)``: where the check is (restarts, restores, each query's prefill as
    "prefilling 12,288 of 32,768 tokens", the cold prefills)."""

    async def run() -> CheckReport:
        ctx = await prepare(target, record, slot_id, on_progress)
        rows = []
        output = await output_for(target, record, output_tokens) if output_check else None
        for i, mode in enumerate(variants):
            name = PROBE_EXACT if mode == "exact" else PROBE_TEXT
            rows.append(await run_probe(ctx, name, mode, question, n_predict=n_predict, restart=restart,
                                     earlier=i > 0, output=output))
        await check_outputs(ctx, rows, output)
        for row in rows:
            record_event(target.catalog, record, "check", target.build, row,
                          {"question": question, "protocol": PROTOCOL_RESTARTS if restart else PROTOCOL_ONE_PROCESS,
                           "confounded": row.confounded or None})
        clean = [r for r in rows if not r.confounded] or rows
        overall = worst(r.verdict for r in clean)
        assert overall is not None
        if record.id is not None:
            target.catalog.update_verdict(record.id, overall.kind.value, overall.reason)
            last = rows[-1]
            target.catalog.update_restore(record.id, last.restore_ms or 0.0, last.n_restored or 0, time.time())
        return CheckReport(session=record.name, profile=record.profile, build=target.build, slot_id=slot_id,
                           n_restored=rows[0].n_restored or len(ctx.tokens), sidecar_status=ctx.sidecar_status,
                           sidecar_count=ctx.sidecar_count, question=question, probes=rows, verdict=overall,
                           warnings=ctx.warnings, protocol=PROTOCOL_RESTARTS if restart else PROTOCOL_ONE_PROCESS,
                           behaviour=str(target.behaviour), output_check=output_check,
                           question_sent=ctx.question_sent)

    return await target.queue.run(f"check {record.name}", leaves_nothing(target, slot_id, run))


def not_its_own_files(report: CheckReport, problems: list[str]) -> CheckReport:
    """A check the user ran (``--yes``) on a park whose files are not the ones it wrote: a warm answer from
    another chat's files is no proof of a correct resume, and the output check's measured drift bound may
    be too wide to see it (Gemma 3 270M: the bound is 1.6 nats, another chat's sidecar moved it 0.4-0.7).
    Unless the output already differs (DIFFERS stands), the verdict is UNKNOWN: never a pass."""
    if report.verdict.kind is VerdictKind.DIFFERS:
        return replace(report, warnings=[*report.warnings, *problems])
    v = report.verdict
    said = "; ".join(problems)
    verdict = Verdict(VerdictKind.UNKNOWN,
                      f"not a correct resume that can be shown: {said}. The check ran on these files because it was "
                      f"told to (--yes); what it measured: {v.kind.value}, {v.reason}",
                      n_restored=v.n_restored, prompt_n=v.prompt_n, cache_n=v.cache_n, prompt_ms=v.prompt_ms,
                      rollback_tokens=v.rollback_tokens, checkpoints_loaded=v.checkpoints_loaded,
                      figures={**v.figures, "files_not_parked": True, "measured_kind": v.kind.value})
    return replace(report, verdict=verdict, warnings=[*report.warnings, *problems])
