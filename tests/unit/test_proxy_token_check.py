"""The conversation proxy's last check before it restores a park (app.proxy.session_backend): the park's own
tokens against the request's prompt as the server tokenises it. A park that is not this request's is never
restored (the real server's case: tests/real/test_real_proxy_final_check.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from app.core.verdict import tolerance
from app.proxy.lease_parks import RestoreAvoided
from app.proxy.session_backend import SessionBackend

CHAT = {"messages": [{"role": "user", "content": "the long document, again"}]}
PARKED = list(range(1000, 1400))  # the park's own tokens: 400 of them


class Client:
    """The server's /apply-template and /tokenize: the request's prompt is ``prompt``."""

    def __init__(self, prompt: list[int]):
        self.prompt = prompt

    async def apply_template(self, body: dict) -> str:
        return "rendered"

    async def tokenize_pieces(self, text: str) -> list[tuple[int, str]]:
        return [(t, "x") for t in self.prompt]


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
    b.requests["proxy-a"] = ("/v1/chat/completions", CHAT)
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
