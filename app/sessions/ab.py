"""The seed's A/B on one parked session: the same state file resumed with its checkpoint sidecar and
with it hidden (app.sessions.sidecar_hide), each arm's first query as a chat client sends it, then the
exact-append probe; optionally a baseline full prefill in an empty slot. The probes, their protocol
(a fresh server process per probe, or one process with confounded arms labelled) and the output
check are :mod:`app.sessions.check`'s."""

from __future__ import annotations

import inspect
from typing import Awaitable, Callable

from app.core import output_check as oc
from app.core.states import SidecarStatus
from app.core.timings import Timings
from app.core.verdict import Verdict, VerdictKind
from app.sessions.check import (CheckContext, ProgressFn, Restarter, check_outputs, hidden_prediction,
                                leaves_nothing, output_for, prepare, record_event, restart_server, run_probe,
                                with_progress)
from app.sessions.check_report import (ARM_BASELINE, ARM_HIDDEN, ARM_HIDDEN_EXACT, ARM_WITH, ARM_WITH_EXACT,
                                       DEFAULT_QUESTION, PROTOCOL_ONE_PROCESS, PROTOCOL_RESTARTS, PROTOCOLS,
                                       ABReport, CheckError, ProbeRow)
from app.sessions.journal import JournalKind, Recovery, recover
from app.sessions.sidecar_hide import hide_sidecar, unhide_sidecar
from app.sessions.target import ServerTarget
from app.server.sidecar import sidecar_candidates
from app.store.catalog import SessionRecord

async def _maybe_await(x) -> None:
    if inspect.isawaitable(x):
        await x


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


