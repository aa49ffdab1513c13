"""Cache reuse in Prometheus on the real server (issue #29 item 5): after a run with more
conversations than slots, ``GET /metrics`` on the proxy's port serves llama-server's own metrics
unchanged, then KV Valet's; parsed with prometheus_client's own text parser, its counters match the
proxy's request records of the same run, and its parks and restores what the run did.

The five series a gateway reads under vLLM's names (issue #38), at ``/metrics`` and ``/kv-valet/metrics``
alike, agree with the answers the client got (prefix-cache queries and hits: the prompt tokens and the
cached ones each answer's ``timings`` reported) and with what the server itself says its slots hold
(``/slots``, read directly); a request held while its slot lease is given is waiting, then neither."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.monitor.slots import slot_rows
from tests.real.sidecar_bin import sidecar_server_bin  # noqa: F401  (fixture)
from tests.real.test_real_proxy import SYSTEMS, Proxied, rotate, turn

pytestmark = pytest.mark.real_server


def samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def vllm_series(text: str) -> dict[str, float]:
    """The five series a gateway reads, each one sample labelled as vLLM labels it."""
    out = {}
    for name, got in samples(text).items():
        if name.startswith("vllm:") and not name.endswith("_created"):
            [s] = got
            assert set(s.labels) == {"model_name", "engine"} and s.labels["engine"] == "0", s
            out[name] = s.value
    return out


def test_metrics_match_the_request_records(real_profile, sidecar_server_bin, monkeypatch):
    # the v2 sidecar build: a restore of Gemma 3 pays there, so the proxy restores (the stock build's would not)
    monkeypatch.setenv("KVV_SIDECAR_MODE", "v2")
    profile = real_profile.replace(name="sidecar", server_binary=str(sidecar_server_bin), proxy=True, metrics=True)

    async def go():
        async with Proxied(profile) as p:
            answers: list[dict] = []  # each chat answer as the client got it (its "timings")

            async def keep(resp: httpx.Response) -> None:
                if resp.request.url.path.endswith("/chat/completions"):
                    await resp.aread()
                    answers.append(resp.json())

            await p.client.close()
            p.client = openai.AsyncOpenAI(base_url=p.proxy.http.url + "/v1", api_key="not-needed",
                                          http_client=httpx.AsyncClient(timeout=120, event_hooks={"response": [keep]}))
            await rotate(p)  # A, B, C on two slots, then A back from its park
            # a client that names its chat, then edits its system prompt: a miss with its cause
            reply, _ = await p.ask(turn(SYSTEMS["B"], question="What is the last word?"), user="chat-m")
            _, edited = await p.ask(turn("Be brief. " + SYSTEMS["B"], ("What is the last word?", reply),
                                         question="And the first?"), user="chat-m")
            assert edited.explanation is not None
            # the park ahead that follows an answer may still run: it corrects its slot's count by the
            # answer's last token (never in the KV cache), which would move the usage between two scrapes
            await p.proxy.settle()
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
            # A was parked to make room for C, and restored when it came back (and the conversations parked
            # ahead between requests may come back from those parks): one restore per restored request
            restored = sum(1 for rec in records if rec.restored_from)
            parks = [s for s in got["kvvalet_proxy_parks_total"] if s.labels["outcome"] == "ok"]
            restores = [s for s in got["kvvalet_proxy_restores_total"] if s.labels["outcome"] == "ok"]
            assert sum(s.value for s in parks) >= 1 and sum(s.value for s in restores) == restored >= 1
            assert sum(s.value for s in got["kvvalet_proxy_park_bytes_total"]) > 0
            assert sum(s.value for s in got["kvvalet_proxy_restore_bytes_total"]) > 0
            [count] = [s for s in got["kvvalet_proxy_restore_seconds_count"]]
            assert count.value == restored
            assert sum(s.value for s in got["kvvalet_proxy_slot_leases_total"]) == len(records)
            [active] = got["kvvalet_proxy_slot_leases_active"]
            assert active.value == 0
            # the proxy's own time on each request's path, by how it got its slot: one per request, the restore's
            path = {c.labels["turn"]: c.value for c in got["kvvalet_proxy_path_seconds_count"]}
            assert sum(path.values()) == len(records) and set(path) <= {"kept", "restored", "other_slot"}
            assert path["restored"] == restored and path["kept"] >= 1
            assert 0 < sum(c.value for c in got["kvvalet_proxy_path_seconds_sum"])

            # -- the gateway's five, under vLLM's names: the same at /metrics and at /kv-valet/metrics
            async with httpx.AsyncClient(timeout=60) as h:
                own = (await h.get(p.proxy.http.url + "/kv-valet/metrics")).text
                held = await h.get(p.handle.client.base_url + "/slots")
            gw, gw_own = vllm_series(text), vllm_series(own)
            assert gw == gw_own and set(gw) == {
                "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"}
            [s] = got["vllm:prefix_cache_queries_total"]
            assert s.labels["model_name"] == (await p.handle.client.props())["model_alias"]
            timings = [a["timings"] for a in answers]
            assert len(timings) == len(records)
            queries = sum(t["cache_n"] + t["prompt_n"] for t in timings)
            hits = sum(t["cache_n"] for t in timings)
            assert gw["vllm:prefix_cache_queries_total"] == queries
            assert gw["vllm:prefix_cache_hits_total"] == hits and 0 < hits <= queries
            assert gw["vllm:num_requests_running"] == gw["vllm:num_requests_waiting"] == 0
            # what the server says its slots hold, over their contexts (two slots of their own: no -kvu)
            rows = slot_rows(held.json())
            in_slots = sum(r.tokens_held or 0 for r in rows) / sum(r.n_ctx for r in rows)
            assert 0 < gw["vllm:kv_cache_usage_perc"] <= 1
            assert abs(gw["vllm:kv_cache_usage_perc"] - in_slots) * sum(r.n_ctx for r in rows) <= len(rows), \
                (gw, [r.tokens_held for r in rows], p.proxy.leases.snapshot())

            # a request held while the leases find it a slot is waiting, not running; then neither
            entered, go_on = asyncio.Event(), asyncio.Event()
            acquire = p.proxy.leases.acquire

            async def held_back(conv, tokens):
                entered.set()
                await go_on.wait()
                return await acquire(conv, tokens)

            monkeypatch.setattr(p.proxy.leases, "acquire", held_back)
            asked = asyncio.create_task(p.ask([{"role": "user", "content": "Say hi."}]))
            await asyncio.wait_for(entered.wait(), 60)
            now = vllm_series(p.proxy.metrics.exposition().decode())
            assert (now["vllm:num_requests_waiting"], now["vllm:num_requests_running"]) == (1, 0)
            go_on.set()
            await asyncio.wait_for(asked, 120)
            after = vllm_series(p.proxy.metrics.exposition().decode())
            assert (after["vllm:num_requests_waiting"], after["vllm:num_requests_running"]) == (0, 0)
            last = answers[-1]["timings"]
            assert after["vllm:prefix_cache_queries_total"] == queries + last["cache_n"] + last["prompt_n"]

    asyncio.run(go())
