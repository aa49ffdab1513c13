"""Load check: gap statistics and stall detection on synthetic timestamps, the loopback
refusal, bounds, and a short run against an in-process streaming transport."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx
import pytest

from app.cli.errors import CliError
from app.tools.loadcheck import (LoadCheckError, StreamRecorder, build_report, check_loopback, gap_series,
                                percentile, run_load_check, stream_prompt, to_json, to_markdown)
from app.server.client import LlamaClient


# --------------------------------------------------------------------------- statistics

def test_percentile_interpolates_between_ranks():
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert percentile([1, 2, 3, 4], 0) == 1 and percentile([1, 2, 3, 4], 100) == 4
    values = list(range(1, 101))
    assert percentile(values, 50) == pytest.approx(50.5) and percentile(values, 99) == pytest.approx(99.01)


def feed(rec: StreamRecorder, t0: float, requests: list[tuple[float, list[float]]]) -> None:
    """Each request: (start, token arrival times), seconds after t0."""
    for start, arrivals in requests:
        rec.start_request(t0 + start)
        for t in arrivals:
            rec.token(t0 + t)
        rec.end_request()


def test_gaps_are_within_a_request_and_stalls_are_found():
    t0 = 1000.0
    rec = StreamRecorder(0, t0, stall_ms=500)
    feed(rec, t0, [
        (0.0, [0.05, 0.06, 0.07, 0.67, 0.68]),  # a 600 ms gap starting at 0.07 s
        (0.70, [1.70, 1.71]),  # 1 s to the first token: a TTFT, not a gap, not a stall
    ])
    s = rec.stats()
    assert s.requests == 2 and s.tokens == 7
    assert s.n_gaps == 5  # 4 in the first request, 1 in the second, none across them
    assert sorted(round(g) for g in s.gap_ms) == [10, 10, 10, 10, 600]
    assert s.gap_p50_ms == pytest.approx(10.0)
    assert s.gap_max_ms == pytest.approx(600.0)
    assert 10.0 < s.gap_p99_ms < 600.0
    assert len(s.stalls) == 1
    offset, gap = s.stalls[0]
    assert offset == pytest.approx(0.07) and gap == pytest.approx(600.0)
    assert sorted(round(x) for x in rec.ttft_ms) == [50, 1000]
    assert s.ttft_max_ms == pytest.approx(1000.0)
    assert s.gap_p50_ms <= s.gap_p99_ms <= s.gap_max_ms


def test_threshold_is_strictly_above_and_an_unfinished_request_keeps_its_gaps():
    t0 = 0.0
    rec = StreamRecorder(3, t0, stall_ms=100)
    rec.start_request(0.0)
    for t in (0.1, 0.2, 0.2 + 0.1001, 0.5):  # gaps 100, ~100.1, ~199.9 ms
        rec.token(t)
    # cancelled at the deadline: no end_request; the next request starts fresh
    rec.start_request(0.6)
    rec.token(5.0)  # 4.4 s TTFT: not a stall
    s = rec.stats()
    assert [round(g, 1) for g in s.gap_ms] == [100.0, 100.1, 199.9]
    assert [round(g, 1) for _, g in s.stalls] == [100.1, 199.9]
    assert s.requests == 2 and s.tokens == 5


def test_a_stall_still_open_at_the_end_counts_as_a_lower_bound():
    t0 = 0.0
    rec = StreamRecorder(0, t0, stall_ms=500)
    rec.start_request(0.0)
    rec.token(0.1)
    rec.token(0.12)
    rec.finish(1.0)  # the deadline came 880 ms after the last token, the request still in flight
    s = rec.stats()
    assert s.open_stall and len(s.stalls) == 1
    assert s.stalls[0] == (pytest.approx(0.12), pytest.approx(880.0))
    assert s.gap_max_ms == pytest.approx(880.0) and s.n_gaps == 2

    quiet = StreamRecorder(1, t0, stall_ms=500)
    quiet.start_request(0.0)
    quiet.token(0.1)
    quiet.token(0.12)
    quiet.finish(0.2)  # an ordinary gap in progress at the end: left out
    waiting = StreamRecorder(2, t0, stall_ms=500)
    waiting.start_request(0.0)
    waiting.finish(3.0)  # no first token yet: a queue wait, not a gap
    for st in (quiet.stats(), waiting.stats()):
        assert not st.open_stall and st.stalls == [] and st.n_gaps == (1 if st.stream == 1 else 0)

    r = build_report([rec, quiet, waiting], url="http://127.0.0.1:1", started_at=0.0, seconds=1, elapsed_s=1,
                     stall_ms=500, n_predict=64)
    assert "stream 0 at 0.12 s: at least 880 ms (still open at the end)" in to_markdown(r)
    assert json.loads(to_json(r))["per_stream"][0]["stalls"] == [{"t_offset_s": 0.12, "gap_ms": 880.0,
                                                                   "open": True}]


def test_one_event_with_several_tokens_is_one_arrival():
    rec = StreamRecorder(0, 0.0, stall_ms=500)
    rec.start_request(0.0)
    rec.token(0.1, count=3)
    rec.token(0.2, count=2)
    s = rec.stats()
    assert s.tokens == 5 and s.n_gaps == 1 and s.gap_max_ms == pytest.approx(100.0)


def test_empty_stream_has_no_figures():
    s = StreamRecorder(0, 0.0, 500).stats()
    assert (s.gap_p50_ms, s.gap_p99_ms, s.gap_max_ms, s.stalls) == (None, None, None, [])


def test_report_pools_every_gap_and_exports():
    t0 = 0.0
    a, b = StreamRecorder(0, t0, 500), StreamRecorder(1, t0, 500)
    feed(a, t0, [(0.0, [0.1 + 0.02 * i for i in range(50)])])  # 49 gaps of 20 ms
    feed(b, t0, [(0.0, [0.1, 0.12, 1.32, 1.34])])  # 20, 1200 (a stall), 20
    r = build_report([a, b], url="http://127.0.0.1:8080", started_at=time.time(), seconds=2.0, elapsed_s=2.0,
                     stall_ms=500, n_predict=64)
    assert r.tokens == 54 and r.requests == 2 and r.tokens_per_s == pytest.approx(27.0)
    assert r.gap_p50_ms == pytest.approx(20.0) and r.gap_max_ms == pytest.approx(1200.0)
    assert r.gap_p50_ms <= r.gap_p99_ms <= r.gap_max_ms
    assert r.n_stalls == 1 and r.stalls == [(1, pytest.approx(0.12), pytest.approx(1200.0))]
    data = json.loads(to_json(r))
    assert data["totals"]["stalls"] == 1 and data["totals"]["tokens"] == 54
    assert [s["tokens"] for s in data["per_stream"]] == [50, 4]
    assert data["per_stream"][1]["stalls"] == [{"t_offset_s": 0.12, "gap_ms": 1200.0, "open": False}]
    assert "gap_t" not in json.dumps(data)
    md = to_markdown(r)
    assert "| 1 | 1 | 4 | 20.0 | " in md and "| 1,200.0 | 1 |" in md
    assert "stream 1 at 0.12 s: 1,200 ms" in md and "| **all** | 2 | 54 |" in md
    series = gap_series(r.per_stream[1], 2.0, 4)  # slices of 0.5 s: gaps start at 0.1, 0.12, 1.32
    assert series == [(0.25, pytest.approx(1200.0)), (1.25, pytest.approx(20.0))]


# --------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("url", ["http://127.0.0.1:8080", "http://127.3.2.1:1", "http://localhost:8080",
                                 "http://LOCALHOST", "http://[::1]:8080", "http://[::ffff:127.0.0.1]:80"])
def test_loopback_urls_are_accepted(url):
    check_loopback(url)


@pytest.mark.parametrize("url", ["http://10.0.0.5:8080", "http://192.168.1.2:8080", "http://example.com:8080",
                                 "http://0.0.0.0:8080", "http://[::]:8080", "http://128.0.0.1", "http://",
                                 "http://localhost.example.com"])
def test_other_hosts_are_refused(url):
    with pytest.raises(LoadCheckError):
        check_loopback(url)


async def test_run_refuses_a_remote_server_before_sending_anything():
    sent = []
    transport = httpx.MockTransport(lambda req: sent.append(req) or httpx.Response(200, json={"status": "ok"}))
    async with LlamaClient("http://192.168.1.20:8080", transport=transport) as client:
        with pytest.raises(LoadCheckError, match="only against a server on this machine"):
            await run_load_check(client, streams=2, seconds=1)
    assert sent == []


@pytest.mark.parametrize("kw", [dict(streams=0), dict(streams=65), dict(seconds=0.5), dict(seconds=601),
                                dict(stall_ms=0), dict(n_predict=0)])
async def test_bounds_are_refused(kw):
    args = dict(streams=2, seconds=1) | kw
    async with LlamaClient("http://127.0.0.1:9") as client:
        with pytest.raises(LoadCheckError):
            await run_load_check(client, **args)


async def test_a_server_that_does_not_answer_is_a_clear_error():
    transport = httpx.MockTransport(lambda req: (_ for _ in ()).throw(httpx.ConnectError("Connection refused")))
    async with LlamaClient("http://127.0.0.1:9", transport=transport) as client:
        with pytest.raises(LoadCheckError, match="not ready"):
            await run_load_check(client, streams=1, seconds=1)


# --------------------------------------------------------------------------- a run on an in-process server

class StreamingServer:
    """A tiny /completion with "stream": true: one SSE event every ``interval`` s; stream 1
    pauses ``stall_s`` once after its third token. Records bodies and closed streams;
    ``flowing`` is set once ``streams`` prompts each had a token taken by the client."""

    def __init__(self, interval=0.02, stall_s=0.45, streams=None):
        self.interval, self.stall_s = interval, stall_s
        self.bodies: list[dict] = []
        self.closed = 0
        self.finished = 0
        self._stalled = False
        self._stalled_over = False
        self.streams = streams
        self.taken: set[str] = set()  # prompts whose first token the client has read
        self.flowing = asyncio.Event()
        self.measured = asyncio.Event()  # the stall is over and every prompt was sent twice

    async def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        body = json.loads(request.content)
        self.bodies.append(body)
        sent = [b["prompt"] for b in self.bodies]
        if (self._stalled_over and self.streams is not None
                and len({p for p in sent if sent.count(p) >= 2}) >= self.streams):
            self.measured.set()

        async def events():
            try:
                for i in range(body["n_predict"]):
                    if i == 1:  # the client asks for more only once it has read the first token
                        self.taken.add(body["prompt"])
                        if self.streams is not None and len(self.taken) >= self.streams:
                            self.flowing.set()
                    await asyncio.sleep(self.interval)
                    if i == 3 and "Stream 1." in body["prompt"] and not self._stalled:
                        self._stalled = True
                        await asyncio.sleep(self.stall_s)
                        self._stalled_over = True
                    ev = {"content": f" t{i}", "tokens": [i], "stop": False}
                    yield f"data: {json.dumps(ev)}\n\n".encode()
                yield b'data: {"content": "", "tokens": [], "stop": true, "timings": {}}\n\n'
                self.finished += 1
            finally:
                self.closed += 1

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())


async def test_a_run_measures_every_stream_and_the_injected_stall():
    # The run is the longest a load check may be (600 s) and is cancelled by an event: once the
    # stalled stream's pause is over and every stream has sent a second request (no time budget);
    # wait_for is a failure guard.
    server = StreamingServer(streams=3)
    cancel = asyncio.Event()
    progress = []

    async def cancel_when_measured():
        await server.measured.wait()
        cancel.set()

    async with LlamaClient("http://127.0.0.1:8080", transport=httpx.MockTransport(server.handler)) as client:
        canceller = asyncio.ensure_future(cancel_when_measured())
        try:
            r = await asyncio.wait_for(run_load_check(client, streams=3, seconds=600, stall_ms=300, n_predict=8,
                                                      cancel=cancel,
                                                      on_progress=lambda f, n: progress.append((f, n))), 60)
        finally:
            canceller.cancel()
    assert r.cancelled and r.streams == 3 and [s.stream for s in r.per_stream] == [0, 1, 2]
    assert all(s.tokens >= 8 and s.requests >= 2 for s in r.per_stream)  # back to back: each finished one
    assert all(s.gap_p50_ms <= s.gap_p99_ms <= s.gap_max_ms for s in r.per_stream)
    # the pause is a stall of stream 1 at least as long as the server slept, and only stream 1 paused
    assert any(g >= server.stall_s * 1000 - 10 for _, g in r.per_stream[1].stalls)  # 10 ms: the loop's timer slack
    assert r.n_stalls >= 1 and r.n_errors == 0
    # every request: id_slot -1, cache_prompt, streamed, a prompt of its own stream
    assert {(b["id_slot"], b["cache_prompt"], b["stream"]) for b in server.bodies} == {(-1, True, True)}
    assert {b["prompt"] for b in server.bodies} == {stream_prompt(i) for i in range(3)}
    # the requests in flight at the end were dropped, none left open
    assert server.closed == len(server.bodies) and server.finished < len(server.bodies)
    assert progress[-1][0] == 1.0 and progress[-1][1] == r.tokens
    assert [f for f, _ in progress] == sorted(f for f, _ in progress)


async def test_a_run_ends_at_its_deadline_or_at_the_last_streams_first_token():
    # How soon after its deadline the run returns is a figure of tests/bench/bench_loadcheck.py
    # (--in-process); here the measured span is the run, cut at its deadline, or later when a
    # stream had no token by then (a busy machine): never a stream measured with nothing.
    server = StreamingServer(interval=0.05)
    async with LlamaClient("http://127.0.0.1:8080", transport=httpx.MockTransport(server.handler)) as client:
        r = await asyncio.wait_for(run_load_check(client, streams=2, seconds=1, n_predict=1000), 60)
    assert all(s.tokens > 0 and s.first_token_s is not None for s in r.per_stream)
    assert r.elapsed_s == pytest.approx(max(1.0, *(s.first_token_s for s in r.per_stream)))
    assert not r.cancelled and server.finished == 0 and server.closed == len(server.bodies)


async def test_a_stream_without_a_token_at_the_deadline_keeps_the_run_going_until_it_has_one():
    # stream 1's server holds its first request until the run's own clock has passed the deadline
    # (the progress it reports reaches 1.0): an event, not a sleep
    server = StreamingServer(interval=0.01)
    past_deadline = asyncio.Event()

    async def handler(request):
        if request.url.path != "/health" and "Stream 1." in json.loads(request.content)["prompt"]:
            await past_deadline.wait()
        return await server.handler(request)

    def on_progress(fraction, tokens):
        if fraction >= 1.0:
            past_deadline.set()

    async with LlamaClient("http://127.0.0.1:8080", transport=httpx.MockTransport(handler)) as client:
        r = await asyncio.wait_for(run_load_check(client, streams=2, seconds=1, n_predict=4,
                                                  on_progress=on_progress), 60)
    late = r.per_stream[1]
    assert late.tokens > 0 and late.first_token_s > 1.0 and r.elapsed_s == pytest.approx(late.first_token_s)
    assert r.per_stream[0].tokens > 0 and not r.cancelled


async def test_cancel_stops_the_run_early():
    # cancelled once every stream has a token (an event, not a timer); a run of 600 s (the most
    # a load check may run) that returns within the failure guard's 60 s has stopped early
    server = StreamingServer(interval=0.05, streams=2)
    cancel = asyncio.Event()

    async def cancel_when_flowing():
        await server.flowing.wait()
        cancel.set()

    async with LlamaClient("http://127.0.0.1:8080", transport=httpx.MockTransport(server.handler)) as client:
        canceller = asyncio.ensure_future(cancel_when_flowing())
        try:
            r = await asyncio.wait_for(run_load_check(client, streams=2, seconds=600, n_predict=1000,
                                                      cancel=cancel), 60)
        finally:
            canceller.cancel()
    assert r.cancelled  # ended by the cancel (the run was 600 s long)
    assert all(s.tokens > 0 for s in r.per_stream)
    assert server.closed == len(server.bodies) == 2 and server.finished == 0


async def test_a_stale_keep_alive_connection_is_asked_again_not_counted_as_an_error():
    """The server closed a pooled connection just as it was reused: nothing was generated."""
    server = StreamingServer(interval=0.01)
    dropped = []

    async def handler(request):
        if request.url.path != "/health":
            prompt = json.loads(request.content)["prompt"]
            if prompt not in dropped:  # each stream's first request meets a closed connection
                dropped.append(prompt)
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.",
                                                request=request)
        return await server.handler(request)

    async with LlamaClient("http://127.0.0.1:8080", transport=httpx.MockTransport(handler)) as client:
        r = await run_load_check(client, streams=2, seconds=1, n_predict=4)
    assert len(dropped) == 2 and r.n_errors == 0 and all(s.tokens > 0 for s in r.per_stream)


async def test_server_errors_are_counted_and_an_all_failed_run_raises():
    async def handler(request):
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        return httpx.Response(503, json={"error": {"code": 503, "message": "Loading model",
                                                   "type": "unavailable_error"}})

    async with LlamaClient("http://127.0.0.1:8080", transport=httpx.MockTransport(handler)) as client:
        with pytest.raises(LoadCheckError, match="no token came back.*Loading model"):
            await run_load_check(client, streams=2, seconds=1)


async def test_an_error_event_in_the_stream_is_a_server_error():
    from app.server.client import ServerError

    async def handler(request):
        async def events():
            yield b'data: {"content": "a", "tokens": [1], "stop": false}\n\n'
            yield b'error: {"code": 500, "message": "boom", "type": "server_error"}\n\n'
        return httpx.Response(200, content=events())

    async with LlamaClient("http://127.0.0.1:8080", transport=httpx.MockTransport(handler)) as client:
        seen = []
        with pytest.raises(ServerError, match="boom"):
            async for ev in client.stream_completion("x", n_predict=2):
                seen.append(ev)
    assert seen == [{"content": "a", "tokens": [1], "stop": False}]


# --------------------------------------------------------------------------- the command line

def parser():
    from app.cli import loadcheck

    p = argparse.ArgumentParser(prog="kv-valet")
    loadcheck.add_commands(p.add_subparsers(dest="command"))
    return p


def test_cli_arguments_and_bounds(capsys):
    a = parser().parse_args(["loadcheck", "http://127.0.0.1:8080", "--streams", "4", "--seconds", "6"])
    assert (a.streams, a.seconds, a.stall_ms, a.n_predict, a.json) == (4, 6.0, 500.0, 64, False)
    for bad in (["--streams", "65", "--seconds", "5"], ["--streams", "2", "--seconds", "0.5"],
                ["--streams", "2"], ["--streams", "2", "--seconds", "5", "--api-key", "k"]):
        with pytest.raises(SystemExit) as e:
            parser().parse_args(["loadcheck", "http://127.0.0.1:8080", *bad])
        assert e.value.code == 2


def test_cli_refuses_a_remote_url():
    a = parser().parse_args(["loadcheck", "http://10.0.0.5:8080", "--streams", "2", "--seconds", "5"])
    with pytest.raises(CliError, match="only against a server on this machine"):
        a.run(a)


def test_cli_reports_a_missing_server_as_an_error(monkeypatch):
    from app.cli import loadcheck

    monkeypatch.setenv("LLAMA_API_KEY", "from-env")
    assert loadcheck.resolve_target("http://127.0.0.1:9/") == ("http://127.0.0.1:9", "from-env")
    from tests.conftest import free_port

    a = parser().parse_args(["loadcheck", f"http://127.0.0.1:{free_port()}", "--streams", "1", "--seconds", "1"])
    with pytest.raises(CliError, match="not ready"):
        a.run(a)


def test_cli_takes_a_profiles_url_and_key(monkeypatch):
    from app.cli import loadcheck
    from app.core.profile import LaunchProfile
    from app.store.profiles import ProfileStore

    monkeypatch.setenv("LLAMA_API_KEY", "from-env")
    store = ProfileStore()
    store.save(LaunchProfile(name="lc", port=8123, api_key="profile-key"))
    store.save(LaunchProfile(name="lc-nokey", host="0.0.0.0", port=8124))
    assert loadcheck.resolve_target("lc") == ("http://127.0.0.1:8123", "profile-key")
    assert loadcheck.resolve_target("lc-nokey") == ("http://127.0.0.1:8124", "from-env")
