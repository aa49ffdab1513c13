"""A check's long work says where it is: the A/B's probes, restarts, restores and each query's prefill
("prefilling 512 of 1,4xx tokens", read from GET /slots between batches, as build 11434 answers it)."""

from __future__ import annotations

import asyncio
import re
import signal
from app.sessions.ab import ab_check
from app.sessions.check_report import ARM_HIDDEN
from app.core.verdict import VerdictKind
from tests.fake_server.test_check_ab import catalog, make_target, park, warm_tokenizer  # noqa: F401

GUARD_S = 120  # a failure guard only: the fake holds the prefill until the test has seen its progress


async def test_ab_reports_prefill_progress_from_slots(fake_server, tmp_path, catalog):  # noqa: F811
    rec = await park(fake_server, tmp_path, catalog)
    # batches of 512: the hidden arm's full re-prefill stops after its first batch until SIGUSR2
    with fake_server(FAKE_SIDECAR=1, FAKE_PREFILL_HOLD=1, extra_args=("-b", "512")) as (url, proc):
        target = make_target(url, tmp_path, catalog, proc)
        await warm_tokenizer(target.client)
        lines: list[str] = []
        seen = asyncio.Event()

        def on_progress(text: str) -> None:
            lines.append(text)
            if re.fullmatch(rf"{ARM_HIDDEN}: prefilling 512 of [\d,]+ tokens", text):
                seen.set()

        task = asyncio.ensure_future(ab_check(target, rec, 0, output_check=False, on_progress=on_progress))
        try:
            await asyncio.wait_for(seen.wait(), GUARD_S)
        except TimeoutError:
            raise AssertionError(lines) from None
        assert not task.done()  # the prefill is still running: the line came while it was
        proc.send_signal(signal.SIGUSR2)
        ab = await asyncio.wait_for(task, GUARD_S)
        await target.client.aclose()
    assert ab.row(ARM_HIDDEN).verdict.kind is VerdictKind.DISCARDED
    total = ab.row(ARM_HIDDEN).prompt_n
    assert f"{ARM_HIDDEN}: prefilling 512 of {total:,} tokens" in lines
    assert lines[0] == f"reading the state file of '{rec.name}'"
    assert f"restoring {rec.n_tokens:,} tokens into slot 0" in lines
    assert any(t.startswith("hiding the sidecar") for t in lines)
    assert any(re.fullmatch(rf"{ARM_HIDDEN}: the first query \([\d,]+ tokens\)", t) for t in lines)


async def test_progress_callback_that_raises_does_not_break_the_check(fake_server, tmp_path, catalog):  # noqa: F811
    rec = await park(fake_server, tmp_path, catalog)
    with fake_server(FAKE_SIDECAR=1) as (url, proc):
        target = make_target(url, tmp_path, catalog, proc)
        await warm_tokenizer(target.client)

        def broken(text: str) -> None:
            raise RuntimeError("the display went away")

        ab = await ab_check(target, rec, 0, output_check=False, on_progress=broken)
        await target.client.aclose()
    assert ab.row(ARM_HIDDEN).verdict.kind is VerdictKind.DISCARDED
