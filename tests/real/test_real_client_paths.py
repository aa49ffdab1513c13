"""The real llama-server (b11434) answers the proxy's own requests alike over both of the client's paths
(issue #38): httpx, and the forward's aiohttp session that a client takes once it has forwarded on the
running loop (the proxy's restores, parks and slot reads). A save, a restore of what it saved, a restore
of a file that is not there (the server's own error: status, message, type) and ``/slots``: the same
answer, to the field, before and after the first forward.
"""

from __future__ import annotations

import pytest

from app.server.client import LlamaClient, ServerError
from tests.real.helpers import start_server

pytestmark = pytest.mark.real_server

#: what varies between two runs of the same call (times, the task counter), not what the path decides
VARIES = {"timings", "id_task", "next_token", "params", "speculative", "is_processing"}


def _shape(value: object) -> object:
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items() if k not in VARIES}
    if isinstance(value, list):
        return [_shape(v) for v in value]
    return value


async def _calls(client: LlamaClient, name: str) -> list[object]:
    out: list[object] = []
    for call in (lambda: client.save_slot(0, f"{name}.bin"), lambda: client.restore_slot(0, f"{name}.bin"),
                 lambda: client.restore_slot(1, "not-there.bin"), client.slots):
        try:
            out.append(_shape(await call()))
        except ServerError as e:
            out.append(("ServerError", e.status, e.message, e.type, e.path))
    return out


async def test_the_real_server_answers_the_proxys_own_requests_alike_over_both_paths(real_profile):
    plan, sup = await start_server(real_profile)
    try:
        async with LlamaClient(plan.url) as client:
            # a slot that holds something: a prompt processed in slot 0
            await client.completion("The valet parks each car in a numbered bay.", slot_id=0, n_predict=2)
            over_httpx = await _calls(client, "chat")
            assert client._aio is None  # (no forward yet: httpx made those)
            async with client.forward("GET", "/health", headers={}, content=None) as r:
                assert r.status_code == 200 and await r.aread()
            over_aiohttp = await _calls(client, "chat")
            assert client._aio is not None and not client._aio.closed  # the forward's session made these
    finally:
        await sup.aclose()
    assert over_aiohttp == over_httpx
    saved, restored, missing, slots = over_httpx
    assert saved["id_slot"] == 0 and saved["filename"] == "chat.bin" and saved["n_saved"] > 0, saved
    assert restored["id_slot"] == 0 and restored["n_restored"] == saved["n_saved"], restored
    assert missing[:2] == ("ServerError", 400) and missing[4] == "/slots/1", missing
    assert [row["id"] for row in slots] == [0, 1]
