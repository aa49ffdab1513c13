"""Which conversation a request belongs to, from its messages alone (pure: no I/O).

A chat client sends the whole conversation with every request. The proxy recognises it by a
hash chain of its messages: element i covers the serving setup and messages[:i+1], so two
requests of one conversation share a prefix of their chains, and the longest shared prefix
names the conversation (a fork of it, or another conversation with the same long system
prompt, shares a shorter one). Reasoning is left out of the chain: a reply that comes back
without its reasoning (most clients drop it) is still the same reply.

* :func:`setup_fingerprint`: what the slot's tokens depend on besides the messages.
* :func:`normalise`: OpenAI chat messages (whatever the client sent) → :class:`Message`.
* :func:`chain`, :func:`cut_at_last_assistant`: the chain, and where a conversation's known
  history ends (its last reply).
* :class:`ConversationIndex`: chains → conversation ids, O(len(chain)) per look-up.
* :func:`hint_from`: the client's own conversation id, when it sends one.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from app.core.conversation import Message

#: hex digits kept of a setup fingerprint / a chain element (64 / 128 bits)
FINGERPRINT_HEX = 16
CHAIN_HEX = 32
#: the longest hint kept (X-Session-Id, the body's "user")
HINT_MAX = 200
#: nesting deeper than this is written as a placeholder by canonical() (no RecursionError)
_MAX_DEPTH = 64

JUNK_ROLE = "?"
_IMAGE_TYPES = {"image_url", "input_image", "image"}
_TEXT_TYPES = {"text", "input_text", "output_text"}
#: content parts that carry an image, audio or a file (OpenAI chat and Responses, Anthropic), by what they are
_MEDIA_KINDS = {"image_url": "an image", "input_image": "an image", "image": "an image",
                "input_audio": "audio", "audio": "audio", "input_file": "a file", "file": "a file",
                "document": "a document"}
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
#: roles whose plain ``{"role", "content"}`` message is its text as it is (no stripping, no reasoning)
_PLAIN_ROLES = frozenset({"system", "user", "developer", "tool"})
#: A chat client re-sends the whole history with every request: the messages already seen are
#: normalised and hashed once, then looked up (by their exact role, name and content). Each memo is
#: emptied when the text it holds passes this many characters.
MEMO_CHARS = 32 * 1024 * 1024


class _Memo(dict):
    """A dict emptied when the characters of what it was given pass ``MEMO_CHARS``."""

    def __init__(self) -> None:
        super().__init__()
        self.chars = 0

    def put(self, key: Any, value: Any, chars: int) -> None:
        if self.chars + chars > MEMO_CHARS:
            self.clear()
            self.chars = 0
        self[key] = value
        self.chars += chars


_plain_memo = _Memo()  # (role, content) -> Message, for a plain {"role", "content"} message
_chain_memo = _Memo()  # (previous element, role, name, content) -> the chain element


def _digest(text: str) -> str:
    # surrogatepass: a lone surrogate in a client's JSON is hashed, not refused
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _plain(value: Any, depth: int = 0) -> Any:
    """``value`` as plain JSON data: str keys, lists for sequences, repr for the rest."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):  # past ~4,300 digits str(int) refuses (CPython's int_max_str_digits)
        return value if value.bit_length() < 14_000 else f"<int of {value.bit_length()} bits>"
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else repr(value)
    if depth >= _MAX_DEPTH:
        return f"<nested deeper than {_MAX_DEPTH}>"
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            key = k if isinstance(k, str) else f"<{type(k).__name__}>{_plain(k, depth + 1)!r}"
            out[key] = _plain(v, depth + 1)
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1) for v in value]
    try:
        return f"<{type(value).__name__}>{value!r}"
    except Exception:  # why: any object's repr may raise; a stable placeholder is the answer
        return f"<{type(value).__name__}>"


