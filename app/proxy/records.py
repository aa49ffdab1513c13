"""The judged requests of one proxy: a request in flight as the judge will need it (:class:`Pending`),
and each judged one stored, told to the observers (the Conversations tab, ``kv-valet serve``, the
metrics) and, after the answer went out, its explanation refined to the first divergent token
(:class:`RequestRecords`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from app.core.background import TaskGroup
from app.core.conversation import Cause, Conversation, Message, RequestRecord
from app.core.observers import Observers
from app.proxy import explain as explain_mod
from app.proxy import watch as watch_mod
from app.proxy.lease_table import Lease
from app.proxy.request_facts import CHAT_PATHS
from app.store.conversations import ConversationStore

log = logging.getLogger(__name__)


@dataclass
class Pending:
    """One request between the proxy's ``before`` and its ``after``: what was found and decided."""

    conv: Conversation | None
    lease: Lease | None
    messages: list[Message]
    previous: list[Message] | None
    expected_reuse: int
    new: bool
    path: str
    stream: bool
    started: float = field(default_factory=time.time)
    body: dict | None = None  # the request as the client sent it
    previous_body: dict | None = None  # the conversation's previous request (for the token comparison)
    restore_hazard: str | None = None  # restored into another chat's checkpoints (the fork keeps them)
    own: str | None = None  # passed through untouched: why (client_choice)
    own_cause: Cause = Cause.CLIENT_CHOSE  # ... and its cause (MULTIMODAL: it carries media)
    settled: asyncio.Future | None = None  # with ``own``: done once ``after`` has seen what it did to the slots
    tasks_before: dict[int, object] | None = None  # with ``own``: each slot's id_task before the request
    slots_before: list | None = None  # with ``own``: the leases' view of the slots before the request
    chain: list[str] | None = None  # with a lease: its messages' hash chain (what its slot holds once it ran)
    # the bookkeeping held off its path until it is sent upstream (ProxyService.sent): run once, in order
    held: list[Callable[[], None]] = field(default_factory=list)


class RequestRecords:
    """Where a proxy's judged requests go: ``store``, the observers, the token comparisons (through the
    client ``client_of()`` gives when one runs: the server's, looked up then)."""

    def __init__(self, store: ConversationStore, client_of: Callable[[], object]) -> None:
        self.store = store
        self._client_of = client_of
        self._record_cbs: Observers[[RequestRecord]] = Observers("the proxy's request records")
        self._explained_cbs: Observers[[RequestRecord]] = Observers("the proxy's refined explanations")
        self._explaining = TaskGroup("the proxy's token comparisons")

    def on_record(self, cb: Callable[[RequestRecord], None]) -> None:
        self._record_cbs.add(cb)

    def on_explained(self, cb: Callable[[RequestRecord], None]) -> None:
        """``cb(record)`` when a recorded request's explanation was refined (its first divergent token)."""
        self._explained_cbs.add(cb)

    async def settle(self) -> None:
        """Wait for the token comparisons running now (explanations refined after their request)."""
        await self._explaining.wait()

    def add(self, conv: Conversation, rec: RequestRecord) -> int:
        """Store a judged request and tell the observers; its row in the store."""
        row = self.store.add_request(conv.id, rec)
        self._record_cbs.emit(rec)
        return row

    def record(self, conv: Conversation, rec: RequestRecord, p: Pending) -> None:
        """Store a judged request, tell the observers, and refine its explanation by tokens later."""
        row = self.add(conv, rec)
        if rec.explanation is not None and explain_mod.wants_tokens(rec.verdict):
            self._explaining.start(self._explain_by_tokens(row, rec, p), f"a request of {conv.id}")

    async def _explain_by_tokens(self, row: int, rec: RequestRecord, p: Pending) -> None:
        """After the answer went out: the first divergent token against the conversation's previous
        prompt, through the server (/apply-template, /tokenize), into the stored record."""
        previous = p.previous_body
        if previous is None and p.previous and p.path in CHAT_PATHS:
            previous = watch_mod.body_of(p.previous)  # an app restart: rebuilt from the stored messages
        if previous is None or p.body is None or rec.explanation is None:
            return
        found = await watch_mod.divergence(self._client_of(), p.path, previous, p.body)
        if isinstance(found, str):
            log.info("request of %s explained by messages only: %s", rec.conversation, found)
            return
        refined = replace(rec, explanation=explain_mod.with_divergent_token(rec.explanation, *found))
        if self.store.set_explanation(row, refined.explanation):
            self._explained_cbs.emit(refined)
