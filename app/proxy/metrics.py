"""Cache reuse in Prometheus (issue #29 item 5): what llama-server's own ``/metrics`` lacks.

llama-server exports prompt and generation totals but no cache-reuse counters (upstream PR #25328
was closed). The proxy knows, per request, what it reused and why it did not: each
:class:`ProxyMetrics` holds one server's families in its own registry, fed by the proxy's request
records (the same records the Conversations tab shows, so the two agree), its parks, restores and
slot leases. :meth:`ProxyMetrics.exposition` is the text format; on the proxy's port ``GET /metrics``
serves the server's own metrics unchanged (when it runs with ``--metrics``) followed by these.

**What a gateway reads (issue #38).** Routers that pick a model server from Prometheus (the Kubernetes
Gateway API inference extension's endpoint picker, llm-d's scheduler on top of it) read vLLM's names,
which llama-server does not export. The proxy exports them with vLLM's types and labels (``model_name``:
the model's name as llama-server serves it in ``/v1/models``, its alias or file; ``engine``: ``"0"``, one
engine behind each proxy), beside KV Valet's own ``kvvalet_proxy_*`` families:

* ``vllm:num_requests_running`` (gauge): completion requests the proxy has sent to the server whose
  answer has not ended. A request llama-server would run but the proxy passes on raw (``/infill``,
  ``/v1/embeddings``) is not counted.
* ``vllm:num_requests_waiting`` (gauge): completion requests the proxy holds before sending them: waiting
  for a slot lease (every slot busy), behind the park that frees a slot or the restore that brings a
  conversation back, or behind a request just ended whose effect on the slots is being read. The
  server's own queue is its ``llamacpp:requests_deferred``, in the same scrape; behind the proxy's leases
  it stays at zero for the proxy's requests (each is pinned to a slot no other request holds).
* ``vllm:kv_cache_usage_perc`` (gauge, a fraction in [0, 1], as vLLM's despite the name): tokens held in
  the server's slots over the KV cells they share (:func:`kv_usage`).
* ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` (counters, exposed as ``..._total``): prompt
  tokens looked up per request (``cache_n + prompt_n`` of the server's own timings) and the ones found in
  the slot (``cache_n``), from the same request records as ``kvvalet_proxy_tokens_*``: hits never exceed
  queries, and hits / queries is the token hit rate vLLM's dashboards plot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily

from app.core.conversation import RequestRecord
from app.core.verdict import WASTEFUL, VerdictKind
from app.proxy.http import ProxyServer
from app.proxy.lease_table import SlotState, SlotView
from app.proxy.leases import SlotLeases

_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: the proxy's own time on a request's path: a millisecond or two on a turn that keeps its slot
_OWN_SECONDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
#: ``turn`` label of ``kvvalet_proxy_path_seconds``: the conversation kept its slot; a park was restored
#: into the slot first; it got another slot (free, or taken from a conversation, parked first when it had
#: changed); the request went through without a lease (the client chose its slot, a router, a server
#: that keeps prompts itself)
PATH_TURNS = ("kept", "restored", "other_slot", "no_lease")
#: vLLM's labels on its engine families (vllm/v1/metrics/loggers.py): the served model, the engine's index
VLLM_LABELS = ("model_name", "engine")


@dataclass(frozen=True)
class Load:
    """What the proxy holds now, read at each scrape (nothing is sampled in between)."""

    running: int = 0  # completion requests at the server (sent, their answer not ended)
    waiting: int = 0  # completion requests the proxy holds before sending them
    kv_usage: float | None = None  # in [0, 1]; None: the proxy keeps no picture of the slots


def served_model_name(props: Mapping) -> str:
    """The model's name as llama-server serves it (``/v1/models``' id): its alias, else its file's path."""
    return str(props.get("model_alias") or props.get("model_path") or "")