def canonical(value: Any) -> str:
    """Canonical JSON (sorted keys, no spaces) of any value; never raises."""
    return json.dumps(_plain(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def setup_fingerprint(*, model_id: str, cache_type_k: str, cache_type_v: str, flash_attn: str,
                      swa_full: bool, chat_template: str, tools=None) -> str:
    """A short stable hex digest of the serving setup: the same messages under another model,
    KV type, attention kernel, SWA mode, chat template or tool list make other tokens, so a
    conversation's chain starts from this."""
    setup = {
        "model_id": model_id,
        "cache_type_k": cache_type_k,
        "cache_type_v": cache_type_v,
        "flash_attn": flash_attn,
        "swa_full": bool(swa_full),
        "chat_template": _digest(chat_template if isinstance(chat_template, str) else canonical(chat_template)),
        "tools": None if tools is None else canonical(tools),
    }
    return _digest(canonical(setup))[:FINGERPRINT_HEX]


# -- messages ------------------------------------------------------------------


def _part_text(part: Any) -> str:
    """One element of a list-valued content: its text, or a stable placeholder."""
    if isinstance(part, str):
        return part
    if not isinstance(part, Mapping):
        return canonical(part)
    kind = part.get("type")
    text = part.get("text")
    if isinstance(text, str) and (kind in _TEXT_TYPES or kind is None):
        return text
    if kind in _IMAGE_TYPES:
        src = part.get(kind) if kind in part else part.get("image_url", part.get("data"))
        if isinstance(src, Mapping) and "url" in src:
            src = src["url"]
        return f"<image {_digest(canonical(src))[:FINGERPRINT_HEX]}>"
    rest = {k: v for k, v in part.items() if k != "type"}
    label = kind if isinstance(kind, str) and kind.isidentifier() else "part"
    return f"<{label} {_digest(canonical(rest))[:FINGERPRINT_HEX]}>"


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_part_text(p) for p in content)
    return canonical(content)


def _tool_call(call: Any) -> Any:
    """A tool call as the proxy compares it: id, name, and the arguments parsed when they are
    JSON (clients re-serialise them with other spacing; the templates re-dump them anyway)."""
    if not isinstance(call, Mapping):
        return call
    fn = call.get("function")
    if not isinstance(fn, Mapping):
        return dict(call)
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            pass
    return {"id": call.get("id"), "name": fn.get("name"), "arguments": args}


def _split_think(content: str) -> tuple[str, str]:
    """(reasoning, content) of an assistant text that starts with a <think> block. An
    unterminated block is all reasoning (the reply was cut off while thinking)."""
    body = content.lstrip()
    if not body.startswith(_THINK_OPEN):
        return "", content
    body = body[len(_THINK_OPEN):]
    end = body.find(_THINK_CLOSE)
    if end < 0:
        return body.strip(), ""
    return body[:end].strip(), body[end + len(_THINK_CLOSE):]


def _plain_one(role: str, content: str) -> Message:
    """A message that is exactly ``{"role": role, "content": content}`` (both strings): what
    :func:`_one` makes of it, computed once per distinct message."""
    key = (role, content)
    m = _plain_memo.get(key)
    if m is None:
        m = _one({"role": role, "content": content}, plain=False)
        _plain_memo.put(key, m, len(content) + len(role))
    return m


def _one(item: Any, plain: bool = True) -> Message:
    if plain and type(item) is dict and len(item) == 2:
        role, content = item.get("role"), item.get("content")
        if type(role) is str and type(content) is str:
            return _plain_one(role, content)
    if not isinstance(item, Mapping):
        return Message(role=JUNK_ROLE, content=canonical(item))
    role = item.get("role")
    if not isinstance(role, str) or not role.strip():
        return Message(role=JUNK_ROLE, content=canonical(item))
    role = role.strip()
    content = _content_text(item.get("content"))
    reasoning = ""
    if role == "assistant":
        given = [r for r in (item.get("reasoning_content"), item.get("reasoning")) if isinstance(r, str)]
        think, content = _split_think(content)
        reasoning = "\n".join(x.strip() for x in [*given[:1], think] if x.strip())
        content = content.strip()
        calls = item.get("tool_calls")
        if calls is None and item.get("function_call") is not None:
            calls = [{"function": item.get("function_call")}]
        if calls is not None:
            calls = [_tool_call(c) for c in calls] if isinstance(calls, list) else calls
            content = "\n".join(x for x in (content, canonical(calls)) if x)
    ids = [x.strip() for x in (item.get("tool_call_id"), item.get("name")) if isinstance(x, str) and x.strip()]
    return Message(role=role, content=content, reasoning=reasoning, name=" ".join(ids))


def normalise(messages: Any) -> list[Message]:
    """OpenAI chat messages → :class:`Message`. Never raises, whatever JSON value it is given:
    an item that is not a message (not an object, no role) becomes ``Message(role="?")`` with
    its canonical JSON as content; ``None`` is no messages; any other non-list one item.

    * content: a string, null, or a list of parts (text parts' text; an image part becomes
      ``<image HASH>`` of its url/data, any other part ``<TYPE HASH>``), parts joined by "\\n";
    * assistant: ``reasoning_content`` (or ``reasoning``) and a ``<think>…</think>`` block at
      the start of the content go to ``reasoning`` (stripped), the content is stripped, and
      ``tool_calls`` are appended to it as canonical JSON;
    * ``tool_call_id`` and ``name`` (a tool result's identity) go to ``name``.
    """
    if messages is None:
        return []
    items = messages if isinstance(messages, (list, tuple)) else [messages]
    return [_one(m) for m in items]


# -- the chain -----------------------------------------------------------------


def chain(setup: str, messages: list[Message]) -> list[str]:
    """The hash chain of ``messages`` under ``setup``: element i covers the setup and
    messages[:i+1] (role, name, content; reasoning excluded). Prefix-stable:
    ``chain(s, m[:k]) == chain(s, m)[:k]``."""
    out: list[str] = []
    h = _digest("kvv-chain\0" + str(setup))
    memo = _chain_memo
    for m in messages:
        key = (h, m.role, m.name, m.content)
        nxt = memo.get(key)
        if nxt is None:  # not seen yet (a chat's history was hashed at its earlier turns)
            nxt = _digest(h + "\0" + canonical([m.role, m.name, m.content]))[:CHAIN_HEX]
            memo.put(key, nxt, len(m.content) + len(m.role) + len(m.name))
        h = nxt
        out.append(h)
    return out


def cut_at_last_assistant(messages: list[Message]) -> int:
    """How many messages lead up to and include the last assistant message (0 when none): a
    conversation is known by its history up to its last reply."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].role == "assistant":
            return i + 1
    return 0


class ConversationIndex:
    """Chains of known conversations → their ids.

    Every element of every added chain is indexed (hash → the conversations holding it, in the
    order they were added), so :meth:`find` walks the asked chain once: the deepest element
    anyone holds is the longest shared prefix (a chain element covers all messages before it),
    and among the conversations holding it the most recently added wins.
    """

    def __init__(self) -> None:
        self._by_hash: dict[str, dict[str, None]] = {}  # insertion-ordered: the last is the newest
        self._chains: dict[str, list[str]] = {}
        self._hints: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._chains)

    def __contains__(self, conv_id: object) -> bool:
        return conv_id in self._chains

    def chain_of(self, conv_id: str) -> list[str] | None:
        c = self._chains.get(conv_id)
        return None if c is None else list(c)

    def add(self, conv_id: str, chain: list[str]) -> None:
        """Remember ``conv_id``'s chain (replacing what it had); it is now the most recent."""
        self._unindex(conv_id)
        chain = list(chain)
        self._chains[conv_id] = chain
        for h in chain:
            self._by_hash.setdefault(h, {})[conv_id] = None

    def add_hint(self, hint: str, conv_id: str) -> None:
        """The client's own id for ``conv_id``: a request that carries it goes there."""
        self._hints[hint] = conv_id

    def forget(self, conv_id: str) -> None:
        self._unindex(conv_id)
        self._chains.pop(conv_id, None)
        for hint in [h for h, c in self._hints.items() if c == conv_id]:
            del self._hints[hint]

    def _unindex(self, conv_id: str) -> None:
        for h in self._chains.get(conv_id, ()):
            holders = self._by_hash.get(h)
            if holders is not None:
                holders.pop(conv_id, None)
                if not holders:
                    del self._by_hash[h]

    def find(self, chain: list[str], hint: str | None = None) -> tuple[str | None, int]:
        """(conversation id, messages matched) of the known conversation whose chain shares the
        longest prefix with ``chain``; ``(None, 0)`` when none shares even the first message. A
        known ``hint`` wins (its conversation, and how much of its chain matches)."""
        if hint is not None and hint in self._hints:
            conv = self._hints[hint]
            known = self._chains.get(conv, [])
            n = 0
            for a, b in zip(chain, known):
                if a != b:
                    break
                n += 1
            return conv, n
        best: str | None = None
        n = 0
        for h in chain:
            holders = self._by_hash.get(h)
            if not holders:
                break
            best = next(reversed(holders))
            n += 1
        return best, n


#: headers that name a conversation, besides any ``x-…-conv-id`` / ``x-…-conversation-id``
CONVERSATION_HEADERS = ("x-session-id", "x-conversation-id", "conversation-id", "conversation_id", "session-id",
                        "session_id")
_CONV_HEADER = re.compile(r"^x-[a-z0-9-]+-conv(?:ersation)?-id$")


def _hint(value: Any) -> str | None:
    if not isinstance(value, str):
        return None
    value = value.strip()[:HINT_MAX].strip()
    return value or None


def hint_from(headers: Mapping[str, str], body: Any) -> str | None:
    """The client's own conversation key, explicit keys first: the body's ``"prompt_cache_key"``
    (OpenAI's), then a conversation-id header (``X-Session-Id``, ``X-Conversation-Id``, any
    ``X-…-Conv-Id``, any case), then the body's ``"user"`` string. Stripped, at most 200 characters,
    None when there is none (the message hash chain then names the conversation)."""
    if isinstance(body, Mapping):
        key = _hint(body.get("prompt_cache_key"))
        if key is not None:
            return key
    try:
        items = list(headers.items())
    except AttributeError:
        items = []
    named = [(k.lower(), v) for k, v in items if isinstance(k, str)]
    for wanted in CONVERSATION_HEADERS:
        for k, v in named:
            if k == wanted and (h := _hint(v)) is not None:
                return h
    for k, v in named:
        if _CONV_HEADER.match(k) and (h := _hint(v)) is not None:
            return h
    return _hint(body.get("user")) if isinstance(body, Mapping) else None


# -- the other chat routes -------------------------------------------------------

#: Anthropic's Messages API and OpenAI's Responses API, as llama-server serves them
MESSAGES_PATH = "/v1/messages"
RESPONSES_PATH = "/v1/responses"
ROUTED_PATHS = (MESSAGES_PATH, RESPONSES_PATH)


def _blocks_text(blocks: Any, text_types: tuple[str, ...] = ("text",)) -> Any:
    """A content value as OpenAI chat content: a string stays; a list of blocks keeps its text blocks
    as text parts and any other block as it is (:func:`normalise` hashes it); anything else as it is."""
    if not isinstance(blocks, list):
        return blocks
    out = []
    for b in blocks:
        if isinstance(b, Mapping) and b.get("type") in text_types and isinstance(b.get("text"), str):
            out.append({"type": "text", "text": b["text"]})
        else:
            out.append(b)
    return out


def _anthropic(body: Mapping) -> list | None:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    out: list = []
    system = body.get("system")
    if system:
        out.append({"role": "system", "content": _blocks_text(system)})
    for m in messages:
        if not isinstance(m, Mapping) or not isinstance(m.get("content"), list):
            out.append(m)
            continue
        blocks = m["content"]
        calls = [{"id": b.get("id"), "type": "function",
                  "function": {"name": b.get("name"), "arguments": canonical(b.get("input"))}}
                 for b in blocks if isinstance(b, Mapping) and b.get("type") == "tool_use"]
        results = [b for b in blocks if isinstance(b, Mapping) and b.get("type") == "tool_result"]
        rest = [b for b in blocks if not (isinstance(b, Mapping) and b.get("type") in ("tool_use", "tool_result"))]
        for r in results:  # a tool's answer: a message of its own, as OpenAI's chat has it
            out.append({"role": "tool", "tool_call_id": r.get("tool_use_id"), "content": _blocks_text(r.get("content"))})
        if rest or calls or not results:
            msg = {"role": m.get("role"), "content": _blocks_text(rest)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def _responses(body: Mapping) -> list | None:
    given = body.get("input")
    if given is None:
        return None
    out: list = []
    if body.get("instructions"):
        out.append({"role": "system", "content": body.get("instructions")})
    if isinstance(given, str):
        return out + [{"role": "user", "content": given}]
    if not isinstance(given, list):
        return out + [given]
    for item in given:
        kind = item.get("type") if isinstance(item, Mapping) else None
        if isinstance(item, Mapping) and "role" in item and kind in (None, "message"):
            out.append({"role": item.get("role"),
                        "content": _blocks_text(item.get("content"), ("input_text", "output_text", "text"))})
        elif kind == "function_call":
            out.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": item.get("call_id"), "type": "function",
                 "function": {"name": item.get("name"), "arguments": item.get("arguments")}}]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output")})
        else:
            out.append(item)  # reasoning items and the rest: kept, hashed as they are
    return out


