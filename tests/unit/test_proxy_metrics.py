"""The proxy's Prometheus families (app/proxy/metrics.py), parsed back with prometheus_client's own
text parser, and the Grafana dashboard in packaging/ asking only for families that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from app.proxy.metrics import ProxyMetrics
from app.core.conversation import Cause, Explanation, RequestRecord
from app.core.verdict import VerdictKind

DASHBOARD = Path(__file__).resolve().parents[2] / "packaging" / "grafana" / "kv-valet-cache-reuse.json"


def record(conv: str, verdict: VerdictKind, cache_n: int, prompt_n: int, expected: int,
           cause: Cause | None = None) -> RequestRecord:
    return RequestRecord(at=0.0, conversation=conv, slot=0, path="/v1/chat/completions", stream=False,
                         cache_n=cache_n, prompt_n=prompt_n, prompt_ms=1.0, predicted_n=2, expected_reuse=expected,
                         verdict=verdict, explanation=Explanation(cause, "") if cause else None)


def values(m: ProxyMetrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(m.exposition().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_requests_tokens_and_time_saved_by_conversation():
    m = ProxyMetrics("prof", prefill_ms_per_token=lambda: 2.0)
    m.observe_request(record("a", VerdictKind.NEW, 0, 100, 0))
    m.observe_request(record("a", VerdictKind.HIT, 100, 10, 102))
    m.observe_request(record("b", VerdictKind.MISS, 0, 300, 280, Cause.SLOT_TAKEN))
    v = values(m)
    lab = lambda **kw: tuple(sorted({"server": "prof", **kw}.items()))  # noqa: E731
    assert v[("kvvalet_proxy_requests_total", lab(conversation="a", verdict="HIT", cause="NONE"))] == 1
    assert v[("kvvalet_proxy_requests_total", lab(conversation="b", verdict="MISS", cause="SLOT_TAKEN"))] == 1
    assert v[("kvvalet_proxy_tokens_reused_total", lab(conversation="a"))] == 100
    assert v[("kvvalet_proxy_tokens_processed_total", lab(conversation="a"))] == 110
    assert v[("kvvalet_proxy_tokens_reprocessed_total", lab(conversation="b"))] == 280
    assert v[("kvvalet_proxy_time_saved_seconds_total", lab(conversation="a"))] == 0.2  # 100 tokens at 2 ms
    assert ("kvvalet_proxy_time_saved_seconds_total", lab(conversation="b")) not in v


def test_parks_restores_and_leases():
    m = ProxyMetrics("prof")
    m.observe_park("a", 0.2, 1000, ok=True)
    m.observe_park("a", 0.0, 0, ok=False)
    m.observe_restore("a", 0.03, 1000, ok=True)
    m.lease_taken("a")
    m.lease_taken("b")
    m.lease_given_back()
    v = values(m)
    lab = lambda **kw: tuple(sorted({"server": "prof", **kw}.items()))  # noqa: E731
    assert v[("kvvalet_proxy_parks_total", lab(conversation="a", outcome="ok"))] == 1
    assert v[("kvvalet_proxy_parks_total", lab(conversation="a", outcome="failed"))] == 1
    assert v[("kvvalet_proxy_park_bytes_total", lab(conversation="a"))] == 1000
    assert v[("kvvalet_proxy_park_seconds_count", lab())] == 1  # a failed park is not timed
    assert v[("kvvalet_proxy_restore_seconds_sum", lab())] == 0.03
    assert v[("kvvalet_proxy_slot_leases_total", lab(conversation="b"))] == 1
    assert v[("kvvalet_proxy_slot_leases_active", lab())] == 1


def test_the_dashboard_asks_for_families_that_exist():
    m = ProxyMetrics("prof", prefill_ms_per_token=lambda: 1.0)
    m.observe_request(record("a", VerdictKind.MISS, 0, 300, 280, Cause.SLOT_TAKEN))
    m.observe_request(record("a", VerdictKind.HIT, 300, 3, 300))
    m.observe_park("a", 0.1, 1, ok=True)
    m.observe_restore("a", 0.1, 1, ok=True)
    m.lease_taken("a")
    names = {name for name, _ in values(m)}
    dash = json.loads(DASHBOARD.read_text())
    asked = {n for p in dash["panels"] for t in p["targets"] for n in re.findall(r"kvvalet_[a-z_]+", t["expr"])}
    assert asked and asked <= names, asked - names
