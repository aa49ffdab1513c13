"""The proxy's values: a request judged (in :class:`app.core.verdict.VerdictKind`), and why it re-processed.

Shared by the identity (app.proxy.identity), the explanation (app.proxy.explain), the slot
leases (app.proxy.leases), the HTTP layer (app.proxy.http) and the faces.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from app.core.verdict import VerdictKind  # a request's verdict: the one vocabulary (app.core.verdict)

__all__ = ["Cause", "Message", "Explanation", "RequestRecord", "Conversation", "ServerCaching"]


class Cause(enum.StrEnum):
    """Why a request re-processed more than it had to (None when it did not)."""

    SYSTEM_PROMPT_CHANGED = "the system prompt changed"
    EARLIER_MESSAGE_EDITED = "an earlier message was edited"
    REASONING_STRIPPED = "the client sent the reply back without its reasoning"
    TOOL_RESULT_CHANGED = "a tool result changed"
    TOOLS_CHANGED = "the tool definitions changed"
    CLIENT_TRUNCATION = "the client dropped old turns"
    TEMPLATE_CHANGED = "the chat template renders the same messages differently"
    SLOT_TAKEN = "another conversation used the slot meanwhile"
    IDLE_SLOT_CLEARED = "the server cleared the idle slot (idle-slot caching)"
    SERVER_RESTARTED = "the server restarted"
    SERVER_SLEPT = "the server slept (its context was destroyed)"
    RESTORE_WITHOUT_CHECKPOINTS = "the restore brought no context checkpoints back (no usable sidecar)"
    RESTORE_FAILED = "the restore failed: the slot was emptied"
    PARK_NOT_ITS_OWN = "its park held other tokens than the request's (not restored)"
    CLIENT_CHOSE = "the client chose its own slot or caching (passed through untouched)"
    MULTIMODAL = "it carries images, audio or files (passed through untouched: such a slot cannot be parked)"
    ROUTER = "router mode: the model's own child server holds the slots (passed through untouched)"
    UNKNOWN = "not known"

    @property
    def client_words(self) -> str:
        """The cause in the words clients already show for a prompt-cache miss (Anthropic's cache
        diagnostics: ``system_changed``, ``tools_changed``, ``messages_changed``,
        ``previous_message_not_found``), with what only llama-server does said by its own short name
        (reasoning dropped by the template, a restore without checkpoints...)."""
        return CLIENT_WORDS[self]


#: every cause in the vocabulary clients show for a cache miss (:attr:`Cause.client_words`)
CLIENT_WORDS: dict[Cause, str] = {
    Cause.SYSTEM_PROMPT_CHANGED: "system_changed",
    Cause.TOOLS_CHANGED: "tools_changed",
    Cause.EARLIER_MESSAGE_EDITED: "messages_changed",
    Cause.CLIENT_TRUNCATION: "messages_changed (old turns dropped)",
    Cause.TOOL_RESULT_CHANGED: "messages_changed (a tool result)",
    Cause.REASONING_STRIPPED: "reasoning dropped by the client or its template",
    Cause.TEMPLATE_CHANGED: "the template renders it differently",
    Cause.SLOT_TAKEN: "previous_message_not_found (slot reused)",
    Cause.IDLE_SLOT_CLEARED: "previous_message_not_found (idle-slot clearing)",
    Cause.SERVER_RESTARTED: "previous_message_not_found (server restarted)",
    Cause.SERVER_SLEPT: "previous_message_not_found (server slept)",
    Cause.RESTORE_WITHOUT_CHECKPOINTS: "no checkpoints (sliding window without a full cache, or hybrid)",
    Cause.RESTORE_FAILED: "previous_message_not_found (restore failed)",
    Cause.PARK_NOT_ITS_OWN: "previous_message_not_found (park was another prompt's)",
    Cause.CLIENT_CHOSE: "the client's own slot or caching",
    Cause.MULTIMODAL: "multimodal (not parked)",
    Cause.ROUTER: "router mode (not leased)",
    Cause.UNKNOWN: "previous_message_not_found",
}


@dataclass(frozen=True)
class Message:
    """One chat message as the proxy compares it: its role and its text (reasoning kept apart)."""

    role: str
    content: str
    reasoning: str = ""  # "reasoning_content", or <think>…</think> taken out of an assistant message
    name: str = ""  # a tool's name / a tool_call_id: part of a tool result's identity


@dataclass(frozen=True)
class Explanation:
    """Why a request re-processed: the cause, where the prompt first differed, and a sentence."""

    cause: Cause
    detail: str  # for the user: "message 3 (user) differs from what the slot held, at character 120"
    first_divergent_message: int | None = None  # index into the request's messages
    first_divergent_token: int | None = None  # when the server's /tokenize was asked
    held_token: str | None = None  # the token text the slot's previous prompt had at that index ("" past its end)
    sent_token: str | None = None  # the token text this request had there ("" past its end)


@dataclass(frozen=True)
class RequestRecord:
    """One request through the proxy, judged."""

    at: float
    conversation: str | None  # the conversation id, None for a request that has none (a raw /completion)
    slot: int | None
    path: str
    stream: bool
    cache_n: int | None
    prompt_n: int | None
    prompt_ms: float | None
    predicted_n: int | None
    expected_reuse: int  # tokens the slot held that this request could have reused
    verdict: VerdictKind
    explanation: Explanation | None = None
    restored_from: str | None = None  # the parked session a restore brought back first
    wasted_ms: float | None = None  # prompt time spent on tokens it could have reused (learned rate)


@dataclass
class Conversation:
    """What the proxy knows of one conversation."""

    id: str
    setup: str  # the serving setup's fingerprint (app.proxy.identity.setup_fingerprint)
    chain: list[str] = field(default_factory=list)  # hash chain of its messages, up to its last reply
    messages: list[Message] = field(default_factory=list)  # the last request's messages (for explanations)
    hint: str | None = None  # the client's own id (X-Session-Id, or the body's "user")
    slot: int | None = None  # the slot holding it now, or None
    n_tokens: int = 0  # tokens it holds in that slot after its last reply
    parked_as: str | None = None  # the session it is parked as, when it is parked
    last_used: float = 0.0
    last_verdict: VerdictKind | None = None
    requests: int = 0
    time_saved_s: float = 0.0
    # Not stored (this process's knowledge): the hash chain of the request whose render its slot holds (set
    # when the server processed a leased request of it there; None when one did not run there), and that of
    # its park, copied from the slot's when this process wrote the park (None: not known)
    slot_chain: list[str] | None = field(default=None, compare=False, repr=False)
    park_chain: list[str] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class ServerCaching:
    """What the server does with prompts by itself, read from its ``--help`` and its argv
    (app.core.helptext.server_caching): what the proxy must work around or step aside for."""

    idle_slots_saved: bool = False  # --cache-idle-slots in effect (it needs --cache-ram != 0)
    idle_slots_cleared: bool = False  # ... and it clears the idle slots it saves (unified KV in build 11434)
    sleep_idle_seconds: int | None = None  # --sleep-idle-seconds N > 0: the context is destroyed when idle
    disk_cache: str | None = None  # the flag of a disk prompt cache the server persists prompts with
    ram_cache: bool = False  # --cache-ram != 0: the server keeps RAM copies of prompts a slot lost (#28276)
    notes: tuple[str, ...] = ()  # how each was decided, for the log and a Notice
    router: bool = False  # a router: each model's prompts are kept by its own child server

    @property
    def steps_aside(self) -> bool:
        """The server persists prompts itself: the proxy passes requests through unchanged."""
        return self.disk_cache is not None