async def ab_check(target: ServerTarget, record: SessionRecord, slot_id: int, *, baseline: bool = False,
                   question: str = DEFAULT_QUESTION, n_predict: int = 1,
                   between_arms: Callable[[], Awaitable[None] | None] | None = None,
                   restart: Restarter | None = None, protocol: str | None = None, output_check: bool = True,
                   output_tokens: int = oc.OUTPUT_TOKENS, exact_probes: bool = True,
                   chat_probe: str = "text", on_progress: ProgressFn | None = None) -> ABReport:
    """Resume the same state file with its sidecar and with the sidecar hidden; each
    arm's first query as a chat client sends it (text), then the exact-append probe
    as a second row; optionally a baseline full prefill.

    ``protocol`` PROTOCOL_RESTARTS (the seed's; the default when ``restart`` is given)
    needs ``restart`` (a fresh server process before each probe); PROTOCOL_ONE_PROCESS
    runs every probe in the running server and labels a probe that reused an earlier
    probe's checkpoints.
    ``output_check``: both arms' outputs compared with one cold prefill per prompt (an arm whose
    output differs is DIFFERS).
    ``exact_probes``: False runs each arm's chat probe only (at 32K tokens on a CPU the hidden arm's
    exact append is another full prefill of minutes).
    ``chat_probe``: how each arm's first query stands for a chat client: "text" (the saved tokens
    detokenised and re-tokenised, the default) or "rollback" (in exact tokens, the last
    TAIL_ROLLBACK saved tokens dropped: the same small rollback, for a model whose tokenizer does
    not round-trip text, such as llama.cpp's test models).
    ``on_progress(text)``: where the A/B is (as :func:`check_resume`'s).
    ``between_arms`` is a test hook run after the first arm."""
    if protocol is None:
        protocol = PROTOCOL_RESTARTS if restart is not None else PROTOCOL_ONE_PROCESS
    if chat_probe not in ("text", "rollback"):
        raise CheckError(f"unknown chat probe '{chat_probe}' (use: text, rollback)")
    if protocol not in PROTOCOLS:
        raise CheckError(f"unknown A/B protocol '{protocol}' (use: {', '.join(PROTOCOLS)})")
    if protocol == PROTOCOL_RESTARTS and restart is None:
        raise CheckError("the A/B across restarts needs a server KV Valet runs (it restarts it between arms, "
                         "as the seed's A/B did); for this server run it in one process, whose arms can "
                         "confound on a build that keeps checkpoints across restores")
    restarter = restart if protocol == PROTOCOL_RESTARTS else None
    recover([JournalKind.AB_HIDE], Recovery(target.catalog))

    async def run() -> ABReport:
        ctx = await prepare(target, record, slot_id, on_progress)
        sidecar = sidecar_candidates(ctx.state_path)[0]
        if record.sidecar_file:
            sidecar = ctx.state_path.with_name(record.sidecar_file)
        has_sidecar = sidecar.is_file()
        rows: list[ProbeRow] = []
        output = await output_for(target, record, output_tokens) if output_check else None

        async def arm(names: tuple[str, str], **kw) -> None:
            for name, mode in zip(names, (chat_probe, "exact") if exact_probes else (chat_probe,)):
                row = await run_probe(ctx, name, mode, question, n_predict=n_predict, restart=restarter,
                                   earlier=bool(rows), output=output, **kw)
                rows.append(row)

        def record_arm(row: ProbeRow) -> None:
            record_event(target.catalog, record, "ab", target.build, row,
                          {"arm": row.name, "protocol": protocol, "confounded": row.confounded or None})

        await arm((ARM_WITH, ARM_WITH_EXACT))
        if between_arms is not None:
            await _maybe_await(between_arms())
        if has_sidecar:
            ctx.say(f"hiding the sidecar ({sidecar.name}) for the second arm")
            pid, hidden = hide_sidecar(target.catalog, sidecar)
            try:
                await arm((ARM_HIDDEN, ARM_HIDDEN_EXACT), sidecar_status=SidecarStatus.MISSING.value,
                          prediction=hidden_prediction(ctx))
            finally:
                unhide_sidecar(target.catalog, pid, sidecar, hidden)
        else:
            await arm((ARM_HIDDEN, ARM_HIDDEN_EXACT))
        await check_outputs(ctx, rows, output)  # the cold prefills after every arm: none can reuse theirs
        for row in rows:
            record_arm(row)
        with_row = next(r for r in rows if r.name == ARM_WITH)
        hidden_row = next(r for r in rows if r.name == ARM_HIDDEN)
        base_row = None
        if baseline:
            if restarter is not None:
                ctx.say("baseline: restarting the server (a fresh process for the cold prefill)")
                await restart_server(ctx, restarter)
            base_row = await _baseline(ctx, question, n_predict)
            rows.append(base_row)
            record_event(target.catalog, record, "baseline", target.build, base_row,
                          {"arm": ARM_BASELINE, "protocol": protocol})
        if record.id is not None:
            target.catalog.update_verdict(record.id, with_row.verdict.kind.value, with_row.verdict.reason)
        if not has_sidecar:
            if ctx.sidecar_status == SidecarStatus.NOT_NEEDED.value:
                note = "no sidecar to hide (a dense model needs none): both arms ran the same"
            elif with_row.verdict.kind is VerdictKind.DISCARDED:
                note = "both arms re-prefill: this build wrote no sidecar"
            else:
                note = "no sidecar to hide: both arms ran the same"
        else:
            note = (f"sidecar with {ctx.sidecar_count} checkpoint{'s' if ctx.sidecar_count != 1 else ''} "
                    f"hidden for the second arm and put back")
        if protocol == PROTOCOL_RESTARTS:
            note += "; every probe ran in a fresh server process (as the seed's A/B)"
        else:
            confounded = [r.name for r in rows if r.confounded]
            note += ("; all probes ran in one server process" + (
                f": {', '.join(confounded)} confounded (reused checkpoints an earlier probe left; "
                "do not trust its ratio, run the A/B across restarts)" if confounded else ""))
        return ABReport(
            session=record.name, profile=record.profile, build=target.build, slot_id=slot_id,
            n_restored=with_row.n_restored or len(ctx.tokens), sidecar_status=ctx.sidecar_status,
            sidecar_count=ctx.sidecar_count, rows=rows,
            delta_prefill_speedup=_ratio(hidden_row.prompt_ms, with_row.prompt_ms),
            end_to_end_speedup=_ratio(hidden_row.total_ms, with_row.total_ms),
            baseline_speedup=_ratio(base_row.prompt_ms, with_row.total_ms) if base_row else None,
            note=note, had_sidecar=has_sidecar, protocol=protocol, behaviour=str(target.behaviour),
            output_check=output_check, question_sent=ctx.question_sent,
        )

    return await target.queue.run(f"A/B {record.name}", leaves_nothing(target, slot_id, run))


async def _baseline(ctx: CheckContext, question: str, n_predict: int) -> ProbeRow:
    """Full prefill of the same tokens + question in an emptied slot, no cache reuse."""
    client = ctx.target.client
    await client.erase_slot(ctx.slot_id)
    ctx.target.restored.pop(ctx.slot_id, None)
    q = await client.tokenize(question)
    prompt = list(ctx.tokens) + list(q)
    ctx.say(f"baseline: a full prefill of {len(prompt):,} tokens in the emptied slot")
    resp = await with_progress(ctx, "baseline", len(prompt), client.completion(
        prompt, slot_id=ctx.slot_id, n_predict=n_predict, cache_prompt=False))
    t = Timings.of(resp)
    n = t.prompt_n
    v = Verdict(VerdictKind.UNKNOWN, f"baseline: full prefill of {n:,} tokens in an empty slot (reference)"
                if n is not None else "baseline: full prefill in an empty slot (reference)",
                n_restored=0, prompt_n=n, cache_n=t.cache_n, prompt_ms=t.prompt_ms,
                figures={"baseline": True})
    return ProbeRow(name=ARM_BASELINE, restore_ms=None, prompt_ms=t.prompt_ms, prompt_n=n,
                    cache_n=t.cache_n, ttft_ms=t.ttft_ms, n_restored=0, checkpoints_loaded=None,
                    verdict=v, prompt_tokens=resp.get("tokens_evaluated"))
