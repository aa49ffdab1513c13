"""A failed restore on the real server: the conversation's park is damaged on disk after it was
written (its header and tokens intact, its KV payload cut short), so the app's checks pass and the
real llama-server 11434 itself refuses the restore (with --swa-full, where a restore of Gemma 3 pays on the
stock build, so the proxy tries it; without it the resume matrix says it buys nothing and the proxy does not) ("Unable to restore slot"), which empties the
slot. (A file cut short is caught by the app before the server is asked: that is not this case.)
The server runs with --cache-ram 0 here, so its RAM prompt cache cannot bring the conversation back
by itself and hide what the proxy did. The proxy must notice, drop the park, re-process the conversation correctly in that slot, and
say why; the next request of the conversation is a HIT again.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from app import paths
from app.core.conversation import Cause
from app.sessions.files_check import digest
from app.store.catalog import Catalog

from app.core.verdict import VerdictKind, tolerance
from app.server.statefile import read_state_header
from tests.real.test_real_proxy import SYSTEMS, Proxied, turn

pytestmark = pytest.mark.real_server


def test_a_restore_the_server_refuses_is_noticed_and_the_conversation_reprocessed(real_profile):
    async def go():
        profile = real_profile.replace(proxy=True, cache_ram=0, swa_full=True)
        async with Proxied(profile) as p:
            first = {}
            for name in ("A", "B", "C"):  # two slots: A is parked to make room for C
                first[name] = await p.ask(turn(SYSTEMS[name], question="What is the first word?"))
            conv_a = first["A"][1].conversation
            park = Path(profile.slot_save_path) / f"proxy-{conv_a}.bin"
            assert park.is_file()
            seq_state = read_state_header(park).header_bytes  # where the slot's KV state begins
            with open(park, "r+b") as f:  # its first fields (cell count...) garbled; size, header, tokens whole
                f.seek(seq_state)
                f.write(b"\xff" * 64)
            # as if the server had written it so (the park's record is of these bytes): KV Valet's own record of
            # its files (tests/real/test_real_park_files.py) does not catch it, and the server is asked
            with Catalog(paths.catalog_path()) as cat:
                rec = next(r for r in cat.list() if r.state_file == park.name)
                cat._update(rec.id, parked_files=digest(park).to_json(), files_verified="")

            again = turn(SYSTEMS["A"], ("What is the first word?", first["A"][0]), question="And the second?")
            reply, rec = await p.ask(again)
            assert rec.conversation == conv_a and rec.restored_from is None, rec
            assert rec.explanation is not None and rec.explanation.cause is Cause.RESTORE_FAILED, rec.explanation
            assert rec.verdict is VerdictKind.MISS, rec  # the failed restore brought nothing: no restore to discard
            assert rec.prompt_n >= rec.expected_reuse - tolerance(rec.expected_reuse), rec
            assert reply  # answered all the same, from a re-processed prompt
            assert not park.exists()  # the damaged park is gone, not tried again
            assert {c.id: c for c in p.proxy.list()}[conv_a].parked_as is None

            # the conversation goes on in its slot: the next request reuses what was just processed
            _, nxt = await p.ask(turn(SYSTEMS["A"], ("What is the first word?", first["A"][0]),
                                      ("And the second?", reply), question="And the third?"))
            assert nxt.conversation == conv_a and nxt.verdict is VerdictKind.HIT, nxt

    asyncio.run(go())
