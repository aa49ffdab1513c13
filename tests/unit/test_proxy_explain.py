"""app.proxy.explain: why a proxied request re-processed, in its order (the verdict: tests/unit/test_verdict.py)."""

from __future__ import annotations

import dataclasses

import pytest

from app.proxy.explain import SlotContext, explain, explain_messages, first_divergent_token
from app.proxy.identity import chain, normalise
from app.core.conversation import Cause, Message
from app.core.verdict import VerdictKind

V = VerdictKind

# -- explain_messages ----------------------------------------------------------

S = Message("system", "You are a helpful assistant. " * 20)


def conv(*texts: str, system: Message | None = S) -> list[Message]:
    out = [system] if system else []
    for i, t in enumerate(texts):
        out.append(Message("user" if i % 2 == 0 else "assistant", t))
    return out


def test_extension_is_not_the_messages_fault():
    prev = conv("u1", "a1", "u2")
    assert explain_messages(prev, prev + [Message("assistant", "a2"), Message("user", "u3")]) is None
    assert explain_messages(prev, prev) is None
    assert explain_messages(prev, prev[:2]) is None  # a regenerate: all of it is in the slot
    assert explain_messages([], prev) is None


def test_extension_ignores_reasoning_the_client_adds_or_changes():
    prev = [S, Message("user", "u1"), Message("assistant", "a1", reasoning="r")]
    cur = [S, Message("user", "u1"), Message("assistant", "a1", reasoning="other"), Message("user", "u2")]
    assert explain_messages(prev, cur) is None
    prev = [S, Message("user", "u1"), Message("assistant", "a1")]
    cur = [S, Message("user", "u1"), Message("assistant", "a1", reasoning="r"), Message("user", "u2")]
    assert explain_messages(prev, cur) is None


def test_system_prompt_changed():
    prev = conv("u1", "a1", "u2")
    cur = [Message("system", S.content[:100] + "X" + S.content[101:]), *prev[1:], Message("assistant", "a2")]
    e = explain_messages(prev, cur)
    assert e.cause is Cause.SYSTEM_PROMPT_CHANGED
    assert e.first_divergent_message == 0
    assert "message 0 (system)" in e.detail and "character 100" in e.detail


def test_system_prompt_removed_or_added():
    prev = conv("u1", "a1", "u2")
    assert explain_messages(prev, prev[1:] + [Message("user", "zz")]).cause is Cause.SYSTEM_PROMPT_CHANGED
    no_sys = conv("u1", "a1", system=None)
    assert explain_messages(no_sys, [S, *no_sys]).cause is Cause.SYSTEM_PROMPT_CHANGED


def test_system_message_edited_mid_conversation():
    prev = [S, Message("user", "u1"), Message("assistant", "a1"), Message("system", "be terse"),
            Message("user", "u2")]
    cur = [*prev[:3], Message("system", "be verbose"), Message("user", "u2")]
    e = explain_messages(prev, cur)
    assert e.cause is Cause.SYSTEM_PROMPT_CHANGED and e.first_divergent_message == 3


def test_earlier_user_message_edited():
    prev = conv("tell me about cats", "cats are...", "and dogs?", "dogs are...")
    cur = conv("tell me about bats", "cats are...", "and dogs?", "dogs are...", "thanks")
    e = explain_messages(prev, cur)
    assert e.cause is Cause.EARLIER_MESSAGE_EDITED
    assert e.first_divergent_message == 1
    assert e.detail == "An earlier message was edited: message 1 (user) differs from what the slot held at character 14."


def test_earlier_assistant_message_edited():
    prev = conv("u1", "the answer is 4", "u2")
    cur = conv("u1", "the answer is four", "u2", "a2", "u3")
    e = explain_messages(prev, cur)
    assert e.cause is Cause.EARLIER_MESSAGE_EDITED and e.first_divergent_message == 2
    assert "message 2 (assistant)" in e.detail and "character 14" in e.detail


def test_role_changed_is_an_edit():
    prev = conv("u1", "a1", "u2")
    cur = [*prev[:2], Message("user", "a1"), prev[3]]
    e = explain_messages(prev, cur)
    assert e.cause is Cause.EARLIER_MESSAGE_EDITED and "was assistant, now user" in e.detail


