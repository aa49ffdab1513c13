"""Load check: N parallel streaming completions for T seconds, inter-token gaps per stream.

Seed 004 (upstream #30252): with ``-kvu`` and ``--cache-idle-slots`` every new task
saves the idle slots to the prompt cache on the server thread, and all streams stall
for up to seconds. This job reproduces that load on a running server so a user can
compare before/after a remedy:

* ``streams`` workers each send ``POST /completion`` (``"stream": true``, ``id_slot``
  -1, ``cache_prompt`` true, a short prompt that differs per stream) back to back until
  the deadline; requests still in flight then are cancelled (the server drops a task
  whose connection goes);
* every token event's arrival is stamped with :func:`time.perf_counter`; a *gap* is the
  time between two consecutive token events of the same request (never across
  requests: the first token of a request is its time to first token, kept apart);
* a gap above ``stall_ms`` is a *stall*, kept with its start offset from the run's
  start.

Loopback only (127.0.0.0/8, ::1, localhost): this is a load generator.
Qt-free: the CLI and the window both call :func:`run_load_check`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import math
import time
from array import array
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from app.server.client import ServerError, ServerUnreachable
from app.tools.loadcheck_limits import MAX_N_PREDICT, MAX_SECONDS, MAX_STREAMS, MIN_SECONDS

ERROR_BACKOFF_S = 0.5  # a worker whose request failed waits this long before the next one
PROGRESS_EVERY_S = 0.25
MAX_ERRORS_KEPT = 20

TOPICS = ("a lighthouse keeper", "a lost umbrella", "the first snow", "a night train", "a bakery at dawn",
          "a clockmaker", "a city of bridges", "an old map", "a beekeeper", "a chess club", "a desert well",
          "a paper boat", "a violin maker", "a harbour cat", "a mountain hut", "a library after closing")

ProgressCallback = Callable[[float, int], None]


class LoadCheckError(Exception):
    """The load check refused to run (bad bounds, not loopback) or could not run at all."""


# --------------------------------------------------------------------------- statistics


def percentile(sorted_values, q: float) -> float | None:
    """The ``q``-th percentile (0..100) of already sorted values, linear interpolation
    between closest ranks (numpy's default); None for no values."""
    n = len(sorted_values)
    if n == 0:
        return None
    if n == 1:
        return float(sorted_values[0])
    pos = (n - 1) * min(max(q, 0.0), 100.0) / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    return float(sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac)


class StreamRecorder:
    """Token arrivals of one stream, request by request (times in seconds, ``perf_counter``
    clock; ``t0`` is the run's start)."""

    def __init__(self, index: int, t0: float, stall_ms: float):
        self.index = index
        self.t0 = t0
        self.stall_ms = stall_ms
        self.requests = 0
        self.tokens = 0
        self.gap_t = array("d")  # start of each gap, seconds after t0
        self.gap_ms = array("d")
        self.ttft_ms = array("d")
        self.stalls: list[tuple[float, float]] = []
        self.errors = 0
        self.open_stall = False  # the last stall was still open when the run ended
        self.first_at: float | None = None  # the stream's first token (perf_counter)
        self._request_start: float | None = None
        self._last: float | None = None

    def start_request(self, now: float) -> None:
        self.requests += 1
        self._request_start = now
        self._last = None

    def token(self, now: float, count: int = 1) -> None:
        """A token event arrived at ``now`` (carrying ``count`` tokens)."""
        self.tokens += count
        if self.first_at is None:
            self.first_at = now
        if self._last is None:
            if self._request_start is not None:
                self.ttft_ms.append((now - self._request_start) * 1000.0)
        else:
            gap = (now - self._last) * 1000.0
            offset = self._last - self.t0
            self.gap_t.append(offset)
            self.gap_ms.append(gap)
            if gap > self.stall_ms:
                self.stalls.append((offset, gap))
        self._last = now

    def end_request(self) -> None:
        self._request_start = None
        self._last = None

    def finish(self, now: float) -> None:
        """The run ended at ``now`` with a request in flight: a gap still open then that is
        already a stall counts (as a gap and a stall, its length a lower bound), else a stall
        in progress at the deadline would go unseen. A shorter open gap is left out."""
        if self._last is not None:
            gap = (now - self._last) * 1000.0
            if gap > self.stall_ms:
                offset = self._last - self.t0
                self.gap_t.append(offset)
                self.gap_ms.append(gap)
                self.stalls.append((offset, gap))
                self.open_stall = True
        self.end_request()

    def stats(self) -> "StreamStats":
        gaps = sorted(self.gap_ms)
        ttft = sorted(self.ttft_ms)
        return StreamStats(
            stream=self.index, requests=self.requests, tokens=self.tokens,
            gap_p50_ms=percentile(gaps, 50), gap_p99_ms=percentile(gaps, 99),
            gap_max_ms=float(gaps[-1]) if gaps else None,
            stalls=list(self.stalls), n_gaps=len(gaps),
            ttft_p50_ms=percentile(ttft, 50), ttft_max_ms=float(ttft[-1]) if ttft else None,
            errors=self.errors, open_stall=self.open_stall,
            first_token_s=None if self.first_at is None else self.first_at - self.t0, gap_t=array("d", self.gap_t),
            gap_ms=array("d", self.gap_ms))


# --------------------------------------------------------------------------- report


@dataclass
class StreamStats:
    stream: int
    requests: int
    tokens: int
    gap_p50_ms: float | None
    gap_p99_ms: float | None
    gap_max_ms: float | None
    stalls: list[tuple[float, float]]  # (start offset s, gap ms)
    n_gaps: int = 0
    ttft_p50_ms: float | None = None  # time to first token (the queue + prefill), not a gap
    ttft_max_ms: float | None = None
    errors: int = 0
    open_stall: bool = False  # the last of ``stalls`` was still open at the end (a lower bound)
    first_token_s: float | None = None  # when the stream's first token came, s after the start
    # every gap (start offset s, ms), for charts; left out of JSON and of comparisons
    gap_t: array = field(default_factory=lambda: array("d"), repr=False, compare=False)
    gap_ms: array = field(default_factory=lambda: array("d"), repr=False, compare=False)


@dataclass
class LoadReport:
    url: str
    started_at: float  # epoch seconds
    seconds: float  # asked for
    elapsed_s: float  # ran
    streams: int
    stall_ms: float
    n_predict: int
    per_stream: list[StreamStats]
    tokens: int
    requests: int
    tokens_per_s: float
    gap_p50_ms: float | None  # over every gap of every stream
    gap_p99_ms: float | None
    gap_max_ms: float | None
    n_stalls: int
    cancelled: bool = False
    ttft_p50_ms: float | None = None  # time to first token over every request (not a gap)
    ttft_max_ms: float | None = None
    errors: list[str] = field(default_factory=list)
    n_errors: int = 0

    @property
    def stalls(self) -> list[tuple[int, float, float]]:
        """Every stall of every stream as (stream, start offset s, gap ms), in time order."""
        return sorted(((s.stream, t, g) for s in self.per_stream for t, g in s.stalls), key=lambda x: x[1])

    def is_open(self, stream: int, t_offset_s: float) -> bool:
        """Whether this stall was still open when the run ended (its gap a lower bound)."""
        s = self.per_stream[stream]
        return s.open_stall and bool(s.stalls) and s.stalls[-1][0] == t_offset_s


def build_report(recorders: list[StreamRecorder], *, url: str, started_at: float, seconds: float,
                 elapsed_s: float, stall_ms: float, n_predict: int, cancelled: bool = False,
                 errors: list[str] | None = None, n_errors: int = 0) -> LoadReport:
    per = [r.stats() for r in recorders]
    everything = sorted(g for r in recorders for g in r.gap_ms)
    ttft = sorted(x for r in recorders for x in r.ttft_ms)
    tokens = sum(s.tokens for s in per)
    return LoadReport(
        url=url, started_at=started_at, seconds=seconds, elapsed_s=elapsed_s, streams=len(per),
        stall_ms=stall_ms, n_predict=n_predict, per_stream=per, tokens=tokens,
        requests=sum(s.requests for s in per), tokens_per_s=tokens / elapsed_s if elapsed_s > 0 else 0.0,
        gap_p50_ms=percentile(everything, 50), gap_p99_ms=percentile(everything, 99),
        gap_max_ms=float(everything[-1]) if everything else None,
        n_stalls=sum(len(s.stalls) for s in per), cancelled=cancelled, errors=list(errors or []),
        n_errors=n_errors, ttft_p50_ms=percentile(ttft, 50), ttft_max_ms=float(ttft[-1]) if ttft else None)


def gap_series(stats: StreamStats, seconds: float, buckets: int) -> list[tuple[float, float]]:
    """The largest gap in each of ``buckets`` equal time slices of ``[0, seconds]``, as
    (slice middle s, gap ms); empty slices are left out. For charts."""
    buckets = max(1, int(buckets))
    seconds = max(seconds, 1e-9)
    top: list[float | None] = [None] * buckets
    for t, g in zip(stats.gap_t, stats.gap_ms):
        i = min(buckets - 1, max(0, int(t / seconds * buckets)))
        if top[i] is None or g > top[i]:
            top[i] = g
    width = seconds / buckets
    return [((i + 0.5) * width, g) for i, g in enumerate(top) if g is not None]


# --------------------------------------------------------------------------- exports


def _r(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


def to_dict(report: LoadReport) -> dict:
    return {
        "url": report.url,
        "started_at": report.started_at,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(report.started_at)),
        "seconds": report.seconds,
        "elapsed_s": _r(report.elapsed_s, 3),
        "streams": report.streams,
        "stall_ms": report.stall_ms,
        "n_predict": report.n_predict,
        "cancelled": report.cancelled,
        "totals": {
            "tokens": report.tokens,
            "requests": report.requests,
            "tokens_per_s": _r(report.tokens_per_s),
            "gap_p50_ms": _r(report.gap_p50_ms),
            "gap_p99_ms": _r(report.gap_p99_ms),
            "gap_max_ms": _r(report.gap_max_ms),
            "stalls": report.n_stalls,
            "ttft_p50_ms": _r(report.ttft_p50_ms),
            "ttft_max_ms": _r(report.ttft_max_ms),
            "errors": report.n_errors,
        },
        "per_stream": [{
            "stream": s.stream, "requests": s.requests, "tokens": s.tokens, "gaps": s.n_gaps,
            "gap_p50_ms": _r(s.gap_p50_ms), "gap_p99_ms": _r(s.gap_p99_ms), "gap_max_ms": _r(s.gap_max_ms),
            "ttft_p50_ms": _r(s.ttft_p50_ms), "ttft_max_ms": _r(s.ttft_max_ms), "errors": s.errors,
            "stalls": [{"t_offset_s": _r(t, 3), "gap_ms": _r(g), "open": s.open_stall and k == len(s.stalls) - 1}
                       for k, (t, g) in enumerate(s.stalls)],
        } for s in report.per_stream],
        "errors": list(report.errors),
    }


def to_json(report: LoadReport) -> str:
    return json.dumps(to_dict(report), indent=2)


def fmt_ms(x: float | None) -> str:
    return "–" if x is None else f"{x:,.1f}"


def to_markdown(report: LoadReport, max_stalls: int = 50) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(report.started_at))
    lines = [
        f"## Load check: {report.streams} streams × {report.seconds:g} s on {report.url}",
        "",
        f"{when} · ran {report.elapsed_s:.1f} s{' (cancelled)' if report.cancelled else ''} · "
        f"{report.requests:,} requests of {report.n_predict} tokens · {report.tokens:,} tokens "
        f"({report.tokens_per_s:,.1f} tokens/s) · stall threshold {report.stall_ms:g} ms",
        "",
        f"Time to first token (queue + prefill, not counted as a gap): p50 {fmt_ms(report.ttft_p50_ms)} ms, "
        f"max {fmt_ms(report.ttft_max_ms)} ms.",
        "",
        "| stream | requests | tokens | gap p50 ms | gap p99 ms | gap max ms | stalls |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in report.per_stream:
        lines.append(f"| {s.stream} | {s.requests:,} | {s.tokens:,} | {fmt_ms(s.gap_p50_ms)} | "
                     f"{fmt_ms(s.gap_p99_ms)} | {fmt_ms(s.gap_max_ms)} | {len(s.stalls)} |")
    lines.append(f"| **all** | {report.requests:,} | {report.tokens:,} | {fmt_ms(report.gap_p50_ms)} | "
                 f"{fmt_ms(report.gap_p99_ms)} | {fmt_ms(report.gap_max_ms)} | {report.n_stalls} |")
    stalls = report.stalls
    if stalls:
        lines += ["", f"Stalls (gap > {report.stall_ms:g} ms between two tokens of one request):", ""]
        for stream, t, g in stalls[:max_stalls]:
            if report.is_open(stream, t):
                lines.append(f"- stream {stream} at {t:.2f} s: at least {g:,.0f} ms (still open at the end)")
            else:
                lines.append(f"- stream {stream} at {t:.2f} s: {g:,.0f} ms")
        if len(stalls) > max_stalls:
            lines.append(f"- … {len(stalls) - max_stalls} more")
    else:
        lines += ["", f"No stall above {report.stall_ms:g} ms."]
    if report.n_errors:
        lines += ["", f"{report.n_errors} failed request(s):", ""]
        lines += [f"- {e}" for e in report.errors]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the run


def check_loopback(url: str) -> None:
    """Raise :class:`LoadCheckError` unless ``url``'s host is 127.0.0.0/8, ::1 or localhost."""
    try:
        host = urlsplit(url if "://" in url else f"http://{url}").hostname
    except ValueError as e:
        raise LoadCheckError(f"not a server URL: {url!r} ({e})") from None
    if not host:
        raise LoadCheckError(f"not a server URL: {url!r}")
    if host.lower().rstrip(".") == "localhost":
        return
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        ip = None
    if ip is not None:
        mapped = getattr(ip, "ipv4_mapped", None)
        if ip.is_loopback or (mapped is not None and mapped.is_loopback):
            return
    raise LoadCheckError(f"the load check runs only against a server on this machine (127.0.0.0/8, ::1 or "
                         f"localhost), not {host}: it sends {MAX_STREAMS} streams at most, back to back, "
                         "and is not meant for a shared server")


def check_bounds(streams: int, seconds: float, stall_ms: float, n_predict: int) -> None:
    if not isinstance(streams, int) or not 1 <= streams <= MAX_STREAMS:
        raise LoadCheckError(f"streams must be 1..{MAX_STREAMS}, not {streams}")
    if not (isinstance(seconds, (int, float)) and MIN_SECONDS <= seconds <= MAX_SECONDS):
        raise LoadCheckError(f"seconds must be {MIN_SECONDS:g}..{MAX_SECONDS:g}, not {seconds}")
    if not (isinstance(stall_ms, (int, float)) and 0 < stall_ms < math.inf):
        raise LoadCheckError(f"the stall threshold must be a positive number of ms, not {stall_ms}")
    if not isinstance(n_predict, int) or not 1 <= n_predict <= MAX_N_PREDICT:
        raise LoadCheckError(f"n_predict must be 1..{MAX_N_PREDICT}, not {n_predict}")


def stream_prompt(index: int, prompt: str | None = None) -> str:
    """The prompt of stream ``index``: short, and different per stream (so the server's
    prompt-cache / slot-similarity logic sees distinct sessions)."""
    if prompt:
        return f"[stream {index}] {prompt}"
    topic = TOPICS[index % len(TOPICS)]
    return f"Stream {index}. Write a short story about {topic}, in plain sentences."


def _token_count(event: dict) -> int:
    tokens = event.get("tokens")
    if isinstance(tokens, list):
        return len(tokens)
    return 1 if event.get("content") else 0


async def run_load_check(client, *, streams: int, seconds: float, stall_ms: float = 500, prompt: str | None = None,
                         n_predict: int = 64, on_progress: ProgressCallback | None = None,
                         cancel: asyncio.Event | None = None) -> LoadReport:
    """Run ``streams`` back-to-back streaming completions against ``client`` (a
    :class:`app.server.client.LlamaClient`) for ``seconds``; return the gap statistics.

    Stops by itself at the deadline (in-flight requests are cancelled) once every stream has
    had its first token (a stream still waiting for one keeps the run going past the deadline
    until it comes or the stream meets an error: a run that measured nothing of a stream says nothing of
    it; ``elapsed_s`` is then the time to that token), or early when
    ``cancel`` is set (the report then says ``cancelled``). ``on_progress(fraction,
    tokens)`` is called about four times a second, and with 1.0 at the end. Raises
    :class:`LoadCheckError` for bad bounds, a non-loopback URL, a server that does not
    answer, or a run in which every request failed."""
    check_bounds(streams, seconds, stall_ms, n_predict)
    url = str(getattr(client, "base_url", ""))
    check_loopback(url)
    health = await client.health()
    if not health.ok:
        raise LoadCheckError(f"{url} is not ready: {health.message or health.status}")
    cancel = cancel if cancel is not None else asyncio.Event()
    started_at = time.time()
    t0 = time.perf_counter()
    deadline = t0 + float(seconds)
    recorders = [StreamRecorder(i, t0, float(stall_ms)) for i in range(streams)]
    errors: list[str] = []
    n_errors = 0

    async def worker(rec: StreamRecorder) -> None:
        nonlocal n_errors
        text = stream_prompt(rec.index, prompt)
        retried = False
        while (time.perf_counter() < deadline or (rec.tokens == 0 and not rec.errors)) and not cancel.is_set():
            rec.start_request(time.perf_counter())
            got_token = False
            try:
                async with aclosing(client.stream_completion(
                        text, slot_id=-1, n_predict=n_predict, cache_prompt=True,
                        extra={"ignore_eos": True})) as events:
                    async for event in events:
                        now = time.perf_counter()
                        count = _token_count(event)
                        if count:
                            got_token = True
                            rec.token(now, count)
                            if all(r.tokens for r in recorders):
                                every_stream_flowing.set()
                        # read on past the "stop" event to the end of the body: the
                        # connection then goes back to the pool for the next request
                retried = False
            except ServerUnreachable as e:
                if not got_token and not retried:
                    # A pooled keep-alive connection the server had just closed ("disconnected
                    # without sending a response"): nothing was generated, so ask once more.
                    retried = True
                    continue
                rec.errors += 1
                n_errors += 1
                if len(errors) < MAX_ERRORS_KEPT:
                    errors.append(f"stream {rec.index}: {e}")
                return  # the server is gone: this stream stops
            except ServerError as e:
                rec.errors += 1
                n_errors += 1
                if len(errors) < MAX_ERRORS_KEPT:
                    errors.append(f"stream {rec.index}: {e}")
                await asyncio.sleep(ERROR_BACKOFF_S)
            finally:
                rec.end_request()

    every_stream_flowing = asyncio.Event()
    tasks = [asyncio.create_task(worker(r), name=f"loadcheck-stream-{r.index}") for r in recorders]
    cancel_wait = asyncio.create_task(cancel.wait(), name="loadcheck-cancel")
    flowing_wait = asyncio.create_task(every_stream_flowing.wait(), name="loadcheck-flowing")

    def waiting_for_a_first_token() -> bool:
        return any(r.tokens == 0 and not r.errors and not t.done() for r, t in zip(recorders, tasks))

    def progress(fraction: float) -> None:
        if on_progress is not None:
            on_progress(min(1.0, max(0.0, fraction)), sum(r.tokens for r in recorders))

    try:
        while True:
            now = time.perf_counter()
            progress((now - t0) / seconds)
            pending = [t for t in tasks if not t.done()]
            if (now >= deadline and not waiting_for_a_first_token()) or cancel.is_set() or not pending:
                break
            waits = [*pending, cancel_wait] + ([flowing_wait] if now >= deadline else [])
            await asyncio.wait(waits, timeout=min(PROGRESS_EVERY_S, max(deadline - now, 0.0)) or PROGRESS_EVERY_S,
                               return_when=asyncio.FIRST_COMPLETED)
    finally:
        # no await since the loop stopped: the workers have not seen the end yet
        last_first = max((r.first_at for r in recorders if r.first_at is not None), default=t0)
        stop_at = min(time.perf_counter(), max(deadline, last_first))
        for r in recorders:
            r.finish(stop_at)
        cancel_wait.cancel()
        flowing_wait.cancel()
        for t in tasks:
            t.cancel()
        results = await asyncio.gather(cancel_wait, flowing_wait, *tasks, return_exceptions=True)
    elapsed = stop_at - t0
    for res in results[2:]:
        if isinstance(res, BaseException) and not isinstance(res, asyncio.CancelledError):
            raise res
    report = build_report(recorders, url=url, started_at=started_at, seconds=float(seconds), elapsed_s=elapsed,
                          stall_ms=float(stall_ms), n_predict=n_predict, cancelled=cancel.is_set(),
                          errors=errors, n_errors=n_errors)
    if report.tokens == 0 and n_errors:
        raise LoadCheckError(f"no token came back: {errors[0]}" + (f" (and {n_errors - 1} more errors)"
                                                                    if n_errors > 1 else ""))
    progress(1.0)
    return report
