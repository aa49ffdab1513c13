"""The check's probe and its leftovers, on the REAL stock llama-server and Gemma 3 270M (issue #36, items 3 and 5).

* The default question goes as the chat's next user turn: the prompt sent ends with the model's turn
  opener, and the model answers instead of going on with chat-format debris. This Gemma 3 270M GGUF
  carries no chat template (the server's ``/props`` shows llama.cpp's ChatML fallback), so the turn is
  written in the Gemma format its vocabulary has the markers of.
* A check and an A/B leave nothing behind: the stop's park of every slot, as the app runs it, puts no
  new session in the catalog or the save folder.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from app import paths
from app.core.lifecycle import StopTrigger
from app.servers.service import ServerService
from app.sessions.check import check_resume
from app.sessions.check_export import to_markdown
from app.sessions.check_report import PROBE_TEXT, PROTOCOL_ONE_PROCESS
from app.store.catalog import Catalog
from tests.real.helpers import TEXT, connect_target, start_server

pytestmark = pytest.mark.real_server

MARKERS = ("<start_of_turn>", "<end_of_turn>", "<|im_start|>", "<|im_end|>")
#: a chat as a Gemma chat client sends it (the user's turn, the model's answer so far)
CHAT = f"<start_of_turn>user\nRead this and remember it.\n{TEXT}<end_of_turn>\n<start_of_turn>model\n"


def test_the_default_question_is_the_chats_next_user_turn(real_profile):
    async def go():
        plan, sup = await start_server(real_profile)
        try:
            t = await connect_target(plan, sup, real_profile)
            from app.sessions.park import park_slot

            await t.client.completion(CHAT, slot_id=0, n_predict=8)
            rec = (await park_slot(t, 0, "gemma chat")).record
            sent: list[tuple[object, dict]] = []
            completion = t.client.completion

            async def spy(prompt, **kw):
                resp = await completion(prompt, **kw)
                sent.append((prompt, resp))
                return resp

            t.client.completion = spy
            report = await check_resume(t, rec, 1, variants=("text",), n_predict=24, output_check=False)
            await t.client.aclose()
            t.catalog.close()
        finally:
            await sup.aclose()
        return report, sent

    report, sent = asyncio.run(go())
    print(to_markdown(report))
    assert [p.name for p in report.probes] == [PROBE_TEXT]
    assert "Gemma chat format" in report.question_sent, report.question_sent
    prompt, resp = sent[0]
    assert isinstance(prompt, str)
    assert prompt.endswith("<end_of_turn>\n<start_of_turn>user\nIn one short sentence, what was this about?"
                           "<end_of_turn>\n<start_of_turn>model\n"), prompt[-200:]
    assert prompt.count("<end_of_turn>\n<start_of_turn>user") == 1  # the answer's turn closed once
    answer = resp["content"]
    print(repr(answer))
    assert answer.strip(), "the model said nothing"
    assert not any(m in answer for m in MARKERS), answer


def test_a_check_and_an_ab_leave_nothing_for_the_stop_to_park(real_profile):
    """As the issue found it: a check, then an A/B, then the server stopped the way the app stops it
    (the one park-then-stop): the check's slots were parked as two new dated sessions."""

    async def go():
        catalog = Catalog(paths.catalog_path())
        servers = ServerService(catalog)
        try:
            handle = await servers.launch(real_profile)
            assert handle is not None
            svc = await servers.sessions(handle.id)
            await svc.target.client.completion(TEXT, slot_id=0, n_predict=4)
            parked = (await svc.park(0, "valet chat")).record
            files = sorted(p.name for p in Path(real_profile.slot_save_path).iterdir())
            # asserted: what the stop parks, not the output
            await svc.check("valet chat", 1, protocol=PROTOCOL_ONE_PROCESS, output_check=False)
            await svc.ab("valet chat", 1, protocol=PROTOCOL_ONE_PROCESS, output_check=False, exact_probes=False)
            report = await servers.park_then_stop(handle.id, StopTrigger.SERVE)
        finally:
            await servers.aclose()
            catalog.close()
        return parked, files, report

    parked, files, report = asyncio.run(go())
    assert report.stopped and report.complete
    assert [(r.slot_id, r.unchanged, r.record.name) for r in report.results] == [(0, True, "valet chat")]
    with Catalog(paths.catalog_path()) as cat:  # read afterwards, as the next start reads it
        assert [(r.name, r.n_tokens) for r in cat.list("real")] == [("valet chat", parked.n_tokens)]
    assert sorted(p.name for p in Path(real_profile.slot_save_path).iterdir()) == files
