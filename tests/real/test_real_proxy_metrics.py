"""Cache reuse in Prometheus on the real server (issue #29 item 5): after a run with more
conversations than slots, ``GET /metrics`` on the proxy's port serves llama-server's own metrics
unchanged, then KV Valet's; parsed with prometheus_client's own text parser, its counters match the
proxy's request records of the same run, and its parks and restores what the run did."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.real.sidecar_bin import sidecar_server_bin  # noqa: F401  (fixture)
from tests.real.test_real_proxy import SYSTEMS, Proxied, rotate, turn

pytestmark = pytest.mark.real_server


def samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def test_metrics_match_the_request_records(real_profile, sidecar_server_bin, monkeypatch):
    # the v2 sidecar build: a restore of Gemma 3 pays there, so the proxy restores (the stock build's would not)
    monkeypatch.setenv("KVV_SIDECAR_MODE", "v2")
    profile = real_profile.replace(name="sidecar", server_binary=str(sidecar_server_bin), proxy=True, metrics=True)

    async def go():
        async with Proxied(profile) as p:
            await rotate(p)  # A, B, C on two slots, then A back from its park
            # a client that names its chat, then edits its system prompt: a miss with its cause
            reply, _ = await p.ask(turn(SYSTEMS["B"], question="What is the last word?"), user="chat-m")
            _, edited = await p.ask(turn("Be brief. " + SYSTEMS["B"], ("What is the last word?", reply),
                                         question="And the first?"), user="chat-m")
            assert edited.explanation is not None
            async with httpx.AsyncClient(timeout=60) as h:
                direct = (await h.get(p.handle.client.base_url + "/metrics")).text
                r = await h.get(p.proxy.http.url + "/metrics")
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
            assert any(k == b"Process-Start-Time-Unix" for k, _ in r.headers.raw)  # the server's headers, its case
            text = r.text
            # the server's own families first, unchanged (values move between two scrapes: names compared)
            theirs = [line.split(" ")[0] for line in direct.splitlines() if line and not line.startswith("#")]
            head = [line.split(" ")[0] for line in text.splitlines()[:len(direct.splitlines())]
                    if line and not line.startswith("#")]
            assert theirs and head == theirs and theirs[0].startswith("llamacpp:")
            got = samples(text)
            records = [rec for conv in p.proxy.list() for rec in p.proxy.store.requests(conv.id)]
            assert len(records) == 7
            by_verdict = Counter(rec.verdict.value for rec in records)
            scraped = Counter()
            for s in got["kvvalet_proxy_requests_total"]:
                assert s.labels["server"] == p.profile.name
                scraped[s.labels["verdict"]] += int(s.value)
            assert scraped == by_verdict
            causes = Counter(rec.explanation.cause.name for rec in records if rec.explanation is not None)
            scraped_causes = Counter()
            for s in got["kvvalet_proxy_requests_total"]:
                if s.labels["cause"] != "NONE":
                    scraped_causes[s.labels["cause"]] += int(s.value)
            assert scraped_causes == causes and causes  # the edited chat said why it re-processed
            assert sum(s.value for s in got["kvvalet_proxy_tokens_reused_total"]) == \
                sum(rec.cache_n or 0 for rec in records)
            assert sum(s.value for s in got["kvvalet_proxy_tokens_processed_total"]) == \
                sum(rec.prompt_n or 0 for rec in records)
            per_conv = Counter()
            for s in got["kvvalet_proxy_requests_total"]:
                per_conv[s.labels["conversation"]] += int(s.value)
            assert per_conv == Counter(rec.conversation for rec in records)
            # A was parked to make room for C, and restored when it came back
            parks = [s for s in got["kvvalet_proxy_parks_total"] if s.labels["outcome"] == "ok"]
            restores = [s for s in got["kvvalet_proxy_restores_total"] if s.labels["outcome"] == "ok"]
            assert sum(s.value for s in parks) >= 1 and sum(s.value for s in restores) == 1
            assert sum(s.value for s in got["kvvalet_proxy_park_bytes_total"]) > 0
            assert sum(s.value for s in got["kvvalet_proxy_restore_bytes_total"]) > 0
            [count] = [s for s in got["kvvalet_proxy_restore_seconds_count"]]
            assert count.value == 1
            assert sum(s.value for s in got["kvvalet_proxy_slot_leases_total"]) == len(records)
            [active] = got["kvvalet_proxy_slot_leases_active"]
            assert active.value == 0

    asyncio.run(go())
