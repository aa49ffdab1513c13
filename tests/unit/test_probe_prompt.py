"""The check's chat probe asks its question as the next user turn (app.core.probe_prompt, app.sessions.probe_turn)."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from app.core import probe_prompt as pp
from app.server.client import ServerError
from app.sessions.probe_turn import AS_RAW, AS_TEMPLATE, next_turn

QUESTION = "\nIn one short sentence, what was this about?"
GEMMA_TURN = "<start_of_turn>user\nIn one short sentence, what was this about?<end_of_turn>\n<start_of_turn>model\n"


def test_gemma_turn_read_off_its_rendering():
    rendered = pp.FORMATS[0].render(pp.messages(QUESTION), True)
    assert rendered.startswith("<start_of_turn>user\nkvv-probe-earlier-question<end_of_turn>\n")
    turn = pp.derive(rendered, QUESTION)
    assert turn.close == "<end_of_turn>\n"
    assert turn.rest == GEMMA_TURN
    assert pp.join("a chat's answer", turn) == "a chat's answer<end_of_turn>\n" + GEMMA_TURN


@pytest.mark.parametrize("ending", ["<end_of_turn>\n", "<end_of_turn>"])
def test_an_end_of_turn_the_chat_already_has_is_not_written_twice(ending):
    turn = pp.derive(pp.FORMATS[0].render(pp.messages(QUESTION), True), QUESTION)
    assert pp.join("the answer" + ending, turn) == "the answer<end_of_turn>\n" + GEMMA_TURN


def test_chatml_and_llama3_turns():
    chatml = pp.derive(pp.FORMATS[2].render(pp.messages(QUESTION), True), QUESTION)
    assert (chatml.close, chatml.rest.endswith("<|im_end|>\n<|im_start|>assistant\n")) == ("<|im_end|>\n", True)
    llama3 = pp.derive(pp.FORMATS[1].render(pp.messages(QUESTION), True), QUESTION)
    assert llama3.close == "<|eot_id|>"
    assert llama3.rest.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_a_template_that_drops_a_message_is_refused():
    with pytest.raises(pp.TemplateError, match="dropped the question"):
        pp.derive("<u>kvv-probe-earlier-question</u><a>kvv-probe-earlier-answer</a><a>", QUESTION)
    with pytest.raises(pp.TemplateError, match="empty"):
        pp.derive("anything", "  \n")


def test_the_fallback_template_is_told_from_a_models_own():
    # /props of build 11434 with Gemma 3 270M (whose GGUF has no template), as the real server answered
    served = ("{%- for message in messages -%}\n  {{- '<|im_start|>' + message.role + '\n' + message.content + "
              "'<|im_end|>\n' -}}\n{%- endfor -%}\n{%- if add_generation_prompt -%}\n  {{- '<|im_start|>assistant\n' "
              "-}}\n{%- endif -%}")
    assert pp.is_fallback(served)
    assert pp.is_fallback(pp.CHATML_FALLBACK) and pp.is_fallback("")
    assert pp.is_fallback(pp.CHATML_FALLBACK.replace("\n", "\n  "))  # whitespace does not count
    assert not pp.is_fallback("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}{% endfor %}")


def test_pick_format_wants_every_marker_as_one_token():
    one = {m: 1 for m in pp.markers()}
    assert pp.pick_format(one).name == "Gemma"
    assert pp.pick_format({**one, "<end_of_turn>": 4}).name == "Llama 3"
    assert pp.pick_format({"<|im_start|>": 1, "<|im_end|>": 1}).name == "ChatML"
    assert pp.pick_format({m: 5 for m in pp.markers()}) is None


# a made-up chat format: markers and role names from an alphabet the placeholders and question do not use
_piece = st.text(alphabet="<>|[]/#_-\n :", min_size=1, max_size=12)


@st.composite
def formats(draw):
    start, close = draw(_piece), draw(_piece)
    user, model, system = draw(_piece), draw(_piece), draw(st.sampled_from(["", "SYS"]))
    question = draw(st.text(alphabet="abcdefgh ?.", min_size=1, max_size=30).filter(lambda q: q.strip()))

    def render(msgs, add):
        opener = {"user": user, "assistant": model}
        body = "".join(f"{start}{opener[m['role']]}{m['content'].strip()}{close}" for m in msgs)
        return system + body + (f"{start}{model}" if add else "")

    return start, close, user, model, question, render


@given(formats(), st.text(alphabet="xyz .\n", max_size=40), st.booleans())
def test_derive_and_join_on_any_format(fmt, answer, ended):
    """For any such format the turn is what a chat client writes after the answer: the close once
    (whether or not the chat already ends with it), the user's turn with the question, the model's opener."""
    start, close, user, model, question, render = fmt
    turn = pp.derive(render(pp.messages(question), True), question)
    assert turn.close == close
    assert turn.rest == f"{start}{user}{question.strip()}{close}{start}{model}"
    joined = pp.join(answer + (close if ended else ""), turn)
    assert joined.startswith(answer) and joined.endswith(turn.rest)
    if close.strip():  # the close is written once, whether or not the chat already ends with it
        assert joined == answer + close + turn.rest


@given(st.text(max_size=60), st.text(max_size=60))
def test_join_never_loses_the_chat_or_the_turn(text, rest):
    turn = pp.Turn(close="<end_of_turn>\n", rest=rest)
    joined = pp.join(text, turn)
    assert joined.startswith(text) and joined.endswith(rest)


# --------------------------------------------------------------------------- the server side


class FakeClient:
    """/props, /apply-template and /tokenize in memory."""

    def __init__(self, template: str | None, vocab: set[str] = frozenset(), render=None, fail: str = ""):
        self.template, self.vocab, self.render, self.fail = template, vocab, render, fail
        self.calls: list[str] = []

    async def props(self) -> dict:
        self.calls.append("props")
        return {"chat_template": self.template} if self.template is not None else {}

    async def apply_template(self, body: dict) -> str:
        self.calls.append("apply-template")
        if self.fail:
            raise ServerError(404, self.fail, path="/apply-template")
        return self.render(body["messages"], body["add_generation_prompt"])

    async def tokenize(self, content: str) -> list[int]:
        self.calls.append("tokenize")
        return [1] if content in self.vocab else [1] * len(content)


async def test_a_models_own_template_renders_the_turn():
    c = FakeClient("{# the model's own #}", render=pp.FORMATS[2].render)
    nt = await next_turn(c, QUESTION)
    assert nt.how == AS_TEMPLATE and c.calls == ["props", "apply-template"]
    assert nt.prompt("chat", QUESTION) == ("chat<|im_end|>\n<|im_start|>user\nIn one short sentence, what was this "
                                           "about?<|im_end|>\n<|im_start|>assistant\n")


async def test_no_template_of_its_own_takes_the_format_its_vocabulary_speaks():
    c = FakeClient(pp.CHATML_FALLBACK, vocab={"<start_of_turn>", "<end_of_turn>"})
    nt = await next_turn(c, QUESTION)
    assert "apply-template" not in c.calls
    assert "Gemma chat format" in nt.how and "no chat template" in nt.how
    assert nt.prompt("chat", QUESTION) == "chat<end_of_turn>\n" + GEMMA_TURN


async def test_no_template_and_no_known_markers_falls_back_to_raw_text():
    nt = await next_turn(FakeClient(pp.CHATML_FALLBACK), QUESTION)
    assert nt.turn is None and nt.how.startswith(AS_RAW) and "no chat template" in nt.how
    assert nt.prompt("chat", QUESTION) == "chat" + QUESTION


async def test_a_server_without_apply_template_falls_back_to_raw_text():
    nt = await next_turn(FakeClient("{# own #}", fail="File Not Found"), QUESTION)
    assert nt.turn is None and nt.how.startswith(AS_RAW) and "File Not Found" in nt.how
