"""The proxy's conversation identity under generated input (issue #19): whatever JSON a client
sends as its messages, normalise() answers messages and never raises; the hash chain is
deterministic and prefix-stable; a conversation continued is found again; and a conversation
that only grew is never blamed on its messages. Profiles (and ``KVV_FUZZ=long``): conftest.py."""

from __future__ import annotations

from hypothesis import example, given, strategies as st

from app.proxy.explain import explain_messages
from app.proxy.identity import ConversationIndex, chain, cut_at_last_assistant, normalise
from app.core.conversation import Message
from tests.fuzz.fuzzkit import outcome

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True),
                    st.text(max_size=30))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                    max_leaves=25)
ROLES = st.sampled_from(["system", "user", "assistant", "tool", "developer", "", " user", "?"])
KEYS = st.sampled_from(["role", "content", "reasoning_content", "reasoning", "tool_calls", "tool_call_id",
                        "name", "function_call"])
PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(st.text(max_size=20), JSON)}),
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_image", "image"]),
                           "image_url": st.one_of(JSON, st.fixed_dictionaries({"url": JSON}))}),
    JSON)
CONTENT = st.one_of(st.none(), st.text(max_size=40), st.lists(PART, max_size=4), JSON,
                    st.text(max_size=20).map(lambda t: f"<think>{t}</think>{t}"),
                    st.text(max_size=20).map(lambda t: f" <think>{t}"))
CALL = st.one_of(JSON, st.fixed_dictionaries({
    "id": JSON, "type": st.just("function"),
    "function": st.one_of(JSON, st.fixed_dictionaries({"name": JSON, "arguments": st.one_of(
        st.text(max_size=20), st.just('{"a": [1, 2], "b": {"c": null}}'), st.just("[" * 3000), JSON)}))}))
MESSAGE_LIKE = st.one_of(
    st.fixed_dictionaries({"role": ROLES, "content": CONTENT},
                          optional={"reasoning_content": JSON, "reasoning": JSON, "tool_calls": st.one_of(
                              st.lists(CALL, max_size=3), JSON), "tool_call_id": JSON, "name": JSON,
                              "function_call": JSON}),
    st.dictionaries(st.one_of(KEYS, st.text(max_size=8)), JSON, max_size=5),
    JSON)
ANY_MESSAGES = st.one_of(st.lists(MESSAGE_LIKE, max_size=8), JSON)

TEXT = st.text(max_size=12)
MESSAGES = st.lists(st.builds(Message, role=st.sampled_from(["system", "user", "assistant", "tool"]),
                              content=TEXT, reasoning=st.one_of(st.just(""), TEXT), name=st.one_of(st.just(""), TEXT)),
                    max_size=10)


def deep(n: int):
    v: object = "x"
    for _ in range(n):
        v = [v] if n % 2 else {"k": v}
    return v


