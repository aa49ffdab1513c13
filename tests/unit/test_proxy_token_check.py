"""The conversation proxy's last check before it restores a park (app.proxy.session_backend): the park's own
tokens against the request's prompt as the server tokenises it. A park that is not this request's is never
restored (the real server's case: tests/real/test_real_proxy_final_check.py)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
from hypothesis import example, given, settings, strategies as st

from app.core.verdict import tolerance
from app.proxy.lease_parks import RestoreAvoided
from app.proxy.session_backend import RestoreFor, SessionBackend, shared_prefix, shared_with_prompt

CHAT = {"messages": [{"role": "user", "content": "the long document, again"}]}
PARKED = list(range(1000, 1400))  # the park's own tokens: 400 of them


def rendered(tokens: list[int]) -> str:
    """A text whose tokens are ``tokens``: a word for each ("t1234 ")."""
    return "".join(f"t{t} " for t in tokens)


def token_ids(text: str) -> list[int]:
    """The tokens of :func:`rendered`'s text; a text cut inside a word tokenises otherwise near the cut (its
    last five tokens here), as a real tokenizer's merges may."""
    ids = [int(w[1:]) for w in text.split(" ") if w[1:].isdigit()]
    if not text.endswith(" "):
        ids[-5:] = [t + 1 for t in ids[-5:]]
    return ids


class Client:
    """The server's /apply-template and /tokenize: the request's prompt is ``prompt``; the texts it was
    asked to tokenise are kept."""

    def __init__(self, prompt: list[int]):
        self.prompt = prompt
        self.tokenised: list[str] = []

    async def apply_template(self, body: dict) -> str:
        return rendered(self.prompt)

    async def token_ids(self, text: str) -> list[int]:
        self.tokenised.append(text)
        return token_ids(text)


class Sessions:
    """A session service whose resume restores at once."""

    def __init__(self):
        self.restored: list[tuple[str, int]] = []  # what the server was asked to restore

    async def parked_tokens(self, name: str) -> list[int]:
        return PARKED

    async def resume(self, name, slot_id=None, **checks):
        self.restored.append((name, slot_id))
        return SimpleNamespace(n_restored=len(PARKED), prediction=None, hazard=None)

    def park_bytes(self, name: str) -> int:
        return 0


def backend(client: Client, sessions: Sessions) -> SessionBackend:
    b = SessionBackend.of(SimpleNamespace(client=client), sessions)
    b.requests["proxy-a"] = RestoreFor("/v1/chat/completions", CHAT)
    return b


async def test_a_park_whose_tokens_are_not_the_requests_is_never_restored():
    """Another chat's tokens under this conversation's park (an identity the messages got wrong): the
    server is never asked to restore it, and the reason names the tokens shared."""
    sessions = Sessions()
    with pytest.raises(RestoreAvoided, match="not this request's: they share 0 of its 400 tokens"):
        await backend(Client(prompt=list(range(5000, 5600))), sessions).restore(2, "proxy-a")
    assert sessions.restored == []


@pytest.mark.parametrize("prompt", [PARKED + [7, 8, 9], [2] + PARKED + [7], PARKED[:300] + [7] * 200],
                         ids=["continues-it", "after-a-bos", "edited-late"])
async def test_the_park_of_this_conversation_is_restored_after_its_tokens_are_checked(prompt):
    """The prompt continues the park, or repeats it after a BOS the park does not start with, or was edited
    well after its start: the park is this conversation's, and restored."""
    sessions = Sessions()
    n = await backend(Client(prompt=prompt), sessions).restore(2, "proxy-a")
    assert (n, sessions.restored) == (400, [("proxy-a", 2)])


async def test_a_park_sharing_only_the_tolerance_with_the_prompt_is_never_restored():
    """A shared template header is not a shared conversation: at most the judge's tolerance in common."""
    sessions = Sessions()
    with pytest.raises(RestoreAvoided, match="they share"):
        await backend(Client(prompt=PARKED[:tolerance(400)] + [9] * 400), sessions).restore(2, "proxy-a")
    assert sessions.restored == []


async def test_a_long_prompt_is_checked_from_a_prefix_of_it():
    """A 30,000-token conversation coming back to its park: a prefix of its prompt, a few hundred tokens
    long, tells that the park is its own; the whole prompt is never tokenised (52 ms at llama-server)."""
    parked = list(range(100_000, 130_000))
    client, sessions = Client(prompt=parked + [7, 8, 9]), Sessions()
    b = backend(client, sessions)
    sessions.parked_tokens = lambda name: _async(parked)
    await b.restore(2, "proxy-a")
    assert sessions.restored == [("proxy-a", 2)]
    assert len(client.tokenised) == 1 and len(token_ids(client.tokenised[0])) < 2 * tolerance(len(parked))


async def _async(value):
    return value


WORD_IDS = st.integers(1_000_000, 1_000_040)
LONG_PARK = [1_000_000 + i % 40 for i in range(300)]


@settings(max_examples=300, deadline=None)
@example(saved=LONG_PARK, keep=300, tail=[1_000_005], bos=False)  # (a first prefix of about the tolerance)
@example(saved=LONG_PARK, keep=300, tail=[], bos=True)
@example(saved=LONG_PARK, keep=20, tail=LONG_PARK[:280], bos=False)  # parts early, then the same again
@given(saved=st.lists(WORD_IDS, min_size=1, max_size=2500),
       keep=st.integers(0, 2600), tail=st.lists(WORD_IDS, max_size=300), bos=st.booleans())
def test_a_prefix_decides_as_the_whole_prompt_would(saved, keep, tail, bos):
    """Whatever the park and the prompt (a part of the park, then anything; a BOS on one side or not): more
    than the tolerance shared, from the prefixes, exactly when the whole prompt's tokens say so. The tokens
    are long ones (9 characters: "t1000040 "), so that a first prefix holds few more than it needs."""
    prompt = ([2] if bos else []) + saved[:keep] + tail
    enough = tolerance(len(saved))

    async def ids(text: str) -> list[int]:
        return token_ids(text)
    found = asyncio.run(shared_with_prompt(ids, rendered(prompt), saved, enough))
    assert (found > enough) == (shared_prefix(saved, prompt) > enough)


async def test_the_parks_file_is_read_while_the_server_renders_the_chat():
    """Each side waits until the other has started: done one after the other, this would never end."""
    reading, rendering = asyncio.Event(), asyncio.Event()
    client, sessions = Client(prompt=PARKED + [7]), Sessions()
    render = client.apply_template

    async def parked_tokens(name):
        reading.set()
        await rendering.wait()
        return PARKED

    async def apply_template(body):
        rendering.set()
        await reading.wait()
        return await render(body)
    sessions.parked_tokens, client.apply_template = parked_tokens, apply_template
    assert await asyncio.wait_for(backend(client, sessions).restore(1, "proxy-a"), 30) == 400  # (a hang guard)


async def test_a_park_whose_file_cannot_be_read_is_restored_unchecked(caplog):
    """The check cannot be made (the park's file unreadable here): the restore goes on as decided, which
    is what the session service's own checks of that file then answer for; said in the log."""
    client, sessions = Client(prompt=list(range(5000, 5600))), Sessions()

    async def unreadable(name):
        raise OSError("Permission denied")
    sessions.parked_tokens = unreadable
    with caplog.at_level(logging.INFO, logger="app.proxy.session_backend"):
        assert await backend(client, sessions).restore(1, "proxy-a") == 400
    assert sessions.restored == [("proxy-a", 1)] and "were not checked" in caplog.text