def chat_body(path: str, body: Mapping) -> dict | None:
    """A request of another chat route as the OpenAI chat request it amounts to (its messages, the
    system prompt or instructions first; its other keys kept), for the conversation's identity, its
    explanation and the token comparison; None when ``path`` is not such a route or the body holds no
    conversation. Anthropic's content blocks and OpenAI Responses' input items become chat messages:
    text blocks their text, ``tool_use`` / ``function_call`` the assistant's tool calls,
    ``tool_result`` / ``function_call_output`` tool messages."""
    if path == MESSAGES_PATH:
        messages = _anthropic(body)
        dropped = ("messages", "system")
    elif path == RESPONSES_PATH:
        messages = _responses(body)
        dropped = ("input", "instructions")
    else:
        return None
    if messages is None:
        return None
    out = {k: v for k, v in body.items() if k not in dropped}
    out["messages"] = messages
    return out


def media_in(body: Mapping) -> str | None:
    """What media a request carries ("an image", "audio", "a file", "a document"), or None: content
    parts of its messages (chat, Anthropic) or input items (Responses), and ``/completion``'s
    ``multimodal_data``. llama-server refuses to save a slot when a multimodal projector is loaded,
    so such a request cannot be parked and restored: the proxy passes it through."""
    def parts(content: Any):
        if isinstance(content, list):
            for part in content:
                if isinstance(part, Mapping):
                    yield part
                    yield from parts(part.get("content"))  # an Anthropic tool_result holding an image

    def kind_of(part: Mapping) -> str | None:
        kind = part.get("type")
        return _MEDIA_KINDS.get(kind) if isinstance(kind, str) else None

    if not isinstance(body, Mapping):
        return None
    for key in ("messages", "input"):
        items = body.get(key)
        if not isinstance(items, list):
            continue
        for item in items:
            if not isinstance(item, Mapping):
                continue
            found = kind_of(item) if key == "input" else None
            if found:
                return found
            content = item.get("content")
            if not isinstance(content, list):  # a string: no parts (most of a chat's history)
                continue
            for part in parts(content):
                found = kind_of(part)
                if found:
                    return found
    prompts = body.get("prompt")
    for prompt in (prompts if isinstance(prompts, list) else [prompts]):
        if isinstance(prompt, Mapping) and prompt.get("multimodal_data"):
            return "an image or audio (multimodal_data)"
    return None