@given(ANY_MESSAGES)
@example([{"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "[" * 3000}}]}])
@example([{"role": "user", "content": "\ud800 lone surrogate"}, "\udfff"])
@example([{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": float("nan")}}]}])
@example({"role": "user", "content": "a dict, not a list"})
@example([{"role": "user", "content": [10 ** 5000]}, 10 ** 5000, {"role": "tool", "content": {"n": -(10 ** 5000)}}])
def test_normalise_never_raises(value):
    kind, out = outcome("proxy messages", lambda: normalise(value))
    assert kind == "parsed" and isinstance(out, list)
    for m in out:
        assert isinstance(m, Message)
        assert all(isinstance(x, str) for x in (m.role, m.content, m.reasoning, m.name))
    # and the result hashes: the chain takes whatever normalise answers
    assert len(chain("setup", out)) == len(out)
    assert normalise(value) == out  # deterministic


def test_deeply_nested_junk():
    """Nesting past the recursion limit (built here: Hypothesis cannot print it as an example)."""
    for n in (2000, 2001):
        value = [deep(n), {"role": "user", "content": deep(n)}, {"role": "assistant", "tool_calls": deep(n)}]
        kind, out = outcome("proxy messages", lambda v=value: normalise(v))
        assert kind == "parsed" and [m.role for m in out] == ["?", "user", "assistant"]
        assert len(chain("setup", out)) == 3


@given(MESSAGES, st.text(max_size=10), st.integers(0, 12))
def test_chain_is_deterministic_and_prefix_stable(messages, setup, k):
    c = chain(setup, messages)
    assert c == chain(setup, list(messages))
    assert chain(setup, messages[:k]) == c[:k]
    # reasoning never changes the chain
    bare = [Message(m.role, m.content, "", m.name) for m in messages]
    assert chain(setup, bare) == c


@given(st.lists(MESSAGES, min_size=1, max_size=5), st.integers(0, 4), MESSAGES)
def test_find_names_a_known_conversation_continued(known, pick, more):
    idx = ConversationIndex()
    pick %= len(known)
    for n, msgs in enumerate(known):
        idx.add(f"c{n}", chain("s", msgs))
    target = known[pick]
    conv, matched = idx.find(chain("s", target + more))
    if not target:
        return
    assert matched >= len(target)
    # the answer holds the whole of target's chain: target itself, or a conversation that
    # contains it (an identical or longer copy); another added later wins the tie
    got = idx.chain_of(conv)
    assert got[:len(target)] == chain("s", target)
    holders = [n for n, msgs in enumerate(known) if chain("s", msgs)[:len(target)] == chain("s", target)]
    if holders == [pick]:  # no other holds it: the target itself, and exactly as far as it goes
        assert (conv, matched) == (f"c{pick}", len(target))
    # the hint, once given, names exactly the target
    idx.add_hint("mine", f"c{pick}")
    conv, matched = idx.find(chain("s", target + more), hint="mine")
    assert conv == f"c{pick}" and matched >= len(target)


@given(st.lists(MESSAGES, min_size=1, max_size=6), MESSAGES)
def test_find_from_the_last_reply(convs, more):
    """As the proxy uses it: conversations are indexed up to their last reply."""
    idx = ConversationIndex()
    for n, msgs in enumerate(convs):
        idx.add(f"c{n}", chain("s", msgs[:cut_at_last_assistant(msgs)]))
    last = convs[-1][:cut_at_last_assistant(convs[-1])]
    conv, matched = idx.find(chain("s", last + more))
    if last:
        assert matched >= len(last)
        assert idx.chain_of(conv)[:len(last)] == chain("s", last)


@given(MESSAGES, MESSAGES)
def test_a_conversation_that_only_grew_is_not_blamed_on_its_messages(messages, more):
    assert explain_messages(messages, messages + more) is None
    assert explain_messages(messages + more, messages) is None  # a prefix of what the slot held


@given(MESSAGES, MESSAGES)
def test_explain_messages_answers_any_pair(a, b):
    e = explain_messages(a, b)
    if e is not None:
        assert 0 <= e.first_divergent_message < min(len(a), len(b))
        assert e.detail and "\n" not in e.detail


ROUTE_BODY = st.one_of(
    st.fixed_dictionaries({}, optional={"system": st.one_of(st.text(max_size=20), st.lists(PART, max_size=3), JSON),
                                        "messages": st.one_of(st.lists(st.one_of(MESSAGE_LIKE, st.fixed_dictionaries(
                                            {"role": ROLES, "content": st.lists(st.one_of(PART, st.fixed_dictionaries(
                                                {"type": st.sampled_from(["tool_use", "tool_result"]),
                                                 "id": JSON, "name": JSON, "input": JSON, "tool_use_id": JSON,
                                                 "content": JSON})), max_size=3)})), max_size=5), JSON),
                                        "instructions": JSON,
                                        "input": st.one_of(st.text(max_size=20), st.lists(st.one_of(
                                            MESSAGE_LIKE, st.fixed_dictionaries(
                                                {"type": st.sampled_from(["message", "function_call",
                                                                          "function_call_output", "reasoning"]),
                                                 "role": ROLES, "content": CONTENT, "call_id": JSON, "name": JSON,
                                                 "arguments": JSON, "output": JSON})), max_size=5), JSON),
                                        "tools": JSON, "model": JSON}),
    st.dictionaries(st.text(max_size=10), JSON, max_size=5))


@given(st.sampled_from(["/v1/messages", "/v1/responses"]), ROUTE_BODY)
@example("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": [1, {}]}]}]})
@example("/v1/responses", {"input": [{"type": "function_call"}, 3, None], "instructions": ["x"]})
def test_another_routes_body_is_a_chat_request_or_none_and_never_raises(path, body):
    """Anthropic's and the Responses API's bodies, whatever JSON a client sends: the chat request they
    amount to (messages that normalise and hash like any chat's), or None; never an exception."""
    from app.proxy.identity import chat_body

    kind, value = outcome("proxy routes", lambda: chat_body(path, body))
    assert kind == "parsed"
    if value is not None:
        assert isinstance(value["messages"], list)
        chain("setup", normalise(value["messages"]))


USAGE = st.one_of(JSON, st.fixed_dictionaries({}, optional={
    "cache_read_input_tokens": st.one_of(st.integers(), JSON), "input_tokens": st.one_of(st.integers(), JSON),
    "output_tokens": st.one_of(st.integers(), JSON),
    "input_tokens_details": st.one_of(JSON, st.fixed_dictionaries({"cached_tokens": st.one_of(st.integers(), JSON)}))}))


@given(st.one_of(st.none(), st.dictionaries(st.sampled_from(["usage", "timings", "message", "response", "x"]),
                                            st.one_of(USAGE, st.fixed_dictionaries({"usage": USAGE}), JSON),
                                            max_size=3)))
def test_an_answers_usage_is_timings_or_none_and_never_raises(final):
    """What the proxy reads of any answer's usage (app.proxy.request_facts.answer_timings): timings or None."""
    from app.core.timings import Timings
    from app.proxy.request_facts import answer_timings

    kind, value = outcome("proxy usage", lambda: answer_timings(final))
    assert kind == "parsed" and (value is None or isinstance(value, Timings))
