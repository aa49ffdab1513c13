"""Cache reuse in Prometheus (issue #29 item 5): what llama-server's own ``/metrics`` lacks.

llama-server exports prompt and generation totals but no cache-reuse counters (upstream PR #25328
was closed). The proxy knows, per request, what it reused and why it did not: each
:class:`ProxyMetrics` holds one server's families in its own registry, fed by the proxy's request
records (the same records the Conversations tab shows, so the two agree), its parks, restores and
slot leases. :meth:`ProxyMetrics.exposition` is the text format; on the proxy's port ``GET /metrics``
serves the server's own metrics unchanged (when it runs with ``--metrics``) followed by these.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from app.core.conversation import RequestRecord
from app.core.verdict import WASTEFUL, VerdictKind

_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ProxyMetrics:
    """One server's cache-reuse families (label ``server``: the profile's name)."""

    def __init__(self, server: str, prefill_ms_per_token: Callable[[], float | None] = lambda: None):
        self.server = server
        self._rate = prefill_ms_per_token
        self.registry = r = CollectorRegistry(auto_describe=True)
        conv = ("server", "conversation")
        # the verdict label takes the one judge's words; DIFFERS (output differs from a cold prefill) is a
        # check's, never a proxied request's (the proxy runs no output check)
        self.requests = Counter("kvvalet_proxy_requests", "Requests through the proxy, by verdict and cause",
                                (*conv, "verdict", "cause"), registry=r)
        self.tokens_reused = Counter("kvvalet_proxy_tokens_reused", "Prompt tokens the server reused (cache_n)",
                                     conv, registry=r)
        self.tokens_processed = Counter("kvvalet_proxy_tokens_processed",
                                        "Prompt tokens the server processed (prompt_n)", conv, registry=r)
        self.tokens_wasted = Counter("kvvalet_proxy_tokens_reprocessed",
                                     "Prompt tokens re-processed that the slot held and could have reused",
                                     conv, registry=r)
        self.time_saved = Counter("kvvalet_proxy_time_saved_seconds",
                                  "Prompt processing the hits skipped, at the server's measured prefill rate",
                                  conv, registry=r)
        self.parks = Counter("kvvalet_proxy_parks", "Conversations saved from their slot to disk",
                             (*conv, "outcome"), registry=r)
        self.restores = Counter("kvvalet_proxy_restores", "Conversations restored from disk into a slot",
                                (*conv, "outcome"), registry=r)
        self.park_bytes = Counter("kvvalet_proxy_park_bytes", "Bytes written by parks", conv, registry=r)
        self.restore_bytes = Counter("kvvalet_proxy_restore_bytes", "Bytes read by restores", conv, registry=r)
        self.park_seconds = Histogram("kvvalet_proxy_park_seconds", "How long a park took", ("server",),
                                      buckets=_SECONDS, registry=r)
        self.restore_seconds = Histogram("kvvalet_proxy_restore_seconds", "How long a restore took", ("server",),
                                         buckets=_SECONDS, registry=r)
        self.leases = Counter("kvvalet_proxy_slot_leases", "Slot leases given to requests", conv, registry=r)
        self.leases_active = Gauge("kvvalet_proxy_slot_leases_active", "Slot leases held now", ("server",),
                                   registry=r)
        self.leases_active.labels(server).set(0)

    def observe_request(self, rec: RequestRecord) -> None:
        """One judged request, as the proxy recorded it."""
        conv = rec.conversation or ""
        cause = rec.explanation.cause.name if rec.explanation is not None else "NONE"
        self.requests.labels(self.server, conv, rec.verdict.value, cause).inc()
        if rec.cache_n:
            self.tokens_reused.labels(self.server, conv).inc(rec.cache_n)
        if rec.prompt_n:
            self.tokens_processed.labels(self.server, conv).inc(rec.prompt_n)
        if rec.verdict in WASTEFUL:
            lost = max(0, rec.expected_reuse - (rec.cache_n or 0))
            if lost:
                self.tokens_wasted.labels(self.server, conv).inc(lost)
        rate = self._rate()
        if rec.verdict is VerdictKind.HIT and rate and rec.cache_n:
            self.time_saved.labels(self.server, conv).inc(rec.cache_n * rate / 1000.0)

    def observe_park(self, conversation: str, seconds: float, n_bytes: int, ok: bool) -> None:
        self.parks.labels(self.server, conversation, "ok" if ok else "failed").inc()
        if ok:
            self.park_seconds.labels(self.server).observe(seconds)
            self.park_bytes.labels(self.server, conversation).inc(n_bytes)

    def observe_restore(self, conversation: str, seconds: float, n_bytes: int, ok: bool) -> None:
        self.restores.labels(self.server, conversation, "ok" if ok else "failed").inc()
        if ok:
            self.restore_seconds.labels(self.server).observe(seconds)
            self.restore_bytes.labels(self.server, conversation).inc(n_bytes)

    def lease_taken(self, conversation: str) -> None:
        self.leases.labels(self.server, conversation).inc()
        self.leases_active.labels(self.server).inc()

    def lease_given_back(self) -> None:
        self.leases_active.labels(self.server).dec()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