def test_client_truncation_keeping_the_system_prompt():
    prev = conv("u1", "a1", "u2", "a2", "u3", "a3", "u4")
    cur = [S, *prev[3:], Message("assistant", "a4"), Message("user", "u5")]
    e = explain_messages(prev, cur)
    assert e.cause is Cause.CLIENT_TRUNCATION
    assert e.first_divergent_message == 1
    assert "dropped 2 old messages" in e.detail and "slot held as message 3" in e.detail


def test_client_truncation_dropping_the_system_prompt_too():
    prev = conv("u1", "a1", "u2", "a2", "u3")
    cur = [*prev[3:], Message("assistant", "a3"), Message("user", "u4")]
    e = explain_messages(prev, cur)
    assert e.cause is Cause.CLIENT_TRUNCATION and e.first_divergent_message == 0
    assert "first 3 messages" in e.detail


def test_client_truncation_without_a_system_prompt():
    prev = conv("u1", "a1", "u2", "a2", "u3", system=None)
    cur = prev[2:] + [Message("assistant", "a3")]
    e = explain_messages(prev, cur)
    assert e.cause is Cause.CLIENT_TRUNCATION and "first 2 messages" in e.detail


def test_a_replaced_last_turn_is_not_truncation():
    prev = conv("u1", "a1", "u2", "a2")
    cur = conv("u1", "a1", "something else")
    assert explain_messages(prev, cur).cause is Cause.EARLIER_MESSAGE_EDITED


def test_reasoning_stripped():
    raw_prev = [{"role": "system", "content": S.content}, {"role": "user", "content": "u1"},
                {"role": "assistant", "content": "<think>let me think</think>\n\nthe answer"}]
    raw_cur = [*raw_prev[:2], {"role": "assistant", "content": "the answer"}, {"role": "user", "content": "u2"}]
    prev, cur = normalise(raw_prev), normalise(raw_cur)
    assert chain("s", cur)[:3] == chain("s", prev)  # the chain cannot tell
    e = explain_messages(prev, cur)
    assert e.cause is Cause.REASONING_STRIPPED
    assert e.first_divergent_message == 2
    assert "message 2 (assistant)" in e.detail.lower()


def test_the_first_divergence_wins():
    prev = [S, Message("user", "u1"), Message("assistant", "a1", reasoning="r"), Message("user", "u2")]
    cur = [S, Message("user", "u1"), Message("assistant", "a1"), Message("user", "u2 edited")]
    assert explain_messages(prev, cur).cause is Cause.REASONING_STRIPPED
    cur = [S, Message("user", "u1 edited"), Message("assistant", "a1"), Message("user", "u2")]
    assert explain_messages(prev, cur).cause is Cause.EARLIER_MESSAGE_EDITED


def test_tool_result_changed():
    call = Message("assistant", '[{"arguments":{},"id":"c1","name":"now"}]')
    prev = [S, Message("user", "time?"), call, Message("tool", "12:00", name="c1"), Message("assistant", "noon")]
    cur = [S, Message("user", "time?"), call, Message("tool", "12:01", name="c1"), Message("assistant", "noon"),
           Message("user", "thanks")]
    e = explain_messages(prev, cur)
    assert e.cause is Cause.TOOL_RESULT_CHANGED and e.first_divergent_message == 3
    assert "message 3 (tool)" in e.detail and "character 4" in e.detail
    renamed = [*cur[:3], Message("tool", "12:00", name="c2"), *cur[4:]]
    e = explain_messages(prev, renamed)
    assert e.cause is Cause.TOOL_RESULT_CHANGED and "'c2'" in e.detail


def test_detail_is_one_sentence():
    prev = conv("u1", "a1", "u2")
    for cur in (conv("x1", "a1", "u2"), [Message("system", "new"), *prev[1:]], [S, *prev[3:]]):
        e = explain_messages(prev, cur)
        assert e.detail.endswith(".") and "\n" not in e.detail and e.detail[0].isupper()


# -- first_divergent_token -----------------------------------------------------


def test_first_divergent_token():
    assert first_divergent_token([1, 2, 3], [1, 2, 4]) == 2
    assert first_divergent_token([1, 2, 3], [9]) == 0
    assert first_divergent_token([1, 2], [1, 2, 3]) == 2
    assert first_divergent_token([1, 2, 3], [1, 2]) == 2
    assert first_divergent_token([], [1]) == 0
    assert first_divergent_token([5, 6], [5, 6]) == 2


