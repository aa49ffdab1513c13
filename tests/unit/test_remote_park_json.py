"""app.servers.remote_view's park/resume read the host's ``kv-valet park|resume --json`` (issue #20)."""

from __future__ import annotations

import asyncio

import pytest

from app.servers import remote_view as rv
from app.remote.host import RemoteError


class StubHost:
    """A host whose kv-valet answers ``answer`` (what ``run_cli`` parsed) to every command."""

    name = "gpu-box"

    def __init__(self, answer):
        self.answer, self.calls = answer, []

    async def run_cli(self, argv, *, timeout=60, ok_exits=(0,)):
        self.calls.append((list(argv), tuple(ok_exits)))
        return self.answer


PARKED = {"ok": True, "profile": "there", "stopped": None,
          "sessions": [{"ok": True, "session": "chat", "slot": 0, "tokens": 1234, "size": 3 * 2**20,
                        "profile": "there", "warnings": ["slow disk"], "unchanged": False}]}


def test_park_asks_for_json_and_says_what_was_parked():
    host = StubHost(PARKED)
    text = asyncio.run(rv.park(host, "there", 0, "chat"))
    assert host.calls == [(["park", "there", "--json", "--slot", "0", "--name", "chat"], (0, 1))]
    assert text == "Parked slot 0 of 'there' on gpu-box as 'chat': 1,234 tokens, 3.0 MiB. Warning: slow disk"


def test_resume_asks_for_json_and_says_tokens_and_time():
    host = StubHost({"ok": True, "session": "chat", "profile": "there", "slot": 1, "tokens": 1234,
                     "restore_ms": 12.34, "warnings": []})
    text = asyncio.run(rv.resume(host, "there", "chat", None))
    assert host.calls == [(["resume", "there", "chat", "--yes", "--json"], (0, 1))]
    assert text == "Resumed 'chat' into slot 1 of 'there' on gpu-box: 1,234 tokens in 12.3 ms."


def test_a_refusal_is_raised_with_the_hosts_reasons():
    host = StubHost({"ok": False, "error": "cannot resume 'x':", "details": ["no parked session named 'x'"],
                     "exit": 1})
    with pytest.raises(RemoteError) as e:
        asyncio.run(rv.resume(host, "there", "x", 0))
    assert str(e.value) == "cannot resume 'x': no parked session named 'x'" and e.value.exit_status == 1
    failed_slot = {"ok": False, "profile": "there", "sessions": [{"ok": False, "slot": 7,
                                                                   "error": "slot 7 does not exist"}]}
    with pytest.raises(RemoteError, match="slot 7 does not exist"):
        asyncio.run(rv.park(StubHost(failed_slot), "there", 7, None))


def test_nothing_to_park_and_no_json_object():
    assert asyncio.run(rv.park(StubHost({"ok": True, "profile": "there", "sessions": []}), "there", None, None)) \
        == "No slot of 'there' on gpu-box holds tokens: nothing to park."
    with pytest.raises(RemoteError, match="no JSON object"):
        asyncio.run(rv.park(StubHost(None), "there", None, None))
