"""The check's question as a chat client sends it: the next user turn, in the model's chat format.

``kv-valet check`` and the A/B ask a parked chat one short question. Appended as raw text after the
chat, the question is no turn at all, and the model goes on with chat-format debris (on Gemma:
"\\n<|im_start|>user" against "\\n<|im_end|>user"), a continuation with no meaning in which near-ties
are the rule. A chat client sends the next turn instead: the assistant's turn closed, a user turn
holding the question, the model's turn opened. This module works that text out, purely:

* :func:`derive` reads it off one rendering of a small conversation (an earlier question and answer
  as placeholders, then the probe question, the generation prompt added): what follows the earlier
  answer is the turn; the part of it that closes the answer (``Turn.close``) is what remains of it
  once the user-turn opener is taken off, and the opener is the longest text the start of the
  rendering (before the first user message) and the gap before the question end with alike.
* :func:`join` puts the turn after the chat's text without writing an end-of-turn twice: a chat
  whose text already ends with the close (or the close less its trailing whitespace) gets the rest.
* A model whose GGUF has no template of its own gets llama.cpp's ChatML fallback from the server
  (:data:`CHATML_FALLBACK`), which is not its format: :data:`FORMATS` are llama.cpp's own renderings
  of a few formats, and :func:`pick_format` takes the first whose markers are each one token of the
  model's vocabulary (Gemma 3 270M, the model the real tests use, has no template but the Gemma
  markers). None: the question goes as raw text, as before, and the report says so.

The server side (``POST /apply-template``, ``/props``, ``/tokenize``) is
:mod:`app.sessions.probe_turn`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

#: the earlier exchange the rendering holds before the question (placeholders found again in it)
EARLIER_QUESTION = "kvv-probe-earlier-question"
EARLIER_ANSWER = "kvv-probe-earlier-answer"

#: llama.cpp's template for a model without one (``CHATML_TEMPLATE_SRC`` in ``common/chat.cpp``,
#: build 11434: a C string, so each ``'\n'`` in the Jinja is a real newline); ``GET /props`` reports
#: it as the model's ``chat_template``
CHATML_FALLBACK = (
    "{%- for message in messages -%}\n"
    "  {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\n' -}}\n"
    "{%- endif -%}"
)


class TemplateError(ValueError):
    """The rendering does not hold the conversation as sent (message: why, user-facing)."""


def messages(question: str) -> list[dict[str, str]]:
    """The conversation whose rendering shows the next turn: an earlier exchange, then the question."""
    return [{"role": "user", "content": EARLIER_QUESTION},
            {"role": "assistant", "content": EARLIER_ANSWER},
            {"role": "user", "content": content(question)}]


def content(question: str) -> str:
    """The question as a chat client's message holds it (no leading newline: that was for raw text)."""
    return question.strip()


def apply_template_body(question: str) -> dict:
    """The body of ``POST /apply-template`` that renders :func:`messages` with the model's turn opened."""
    return {"messages": messages(question), "add_generation_prompt": True}


@dataclass(frozen=True)
class Turn:
    """What a chat client writes after the model's answer to ask ``question``."""

    close: str  # the end of the answer's turn ("<end_of_turn>\n"; "" when it could not be told apart)
    rest: str  # the user's turn with the question, then the model's turn opener

    @property
    def text(self) -> str:
        return self.close + self.rest


def _common_suffix(a: str, b: str) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
        n += 1
    return n


def derive(rendered: str, question: str) -> Turn:
    """The next turn from the rendering of :func:`messages` (``add_generation_prompt``); TemplateError
    when the rendering does not hold the earlier exchange and the question in that order."""
    q = content(question)
    if not q:
        raise TemplateError("the question is empty")
    a = rendered.find(EARLIER_QUESTION)
    if a < 0:
        raise TemplateError("the chat template dropped the first user message")
    b = rendered.find(EARLIER_ANSWER, a + len(EARLIER_QUESTION))
    if b < 0:
        raise TemplateError("the chat template dropped the assistant's message")
    end_b = b + len(EARLIER_ANSWER)
    i_q = rendered.find(q, end_b)
    if i_q < 0:
        raise TemplateError("the chat template dropped the question")
    lead, gap = rendered[:a], rendered[end_b:i_q]
    # a template that writes a block before the first user turn ending as the answer's turn does
    # (a system turn) shows no close of its own here: "" (the whole turn is then appended)
    close = gap[:len(gap) - _common_suffix(lead, gap)]
    return Turn(close=close, rest=rendered[end_b + len(close):])


def join(text: str, turn: Turn) -> str:
    """``text`` (a chat, detokenised) followed by ``turn``, less the part of the close it already ends with."""
    for cut in sorted({len(turn.close), len(turn.close.rstrip())}, reverse=True):
        part = turn.close[:cut]
        if part.strip() and text.endswith(part):
            return text + turn.close[cut:] + turn.rest
    return text + turn.text


# --------------------------------------------------------------------------- llama.cpp's own formats

Render = Callable[[list[dict[str, str]], bool], str]


def _gemma(msgs: list[dict[str, str]], add_generation_prompt: bool) -> str:
    # src/llama-chat.cpp, LLM_CHAT_TEMPLATE_GEMMA (build 11434): "assistant" is "model", contents trimmed
    out = []
    for m in msgs:
        role = "model" if m["role"] == "assistant" else m["role"]
        out.append(f"<start_of_turn>{role}\n{m['content'].strip()}<end_of_turn>\n")
    if add_generation_prompt:
        out.append("<start_of_turn>model\n")
    return "".join(out)


def _llama3(msgs: list[dict[str, str]], add_generation_prompt: bool) -> str:
    # src/llama-chat.cpp, LLM_CHAT_TEMPLATE_LLAMA_3
    out = [f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>" for m in msgs]
    if add_generation_prompt:
        out.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(out)


def _chatml(msgs: list[dict[str, str]], add_generation_prompt: bool) -> str:
    # src/llama-chat.cpp, LLM_CHAT_TEMPLATE_CHATML (the same text as CHATML_FALLBACK renders)
    out = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs]
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


@dataclass(frozen=True)
class Format:
    name: str
    markers: tuple[str, ...]  # each is one token of a vocabulary made for this format
    render: Render


FORMATS: tuple[Format, ...] = (
    Format("Gemma", ("<start_of_turn>", "<end_of_turn>"), _gemma),
    Format("Llama 3", ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), _llama3),
    Format("ChatML", ("<|im_start|>", "<|im_end|>"), _chatml),
)


def markers() -> list[str]:
    """Every marker :func:`pick_format` asks about (each tokenised once)."""
    return [m for f in FORMATS for m in f.markers]


def pick_format(n_tokens: Mapping[str, int]) -> Format | None:
    """The first format whose every marker is a single token (``n_tokens[marker]``), or None."""
    for f in FORMATS:
        if all(n_tokens.get(m) == 1 for m in f.markers):
            return f
    return None


def _squash(s: str) -> str:
    return "".join(s.split())


def is_fallback(template: str) -> bool:
    """Whether ``/props``'s ``chat_template`` is llama.cpp's fallback (the model brought none)."""
    return not template.strip() or _squash(template) == _squash(CHATML_FALLBACK)
