"""The check's chat probe asks its question as the next user turn, in the model's chat format.

The pure part (the turn read off a rendering, the join, llama.cpp's own formats) is
:mod:`app.core.probe_prompt`; this module asks the server: ``GET /props`` for the model's template,
``POST /apply-template`` to render it (build 11434 has the endpoint), ``POST /tokenize`` to tell
which format's markers the vocabulary holds when the model brought no template. When nothing
fits, the question goes as raw text after the chat (what the check did before) and ``how`` says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.core import probe_prompt as pp
from app.server.client import LlamaClient, ServerError, ServerUnreachable

AS_TEMPLATE = "as a user turn through the model's chat template"
AS_RAW = "as raw text after the chat"


@dataclass(frozen=True)
class NextTurn:
    turn: pp.Turn | None  # None: the question goes as raw text
    how: str  # how the question is sent, for the report ("as a user turn through …")

    def prompt(self, text: str, question: str) -> str:
        """The chat probe's prompt: ``text`` (the chat) and the question."""
        return pp.join(text, self.turn) if self.turn is not None else text + question


async def next_turn(client: LlamaClient, question: str) -> NextTurn:
    """How a chat client would ask ``question`` after the chat this server's model holds."""
    try:
        props = await client.props()
    except (ServerError, ServerUnreachable) as e:
        return NextTurn(None, f"{AS_RAW} (the server's chat template could not be read: {e})")
    template = str(props.get("chat_template") or "")
    if not pp.is_fallback(template):
        try:
            rendered = await client.apply_template(pp.apply_template_body(question))
            return NextTurn(pp.derive(str(rendered), question), AS_TEMPLATE)
        except (ServerError, ServerUnreachable, KeyError, TypeError) as e:
            return NextTurn(None, f"{AS_RAW} (the server did not render its chat template: {e})")
        except pp.TemplateError as e:
            return NextTurn(None, f"{AS_RAW} ({e})")
    # the model brought no template: the server's is llama.cpp's ChatML fallback, right only for a
    # vocabulary with the ChatML markers; ask the vocabulary which of llama.cpp's own formats it speaks
    try:
        counts = {m: len(await client.tokenize(m)) for m in pp.markers()}
    except (ServerError, ServerUnreachable, KeyError, TypeError) as e:
        return NextTurn(None, f"{AS_RAW} (the model has no chat template and its vocabulary could not be read: {e})")
    fmt = pp.pick_format(counts)
    if fmt is None:
        return NextTurn(None, f"{AS_RAW} (the model has no chat template, and its vocabulary has the markers of "
                              f"none of {', '.join(f.name for f in pp.FORMATS)})")
    turn = pp.derive(fmt.render(pp.messages(question), True), question)
    return NextTurn(turn, f"as a user turn in the {fmt.name} chat format (the model brings no chat template; "
                          f"its vocabulary has the {fmt.name} markers)")
