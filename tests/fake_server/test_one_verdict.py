"""One proxied restore, one verdict (#27): the resume watcher judges the first query after the
proxy brought a conversation back from its park (the Sessions tab's row of that park), the proxy
judges the same request (the Conversations tab's rows); both call the one judge
(app.core.verdict.judge) and both tabs show the same word, on a stock-like build (DISCARDED: no
checkpoints came back) and on the sidecar build (HIT)."""

from __future__ import annotations

import asyncio

import pytest
from PySide6.QtCore import Qt

from app.core.verdict import VerdictKind
from app.ui.conversations.model import (COL_VERDICT, RCOL_VERDICT, ConversationsModel, RequestsModel)
from app.ui.sessions.model import COL_VERDICT as SESSION_COL_VERDICT
from app.ui.sessions.model import SessionsModel
from tests.fake_server.profiles import fake_profile
from tests.fake_server.test_proxy_service import Proxied, chat, system


@pytest.mark.parametrize("sidecar, word", [("0", VerdictKind.DISCARDED), ("1", VerdictKind.HIT)])
async def test_a_proxied_restore_reads_the_same_in_the_sessions_and_the_conversations_tab(
        tmp_path, monkeypatch, qapp, sidecar, word):
    monkeypatch.setenv("FAKE_SIDECAR", sidecar)
    # no RAM prompt cache: it would bring the conversation back by itself, with no restore to judge
    async with Proxied(fake_profile(tmp_path, cache_ram=0).replace(proxy=True)) as p:
        firsts = {name: await p.ask(chat(system(name), "hello")) for name in "ABC"}  # C takes A's slot: A parked
        reply_a, rec_a = firsts["A"]
        park = f"proxy-{rec_a.conversation}"
        judged = asyncio.get_running_loop().create_future()
        p.handle.sessions.on_verdict(
            lambda slot, name, v: name == park and not judged.done() and judged.set_result(v))
        _, back = await p.ask(chat(system("A"), "hello", reply_a, "again"))
        assert back.restored_from == park, back
        resume = await asyncio.wait_for(judged, 120)  # the watcher read the same query in the server's log

        sessions = SessionsModel()
        sessions.set_records(p.handle.sessions.catalog.list(p.profile.name))
        conversations = ConversationsModel()
        conversations.set_conversations(p.proxy.list())
        requests = RequestsModel()
        requests.set_records(p.proxy.store.requests(rec_a.conversation))

        def shown(model, row, col):
            return model.data(model.index(row, col), Qt.DisplayRole)

        in_sessions = shown(sessions, sessions.row_of(name=park), SESSION_COL_VERDICT)
        in_conversations = shown(conversations, conversations.row_of(rec_a.conversation), COL_VERDICT)
        in_requests = shown(requests, requests.rowCount() - 1, RCOL_VERDICT)  # its last request: the one restored
    assert (resume.kind, back.verdict) == (word, word), (resume.reason, back)
    assert in_sessions == in_conversations == in_requests == word.value