class TextPrompts:
    """The last text prompt of each conversation sent as text (``/completion``, ``/v1/completions``),
    for finding it again without a client-given key: a prompt that starts with a conversation's last
    prompt continues it (a script appends to its text), the longest such prompt wins; the same prompt
    sent again is the same conversation. A prompt shorter than ``PREFIX_MIN_CHARS`` is matched only when
    sent again as it is ("Hello" is the start of too many texts to say whose). With each prompt, the
    tokens it came to (the server's count), which is what its next turn can reuse. Kept least recently
    used first out, up to ``max_chars`` of text."""

    PREFIX_MIN_CHARS = 64

    def __init__(self, max_chars: int = MEMO_CHARS):
        self._texts: OrderedDict[str, tuple[str, int | None]] = OrderedDict()
        self._chars = 0
        self._max = max_chars

    def note(self, conv_id: str, text: str) -> None:
        if not text:
            return
        old = self._texts.pop(conv_id, None)
        if old is not None:
            self._chars -= len(old[0])
        self._texts[conv_id] = (text, old[1] if old is not None and old[0] == text else None)
        self._chars += len(text)
        while self._chars > self._max and len(self._texts) > 1:
            _cid, (dropped, _n) = self._texts.popitem(last=False)
            self._chars -= len(dropped)

    def set_tokens(self, conv_id: str, n_tokens: int) -> None:
        """The prompt of ``conv_id``'s last request came to ``n_tokens`` tokens."""
        if conv_id in self._texts:
            self._texts[conv_id] = (self._texts[conv_id][0], n_tokens)

    def tokens(self, conv_id: str) -> int | None:
        entry = self._texts.get(conv_id)
        return entry[1] if entry is not None else None

    def find(self, text: str) -> str | None:
        """The conversation whose last prompt ``text`` starts with (the longest), or None."""
        best, best_len = None, -1
        for conv_id, (known, _n) in self._texts.items():
            if len(known) > best_len and (text == known or len(known) >= self.PREFIX_MIN_CHARS
                                          and text.startswith(known)):
                best, best_len = conv_id, len(known)
        return best

    def forget(self, conv_id: str) -> None:
        old = self._texts.pop(conv_id, None)
        if old is not None:
            self._chars -= len(old[0])
