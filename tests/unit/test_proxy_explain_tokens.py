"""The first divergent token of a request that re-processed: the pure comparison, the server calls
that feed it (a stand-in client), the stored record (schema v2, migrated from v1), and how the
faces show it."""

from __future__ import annotations

import sqlite3

from app.core.conversation import Cause, Explanation, Message, RequestRecord

from app.core.verdict import VerdictKind
from app.proxy import watch
from app.proxy.explain import TOKEN_DIFF_MAX_CHARS, wants_tokens, with_divergent_token
from app.store.conversations import ConversationStore


def toks(*pieces: str) -> list[tuple[int, str]]:
    """(id, text) pairs: the id is the text's hash, so equal texts are equal tokens."""
    return [(hash(p) & 0xFFFF, p) for p in pieces]


EDITED = Explanation(Cause.EARLIER_MESSAGE_EDITED, "An earlier message was edited: message 1 (user) differs.",
                     first_divergent_message=1)


def test_the_first_divergent_token_is_the_shared_prefix_length_with_both_texts():
    held = toks("<bos>", "<start_of_turn>", "user", "\n", "Tell", " me", " about", " cats", ".")
    sent = toks("<bos>", "<start_of_turn>", "user", "\n", "Tell", " me", " about", " dogs", ".", " Now")
    ex = with_divergent_token(EDITED, held, sent)
    assert ex.first_divergent_token == 7
    assert (ex.held_token, ex.sent_token) == (" cats", " dogs")
    assert ex.cause is Cause.EARLIER_MESSAGE_EDITED and ex.first_divergent_message == 1  # the part kept
    assert ex.detail.startswith(EDITED.detail)
    assert "token 7 of 10" in ex.detail and "after 'Tell me about'" in ex.detail and "' cats'" in ex.detail
    # a few decoded tokens on each side: before the divergence, and after it in each prompt
    assert "the slot held ' cats' (then '.'), this request has ' dogs' (then '. Now')." in ex.detail, ex.detail


def test_a_previous_prompt_kept_whole_says_the_change_came_after_it():
    held = toks("a", "b", "c")
    ex = with_divergent_token(Explanation(Cause.TEMPLATE_CHANGED, ""), held, held + toks("d"))
    assert ex.first_divergent_token == 3 and ex.held_token == "" and ex.sent_token == "d"
    assert "unchanged at the start" in ex.detail and "3 tokens" in ex.detail


def test_only_a_request_that_re_processed_is_compared():
    assert wants_tokens(VerdictKind.PARTIAL) and wants_tokens(VerdictKind.MISS)
    assert not wants_tokens(VerdictKind.HIT) and not wants_tokens(VerdictKind.NEW)


class Client:
    """The server's /apply-template and /tokenize, in memory: a chat renders as role: content lines;
    a token is a character."""

    def __init__(self, *, templates: bool = True):
        self.templates = templates
        self.calls: list[str] = []

    async def apply_template(self, body: dict) -> str:
        self.calls.append("apply-template")
        if not self.templates:
            raise RuntimeError("404 File Not Found")
        assert "stream" not in body and "id_slot" not in body
        return "".join(f"{m['role']}: {m['content']}\n" for m in body["messages"])

    async def tokenize_pieces(self, content: str) -> list[tuple[int, str]]:
        self.calls.append("tokenize")
        return [(ord(c), c) for c in content]


def chat(*contents: str) -> dict:
    return {"messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": c}
                         for i, c in enumerate(contents)], "stream": True, "id_slot": 1}


async def test_the_server_renders_and_tokenises_both_prompts():
    c = Client()
    held, sent = await watch.divergence(c, "/v1/chat/completions", chat("hi", "yo"), chat("hi", "YO", "more"))
    ex = with_divergent_token(EDITED, held, sent)
    assert ex.first_divergent_token == len("user: hi\nassistant: ")
    assert c.calls == ["apply-template", "apply-template", "tokenize", "tokenize"]


async def test_a_text_prompt_is_tokenised_as_it_is():
    c = Client()
    held, sent = await watch.divergence(c, "/completion", {"prompt": "abcdef"}, {"prompt": "abXdef"})
    assert with_divergent_token(EDITED, held, sent).first_divergent_token == 2
    assert c.calls == ["tokenize", "tokenize"]


