"""The conversation proxy of one server: identity, slot leases, judgment, in one place.

``kv-valet serve PROFILE --proxy`` and the window's proxy switch are faces of this class.
It sits on a server of :class:`app.jobs.server_service.ServerService` (its one HTTP client,
its session service for parks and restores) and is the HTTP layer's interceptor
(:class:`app.proxy.http.ProxyServer`): before a chat request it finds the conversation
(:mod:`app.proxy.identity`), leases it a slot (:mod:`app.proxy.leases`: restored from its
park when it comes back to a slot another conversation used) and pins the request there
(``id_slot``); after it, it judges the request from the server's own timings and, when it
re-processed more than it had to, says why (:mod:`app.proxy.explain`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

from app.core.timings import Timings
from app.jobs.server_service import ServerHandle, ServerService
from app.proxy import explain as explain_mod
from app.proxy import identity
from app.proxy.http import ProxyServer, Result
from app.proxy.leases import Lease, SlotLeases
from app.proxy.model import Conversation, Message, RequestRecord, RequestVerdict
from app.store.conversations import ConversationStore

log = logging.getLogger(__name__)

CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")
TEXT_PATHS = ("/v1/completions", "/completions", "/completion")
#: Characters per token when a request's size must be guessed before the server tokenises it.
CHARS_PER_TOKEN = 4


class SessionBackend:
    """The leases' slot operations through the server's session service: a conversation's park
    is a catalog session (``proxy-<id>``), private like every park."""

    def __init__(self, handle: ServerHandle, servers: ServerService):
        self.handle, self.servers = handle, servers
        self.checkpoints_loaded: dict[int, bool | None] = {}

    async def _svc(self):
        return await self.servers.sessions(self.handle.id)

    async def save(self, slot: int, name: str) -> int:
        result = await (await self._svc()).park(slot, name)
        return result.record.n_tokens if result.record is not None else 0

    async def restore(self, slot: int, name: str) -> int:
        result = await (await self._svc()).resume(name, slot, force=True)
        # did the restore bring context checkpoints back (a sidecar this build loads)? None: not known
        # or not needed (a dense model keeps every position)
        self.checkpoints_loaded[slot] = result.prediction.loads if result.prediction is not None else None
        return result.n_restored

    async def erase(self, slot: int) -> None:
        await self.handle.client.erase_slot(slot)

    def parked_size(self, name: str) -> int:
        svc = self.handle.sessions
        rec = svc.catalog.get(svc.profile_name, name) if svc is not None else None
        return (rec.state_size + rec.sidecar_size) if rec is not None else 0

    def delete_park(self, name: str) -> None:
        svc = self.handle.sessions
        if svc is not None:
            svc.delete(name)


@dataclass
class _Pending:
    conv: Conversation | None
    lease: Lease | None
    messages: list[Message]
    previous: list[Message] | None
    expected_reuse: int
    new: bool
    path: str
    stream: bool
    started: float = field(default_factory=time.time)


class ProxyService:
    def __init__(self, servers: ServerService, target_id: str, *, store: ConversationStore | None = None,
                 disk_budget_bytes: int | None = None):
        self.servers = servers
        self.target_id = target_id
        self.store = store if store is not None else ConversationStore()
        self._owns_store = store is None
        self.disk_budget_bytes = disk_budget_bytes
        self.index = identity.ConversationIndex()
        self.conversations: dict[str, Conversation] = {}
        self.leases: SlotLeases | None = None
        self.http: ProxyServer | None = None
        self.setup = ""
        self._started_at: float | None = None
        self._record_cbs: list[Callable[[RequestRecord], None]] = []
        self._stopped = False

    # -- life --------------------------------------------------------------------------
    @property
    def handle(self) -> ServerHandle:
        h = self.servers.get(self.target_id)
        if h is None:
            raise RuntimeError(f"no server {self.target_id}")
        return h

    @property
    def profile(self) -> str:
        h = self.handle
        return h.profile.name if h.profile is not None else h.url

    async def start(self, host: str, port: int, *, api_key: str | None = None) -> str:
        """Read the serving setup, recover the conversations, listen on ``host:port``."""
        h = self.handle
        props = await h.client.props()
        slots = await h.client.slots()
        p = h.profile
        self.setup = identity.setup_fingerprint(
            model_id=str(props.get("model_path") or ""), cache_type_k=(p.cache_type_k if p else "") or "f16",
            cache_type_v=(p.cache_type_v if p else "") or "f16", flash_attn=(p.flash_attn if p else "") or "auto",
            swa_full=bool(p.swa_full) if p else False, chat_template=str(props.get("chat_template") or ""))
        for conv in self.store.list(self.profile):
            if conv.setup == self.setup:
                self.conversations[conv.id] = conv
                self.index.add(conv.id, conv.chain)
                if conv.hint:
                    self.index.add_hint(conv.hint, conv.id)
        self._started_at = h.started_at
        self._backend = SessionBackend(h, self.servers)
        self.leases = SlotLeases(len(slots), self._backend, store=self.store,
                                 profile=self.profile, prefill_ms_per_token=self._prefill_ms_per_token,
                                 restore_ms_estimate=self._restore_ms, disk_budget_bytes=self.disk_budget_bytes)
        self.leases.recover(server_same_process=False)
        self.http = ProxyServer(h.client, interceptor=self, api_key=api_key)
        await self.http.start(host, port)
        return self.http.url

    async def stop(self) -> None:
        if self.http is not None:
            await self.http.stop()
            self.http = None
        if self._owns_store and not self._stopped:
            self.store.close()
        self._stopped = True

    async def park_before_stop(self) -> None:
        """Save every slot a conversation used since its last save (the server is about to stop)."""
        if self.leases is not None:
            await self.leases.save_dirty()

    def on_record(self, cb: Callable[[RequestRecord], None]) -> None:
        self._record_cbs.append(cb)

    # -- what the leases need to decide ------------------------------------------------------
    def _prefill_ms_per_token(self) -> float | None:
        rate = self.servers.catalog.prefill_rate(self.profile)  # tokens per second, measured
        return 1000.0 / rate if rate else None

    def _restore_ms(self, n_tokens: int) -> float:
        # restores read the state file: about 2 GB/s from the page cache, and a fixed cost
        return 20.0 + n_tokens * 0.01

    # -- the interceptor -----------------------------------------------------------------------
    async def before(self, path: str, headers: Mapping[str, str], body: dict) -> tuple[dict, object]:
        self._check_restart()
        hint = identity.hint_from(headers, body)
        stream = bool(body.get("stream"))
        if path in CHAT_PATHS and isinstance(body.get("messages"), list):
            messages = identity.normalise(body["messages"])
            chain = identity.chain(self.setup, messages)
            key = chain[:identity.cut_at_last_assistant(messages)]
            conv_id, matched = self.index.find(key, hint) if key or hint else (None, 0)
        elif path in TEXT_PATHS:
            prompt = body.get("prompt")
            text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
            messages = [Message("prompt", text)]
            chain = [hashlib.sha256(f"{self.setup}\0{text}".encode()).hexdigest()[:32]]
            conv_id, matched = (self.index.find([], hint) if hint else (None, 0))
        else:
            return body, _Pending(None, None, [], None, 0, True, path, stream)
        conv = self.conversations.get(conv_id) if conv_id else None
        new = conv is None
        if conv is None:
            conv = Conversation(id=secrets.token_hex(6), setup=self.setup, hint=hint)
            self.conversations[conv.id] = conv
            if hint:
                self.index.add_hint(hint, conv.id)
        previous = list(conv.messages) if not new else None
        estimate = max(1, len(json.dumps(body.get("messages") or body.get("prompt") or "")) // CHARS_PER_TOKEN)
        held_before = conv.n_tokens  # what it held after its last reply, wherever that is now
        assert self.leases is not None
        lease = await self.leases.acquire(conv, estimate)
        if lease.restored_from:
            lease.restore_had_checkpoints = self._backend.checkpoints_loaded.get(lease.slot)
        # what this request could have reused: what the conversation held after its last reply (a slot
        # taken meanwhile, a failed restore or a restart do not lower it: they are the causes said)
        expected = 0 if new else max(lease.slot_context.expected_tokens, held_before)
        out = dict(body)
        out["id_slot"] = lease.slot
        out["cache_prompt"] = True
        conv.messages, conv.chain = messages, chain
        return out, _Pending(conv, lease, messages, previous, expected, new, path, stream)

    async def after(self, ctx: object, result: Result) -> None:
        p = ctx
        assert isinstance(p, _Pending)
        if p.conv is None or p.lease is None:
            return
        conv, lease = p.conv, p.lease
        t = Timings.from_json((result.final or {}).get("timings")) if result.final else None
        ok = result.status == 200 and result.error is None
        n_tokens = None
        if t is not None and t.prompt_n is not None:
            n_tokens = (t.cache_n or 0) + t.prompt_n + (t.predicted_n or 0)
        if result.disconnected or n_tokens is None:
            n_tokens = await self._tokens_in(lease.slot)  # what the server kept of a cut-short request
        assert self.leases is not None
        self.leases.release(lease, n_tokens or 0, ok=ok and bool(n_tokens))
        conv.n_tokens = n_tokens or 0
        conv.last_used = time.time()
        conv.requests += 1
        self.index.add(conv.id, conv.chain)
        if t is None or not ok:
            self._save(conv)
            return
        expected = p.expected_reuse if not lease.restore_failed else 0
        verdict = explain_mod.judge(t.cache_n, t.prompt_n, p.expected_reuse, new=p.new)
        ctx_slot = explain_mod.SlotContext(
            # a conversation brought back from its park: what counts is what the restore brought
            taken_by=None if lease.restored_from else lease.taken_by,
            idle_cleared=lease.idle_cleared and not lease.restored_from,
            restarted=lease.restarted and not lease.restored_from,
            slept=lease.slept and not lease.restored_from, restored_from=lease.restored_from,
            restore_had_checkpoints=lease.restore_had_checkpoints, restore_failed=lease.restore_failed)
        why = explain_mod.explain(verdict, p.previous, p.messages, ctx_slot)
        rate = self._prefill_ms_per_token()
        wasted = None
        if verdict in (RequestVerdict.PARTIAL, RequestVerdict.MISS) and rate:
            wasted = max(0, expected - (t.cache_n or 0)) * rate
        rec = RequestRecord(at=p.started, conversation=conv.id, slot=lease.slot, path=p.path, stream=p.stream,
                            cache_n=t.cache_n, prompt_n=t.prompt_n, prompt_ms=t.prompt_ms, predicted_n=t.predicted_n,
                            expected_reuse=p.expected_reuse, verdict=verdict, explanation=why,
                            restored_from=lease.restored_from, wasted_ms=wasted)
        conv.last_verdict = verdict
        if verdict is RequestVerdict.HIT and rate and t.cache_n:
            conv.time_saved_s += t.cache_n * rate / 1000.0
        self._save(conv)
        self.store.add_request(conv.id, rec)
        for cb in list(self._record_cbs):
            try:
                cb(rec)
            except Exception:  # why: an observer (the window, serve's printer) must not break the proxy
                log.exception("a proxy record observer failed for conversation %s", conv.id)

    def _save(self, conv: Conversation) -> None:
        self.store.save(conv, self.profile)

    async def _tokens_in(self, slot: int) -> int | None:
        try:
            svc = await self.servers.sessions(self.target_id)
            rows = await svc.slot_rows()
        except Exception:  # report: the slot's content is unknown: the lease frees it
            log.warning("cannot read /slots after a cut-short request on slot %s", slot, exc_info=True)
            return None
        row = next((r for r in rows if r.id == slot), None)
        return row.tokens_held if row is not None else None

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
        if self.leases is not None:
            return await self.leases.forget(conv_id)
        return self.store.forget(conv_id)



async def launch_with_proxy(servers: ServerService, profile) -> tuple[ServerHandle | None, ProxyService | None]:
    """Launch ``profile``'s server, behind the conversation proxy when the profile says so
    (``proxy = true``) : the proxy takes the profile's host and port, the server a private
    loopback port; the proxy's conversations are saved under their own names before any stop.
    The one launch path of the window and ``kv-valet serve``."""
    if not profile.proxy:
        return await servers.launch(profile), None
    from app.jobs.server_service import free_loopback_port
    from app.server.launcher import resolve_api_key

    behind = profile.replace(host="127.0.0.1", port=free_loopback_port())
    handle = await servers.launch(behind)
    if handle is None:
        return None, None
    proxy = ProxyService(servers, handle.id)
    await proxy.start(profile.host.split(",")[0].strip() or "127.0.0.1", profile.port,
                      api_key=resolve_api_key(profile))
    handle.before_park.append(proxy.park_before_stop)
    handle.proxy = proxy
    from app.jobs.server_service import Notice, ProxyChanged

    servers._emit(ProxyChanged(handle.id, proxy))
    servers._emit(Notice(handle.id, f"Conversation proxy at {proxy.http.url}: clients talk to it; the server "
                                    f"listens on {handle.url} (loopback only)."))
    return handle, proxy


def forget_stored(conv_id: str, store: ConversationStore | None = None):
    """Forget a conversation no running proxy holds: its records, and its park (a catalog session).
    Returns (the conversation or None, the files deleted). The CLI's and the window's forget."""
    from app import paths
    from app.jobs.sessions import delete_session
    from app.store.catalog import Catalog, CatalogError

    own = store is None
    store = store if store is not None else ConversationStore()
    try:
        conv = store.get(conv_id)
        if conv is None:
            return None, []
        profile = store.profile_of(conv_id)
        store.forget(conv_id)
    finally:
        if own:
            store.close()
    removed = []
    if conv.parked_as and profile:
        with Catalog(paths.catalog_path()) as catalog:
            try:
                removed = delete_session(catalog, conv.parked_as, profile)
            except CatalogError:
                removed = []  # its park was deleted already
    return conv, removed
