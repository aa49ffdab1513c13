"""The proxy's KV events, followed from its leases: what :class:`app.proxy.service.ProxyService` tells
(a request ended, a conversation forgotten) and what its :class:`app.proxy.leases.SlotLeases` journal
(every slot and park change, through ``on_change``) become events of :mod:`app.proxy.kv_events`, sent
on the socket of :mod:`app.proxy.kv_publisher`. Off unless the user names an endpoint
(``kv-valet serve PROFILE --proxy --kv-events tcp://127.0.0.1:5557``): then each request costs the
server two small calls after its answer went out (``/apply-template`` and ``/tokenize`` of the prompt:
the token ids a router matches), and nothing on the request's own path.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from app.core.background import TaskGroup
from app.core.conversation import Conversation
from app.proxy.kv_events import ProxyKv
from app.proxy.lease_table import SlotState
from app.proxy.leases import SlotLeases
from app.server.client import ServerError, ServerUnreachable
from app.server.statefile import StateFileError, read_state_tokens

log = logging.getLogger(__name__)

#: what a chat request's prompt is rendered from (as the proxy's final check before a restore renders it)
RENDERED_KEYS = ("messages", "tools", "chat_template_kwargs")


class _Proxy(Protocol):
    """What the follower reads of :class:`app.proxy.service.ProxyService` (which imports this module)."""

    target_id: str
    setup: str
    leases: SlotLeases | None
    conversations: dict[str, Conversation]

    @property
    def handle(self): ...


class KvFollower:
    """The KV events of one proxy's server."""

    def __init__(self, proxy: _Proxy, endpoint: str) -> None:
        from app.proxy.kv_publisher import KvEventPublisher  # pyzmq only where KV events are on

        self.proxy = proxy
        self.publisher = KvEventPublisher(endpoint, on_subscribe=self.subscribed)
        self.kv = ProxyKv(proxy.setup)
        self._tasks = TaskGroup("the proxy's KV events")
        self._bos: list[int] | None = None

    def start(self) -> None:
        """Tell a consumer to forget what it knew of this server (an earlier run's blocks), follow the
        leases from now on, and read the parks of earlier runs from their state files."""
        leases = self.proxy.leases
        assert leases is not None
        self.publisher.publish(self.kv.cleared())
        leases.on_change = self.changed
        for conv in list(self.proxy.conversations.values()):
            if conv.parked_as:
                self._tasks.start(self._read_park(conv.id, conv.parked_as), f"the park of {conv.id}")

    async def close(self) -> None:
        await self._tasks.wait()
        await self.publisher.close()

    def subscribed(self) -> None:
        """A subscriber arrived: it gets the whole state (to the others, the same truth again)."""
        self.publisher.publish(self.kv.blocks.resend())

    async def settle(self) -> None:
        """Wait for the tokenisations running now (a test's or a bench's sync point)."""
        await self._tasks.wait()

    def changed(self, event: str, conv_id: str | None) -> None:
        """The leases changed (``event``, as journaled): publish what a consumer must hear of it."""
        leases = self.proxy.leases
        if leases is None:
            return
        try:
            events = self.kv.cleared() if event == "reset" else []
            if event == "saved" and conv_id is not None:
                self.kv.saved(conv_id)
            elif event == "restored" and conv_id is not None:
                self.kv.restored(conv_id)
            holding = {s.index: s.conversation if s.conversation and s.n_tokens > 0
                       and s.state not in (SlotState.FREE, SlotState.RESTORING) else None for s in leases.snapshot()}
            parked = [c.id for c in self.proxy.conversations.values() if c.parked_as]
            self.publisher.publish(events + self.kv.sync(holding, parked))
        except Exception:  # report: KV events must never stop a lease change; logged with the traceback
            log.exception("KV events of %s after %s", self.proxy.target_id, event)

    def forgotten(self, conv_id: str) -> None:
        self.kv.forget(conv_id)
        self.changed("forgotten", conv_id)

    def request_ended(self, conv_id: str, route: str | None, body: dict | None, n_prompt: int) -> None:
        """A request of ``conv_id`` ended well: its slot holds its prompt, ``n_prompt`` tokens by the
        server's own count (cache_n + prompt_n). ``route``: "chat" (messages), "text" (a prompt) or None
        (another route). Its token ids are asked for in the background."""
        self._tasks.start(self._learn(conv_id, route, body, n_prompt, self.kv.saves(conv_id)),
                          f"the KV events of {conv_id}")

    async def _learn(self, conv_id: str, route: str | None, body: dict | None, n_prompt: int, saves: int) -> None:
        client = self.proxy.handle.client
        try:
            if route == "chat" and body is not None:
                text = await client.apply_template({k: v for k, v in body.items() if k in RENDERED_KEYS})
            elif route == "text" and body is not None and isinstance(body.get("prompt"), str):
                text = body["prompt"]
            else:
                return  # a route whose prompt the proxy does not render (Anthropic, Responses, token lists)
            tokens = [t for t, _piece in await client.tokenize_pieces(text)]
            if n_prompt == len(tokens) + 1:  # the server put its BOS first; /tokenize's pieces call adds none
                tokens = await self._bos_token() + tokens
        except (ServerError, ServerUnreachable, KeyError, TypeError, ValueError) as e:
            log.info("KV events: the prompt of %s was not tokenised (%s): its slot's blocks stay as they were",
                     conv_id, e)
            return
        self.kv.learn(conv_id, tokens, saves)
        self.changed("learned", conv_id)

    async def _bos_token(self) -> list[int]:
        """The server's BOS token as a list of its id (asked once: /props, then /tokenize)."""
        if self._bos is None:
            client = self.proxy.handle.client
            bos = (await client.props()).get("bos_token")
            self._bos = [t for t, _ in await client.tokenize_pieces(bos)][:1] if isinstance(bos, str) else []
        return self._bos

    async def _read_park(self, conv_id: str, name: str) -> None:
        """A park of an earlier run: its tokens, from its state file (a host's server has its parks there,
        not here: none are read)."""
        svc = self.proxy.handle.sessions
        rec = svc.catalog.get(svc.profile_name, name) if svc is not None else None
        if rec is None:
            return
        try:
            tokens = await asyncio.to_thread(read_state_tokens, rec.state_path)
        except (StateFileError, OSError) as e:
            log.info("KV events: the park %s was not read (%s)", name, e)
            return
        self.kv.learn_park(conv_id, tokens)
        self.changed("read", conv_id)
