"""The proxy's token check before a restore tokenises a prefix of the prompt, trusting all but its last
``PREFIX_UNTRUSTED_TOKENS`` tokens (app.proxy.session_backend.shared_with_prompt). That rests on the real
tokenizer: a text cut anywhere tokenises as the whole text does, up to a few tokens before the cut. Measured
here on Gemma 3's (llama-server's /tokenize, special tokens parsed) over chat templates, prose, code, runs
without spaces and other scripts, each cut at many places; and the check's decisions from prefixes against
the whole prompt's, on the same server."""

from __future__ import annotations

import asyncio

import pytest

from app.core.verdict import tolerance
from app.proxy.session_backend import PREFIX_UNTRUSTED_TOKENS, shared_prefix, shared_with_prompt
from app.server.client import LlamaClient
from tests.real.helpers import TEXT, start_server

pytestmark = pytest.mark.real_server

CHAT = [{"role": "system", "content": TEXT},
        {"role": "user", "content": "Where is the car? Answer with the bay's number."},
        {"role": "assistant", "content": "Bay 42, by the lifts."},
        {"role": "user", "content": "Und auf Deutsch? 車はどこですか。Ответьте кратко."}]
TEXTS = {
    "code": ("def park(slot: int, name: str) -> None:\n    if slot < 0:\n"
             "        raise ValueError(f'slot {slot}')\n") * 30,
    "no-spaces": "abcdefghij0123456789" * 120 + "https://example.com/" + "x" * 800,
    "scripts": ("車はどこですか。駐車場の三番です。" * 40 + " Ответьте кратко, пожалуйста. " * 30
                + "🚗🅿️" * 50),
    "numbers": " ".join(str(n * 7919 % 100000) for n in range(600)),
}


def test_a_prefix_of_a_text_tokenises_as_the_text_does_up_to_its_last_tokens(real_profile):
    async def go():
        plan, sup = await asyncio.wait_for(start_server(real_profile), 300)
        try:
            async with LlamaClient(plan.url) as client:
                texts = dict(TEXTS, chat=await client.apply_template({"messages": CHAT}))
                worst = {}
                for label, text in texts.items():
                    whole = await client.token_ids(text)
                    differs = []
                    for cut in range(1, len(text), max(1, len(text) // 60)):
                        part = await client.token_ids(text[:cut])
                        same = next((i for i, (a, b) in enumerate(zip(part, whole)) if a != b), len(part))
                        differs.append(len(part) - same)  # tokens at the end of the prefix unlike the text's
                    worst[label] = max(differs)
                assert max(worst.values()) <= PREFIX_UNTRUSTED_TOKENS // 8, worst  # far inside the margin

                # the decisions: a prompt continuing the park, one parting from it early, one sharing nothing
                chat = texts["chat"]
                parked = (await client.token_ids(chat))[:-20]
                for prompt, restored in ((chat + "More, please.", True),
                                         (chat[:40] + " something else entirely. " * 200, False),
                                         (TEXTS["code"], False)):
                    enough = tolerance(len(parked))
                    found = await shared_with_prompt(client.token_ids, prompt, parked, enough)
                    full = shared_prefix(parked, await client.token_ids(prompt))
                    assert (found > enough) == (full > enough) == restored, (found, full, prompt[:60])
        finally:
            await sup.aclose()
    asyncio.run(go())
