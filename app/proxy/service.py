"""The conversation proxy of one server: identity, slot leases, judgment, in one place.

``kv-valet serve PROFILE --proxy`` and the window's proxy switch are faces of this class.
It sits on a server of :class:`app.servers.service.ServerService` (its one HTTP client,
its session service for parks and restores) and is the HTTP layer's interceptor
(:class:`app.proxy.http.ProxyServer`): before a chat request it finds the conversation
(:mod:`app.proxy.identity`), leases it a slot (:mod:`app.proxy.leases`: restored from its
park when it comes back to a slot another conversation used) and pins the request there
(``id_slot``); after it, it judges the request from the server's own timings and, when it
re-processed more than it had to, says why: the verdict is the one judge's
(:func:`app.core.verdict.judge`, the Sessions tab's words), the why :mod:`app.proxy.explain`'s.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
from collections import OrderedDict
from typing import Callable, Mapping

from app.core.background import track
from app.core.rules import kv_unified
from app.core.conversation import Cause, Conversation, Explanation, Message, RequestRecord, ServerCaching
from app.core.timings import Timings
from app.core.verdict import WASTEFUL, Reuse, VerdictKind, judge, tolerance
from app.servers.service import ServerHandle, ServerService
from app.proxy import explain as explain_mod
from app.proxy import identity
from app.proxy import watch as watch_mod
from app.proxy.http import ProxyServer, Result
from app.proxy.kv_follow import KvFollower
from app.proxy.lease_table import park_name
from app.proxy.leases import SlotLeases, recover_leases
from app.proxy.metrics import ProxyMetrics, proxy_load, served_model_name
from app.proxy.records import Pending, RequestRecords
from app.proxy.request_facts import CHAT_PATHS, TEXT_PATHS, answer_timings, client_choice, slot_actions_on
from app.proxy.session_backend import RestoreFor, SessionBackend, tokens_left
from app.sessions.journal import Recovery
from app.server.client import ServerError, ServerUnreachable
from app.store.conversations import ConversationStore, ConversationStoreError

log = logging.getLogger(__name__)

#: Characters per token when a request's size must be guessed before the server tokenises it.
CHARS_PER_TOKEN = 4
#: The last request bodies kept (one per conversation, most recent): the previous prompt a token
#: comparison renders. Past them (and after an app restart) it is rebuilt from the stored messages.
BODIES_KEPT = 256
#: the longest a request waits for the bookkeeping of one passed through untouched that has just ended
SETTLE_WAIT_S = 2.0
#: who took an idle slot when a request the proxy passed through untouched ran in it
OUTSIDE = explain_mod.OUTSIDE
#: the start of a router's conversations' setup (each from its model's: ProxyService._setup_of)
ROUTER_SETUP = "router-"


def run_held(held: list[Callable[[], None]], who: str) -> None:
    """Run and empty ``held`` (the bookkeeping a request held until it was sent), in order; a failure is
    logged and the rest still run."""
    items = list(held)
    held.clear()
    for fn in items:
        try:
            fn()
        except Exception:  # report: the request is not the one to fail for its bookkeeping
            log.exception("%s: the bookkeeping held until a request was sent failed", who)


def _path_turn(p: Pending) -> str:
    """How a request reached its slot, as ``kvvalet_proxy_path_seconds`` labels it (app.proxy.metrics)."""
    if p.lease is None:
        return "no_lease"
    if p.lease.restored_from:
        return "restored"
    return "kept" if p.lease.slot_context.held else "other_slot"


class ProxyService:
    def __init__(self, servers: ServerService, target_id: str, *, store: ConversationStore | None = None,
                 disk_budget_bytes: int | None = None, save_before_idle_clear: bool = True,
                 profile_name: str | None = None,
                 backend: Callable[[ServerHandle], SessionBackend] | None = None, kv_events: str | None = None,
                 warm_start: bool = True, park_ahead: bool = True):
        """``profile_name``: the name its conversations are kept under (default: the server's profile);
        ``backend``: makes the leases' slot operations for the server's handle (default: the server's
        session service here; app.proxy.remote's for a host's server); ``kv_events``: a ZMQ endpoint to
        publish the slots' and parks' KV events on (app.proxy.kv_follow; None: off); ``warm_start``: restore
        the parks of the conversations used last into the free slots at the start (app.proxy.leases); ``park_ahead``:
        at idle moments, park the conversation the next eviction would take (app.proxy.leases, "Park ahead")."""
        self.servers = servers
        self.target_id = target_id
        self.store = store if store is not None else ConversationStore()
        self._owns_store = store is None
        self.disk_budget_bytes = disk_budget_bytes
        self.index = identity.ConversationIndex()
        self._unsettled: set[asyncio.Future] = set()  # see ``ended``
        self.texts = identity.TextPrompts()  # text prompts (/completion) without a client key, by conversation
        self.conversations: dict[str, Conversation] = {}
        self.leases: SlotLeases | None = None
        self.http: ProxyServer | None = None
        self.setup = ""
        self._started_at: float | None = None
        self.records = RequestRecords(self.store, lambda: self.handle.client)
        self._stopped = False
        # the server's own caching (its --help and argv), and the live watch over it
        self.caching = ServerCaching()
        self.save_before_idle_clear = save_before_idle_clear
        self.watch: watch_mod.ServerWatch | None = None
        self._bodies: OrderedDict[str, dict] = OrderedDict()
        self.metrics: ProxyMetrics | None = None  # its cache reuse in Prometheus (started with the proxy)
        self._profile_name: str | None = profile_name  # kept from the server's handle (see ``profile``)
        self._fixed_name = profile_name is not None
        self._make_backend = backend
        self.router = False  # the server is a router (read from /props at start)
        self.kv_events = kv_events
        self.kv: KvFollower | None = None  # made by start() when kv_events names an endpoint
        self.warm_start = warm_start
        #: the warm start's restores (started by start(); done at once when there is none): the conversations
        #: brought into a slot
        self.warming: asyncio.Future | None = None
        self._idle_callbacks: list[Callable[[], object]] = []
        self.park_ahead = park_ahead
        #: the park ahead running now, started at an idle moment (None: none was started yet)
        self.parking_ahead: asyncio.Future | None = None

    # -- life --------------------------------------------------------------------------
    @property
    def handle(self) -> ServerHandle:
        h = self.servers.get(self.target_id)
        if h is None:
            raise RuntimeError(f"no server {self.target_id}")
        return h

    @property
    def profile(self) -> str:
        """The server's profile name (its URL when it has none); still known once the server is gone
        (a request that ends as the server stops is stored under it all the same)."""
        h = self.servers.get(self.target_id)
        if h is not None and not self._fixed_name:
            self._profile_name = h.profile.name if h.profile is not None else h.url
        if self._profile_name is None:
            raise RuntimeError(f"no server {self.target_id}")
        return self._profile_name

    async def start(self, host: str, port: int, *, api_key: str | None = None, slots_endpoint: bool = True) -> str:
        """Read the serving setup, recover the conversations, listen on ``host:port`` (``slots_endpoint``
        False: the user's ``--no-slots``, kept for the clients; the server behind serves /slots to the proxy)."""
        h = self.handle
        props = await h.client.props()
        # a router (a server started without a model) answers /props itself and routes the rest by the
        # request's "model" to a child server of that model: its slots are the child's, which it starts
        # and stops; the proxy passes every request through, judged (see ``router``)
        self.router = props.get("role") == "router"
        slots = [] if self.router else await h.client.slots()
        p = h.profile
        self.setup = identity.setup_fingerprint(
            model_id=str(props.get("model_path") or ""), cache_type_k=(p.cache_type_k if p else "") or "f16",
            cache_type_v=(p.cache_type_v if p else "") or "f16", flash_attn=(p.flash_attn if p else "") or "auto",
            swa_full=bool(p.swa_full) if p else False, chat_template=str(props.get("chat_template") or ""))
        for conv in self.store.list(self.profile):
            # a router's conversations each start from their own model's setup (see ``_setup_of``)
            if conv.setup == self.setup or self.router and conv.setup.startswith(ROUTER_SETUP):
                self.conversations[conv.id] = conv
                self.index.add(conv.id, conv.chain)
                if conv.hint:
                    self.index.add_hint(conv.hint, conv.id)
        self._started_at = h.started_at
        self._backend = self._make_backend(h) if self._make_backend is not None else \
            SessionBackend.here(h, self.servers)
        self._backend.disk_budget_bytes = self.disk_budget_bytes
        n_ctx, unified = [int(r.get("n_ctx") or 0) for r in slots if isinstance(r, dict)], bool(p and kv_unified(p))
        self.metrics = ProxyMetrics(self.profile, self._prefill_ms_per_token, model_name=served_model_name(props),
                                    load=lambda: proxy_load(self.http, None if self.steps_aside else self.leases,
                                                            n_ctx, unified))
        self._backend.metrics = self.metrics
        self.on_record(self.metrics.observe_request)
        if not self.router:
            self.leases = SlotLeases(len(slots), self._backend, store=self.store,
                                     profile=self.profile, prefill_ms_per_token=self._prefill_ms_per_token,
                                     restore_ms_estimate=self._restore_ms, disk_budget_bytes=self.disk_budget_bytes)
            for msg in recover_leases(Recovery(subject=self.leases, same_process=False)):
                log.info("proxy %s after a crash: %s", self.target_id, msg)
            self.caching = await watch_mod.read_caching(h)
            # the server's RAM cache as a restore source (#28276): see app.proxy.leases
            self.leases.ram_cache = self.caching.ram_cache
            self.leases.idle_slots_cleared = self.caching.idle_slots_cleared
            self.watch = watch_mod.ServerWatch(h.client, self.leases, self.caching,
                                               save_before_clear=self.save_before_idle_clear)
            for note in self.caching.notes:
                log.info("server %s: %s", self.target_id, note)
            if self.kv_events:
                self.kv = KvFollower(self, self.kv_events)
                self.kv.start()
                log.info("KV events of %s on %s", self.target_id, self.kv.publisher.bound)
        else:
            log.info("server %s is a router: the proxy passes its requests through, judged", self.target_id)
        if h.supervisor is not None:
            h.supervisor.on_state(self._on_server_state)
        # the journal's commits sit on the requests' path: their WAL checkpoints (fsyncs) run when it is idle
        self.store.defer_checkpoints()
        self.http = ProxyServer(h.client, interceptor=self, api_key=api_key, slot_actions=slot_actions_on(p),
                                slots_endpoint=slots_endpoint, metrics=self.metrics.exposition, on_idle=self._idle)
        await self.http.start(host, port)
        if self.leases is not None and self.warm_start and not self.steps_aside:
            self.warming = track(self._warm(), f"proxy {self.target_id}: warm start")
        return self.http.url

    async def _warm(self) -> list[str]:
        """The warm start (app.proxy.leases): the parked conversations of this server, most recently used
        first, restored into the free slots while no request asks for one."""
        assert self.leases is not None
        parked = [c for c in self.conversations.values() if c.parked_as]
        warmed = await self.leases.warm(parked)
        if warmed:
            log.info("proxy %s: warm start restored %s", self.target_id, ", ".join(warmed))
        return warmed

    @property
    def steps_aside(self) -> bool:
        """The server persists prompts on disk itself: requests pass through unchanged, judged only."""
        return self.caching.steps_aside

    @property
    def url(self) -> str:
        """Where clients reach the proxy (``http://host:port``)."""
        return self.http.url if self.http is not None else ""

    def notice(self) -> str | None:
        """What the user should know of the server's own caching behind this proxy (None: nothing)."""
        if self.router:
            return watch_mod.ROUTER_NOTICE
        return watch_mod.caching_notice(self.caching, self.save_before_idle_clear)

    def _setup_of(self, body: dict) -> str:
        """The setup a request's conversation starts from: the server's, or for a router the model the
        request names (the same messages to another model are another conversation)."""
        if not self.router:
            return self.setup
        model = body.get("model")
        return ROUTER_SETUP + identity.setup_fingerprint(
            model_id=f"router:{model if isinstance(model, str) else ''}", cache_type_k="", cache_type_v="",
            flash_attn="", swa_full=False, chat_template="")

    def apply_settings(self, prefs) -> None:
        """The preferences (app.settings.Settings) that apply to a running proxy: the disk budget of its
        parks (enforced at its next save) and whether it saves idle slots before the server clears them."""
        self.disk_budget_bytes = prefs.proxy_disk_budget_bytes()
        if self.leases is not None:
            self.leases.disk_budget_bytes = self.disk_budget_bytes
        backend = getattr(self, "_backend", None)  # made when the proxy starts
        if backend is not None:
            backend.disk_budget_bytes = self.disk_budget_bytes
        self.save_before_idle_clear = prefs.proxy_save_before_idle_clear
        if self.watch is not None:
            self.watch.save_before_clear = prefs.proxy_save_before_idle_clear
        self.park_ahead = prefs.proxy_park_ahead

    async def settle(self) -> None:
        """Wait for the work that follows the requests: the token comparisons running now (explanations
        refined after their request) and a park ahead under way."""
        await self.records.settle()
        await self._parked_ahead()

    async def _parked_ahead(self) -> None:
        if self.parking_ahead is not None and not self.parking_ahead.done():
            await asyncio.wait([self.parking_ahead])

    def on_idle(self, cb: Callable[[], object]) -> None:
        """``cb()`` whenever the proxy has answered and judged every request it was given (nothing in
        flight): work that must not land inside a request (``kv-valet serve``'s garbage collections)."""
        self._idle_callbacks.append(cb)

    def _idle(self) -> None:
        try:
            self.store.checkpoint_if_due()
        except ConversationStoreError as e:  # report: the next idle moment tries again, SQLite's own limit holds
            log.warning("the conversation store's checkpoint did not run: %s", e)
        if self.park_ahead and self.leases is not None and not self._stopped \
                and (self.parking_ahead is None or self.parking_ahead.done()) \
                and self.leases.park_ahead_slot() is not None:
            # the save sits here, between requests, not on the path of the conversation that takes the slot next
            self.parking_ahead = track(self.leases.park_ahead(), f"proxy {self.target_id}: parking ahead")
        for cb in self._idle_callbacks:
            cb()

    def on_explained(self, cb: Callable[[RequestRecord], None]) -> None:
        """``cb(record)`` when a recorded request's explanation was refined (its first divergent token)."""
        self.records.on_explained(cb)

    async def stop(self) -> None:
        await self._parked_ahead()  # a save under way ends (a cancelled one would drop the park it overwrote)
        if self.warming is not None and not self.warming.done():
            self.warming.cancel()  # the park it restores stays (a cancelled warm restore keeps it)
            await asyncio.wait([self.warming])
        if self.watch is not None:
            self.watch.close()
        if self.kv is not None:
            await self.kv.close()
        if self.http is not None:
            await self.http.stop()
            self.http = None
        if self._owns_store and not self._stopped:
            self.store.close()
        self._stopped = True

    async def park_before_stop(self) -> None:
        """Save every slot a conversation used since its last save (the server is about to stop)."""
        if self.warming is not None and not self.warming.done():
            await asyncio.wait([self.warming])  # a restore under way ends first: a stop would fail it
        await self._parked_ahead()  # so does a park ahead
        if self.leases is not None:
            await self.leases.save_dirty()

    def on_record(self, cb: Callable[[RequestRecord], None]) -> None:
        self.records.on_record(cb)

    # -- what the leases need to decide ------------------------------------------------------
    def _prefill_ms_per_token(self) -> float | None:
        rate = self.servers.catalog.prefill_rate(self.profile)  # tokens per second, measured
        return 1000.0 / rate if rate else None

    def _restore_ms(self, n_tokens: int) -> float:
        # restores read the state file: about 2 GB/s from the page cache, and a fixed cost
        return 20.0 + n_tokens * 0.01

    # -- the interceptor -----------------------------------------------------------------------
    def ended(self, ctx: object) -> None:
        """A request passed through untouched has ended: until its ``after`` has read what it did to the
        slots (a slot it took, a prompt the server moved to its RAM cache), the next request waits for it
        (``before``): a client that sends its next request at once must find the slots as they are."""
        if isinstance(ctx, Pending) and ctx.own is not None:
            ctx.settled = asyncio.get_running_loop().create_future()
            self._unsettled.add(ctx.settled)

    def sent(self, ctx: object) -> None:
        """The request is sent upstream: the bookkeeping held off its path runs next, while the server works
        (the journal entries held, a restore's catalog note: app.proxy.lease_journal, app.sessions.resume)."""
        if isinstance(ctx, Pending) and ctx.held or self.leases is not None and self.leases.journal_held:
            asyncio.get_running_loop().call_soon(self._run_held, ctx)

    def _run_held(self, ctx: object) -> None:
        """What was held until the request was sent (at the latest in its ``after``); each failure logged."""
        if self.leases is not None:
            try:
                self.leases.flush_journal()
            except Exception:  # report: the next entry written tries again
                log.exception("proxy %s: the lease journal's held entries were not written", self.target_id)
        if isinstance(ctx, Pending):
            run_held(ctx.held, f"proxy {self.target_id}")

    def _settled(self, p: Pending) -> None:
        if p.settled is not None:
            self._unsettled.discard(p.settled)
            if not p.settled.done():
                p.settled.set_result(None)

    async def before(self, path: str, headers: Mapping[str, str], body: dict) -> tuple[dict, object]:
        if self._unsettled:  # a request passed through untouched has just ended: see what it did first
            await asyncio.wait(set(self._unsettled), timeout=SETTLE_WAIT_S)
        self._check_restart()
        if self.watch is not None:
            await self.watch.before_request()
        hint = identity.hint_from(headers, body)
        stream = bool(body.get("stream"))
        own = client_choice(path, body)
        own_cause = Cause.CLIENT_CHOSE
        media = identity.media_in(body) if own is None else None
        if media is not None:
            own, own_cause = (f"it carries {media}, and llama-server does not save a slot holding media tokens "
                              "(with a multimodal projector loaded), so it could not be parked"), Cause.MULTIMODAL
        if self.router:
            model = body.get("model")
            own, own_cause = (f"the server is a router: the model {model!r} runs in a child server the router "
                              "starts and stops, whose slots KV Valet neither leases nor parks"
                              if isinstance(model, str) and model else
                              "the server is a router and the request names no model"), Cause.ROUTER
        setup = self._setup_of(body)
        # Anthropic's /v1/messages and OpenAI's /v1/responses: the same conversation as the chat request
        # they amount to (what identity, explanations and the token comparison read; the server gets the
        # client's own body)
        chat = identity.chat_body(path, body) if path in identity.ROUTED_PATHS else None
        body_seen = chat if chat is not None else body
        if (path in CHAT_PATHS or chat is not None) and isinstance(body_seen.get("messages"), list):
            messages = identity.normalise(body_seen["messages"])
            chain = identity.chain(setup, messages)
            key = chain[:identity.cut_at_last_assistant(messages)]
            conv_id, matched = self.index.find(key, hint) if key or hint else (None, 0)
            if conv_id is not None and hint is None and self._forks(conv_id, chain, messages):
                conv_id = None  # a new conversation: the original keeps its identity (and its slot)
        elif path in TEXT_PATHS:
            prompt = body.get("prompt")
            text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
            messages = [Message("prompt", text)]
            chain = [hashlib.sha256(f"{setup}\0{text}".encode()).hexdigest()[:32]]
            conv_id, matched = (self.index.find([], hint) if hint else (None, 0))
            if conv_id is None and hint is None and isinstance(prompt, str):
                # no client key: the conversation whose last prompt this one continues, or repeats (also
                # after a restart: its stored chain is the prompt's hash)
                conv_id = self.texts.find(prompt) or self.index.find(chain, None)[0]
        else:
            return body, Pending(None, None, [], None, 0, True, path, stream)
        conv = self.conversations.get(conv_id) if conv_id else None
        if conv is not None and hint is not None and conv.hint != hint:
            if conv.hint is not None:  # found by its messages, but the client names another conversation
                conv = None
            else:  # a conversation the client names from now on
                conv.hint = hint
                self.index.add_hint(hint, conv.id)
        new = conv is None
        if conv is None:
            conv = Conversation(id=secrets.token_hex(6), setup=setup, hint=hint)
            self.conversations[conv.id] = conv
            if hint:
                self.index.add_hint(hint, conv.id)
        if path in TEXT_PATHS and isinstance(body.get("prompt"), str):
            prompt_tokens = self.texts.tokens(conv.id)  # what its last prompt came to: what a continuation reuses
            self.texts.note(conv.id, body["prompt"])
        else:
            prompt_tokens = None
        previous = list(conv.messages) if not new else None
        previous_body = self._remember(conv.id, body_seen)
        if own is not None and not self.steps_aside:  # what the client asked for wins: no lease, no pinning
            conv.messages, conv.chain = messages, chain
            tasks = None if self.router else await self._slot_tasks()  # a router's /slots are its children's
            return body, Pending(conv, None, messages, previous, 0 if new else conv.n_tokens, new, path, stream,
                                  body=body_seen, previous_body=previous_body, own=own, own_cause=own_cause,
                                  tasks_before=tasks,
                                  slots_before=self.leases.snapshot() if self.leases is not None else None)
        if self.steps_aside:  # the server keeps prompts itself: no pinning, no parks; judged all the same
            conv.messages, conv.chain = messages, chain
            return body, Pending(conv, None, messages, previous, 0 if new else conv.n_tokens, new, path, stream,
                                  body=body_seen, previous_body=previous_body)

        def estimate() -> int:  # only when a restore is weighed: from the texts' lengths (no serialising again)
            return max(1, sum(len(m.content) + len(m.reasoning) for m in messages) // CHARS_PER_TOKEN)
        held_before = conv.n_tokens  # what it held after its last reply, wherever that is now
        assert self.leases is not None
        # for the final check of a restore: messages that continue the request whose render (and answer) the
        # park holds prove the park's tokens are this request's own
        held = conv.park_chain
        proven = held is not None and chain[:len(held)] == held
        held: list[Callable[[], None]] = []  # run once the request is sent (``sent``)
        self._backend.requests[park_name(conv.id)] = RestoreFor(path, body_seen, proven, held.append)
        try:
            try:
                lease = await self.leases.acquire(conv, estimate)
            finally:
                self._backend.requests.pop(park_name(conv.id), None)
            if self.metrics is not None:
                self.metrics.lease_taken(conv.id)
            if self.watch is not None:
                await self.watch.before_dispatch()  # the server clears idle slots: the others are saved first
        except BaseException:  # not sent: what was held runs now (a restore's note, the journal's entries)
            self._run_held(Pending(conv, None, messages, previous, 0, new, path, stream, held=held))
            raise
        hazard = None
        if lease.restored_from:
            lease.restore_had_checkpoints = self._backend.checkpoints_loaded.get(lease.slot)
            hazard = self._backend.hazards.get(lease.slot)
        # what this request could have reused: what the conversation held after its last reply (a slot
        # taken meanwhile, a failed restore or a restart do not lower it: they are the causes said)
        expected = 0 if new else max(lease.slot_context.expected_tokens, held_before)
        if prompt_tokens is not None and not new:
            # a text prompt continues its last prompt, not always its generated text: that prompt is what
            # the server can reuse for sure (a HIT reuses at least that)
            expected = min(expected, prompt_tokens) if expected else prompt_tokens
        out = dict(body)
        out["id_slot"] = lease.slot
        out["cache_prompt"] = True
        conv.messages, conv.chain = messages, chain
        return out, Pending(conv, lease, messages, previous, expected, new, path, stream, body=body_seen,
                             previous_body=previous_body, restore_hazard=hazard, chain=chain, held=held)

    def _remember(self, conv_id: str, body: dict) -> dict | None:
        """Keep ``body`` as the conversation's last request; the one before it (None: not kept)."""
        previous = self._bodies.pop(conv_id, None)
        self._bodies[conv_id] = body
        while len(self._bodies) > BODIES_KEPT:
            self._bodies.popitem(last=False)
        return previous

    def _forks(self, conv_id: str, chain: list[str], messages: list[Message]) -> bool:
        """The request branches off ``conv_id``'s known history before its end (a client's "edit and
        resend", a branch of the chat): a fork, unless it only dropped old turns (client truncation)."""
        known = self.index.chain_of(conv_id) or []
        shared = next((i for i, (a, b) in enumerate(zip(chain, known)) if a != b), None)
        if shared is None:  # one is a prefix of the other: the same conversation, further on or again
            return False
        conv = self.conversations.get(conv_id)
        why = explain_mod.explain_messages(conv.messages, messages) if conv is not None else None
        return why is None or why.cause is not Cause.CLIENT_TRUNCATION

    async def after(self, ctx: object, result: Result) -> None:
        p = ctx
        assert isinstance(p, Pending)
        self._run_held(p)  # (never sent: not run yet)
        if self.metrics is not None and result.own_s is not None:
            self.metrics.observe_path(result.own_s, _path_turn(p))
        if p.conv is None:
            return
        if p.own is not None:
            try:
                return await self._after_own(p, result)
            finally:
                self._settled(p)
        if p.lease is None:
            return await self._after_passthrough(p, result)
        conv, lease = p.conv, p.lease
        t = answer_timings(result.final)
        self._note_prompt_tokens(p, t)
        ok = result.status == 200 and result.error is None
        n_tokens = None
        if t is not None and t.prompt_n is not None:
            n_tokens = (t.cache_n or 0) + t.prompt_n + (t.predicted_n or 0)
        if result.disconnected or n_tokens is None:
            n_tokens = await tokens_left(self.servers, self.target_id, lease.slot,
                                         streamed=p.stream)  # what a cut-short request left
        assert self.leases is not None
        # its slot holds its render (and answer) once the server processed its prompt there, and so will a park
        # of it (app.proxy.session_backend.RestoreFor); one that did not run there leaves that unknown
        conv.slot_chain = p.chain if ok and t is not None and t.prompt_n is not None else None
        self.leases.release(lease, n_tokens or 0, ok=ok and bool(n_tokens))
        if self.metrics is not None:
            self.metrics.lease_given_back()
        if self.watch is not None:
            self.watch.note_activity()
            await self.watch.check_cleared()  # did this request's task make the server clear idle slots?
        if ok or n_tokens is not None:  # a request that failed unseen (the server died): what it held before stays
            conv.n_tokens = n_tokens or 0
        if self.kv is not None and ok and t is not None and t.prompt_n is not None:
            route = "chat" if p.path in CHAT_PATHS else "text" if p.path in TEXT_PATHS else None
            self.kv.request_ended(conv.id, route, p.body, (t.cache_n or 0) + t.prompt_n)
        conv.last_used = time.time()
        conv.requests += 1
        self.index.add(conv.id, conv.chain)
        if t is None or not ok:
            self._save(conv)
            return
        expected = p.expected_reuse if not lease.restore_failed else 0
        # a request after a restore is judged against what the restore brought, as the resume watcher
        # judges the same query for the Sessions tab: one event, one verdict (a failed restore brought nothing)
        restored = bool(lease.restored_from) and not lease.restore_failed
        # A park that holds less than the conversation had (a server restart lost the turns after it)
        # is judged against what the conversation held: the request re-processed those turns
        # (SERVER_RESTARTED), however well the park itself was reused.
        brought = lease.slot_context.restored_tokens if restored else 0
        stale = restored and brought < p.expected_reuse - tolerance(p.expected_reuse)
        reusable = (p.expected_reuse if stale else brought) or p.expected_reuse
        verdict = judge(Reuse(reusable, t.cache_n, t.prompt_n, prompt_ms=t.prompt_ms, restored=restored,
                              new=p.new)).kind
        ctx_slot = explain_mod.SlotContext(
            # a conversation brought back from its park: what counts is what the restore brought
            taken_by=None if lease.restored_from else lease.taken_by,
            idle_cleared=lease.idle_cleared and not lease.restored_from,
            # a park restored after a restart that holds less than the slot held: the restart lost the rest
            restarted=lease.restarted and (not lease.restored_from or lease.slot_context.restored_tokens
                                           < p.expected_reuse - tolerance(p.expected_reuse)),
            slept=lease.slept and not lease.restored_from, restored_from=lease.restored_from,
            restore_had_checkpoints=lease.restore_had_checkpoints, restore_failed=lease.restore_failed,
            ram_tokens=lease.slot_context.ram_tokens, parked_as=conv.parked_as, avoided=lease.restore_avoided,
            hazard=p.restore_hazard)
        why = explain_mod.explain(verdict, p.previous, p.messages, ctx_slot, cache_n=t.cache_n,
                                  reusable=p.expected_reuse)
        if why is not None and why.cause in (Cause.TEMPLATE_CHANGED, Cause.UNKNOWN) and p.previous_body is not None \
                and p.body is not None and p.previous_body.get("tools") != p.body.get("tools"):
            why = explain_mod.tools_changed(why, p.previous_body.get("tools"), p.body.get("tools"))
        rate = self._prefill_ms_per_token()
        wasted = None
        if verdict in WASTEFUL and rate:
            wasted = max(0, expected - (t.cache_n or 0)) * rate
        rec = RequestRecord(at=p.started, conversation=conv.id, slot=lease.slot, path=p.path, stream=p.stream,
                            cache_n=t.cache_n, prompt_n=t.prompt_n, prompt_ms=t.prompt_ms, predicted_n=t.predicted_n,
                            expected_reuse=p.expected_reuse, verdict=verdict, explanation=why,
                            restored_from=lease.restored_from, wasted_ms=wasted)
        conv.last_verdict = verdict
        if verdict is VerdictKind.HIT and rate and t.cache_n:
            conv.time_saved_s += t.cache_n * rate / 1000.0
        self._save(conv)
        self.records.record(conv, rec, p)

    async def _after_passthrough(self, p: Pending, result: Result) -> None:
        """A request passed through unchanged (the server persists prompts itself): judged from its
        timings against what the conversation held after its last reply; nothing leased."""
        conv = p.conv
        assert conv is not None
        final = result.final or {}
        t = answer_timings(result.final)
        self._note_prompt_tokens(p, t)
        conv.last_used = time.time()
        conv.requests += 1
        self.index.add(conv.id, conv.chain)
        if t is None or result.status != 200 or result.error is not None or t.prompt_n is None:
            self._save(conv)
            return
        conv.n_tokens = (t.cache_n or 0) + t.prompt_n + (t.predicted_n or 0)
        verdict = judge(Reuse(p.expected_reuse, t.cache_n, t.prompt_n, prompt_ms=t.prompt_ms, new=p.new)).kind
        why = explain_mod.explain(verdict, p.previous, p.messages, explain_mod.SlotContext(), cache_n=t.cache_n,
                                  reusable=p.expected_reuse)
        slot = final.get("id_slot")
        rec = RequestRecord(at=p.started, conversation=conv.id, slot=slot if isinstance(slot, int) else None,
                            path=p.path, stream=p.stream, cache_n=t.cache_n, prompt_n=t.prompt_n,
                            prompt_ms=t.prompt_ms, predicted_n=t.predicted_n, expected_reuse=p.expected_reuse,
                            verdict=verdict, explanation=why)
        conv.last_verdict = verdict
        self._save(conv)
        self.records.record(conv, rec, p)

    async def _slot_tasks(self) -> dict[int, object] | None:
        """Each slot's ``id_task`` now (None: /slots could not be read)."""
        try:
            rows = await self.handle.client.slots()
        except (ServerError, ServerUnreachable) as e:
            log.info("cannot read /slots around a request passed through untouched: %s", e)
            return None
        return {r.get("id"): r.get("id_task") for r in rows if isinstance(r, dict)}

    async def _after_own(self, p: Pending, result: Result) -> None:
        """A request the client set its own slot or caching for, passed through untouched: the idle
        slots it ran in lose their conversations (the leases are told), and it is judged from its
        timings against what the conversation held, the client's choice given as the reason."""
        conv = p.conv
        assert conv is not None and p.own is not None
        after = None if self.router else await self._slot_tasks()
        ran = [i for i, task in (after or {}).items() if p.tasks_before is not None and task is not None
               and task != p.tasks_before.get(i)]
        final = result.final or {}
        t = answer_timings(result.final)
        self._note_prompt_tokens(p, t)
        judged = t is not None and result.status == 200 and result.error is None and t.prompt_n is not None
        # what it left in the one slot it ran in (a batch of prompts ran in several: not noted)
        left = (t.cache_n or 0) + (t.prompt_n or 0) + (t.predicted_n or 0) if judged and len(ran) == 1 else 0
        if self.leases is not None and p.tasks_before is not None and after is not None:
            before_views = {v.index: v for v in p.slots_before or []}
            for view in self.leases.snapshot():
                was = before_views.get(view.index)
                if after.get(view.index) != p.tasks_before.get(view.index) and was == view:
                    # a task ran there and the proxy's own leases did not touch the slot meanwhile
                    self.leases.note_slot_used_outside(view.index, OUTSIDE, conv_id=conv.id,
                                                       n_tokens=left if ran == [view.index] else 0)
        if self.watch is not None:
            self.watch.note_activity()
            await self.watch.check_cleared()  # its task too makes the server clear idle slots
        conv.last_used = time.time()
        conv.requests += 1
        self.index.add(conv.id, conv.chain)
        verdict = (judge(Reuse(p.expected_reuse, t.cache_n, t.prompt_n, prompt_ms=t.prompt_ms, new=p.new)).kind
                   if judged else VerdictKind.NEW)
        if judged and self.router:  # what the child's slot holds now: what its next turn can reuse
            conv.n_tokens = (t.cache_n or 0) + t.prompt_n + (t.predicted_n or 0)
        text = (f"The proxy passed this request through untouched: {p.own}. "
                + ("Its verdict is the child server's reuse." if self.router else "It leased no slot for it."))
        if not judged:
            text += " Not judged: " + ("the answer carried no single timings." if result.status == 200
                                       and result.error is None else f"it failed ({result.error}).")
        elif verdict in WASTEFUL:
            found = explain_mod.explain_messages(p.previous, p.messages) if p.previous is not None else None
            if found is not None and found.cause is not Cause.UNKNOWN:
                text += f" Also, {found.cause.value}: {found.detail}"
        slot = final.get("id_slot")
        if not (isinstance(slot, int) and slot >= 0):
            slot = ran[0] if len(ran) == 1 else None  # an OpenAI-style answer does not say: /slots does
        rec = RequestRecord(at=p.started, conversation=conv.id, slot=slot, path=p.path, stream=p.stream,
                            cache_n=t.cache_n if judged else None, prompt_n=t.prompt_n if judged else None,
                            prompt_ms=t.prompt_ms if judged else None,
                            predicted_n=t.predicted_n if judged else None, expected_reuse=p.expected_reuse,
                            verdict=verdict, explanation=Explanation(p.own_cause, text))
        if judged:
            conv.last_verdict = verdict
        self._save(conv)
        self.records.add(conv, rec)

    def _note_prompt_tokens(self, p: Pending, t: Timings | None) -> None:
        """A text prompt's size in tokens, as the server counted it: what its continuation can reuse."""
        if p.conv is not None and p.path in TEXT_PATHS and t is not None and t.prompt_n is not None:
            self.texts.set_tokens(p.conv.id, (t.cache_n or 0) + t.prompt_n)

    def _save(self, conv: Conversation) -> None:
        self.store.save(conv, self.profile)

    def _on_server_state(self, state, outcome) -> None:
        """The server process ended (killed, crashed, stopped): every slot is empty from now on, and
        the leases say so at once, not at the next request (a request cut off by it is explained by it).
        Ready again: the warm start runs again."""
        from app.core.states import ServerState

        if state in (ServerState.CRASHED, ServerState.STOPPED) and self.leases is not None \
                and self.http is not None and self._started_at is not None:
            self._started_at = None  # the next request's _check_restart does not reset a second time
            self.leases.note_server_restarted()
        elif state is ServerState.READY and self._started_at is None and self.leases is not None \
                and self.http is not None:
            # the server back (a crash and its auto-restart, a start from the window): its process is the
            # one the slots are of now, and the conversations used last come back as at the proxy's start
            self._started_at = self.handle.started_at
            if self.warm_start and not self.steps_aside:
                self.warming = track(self._warm(), f"proxy {self.target_id}: warm start after a restart")

    def _check_restart(self) -> None:
        """A new server process (a restart, a crash and auto-restart): no slot holds anything."""
        started = self.handle.started_at
        if self._started_at is not None and started is not None and started != self._started_at \
                and self.leases is not None:
            self.leases.note_server_restarted()
        self._started_at = started

    # -- the faces ------------------------------------------------------------------------------
    def list(self) -> list[Conversation]:
        return self.store.list(self.profile)

    async def forget(self, conv_id: str) -> Conversation | None:
        """Forget a conversation: its slot is erased, its park deleted, its records dropped."""
        self.conversations.pop(conv_id, None)
        self.index.forget(conv_id)
        self.texts.forget(conv_id)
        if self.leases is not None:
            gone = await self.leases.forget(conv_id)
            if self.kv is not None:
                self.kv.forgotten(conv_id)
            return gone
        return self.store.forget(conv_id)