# -- explain -------------------------------------------------------------------

PREV = conv("u1", "a1", "u2")
CUR = PREV + [Message("assistant", "a2"), Message("user", "u3")]


def test_hit_new_and_unknown_need_no_explanation():
    ctx = SlotContext(restarted=True)
    assert explain(V.HIT, PREV, CUR, ctx) is None
    assert explain(V.NEW, None, CUR, ctx) is None
    assert explain(V.UNKNOWN, PREV, CUR, ctx) is None


def test_the_whole_order_lives_here():
    """Before the slot's story: a reuse onto another chat's checkpoints (even of a HIT), then a park the
    proxy did not restore (the messages' cause kept when they say one; a slot another chat took is not
    why a park that is not this chat's went unrestored: tests/real/test_real_proxy_causes.py); the RAM
    cache that missed is said with a taken slot."""
    edited = conv("changed", "a1", "u2")
    hazard = SlotContext(restored_from="p", restore_had_checkpoints=False, hazard="the slot holds chat X: ...",
                         avoided="the park's own tokens are not this request's", parked_as="proxy-p",
                         taken_by="other")
    e = explain(V.HIT, PREV, CUR, hazard, cache_n=900, reusable=1000)
    assert e.cause is Cause.RESTORE_WITHOUT_CHECKPOINTS and "900 tokens" in e.detail and "the slot holds chat X" in e.detail
    assert explain(V.HIT, PREV, CUR, hazard, cache_n=32, reusable=1000) is None  # no reuse beyond the tolerance
    e = explain(V.MISS, PREV, edited, hazard, cache_n=0, reusable=1000)
    assert e.cause is Cause.EARLIER_MESSAGE_EDITED and "did not restore 'proxy-p'" in e.detail
    e = explain(V.MISS, PREV, CUR, hazard, cache_n=0, reusable=1000)
    assert e.cause is Cause.PARK_NOT_ITS_OWN and "did not restore 'proxy-p'" in e.detail
    e = explain(V.MISS, PREV, CUR, SlotContext(taken_by="other", ram_tokens=1234))
    assert e.cause is Cause.SLOT_TAKEN and "RAM prompt cache" in e.detail and "1,234" in e.detail


@pytest.mark.parametrize("ctx, cause", [
    (SlotContext(restore_failed=True, restored_from="chat-1"), Cause.RESTORE_FAILED),
    (SlotContext(restarted=True), Cause.SERVER_RESTARTED),
    (SlotContext(slept=True), Cause.SERVER_SLEPT),
    (SlotContext(taken_by="conv-9"), Cause.SLOT_TAKEN),
    (SlotContext(idle_cleared=True), Cause.IDLE_SLOT_CLEARED),
    (SlotContext(restored_from="chat-1", restore_had_checkpoints=False), Cause.RESTORE_WITHOUT_CHECKPOINTS),
])
def test_each_server_side_cause(ctx, cause):
    for verdict in (V.PARTIAL, V.MISS, V.DISCARDED):
        e = explain(verdict, PREV, CUR, ctx)
        assert e.cause is cause and e.first_divergent_message is None
        assert e.detail.endswith(".") and "\n" not in e.detail


def test_server_side_causes_come_first_in_order():
    everything = SlotContext(taken_by="other", idle_cleared=True, restarted=True, slept=True,
                             restored_from="p", restore_had_checkpoints=False, restore_failed=True)
    edited = conv("changed", "a1", "u2")
    order = [("restore_failed", Cause.RESTORE_FAILED), ("restarted", Cause.SERVER_RESTARTED),
             ("slept", Cause.SERVER_SLEPT), ("taken_by", Cause.SLOT_TAKEN),
             ("idle_cleared", Cause.IDLE_SLOT_CLEARED),
             ("restore_had_checkpoints", Cause.RESTORE_WITHOUT_CHECKPOINTS)]
    ctx = everything
    for field, cause in order:
        assert explain(V.MISS, PREV, edited, ctx).cause is cause
        ctx = dataclasses.replace(ctx, **{field: None if field in ("taken_by", "restore_had_checkpoints") else False})
    # with the slot's story told, the messages
    assert explain(V.MISS, PREV, edited, ctx).cause is Cause.EARLIER_MESSAGE_EDITED
    assert "taken_by" in {f.name for f in dataclasses.fields(SlotContext)}