async def test_a_server_that_cannot_render_leaves_the_message_explanation():
    why = await watch.divergence(Client(templates=False), "/v1/chat/completions", chat("a"), chat("b"))
    assert isinstance(why, str) and "could not render" in why


async def test_a_prompt_over_the_bound_is_not_tokenised():
    c = Client()
    why = await watch.divergence(c, "/completion", {"prompt": "x" * (TOKEN_DIFF_MAX_CHARS + 1)}, {"prompt": "y"})
    assert isinstance(why, str) and f"{TOKEN_DIFF_MAX_CHARS:,}" in why
    assert "tokenize" not in c.calls


def test_a_body_is_rebuilt_from_stored_messages_after_an_app_restart():
    body = watch.body_of([Message("user", "q"), Message("assistant", "a", reasoning="think"),
                          Message("tool", "42", name="call_1")])
    assert body == {"messages": [{"role": "user", "content": "q"},
                                 {"role": "assistant", "content": "a", "reasoning_content": "think"},
                                 {"role": "tool", "content": "42", "tool_call_id": "call_1"}]}


# -- the stored record ----------------------------------------------------------------------------

def record(ex: Explanation | None) -> RequestRecord:
    return RequestRecord(at=1.0, conversation="c1", slot=0, path="/v1/chat/completions", stream=False, cache_n=4,
                         prompt_n=90, prompt_ms=12.0, predicted_n=2, expected_reuse=80,
                         verdict=VerdictKind.PARTIAL, explanation=ex)


def test_the_token_lands_in_the_stored_request(tmp_path):
    from app.core.conversation import Conversation

    with ConversationStore(tmp_path / "c.sqlite3") as store:
        store.save(Conversation(id="c1", setup="s"), "p")
        row = store.add_request("c1", record(EDITED))
        refined = with_divergent_token(EDITED, toks("a", "b"), toks("a", "c"))
        assert store.set_explanation(row, refined)
        [back] = store.requests("c1")
        assert back.explanation == refined
        assert (back.explanation.first_divergent_token, back.explanation.held_token,
                back.explanation.sent_token) == (1, "b", "c")
        store.forget("c1")
        assert not store.set_explanation(row, refined)  # its conversation was forgotten meanwhile


def test_a_version_1_file_is_migrated_and_keeps_its_requests(tmp_path):
    from app.store.conversations import _SCHEMA_V1

    path = tmp_path / "old.sqlite3"
    conn = sqlite3.connect(path)
    for statement in _SCHEMA_V1.split(";"):
        if statement.strip():
            conn.execute(statement)
    conn.execute("INSERT INTO conversations (id, created_at) VALUES ('c1', 1.0)")
    conn.execute("INSERT INTO requests (conversation_id, at, verdict, cause, detail, first_divergent_token) "
                 "VALUES ('c1', 2.0, 'MISS', 'EARLIER_MESSAGE_EDITED', 'edited', 5)")
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    with ConversationStore(path) as store:
        assert store.schema_version == 2
        [rec] = store.requests("c1")
        assert rec.explanation.first_divergent_token == 5 and rec.explanation.held_token is None


def test_the_faces_show_the_token(tmp_path, capsys, monkeypatch):
    from types import SimpleNamespace

    from app.cli import conversations as cli
    from app.core.conversation import Conversation

    refined = with_divergent_token(EDITED, toks("a", "b"), toks("a", "c"))
    store = ConversationStore(tmp_path / "c.sqlite3")
    store.save(Conversation(id="c1", setup="s"), "p")
    store.add_request("c1", record(refined))
    store.close()
    monkeypatch.setattr(cli, "_store", lambda: ConversationStore(tmp_path / "c.sqlite3"))
    cli.cmd_show(SimpleNamespace(id="c1", json=False, last=5))
    out = capsys.readouterr().out
    assert "first divergent token: 1 (the slot held 'b', the request had 'c')" in out
    assert "why: an earlier message was edited [messages_changed]: " in out  # with the words clients use
    assert cli.request_dict(record(refined))["first_divergent_token"] == 1
    assert cli.request_dict(record(refined))["client_words"] == "messages_changed"
