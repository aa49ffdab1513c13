"""A sliding-window model under --swa-full on the stock build: the park needs no checkpoints (issue #26).

Build 11434 with ``--swa-full`` keeps a full-size window cache (``n_swa = 0``): every position stays,
as in a dense model, so a restore after a restart can roll back the few tokens a chat client's
re-rendered turn needs without any checkpoint. Seen as a user would before the fix: the park warned
that the next query "will re-prefill", the resume asked for --yes, and the next turn was a HIT.
Here: no warning, no question, and the real next turn is a HIT.
"""

from __future__ import annotations

import asyncio

import pytest

from app.core.states import SidecarStatus
from app.core.verdict import VerdictKind
from tests.real.helpers import TEXT
from tests.real.test_real_sidecar_verdicts import Running

pytestmark = pytest.mark.real_server


def test_a_swa_full_park_on_the_stock_build_warns_of_nothing_and_resumes_warm(real_profile):
    profile = real_profile.replace(name="swa-full", swa_full=True)

    async def go():
        async with Running(profile) as srv:
            await srv.fill(0, TEXT * 2)
            park = await srv.svc.park(0, "full window")
        rec = park.record
        assert rec.memory_kind == "sliding-window"  # the model's kind is kept as it is
        assert rec.sidecar_status is SidecarStatus.NOT_NEEDED, rec.sidecar_reason
        assert park.warnings == []

        async with Running(profile) as srv:  # the restart
            assert srv.svc.on_this_server(rec) is None  # nothing to say about a sidecar it does not need
            result = await srv.svc.resume("full window", 0)  # no NeedsConfirmation: nothing re-prefills
            assert result.warnings == []
            name, v = await srv.other_client_query(0, TEXT * 2 + " And one more thing.")
            assert name == "full window" and v.kind is VerdictKind.HIT, v.reason

    asyncio.run(go())