def test_a_restore_with_checkpoints_or_unknown_is_not_a_cause():
    for had in (True, None):
        e = explain(V.PARTIAL, PREV, CUR, SlotContext(restored_from="p", restore_had_checkpoints=had))
        assert e.cause is Cause.TEMPLATE_CHANGED


def test_messages_explain_when_the_slot_was_left_alone():
    e = explain(V.PARTIAL, PREV, [Message("system", "new"), *CUR[1:]], SlotContext())
    assert e.cause is Cause.SYSTEM_PROMPT_CHANGED and e.first_divergent_message == 0


def test_unchanged_messages_blame_the_server():
    e = explain(V.PARTIAL, PREV, CUR, SlotContext())
    assert e.cause is Cause.TEMPLATE_CHANGED
    assert "unchanged" in e.detail and "template" in e.detail and "SWA" in e.detail
    e = explain(V.MISS, None, CUR, SlotContext())
    assert e.cause is Cause.UNKNOWN


def test_slot_context_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SlotContext().restarted = True  # type: ignore[misc]


def test_a_park_left_because_the_matrix_says_a_restore_buys_nothing():
    """The proxy did not restore a park where the resume matrix measured a full re-prefill after it
    (app.sessions.resume.useless_restore): said with the measured cell and the remedy; an edit the
    messages show stays the cause."""
    from app.core.resume_matrix import predict
    from app.proxy.explain import USELESS_RESTORE

    rp = predict("sliding-window", "stock", "default")
    assert rp.buys_nothing and not predict("sliding-window", "v2", "default").buys_nothing
    assert not predict("hybrid-conv", "v2", "default").buys_nothing  # PARTIAL: the restore still buys some
    ctx = SlotContext(avoided=f"{USELESS_RESTORE}: {rp.sentence}; to resume: {rp.remedy}", parked_as="proxy-p")
    e = explain(V.MISS, PREV, CUR, ctx, cache_n=0, reusable=1000)
    assert e.cause is Cause.RESTORE_WITHOUT_CHECKPOINTS
    assert e.detail.startswith("The proxy did not restore 'proxy-p': Measured for a sliding-window attention model on "
                               "a stock build (default flags): a chat client's first turn after a restart "
                               "re-prefills everything"), e.detail
    assert "to resume: " in e.detail and "the park stays" in e.detail
    e = explain(V.MISS, PREV, conv("changed", "a1", "u2"), ctx, cache_n=0, reusable=1000)
    assert e.cause is Cause.EARLIER_MESSAGE_EDITED and "did not restore 'proxy-p'" in e.detail


def test_every_cause_has_the_words_clients_show():
    """Misses said in the vocabulary users meet elsewhere (system, tools or messages changed; previous
    not found), the llama.cpp-specific causes kept by their own short names; the Conversations tab and
    `conversations show` give both."""
    from app.core.conversation import CLIENT_WORDS
    from app.core.conversation import RequestRecord
    from app.ui.conversations.model import why_text

    assert set(CLIENT_WORDS) == set(Cause)
    assert Cause.SYSTEM_PROMPT_CHANGED.client_words == "system_changed"
    assert Cause.TOOLS_CHANGED.client_words == "tools_changed"
    assert Cause.EARLIER_MESSAGE_EDITED.client_words == "messages_changed"
    assert Cause.CLIENT_TRUNCATION.client_words.startswith("messages_changed")
    assert all(c.client_words.startswith("previous_message_not_found") for c in (
        Cause.SLOT_TAKEN, Cause.SERVER_RESTARTED, Cause.IDLE_SLOT_CLEARED, Cause.RESTORE_FAILED))
    assert "reasoning dropped" in Cause.REASONING_STRIPPED.client_words
    assert "no checkpoints" in Cause.RESTORE_WITHOUT_CHECKPOINTS.client_words
    e = explain(V.MISS, PREV, conv("changed", "a1", "u2"), SlotContext())
    rec = RequestRecord(at=0.0, conversation="c", slot=0, path="/v1/chat/completions", stream=False, cache_n=0,
                        prompt_n=100, prompt_ms=10.0, predicted_n=1, expected_reuse=100, verdict=V.MISS,
                        explanation=e)
    assert why_text(rec).startswith("an earlier message was edited [messages_changed]: "), why_text(rec)
