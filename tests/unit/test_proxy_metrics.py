"""The proxy's Prometheus families (app/proxy/metrics.py), parsed back with prometheus_client's own
text parser: KV Valet's own, and the five a gateway reads under vLLM's names (fed by request records
and real slot leases on an in-memory backend); the Grafana dashboard in packaging/ asking only for
families that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from app.proxy.lease_table import SlotState, SlotView
from app.proxy.metrics import ProxyMetrics, kv_usage, proxy_load
from app.core.conversation import Cause, Conversation, Explanation, RequestRecord
from app.core.verdict import VerdictKind
from tests.unit.test_proxy_leases import FakeBackend, make, turn

DASHBOARD = Path(__file__).resolve().parents[2] / "packaging" / "grafana" / "kv-valet-cache-reuse.json"


def record(conv: str, verdict: VerdictKind, cache_n: int | None, prompt_n: int | None, expected: int,
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


# -- what a gateway reads: vLLM's names (issue #38) ----------------------------------------------

def families(m: ProxyMetrics) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(m.exposition().decode())}


def vllm(v: dict, name: str, model: str = "gemma.gguf") -> float | None:
    return v.get((name, (("engine", "0"), ("model_name", model))))


async def test_the_five_vllm_series_follow_the_requests_and_the_slots():
    be = FakeBackend()
    leases = make(2, backend=be)
    http = SimpleNamespace(running=0, waiting=0)  # the HTTP layer's counts (counted in tests/fake_server)
    m = ProxyMetrics("prof", model_name="gemma.gguf", load=lambda: proxy_load(http, leases, [2048, 2048], False))
    v = values(m)
    # every series there from the start, at zero, as vLLM's
    assert vllm(v, "vllm:num_requests_running") == vllm(v, "vllm:num_requests_waiting") == 0
    assert vllm(v, "vllm:kv_cache_usage_perc") == 0.0
    assert vllm(v, "vllm:prefix_cache_queries_total") == vllm(v, "vllm:prefix_cache_hits_total") == 0
    fam = families(m)
    assert fam["vllm:prefix_cache_queries"].type == fam["vllm:prefix_cache_hits"].type == "counter"
    assert {fam[n].type for n in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                  "vllm:kv_cache_usage_perc")} == {"gauge"}

    a, b = Conversation(id="A", setup="s"), Conversation(id="B", setup="s")
    await turn(leases, be, a, 700)  # A's slot holds 700 of its 2,048
    lease_b = await leases.acquire(b, 50)  # B's request runs: its slot holds nothing known yet
    http.running, http.waiting = 1, 2
    m.observe_request(record("a", VerdictKind.NEW, 0, 690, 0))
    m.observe_request(record("a", VerdictKind.HIT, 690, 12, 700))
    m.observe_request(record("b", VerdictKind.MISS, 0, 300, 280, Cause.SLOT_TAKEN))
    m.observe_request(record("c", VerdictKind.NEW, None, None, 0))  # not judged: no timings, no lookup counted
    v = values(m)
    assert vllm(v, "vllm:num_requests_running") == 1 and vllm(v, "vllm:num_requests_waiting") == 2
    assert vllm(v, "vllm:kv_cache_usage_perc") == 700 / 4096
    queries, hits = vllm(v, "vllm:prefix_cache_queries_total"), vllm(v, "vllm:prefix_cache_hits_total")
    assert (queries, hits) == (690 + 702 + 300, 690) and hits <= queries
    # the same tokens as KV Valet's own families, which stay
    assert vllm(v, "vllm:prefix_cache_hits_total") == sum(
        val for (name, _), val in v.items() if name == "kvvalet_proxy_tokens_reused_total")

    leases.release(lease_b, 3000, ok=True)  # more than a slot holds: capped at its n_ctx
    http.running = http.waiting = 0
    v = values(m)
    assert vllm(v, "vllm:kv_cache_usage_perc") == (700 + 2048) / 4096
    assert vllm(v, "vllm:num_requests_running") == vllm(v, "vllm:num_requests_waiting") == 0
    # one KV buffer shared by both slots (each reports all of it): the cells are counted once
    shared = ProxyMetrics("prof", model_name="gemma.gguf",
                          load=lambda: proxy_load(http, leases, [4096, 4096], True))
    assert vllm(values(shared), "vllm:kv_cache_usage_perc") == (700 + 3000) / 4096
    leases.note_server_restarted()  # every slot empty
    assert vllm(values(m), "vllm:kv_cache_usage_perc") == 0.0
    # a request passed through untouched left its prompt in a slot the proxy holds free: counted
    leases.note_slot_used_outside(1, "outside", conv_id="x", n_tokens=400)
    assert vllm(values(m), "vllm:kv_cache_usage_perc") == 400 / 4096


def test_without_a_picture_of_the_slots_the_usage_is_left_out_not_zero():
    # a router (no leases), or a server that persists prompts itself: the proxy does not know what is held
    m = ProxyMetrics("prof", model_name="m", load=lambda: proxy_load(SimpleNamespace(running=3, waiting=0), None,
                                                                     [], False))
    v = values(m)
    assert vllm(v, "vllm:kv_cache_usage_perc", "m") is None and "vllm:kv_cache_usage_perc" in families(m)
    assert vllm(v, "vllm:num_requests_running", "m") == 3


def test_usage_stays_a_fraction_whatever_the_slots_say():
    views = [SlotView(0, SlotState.IDLE_DIRTY, "a", 10**6, None, None),
             SlotView(1, SlotState.BUSY, "b", -5, None, None),
             SlotView(7, SlotState.IDLE_CLEAN, "c", 100, None, None)]  # a slot /slots did not list
    assert kv_usage(views, {}, [1024, 1024], False) == 0.5
    assert kv_usage(views, {}, [1024, 1024], True) == 1.0
    assert kv_usage(views, {}, [], False) is None and kv_usage(views, {}, [0], True) is None
