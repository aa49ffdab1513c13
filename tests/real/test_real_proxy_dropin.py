"""The proxy as a drop-in on the real llama-server (issue #29 item 1): what llama.cpp's own server
tests found different through the proxy. A request with ``cache_prompt: false`` answers the same text
as the server gives directly; a two-prompt batch is answered in two slots; a client that pins slot 1
and saves it gets its tokens saved. Each goes through untouched, and is recorded with the reason."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from app.core.conversation import Cause
from tests.real.helpers import TEXT
from tests.real.test_real_proxy import Proxied

pytestmark = pytest.mark.real_server

PROMPT = "Here is a manual. " + TEXT[:600] + "\nThe first word of the manual is"


def test_the_clients_own_slot_and_caching_pass_through(real_profile):
    async def go():
        async with Proxied(real_profile.replace(proxy=True)) as p:
            direct = p.handle.client.base_url
            async with httpx.AsyncClient(timeout=600) as h:
                # prime a slot through the proxy, so a cached prefix exists to be (not) reused
                primed = (await h.post(p.proxy.http.url + "/completion",
                                       json={"prompt": PROMPT, "n_predict": 4, "temperature": 0})).json()
                await asyncio.wait_for(p.judged.get(), 120)
                body = {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "cache_prompt": False}
                via = (await h.post(p.proxy.http.url + "/completion", json=body)).json()
                rec = await asyncio.wait_for(p.judged.get(), 120)
                straight = (await h.post(direct + "/completion", json=body)).json()
                assert via["content"] == straight["content"]
                assert via["timings"]["cache_n"] == 0 and primed["timings"]["prompt_n"] > 0
                assert rec.explanation.cause is Cause.CLIENT_CHOSE and "cache_prompt" in rec.explanation.detail

                # a batch of two prompts: one slot each, as the server chooses
                batch = (await h.post(p.proxy.http.url + "/completion",
                                      json={"prompt": ["Say one.", "Say two."], "n_predict": 2,
                                            "temperature": 0})).json()
                rec = await asyncio.wait_for(p.judged.get(), 120)
                assert isinstance(batch, list) and len(batch) == 2
                assert sorted(r["id_slot"] for r in batch) == [0, 1]
                assert rec.explanation.cause is Cause.CLIENT_CHOSE and "batch of 2" in rec.explanation.detail

                # the client pins slot 1 and saves it (the profile set its own --slot-save-path)
                pinned = (await h.post(p.proxy.http.url + "/completion",
                                       json={"prompt": PROMPT, "n_predict": 2, "id_slot": 1})).json()
                rec = await asyncio.wait_for(p.judged.get(), 120)
                assert pinned["id_slot"] == 1 and rec.slot == 1
                saved = (await h.post(p.proxy.http.url + "/slots/1?action=save",
                                      json={"filename": "client-own.bin"})).json()
                assert saved["n_saved"] >= pinned["tokens_evaluated"] > 0, saved  # its own tokens, not 0

    asyncio.run(go())
