"""The proxy's log after a server kill: a request cut short by it finds /slots unreachable, which is
an expected way for a request to end, said in one line (no traceback)."""

from __future__ import annotations

import logging

from app.proxy.session_backend import tokens_left
from app.server.client import ServerUnreachable


class _GoneServers:
    async def sessions(self, target_id):
        raise ServerUnreachable("http://127.0.0.1:9", "connection refused")


async def test_slots_unreachable_after_a_kill_is_one_log_line(caplog):
    with caplog.at_level(logging.WARNING, logger="app.proxy.session_backend"):
        assert await tokens_left(_GoneServers(), "profile:real", 1) is None
    [rec] = caplog.records
    assert rec.exc_info is None and "\n" not in rec.getMessage()
    assert rec.getMessage() == ("cannot read /slots after a cut-short request on slot 1: "
                                "cannot reach http://127.0.0.1:9: connection refused")
