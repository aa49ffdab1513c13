"""What the server service and the faces call the proxy through from outside a running one: the front
the server service puts before a server whose profile says ``proxy = true`` (:class:`ProxyFront`,
which also saves a leftover server's leased conversations) and forgetting a conversation no running
proxy holds (:func:`forget_stored`).
"""

from __future__ import annotations

import logging

from app.proxy.leases import SlotLeases, recover_leases
from app.proxy.service import ProxyService
from app.proxy.session_backend import SessionBackend
from app.servers.service import ServerHandle, ServerService
from app.sessions.journal import Recovery
from app.store.conversations import ConversationStore

log = logging.getLogger(__name__)


class ProxyFront:
    """The conversation proxy as the front the server service puts before a server whose profile says
    ``proxy = true`` (:class:`app.servers.launch.Front`): the window and ``kv-valet serve`` give it to
    their :class:`ServerService`; :func:`app.servers.launch.launch_profile` decides the rest."""

    def __init__(self, kv_events: str | None = None) -> None:
        self.kv_events = kv_events  # a ZMQ endpoint for the proxy's KV events (None: off; app.proxy.kv_follow)

    async def start(self, servers: ServerService, handle: ServerHandle, host: str, port: int,
                    api_key: str | None, *, slots_endpoint: bool = True) -> ProxyService:
        from app.settings import load_or_defaults

        prefs, _problem = load_or_defaults()  # a broken settings file is said by the window and `settings`
        proxy = ProxyService(servers, handle.id, disk_budget_bytes=prefs.proxy_disk_budget_bytes(),
                             save_before_idle_clear=prefs.proxy_save_before_idle_clear, kv_events=self.kv_events,
                             warm_start=prefs.proxy_warm_start, park_ahead=prefs.proxy_park_ahead)
        await proxy.start(host, port, api_key=api_key, slots_endpoint=slots_endpoint)
        return proxy

    async def save_leftover(self, servers: ServerService, handle: ServerHandle, profile, rec) -> list[str]:
        """The proxy's conversations in a leftover server's slots, saved under their own names (none
        when the lease journal was not written by a proxy in front of this very server process)."""
        store = ConversationStore()
        try:
            entries = store.journal_entries(profile.name)
            if not entries or min(e.at for e in entries) < rec.create_time:
                return []  # the journal predates this server process: it says nothing about its slots
            from app.settings import load_or_defaults

            prefs, _problem = load_or_defaults()
            slots = await handle.client.slots()
            backend = SessionBackend.here(handle, servers)
            backend.disk_budget_bytes = prefs.proxy_disk_budget_bytes()
            leases = SlotLeases(len(slots), backend, store=store, profile=profile.name,
                                prefill_ms_per_token=lambda: None, restore_ms_estimate=lambda n: 0.0,
                                disk_budget_bytes=prefs.proxy_disk_budget_bytes())
            for msg in recover_leases(Recovery(subject=leases, same_process=True)):
                log.info("proxy of %s after a crash: %s", profile.name, msg)
            return await leases.save_dirty()
        finally:
            store.close()


def forget_stored(conv_id: str, store: ConversationStore | None = None):
    """Forget a conversation no running proxy holds: its records, and its park (a catalog session).
    Returns (the conversation or None, the files deleted). The CLI's and the window's forget."""
    from app import paths
    from app.sessions.records import delete_session
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
