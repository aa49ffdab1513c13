"""app.proxy.identity: the setup fingerprint, message normalisation, the hash chain, and the
index that names a request's conversation."""

from __future__ import annotations

import pytest

from app.proxy.identity import (
    ConversationIndex,
    chain,
    cut_at_last_assistant,
    hint_from,
    normalise,
    setup_fingerprint,
)
from app.core.conversation import Message

SETUP = dict(model_id="qwen3-8b", cache_type_k="q8_0", cache_type_v="q8_0", flash_attn="on", swa_full=False,
             chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")


# -- setup_fingerprint ---------------------------------------------------------


def test_fingerprint_is_short_stable_hex():
    fp = setup_fingerprint(**SETUP)
    assert fp == setup_fingerprint(**SETUP)
    assert 8 <= len(fp) <= 64 and int(fp, 16) >= 0


@pytest.mark.parametrize("change", [
    {"model_id": "other"}, {"cache_type_k": "f16"}, {"cache_type_v": "q4_0"}, {"flash_attn": "off"},
    {"swa_full": True}, {"chat_template": "{{ messages }}"}, {"tools": [{"type": "function"}]},
])
def test_fingerprint_changes_with_every_part_of_the_setup(change):
    assert setup_fingerprint(**{**SETUP, **change}) != setup_fingerprint(**SETUP)


def test_fingerprint_tools_are_canonical():
    a = [{"type": "function", "function": {"name": "f", "parameters": {"a": 1, "b": 2}}}]
    b = [{"function": {"parameters": {"b": 2, "a": 1}, "name": "f"}, "type": "function"}]
    assert setup_fingerprint(**SETUP, tools=a) == setup_fingerprint(**SETUP, tools=b)
    assert setup_fingerprint(**SETUP, tools=[]) != setup_fingerprint(**SETUP)


# -- normalise -----------------------------------------------------------------


def test_plain_messages():
    out = normalise([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert out == [Message("system", "be brief"), Message("user", "hi")]


def test_content_none_and_missing_are_empty():
    assert normalise([{"role": "assistant", "content": None}, {"role": "user"}]) == [
        Message("assistant", ""), Message("user", "")]


def test_content_parts_text_and_images():
    url = "data:image/png;base64,AAAA"
    out = normalise([{"role": "user", "content": [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": url, "detail": "high"}},
    ]}])
    again = normalise([{"role": "user", "content": [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": url}},
    ]}])
    other = normalise([{"role": "user", "content": [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": url + "B"}},
    ]}])
    assert out[0].content.startswith("look\n<image ")
    assert url not in out[0].content  # a hash, not the image itself
    assert out == again  # stable, and the url alone names the image
    assert out != other


def test_reasoning_content_goes_to_reasoning():
    out = normalise([{"role": "assistant", "content": " Answer ", "reasoning_content": " thought "}])
    assert out == [Message("assistant", "Answer", reasoning="thought")]
    out = normalise([{"role": "assistant", "content": "Answer", "reasoning": "thought"}])
    assert out == [Message("assistant", "Answer", reasoning="thought")]


def test_think_block_goes_to_reasoning():
    out = normalise([{"role": "assistant", "content": "<think>\nstep 1\n</think>\n\nAnswer"}])
    assert out == [Message("assistant", "Answer", reasoning="step 1")]
    # a reply sent back without its reasoning is the same message, reasoning aside
    bare = normalise([{"role": "assistant", "content": "Answer"}])
    assert bare[0].content == out[0].content


def test_think_block_only_in_assistant_messages_and_only_at_start():
    user = normalise([{"role": "user", "content": "<think>x</think>y"}])
    assert user == [Message("user", "<think>x</think>y")]
    mid = normalise([{"role": "assistant", "content": "a <think>x</think> b"}])
    assert mid == [Message("assistant", "a <think>x</think> b")]


def test_tool_calls_appended_as_canonical_json():
    a = normalise([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"b": 1, "a": 2}'}}]}])
    b = normalise([{"role": "assistant", "tool_calls": [
        {"type": "function", "id": "c1", "index": 0, "function": {"arguments": '{"a":2,"b":1}', "name": "get"}}]}])
    assert a == b
    assert '"name":"get"' in a[0].content and '"c1"' in a[0].content
    with_text = normalise([{"role": "assistant", "content": "calling", "tool_calls": [
        {"id": "c1", "function": {"name": "get", "arguments": "{}"}}]}])
    assert with_text[0].content.startswith("calling\n[")


def test_tool_message_identity_goes_to_name():
    out = normalise([{"role": "tool", "tool_call_id": "call_7", "content": "42"}])
    assert out == [Message("tool", "42", name="call_7")]
    named = normalise([{"role": "tool", "name": "weather", "content": "sun"}])
    assert named[0].name == "weather"


@pytest.mark.parametrize("junk", [5, "text", None, [1, 2], {"content": "no role"}, {"role": 3},
                                  {"role": ""}, True, 1.5])
def test_junk_items_become_question_marks(junk):
    out = normalise([junk])
    assert len(out) == 1 and out[0].role == "?"


@pytest.mark.parametrize("value", [None, 3, "x", {"role": "user", "content": "hi"}, {}, [], float("nan")])
def test_normalise_takes_any_value(value):
    out = normalise(value)
    assert isinstance(out, list) and all(isinstance(m, Message) for m in out)


def test_normalise_odd_content_and_parts():
    out = normalise([{"role": "user", "content": {"a": 1}},
                     {"role": "user", "content": [3, None, {"type": "input_audio", "input_audio": {"data": "x"}},
                                                  {"no": "type"}, "raw"]},
                     {"role": "assistant", "content": "x", "tool_calls": "junk"},
                     {"role": "assistant", "content": "<think>cut off"}])
    assert out[0].content == '{"a":1}'
    assert "<input_audio " in out[1].content and out[1].content.endswith("raw")
    assert out[2].content == 'x\n"junk"'
    assert out[3] == Message("assistant", "", reasoning="cut off")


# -- chain ---------------------------------------------------------------------

CONV = [Message("system", "S"), Message("user", "u1"), Message("assistant", "a1"), Message("user", "u2")]


def test_chain_is_deterministic_and_prefix_stable():
    c = chain("setup", CONV)
    assert len(c) == len(CONV) and len(set(c)) == len(c)
    assert c == chain("setup", list(CONV))
    for k in range(len(CONV) + 1):
        assert chain("setup", CONV[:k]) == c[:k]


def test_chain_depends_on_setup_role_name_and_content():
    base = chain("setup", CONV)
    assert chain("other", CONV)[0] != base[0]
    assert chain("setup", [Message("user", "S"), *CONV[1:]])[0] != base[0]
    assert chain("setup", [Message("system", "S", name="x"), *CONV[1:]])[0] != base[0]
    assert chain("setup", [Message("system", "S2"), *CONV[1:]])[0] != base[0]
    # every later element depends on every earlier message
    edited = [CONV[0], Message("user", "u1!"), *CONV[2:]]
    assert chain("setup", edited)[0] == base[0]
    assert all(a != b for a, b in zip(chain("setup", edited)[1:], base[1:]))


def test_chain_excludes_reasoning():
    with_r = [*CONV[:2], Message("assistant", "a1", reasoning="long thought"), CONV[3]]
    assert chain("setup", with_r) == chain("setup", CONV)


def test_chain_does_not_confuse_field_boundaries():
    a = chain("s", [Message("user", "a\0b")])
    b = chain("s", [Message("user", "a", name="b")])
    assert a != b


def test_cut_at_last_assistant():
    assert cut_at_last_assistant([]) == 0
    assert cut_at_last_assistant(CONV[:2]) == 0
    assert cut_at_last_assistant(CONV) == 3
    assert cut_at_last_assistant(CONV[:3]) == 3


# -- ConversationIndex ---------------------------------------------------------


def _msgs(*texts: str, system: str = "You are a careful assistant. " * 50) -> list[Message]:
    out = [Message("system", system)]
    for i, t in enumerate(texts):
        out.append(Message("user" if i % 2 == 0 else "assistant", t))
    return out


def test_find_nothing_in_an_empty_index():
    idx = ConversationIndex()
    assert idx.find(chain("s", CONV)) == (None, 0)
    assert idx.find([]) == (None, 0)


def test_two_conversations_sharing_a_long_system_prompt():
    idx = ConversationIndex()
    a = _msgs("what is 2+2?", "4")
    b = _msgs("name a colour", "blue")
    idx.add("A", chain("s", a))
    idx.add("B", chain("s", b))  # the newer one
    assert idx.find(chain("s", a + [Message("user", "and 3+3?")])) == ("A", 3)
    assert idx.find(chain("s", b + [Message("user", "another")])) == ("B", 3)
    # only the system prompt in common: both match 1; the most recently added wins the tie
    assert idx.find(chain("s", _msgs("something else"))) == ("B", 1)
    # another setup matches nothing
    assert idx.find(chain("t", a)) == (None, 0)


def test_a_fork_resolves_to_the_branch_that_matches_longer():
    idx = ConversationIndex()
    trunk = _msgs("u1", "a1", "u2", "a2")
    fork = _msgs("u1", "a1", "u2 edited", "a2'")
    idx.add("trunk", chain("s", trunk))
    idx.add("fork", chain("s", fork))
    assert idx.find(chain("s", trunk + [Message("user", "u3")])) == ("trunk", 5)
    assert idx.find(chain("s", fork + [Message("user", "u3")])) == ("fork", 5)
    # a third branch off the common part: the tie goes to the most recently added
    assert idx.find(chain("s", _msgs("u1", "a1", "u2 again"))) == ("fork", 3)
    idx.add("trunk", chain("s", trunk))  # re-added: now the most recent
    assert idx.find(chain("s", _msgs("u1", "a1", "u2 again"))) == ("trunk", 3)


def test_a_shorter_request_matches_as_far_as_it_goes():
    idx = ConversationIndex()
    conv = _msgs("u1", "a1", "u2", "a2")
    idx.add("c", chain("s", conv))
    assert idx.find(chain("s", conv[:2])) == ("c", 2)  # a regenerate of the first reply


def test_forget_and_replace():
    idx = ConversationIndex()
    a = _msgs("u1", "a1")
    idx.add("A", chain("s", a))
    idx.add("B", chain("s", _msgs("other", "x")))
    idx.forget("B")
    assert idx.find(chain("s", _msgs("zzz"))) == ("A", 1)
    assert "B" not in idx and len(idx) == 1
    idx.forget("A")
    assert idx.find(chain("s", a)) == (None, 0)
    idx.forget("never known")  # harmless
    # add replaces a conversation's chain: the old elements no longer point at it
    idx.add("C", chain("s", a))
    longer = a + [Message("user", "u2"), Message("assistant", "a2")]
    idx.add("C", chain("s", longer))
    assert idx.chain_of("C") == chain("s", longer)
    idx.add("C", chain("s", _msgs("new", "start")))
    assert idx.find(chain("s", longer)) == ("C", 1)


def test_a_known_hint_wins_over_the_chain():
    idx = ConversationIndex()
    a, b = _msgs("u1", "a1"), _msgs("v1", "b1")
    idx.add("A", chain("s", a))
    idx.add("B", chain("s", b))
    idx.add_hint("session-A", "A")
    assert idx.find(chain("s", b), hint="session-A") == ("A", 1)
    assert idx.find(chain("s", a), hint="session-A") == ("A", 3)
    assert idx.find(chain("s", b), hint="unknown hint") == ("B", 3)
    idx.forget("A")
    assert idx.find(chain("s", a), hint="session-A") == ("B", 1)


def test_find_is_not_a_scan_of_all_conversations():
    """Thousands of conversations sharing a system prompt: a find walks only the asked chain."""
    idx = ConversationIndex()
    for n in range(3000):
        idx.add(f"c{n}", chain("s", _msgs(f"question {n}", f"answer {n}")))
    q = chain("s", _msgs("question 1234", "answer 1234", "more"))

    class Counting(dict):  # the index's hash table, counting the look-ups a find makes
        lookups = 0

        def get(self, key, default=None):
            Counting.lookups += 1
            return super().get(key, default)

    idx._by_hash = Counting(idx._by_hash)
    assert idx.find(q) == ("c1234", 3)
    assert Counting.lookups <= len(q)  # one per message of the asked chain, not one per conversation


# -- hint_from -----------------------------------------------------------------


def test_hint_from_header_any_case():
    assert hint_from({"X-Session-Id": " abc "}, {}) == "abc"
    assert hint_from({"x-session-id": "abc"}, {"user": "u"}) == "abc"
    assert hint_from({"X-SESSION-ID": "abc"}, {}) == "abc"


def test_hint_from_body_user():
    assert hint_from({}, {"user": "  alice "}) == "alice"
    assert hint_from({"X-Session-Id": "  "}, {"user": "alice"}) == "alice"


def test_hint_from_nothing():
    assert hint_from({}, {}) is None
    assert hint_from({}, {"user": "   "}) is None
    assert hint_from({}, {"user": 42}) is None
    assert hint_from({"Other": "x"}, "not a body") is None


def test_hint_is_capped():
    assert hint_from({"X-Session-Id": "x" * 500}, {}) == "x" * 200


def test_hint_from_explicit_keys_first():
    # OpenAI's prompt_cache_key names the conversation before any header or "user"
    assert hint_from({"X-Session-Id": "s"}, {"prompt_cache_key": " k ", "user": "u"}) == "k"
    assert hint_from({"X-Conversation-Id": "c"}, {"user": "u"}) == "c"
    assert hint_from({"x-acme-conv-id": "a1"}, {"user": "u"}) == "a1"
    assert hint_from({"X-My-App-Conversation-Id": "a2"}, {}) == "a2"
    assert hint_from({"session_id": "codex-1"}, {}) == "codex-1"
    assert hint_from({"x-session-id": "s", "x-acme-conv-id": "a"}, {}) == "s"  # the named headers first
    assert hint_from({"x-conv-idx": "no", "x-request-id": "no"}, {"user": "u"}) == "u"
    assert hint_from({}, {"prompt_cache_key": "  ", "user": "u"}) == "u"
    assert hint_from({}, {"prompt_cache_key": 7}) is None
    assert hint_from({}, {"prompt_cache_key": "k" * 500}) == "k" * 200


# -- the memos: a history seen before is looked up, with the very same answers -------------------


def _uncached_chain(setup: str, messages: list[Message]) -> list[str]:
    import hashlib
    import json

    def digest(text: str) -> str:
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()

    out, h = [], digest("kvv-chain\0" + setup)
    for m in messages:
        h = digest(h + "\0" + json.dumps([m.role, m.name, m.content], sort_keys=True, separators=(",", ":"),
                                         ensure_ascii=False))[:32]
        out.append(h)
    return out


def test_memoised_chain_and_messages_are_the_computed_ones(monkeypatch):
    from app.proxy import identity

    raw = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
           {"role": "assistant", "content": "<think>why</think>  hello  "}, {"role": " user ", "content": "x"},
           {"role": "tool", "content": "42"}, {"role": "user", "content": "hi"}]
    first = normalise(raw)
    assert first[2] == Message("assistant", "hello", reasoning="why")
    assert first[3] == Message("user", "x")
    again = normalise([dict(m) for m in raw])  # new objects, equal text: from the memo
    assert again == first
    # the plain path gives what the general one gives (a message with more keys takes the general one)
    assert [normalise([dict(m, name="")])[0] for m in raw] == first
    for setup in ("s1", "s2"):
        assert chain(setup, first) == _uncached_chain(setup, first)
        assert chain(setup, first) == _uncached_chain(setup, first)  # looked up this time
    assert chain("s1", first[:3]) == chain("s1", first)[:3]
    assert chain("s1", [Message("user", "hi", name="t")]) != chain("s1", [Message("user", "hi")])
    # a memo is emptied when a new entry would take it past its size, and answers the same
    monkeypatch.setattr(identity, "MEMO_CHARS", 10)
    assert chain("s3", first) == _uncached_chain("s3", first)
    assert normalise([dict(m, content=m["content"] + "!") for m in raw])[1] == Message("user", "hi!")
    assert identity._chain_memo.chars <= 10 + max(len(m.content) + len(m.role) for m in first)


def test_the_other_chat_routes_are_the_chat_request_they_amount_to():
    """Anthropic's /v1/messages and OpenAI's /v1/responses as chat messages: the same conversation,
    hashed the same, whichever route a client uses for it."""
    from app.proxy.identity import chat_body, normalise

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More"}]
    anthropic = chat_body("/v1/messages", {"model": "m", "max_tokens": 4, "system": "Be brief.", "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
        {"role": "user", "content": [{"type": "text", "text": "More"}]}]})
    responses = chat_body("/v1/responses", {"model": "m", "instructions": "Be brief.", "input": [
        {"type": "message", "role": "user", "content": "Hi"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "More"}]}]})
    assert normalise(anthropic["messages"]) == normalise(responses["messages"]) == normalise(chat)
    assert anthropic["max_tokens"] == 4 and "system" not in anthropic and "input" not in responses
    # tool calls and their results: the assistant's call, then a tool message
    tools = chat_body("/v1/messages", {"messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "42"}]}]})
    assert [m["role"] for m in tools["messages"]] == ["assistant", "tool"]
    assert tools["messages"][1]["tool_call_id"] == "t1"
    assert chat_body("/v1/responses", {"input": "Hi"})["messages"] == [{"role": "user", "content": "Hi"}]
    assert chat_body("/v1/messages", {"model": "m"}) is None and chat_body("/v1/chat/completions", {}) is None


def test_a_routes_usage_is_its_timings():
    from app.proxy.request_facts import answer_timings

    t = answer_timings({"usage": {"cache_read_input_tokens": 155, "input_tokens": 37, "output_tokens": 4}})
    assert (t.cache_n, t.prompt_n, t.predicted_n) == (155, 37, 4)
    t = answer_timings({"type": "message_start", "message": {"usage": {"cache_read_input_tokens": 155,
                                                                        "input_tokens": 5, "output_tokens": 0}}})
    assert (t.cache_n, t.prompt_n, t.predicted_n) == (155, 5, None)
    t = answer_timings({"usage": {"input_tokens": 160, "output_tokens": 4, "input_tokens_details": {"cached_tokens": 154}}})
    assert (t.cache_n, t.prompt_n) == (154, 6)
    t = answer_timings({"usage": {"input_tokens": 1}, "timings": {"cache_n": 3, "prompt_n": 2}})
    assert (t.cache_n, t.prompt_n) == (3, 2)  # the server's own timings first
    assert answer_timings({"usage": {"prompt_tokens": 3}}) is None and answer_timings(None) is None