def kv_usage(views: Iterable[SlotView], outside: Mapping[int, tuple[str, int]], n_ctx: Sequence[int],
             unified: bool) -> float | None:
    """Tokens held in the server's slots over the KV cells they have, in [0, 1] (None: no slot's size known).

    **The source is the leases' picture of the slots** (:meth:`SlotLeases.snapshot`), not a read of
    ``/slots`` at each scrape. The picture is the server's own figures: each slot's count is set at the end
    of each request from its timings (``cache_n + prompt_n + predicted_n``, what the slot holds after the
    answer) or from a restore's ``n_restored``, and emptied when the slot is given to another conversation,
    the server restarts or sleeps, idle-slot caching clears it (the watch reads ``/slots`` after a request
    to see that) or a request the proxy passed through untouched runs there; the prompt such a request
    leaves in a slot the proxy holds free is counted too (``outside``). A ``/slots`` read per scrape would
    be fresher during a request, but a gateway scrapes every 50 ms (the endpoint picker's default), and
    each read is a task in the server's queue whose result restarts the quiet second in which llama-server
    notices a non-streamed client that went away (see ``CUT_SHORT_QUIET_EVERY_S`` in
    :mod:`app.proxy.session_backend`): reads that often would keep an abandoned generation running. The picture
    costs nothing and never touches the server. Its one lag: a slot in
    use counts what it held when its request began (the conversation it kept, the park restored into it,
    nothing for a new one) until the answer says what it holds.

    **An idle slot's tokens count as used**, unlike vLLM, which counts a finished request's cached blocks
    as free (evictable at no cost): llama.cpp keeps a finished conversation in its slot's cells, and
    another conversation gets them only after the proxy has parked it (a save to disk first).

    **The cells**: each slot's ``n_ctx`` as ``/slots`` gave it at start. With a unified KV buffer
    (``--kv-unified``, or the slot count left to the server) every slot reports the whole buffer and they
    share it: the cells are the largest ``n_ctx``; else each slot has its own: their sum. A slot's count
    is capped at its ``n_ctx``."""
    sizes = [max(0, int(n or 0)) for n in n_ctx]
    cells = (max(sizes, default=0) if unified else sum(sizes))
    if cells <= 0:
        return None
    held = 0
    for v in views:
        n = v.n_tokens
        if v.state is SlotState.FREE:
            n = outside.get(v.index, ("", 0))[1]
        if 0 <= v.index < len(sizes):
            held += min(max(0, n), sizes[v.index])
    return min(1.0, held / cells)


def proxy_load(http: ProxyServer | None, leases: SlotLeases | None, n_ctx: Sequence[int], unified: bool) -> Load:
    """The proxy's load now: its HTTP layer's requests held and sent, and the leases' slots (``leases``
    None: no picture of the slots, as for a router or a server that persists prompts itself)."""
    usage = kv_usage(leases.snapshot(), leases.outside_prompts(), n_ctx, unified) if leases is not None else None
    return Load(running=http.running if http is not None else 0, waiting=http.waiting if http is not None else 0,
                kv_usage=usage)


class _GatewayGauges:
    """vLLM's three gauges, read from ``load()`` when scraped."""

    def __init__(self, load: Callable[[], Load], labels: tuple[str, str]):
        self._load, self._labels = load, list(labels)

    def describe(self):
        return self._families(Load())

    def collect(self):
        return self._families(self._load())

    def _families(self, now: Load) -> list[GaugeMetricFamily]:
        running = GaugeMetricFamily("vllm:num_requests_running", "Completion requests at the server (sent by "
                                    "the proxy, their answer not ended)", labels=VLLM_LABELS)
        running.add_metric(self._labels, now.running)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Completion requests the proxy holds before "
                                    "sending them (a slot lease, a park or restore)", labels=VLLM_LABELS)
        waiting.add_metric(self._labels, now.waiting)
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage: tokens held in the slots over "
                                  "their cells. 1 means 100 percent usage.", labels=VLLM_LABELS)
        if now.kv_usage is not None:
            usage.add_metric(self._labels, now.kv_usage)
        return [running, waiting, usage]


class ProxyMetrics:
    """One server's cache-reuse families (label ``server``: the profile's name), and the gateway's under
    vLLM's names (``model_name``: ``model_name``; ``load``: read at each scrape)."""

    def __init__(self, server: str, prefill_ms_per_token: Callable[[], float | None] = lambda: None, *,
                 model_name: str = "", load: Callable[[], Load] = Load):
        self.server = server
        self._rate = prefill_ms_per_token
        self.registry = r = CollectorRegistry(auto_describe=True)
        # what a gateway reads, under vLLM's names and labels (see the module's doc)
        vllm = (model_name, "0")
        r.register(_GatewayGauges(load, vllm))
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number "
                                      "of queried tokens (cache_n + prompt_n)", VLLM_LABELS, registry=r).labels(*vllm)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                                   "tokens (cache_n)", VLLM_LABELS, registry=r).labels(*vllm)
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
        self.path_seconds = Histogram(
            "kvvalet_proxy_path_seconds", "The proxy's own time on a completion request's path: from its arrival "
            "to its sending upstream, and from the server's answer to its first bytes at the client (a park "
            "or restore on the path counts)", ("server", "turn"), buckets=_OWN_SECONDS, registry=r)
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
        if rec.prompt_n is not None:  # judged from the server's timings: the tokens it looked up, and found
            self.prefix_queries.inc((rec.cache_n or 0) + rec.prompt_n)
            self.prefix_hits.inc(rec.cache_n or 0)
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

    def observe_path(self, seconds: float, turn: str) -> None:
        """One request's own time on the path (``Result.own_s``); ``turn``: one of :data:`PATH_TURNS`."""
        self.path_seconds.labels(self.server, turn).observe(seconds)

    def lease_taken(self, conversation: str) -> None:
        self.leases.labels(self.server, conversation).inc()
        self.leases_active.labels(self.server).inc()

    def lease_given_back(self) -> None:
        self.leases_active.labels(self.server).dec()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
