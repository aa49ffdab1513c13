"""The proxy's HTTP layer: a loopback HTTP server in front of llama-server (issue #19).

Everything is passed through to the upstream server with the same method, path, query, body and
status, and the response body is streamed back chunk by chunk as it arrives (an SSE stream is
never buffered: each upstream chunk is written to the client before the next one is read). JSON
POSTs to the completion endpoints (:data:`INTERCEPTED`) go through the :class:`Interceptor`:
``before`` may rewrite the body (the proxy's service pins ``id_slot`` and sets ``cache_prompt``),
and ``after`` is told how the request ended (:class:`Result`), exactly once per request that
``before`` accepted, whatever happened: a success, an upstream error, an unreachable upstream, a
client that went away, the proxy stopping. A failure in ``after`` is logged, never the client's
problem. Once an ``after`` has ended with no intercepted request waiting or running, ``on_idle`` is
called: what the proxy keeps off the requests' path runs there.

A client that goes away mid-response: aiohttp cancels the handler (``handler_cancellation``), the
upstream response is closed unread (its connection dropped, not drained), and llama-server stops
generating for it (``srv stop: cancel task``): the slot is free at once, holding what it had
processed. ``after`` gets ``disconnected=True``.

Security: the proxy refuses a non-loopback host without an API key (:class:`ProxyRefused`); with
a key, every request but ``/health`` (and a CORS preflight, like llama-server) needs
``Authorization: Bearer KEY`` (or ``X-Api-Key: KEY``), else 401 in llama-server's error shape.
A ``GET /`` without the key (llama-server's web UI, public there) is passed on with no key at all,
so the upstream's own rule decides. The key is never logged, nor shown in ``repr``; it is never sent
upstream either (the upstream client's own key replaces the client's ``Authorization``).
``slot_actions=False``: ``POST /slots/{id}?action=save|restore|erase`` is refused with llama-server's
own 501 "not supported" answer (the proxy's own ``--slot-save-path`` must not give clients what the
user's profile did not); ``slots_endpoint=False`` (the profile's ``--no-slots``) answers ``GET /slots``
the same way, while the server behind keeps the endpoint the proxy itself reads. Response headers keep
the case the server wrote them in.

No Qt here: the server runs on whatever asyncio loop is running (qasync's in the window), started
with ``web.AppRunner`` + ``web.TCPSite``.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, Sequence

from aiohttp import web

from app.core.background import TaskGroup, track
from app.server.client import LlamaClient, ServerUnreachable

log = logging.getLogger(__name__)

#: the endpoints whose JSON POSTs go through the interceptor
INTERCEPTED = frozenset({"/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions",
                         "/completion", "/v1/messages", "/v1/responses"})
#: paths a client reaches without the proxy's key (like llama-server's public endpoints)
PUBLIC = frozenset({"/health", "/v1/health"})
#: paths a client without the proxy's key may GET when the upstream serves them without a key (the web UI)
PUBLIC_IF_UPSTREAM = frozenset({"/"})
#: llama-server's answer to a slot action when it runs without --slot-save-path (build 11434, verbatim)
SLOT_ACTIONS_OFF = ("This server does not support slots action. Start it with `--slot-save-path`",
                    "not_supported_error")
#: its answer to ``GET /slots`` under --no-slots (verbatim)
SLOTS_OFF = ("This server does not support slots endpoint. Start it with `--slots`", "not_supported_error")
#: response headers not copied from upstream (aiohttp frames the body itself)
#: KV Valet's families alone, whatever the server's ``--metrics`` (``/metrics`` follows the server)
OWN_METRICS_PATH = "/kv-valet/metrics"
_NOT_COPIED = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer", "trailers", "upgrade",
                         "content-length", "proxy-authenticate", "proxy-connection"})
#: request bodies the proxy takes (a chat with a long history and images is megabytes, not gigabytes)
MAX_REQUEST_BYTES = 256 * 1024 * 1024
#: at most this much of a non-streamed JSON answer is kept to parse for ``Result.final``
_MAX_JSON_KEPT = 64 * 1024 * 1024
#: an SSE line longer than this is not parsed (the bytes still pass through)
_MAX_LINE = 16 * 1024 * 1024
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_SHUTDOWN_S = 0.5  # aiohttp's grace for a request that arrived while stop() ended the others


class ProxyRefused(Exception):
    """The proxy will not start as asked (a public host without an API key)."""


@dataclass(frozen=True)
class Result:
    """How an intercepted request ended, for :meth:`Interceptor.after`."""

    status: int  # the upstream's HTTP status; 502 when it could not be reached
    stream: bool  # the client asked for a stream ("stream": true)
    # the non-streamed JSON answer (an error body too); for a stream the last SSE data object that
    # carries "timings" (llama-server's final chunk), else the last JSON data object; None if none
    final: dict | None
    disconnected: bool  # the client went away before the answer's end: the upstream request was cancelled
    error: str | None  # what went wrong upstream (an HTTP error's message, a broken connection), else None
    # the proxy's own time on the request's path, in seconds: from its arrival to its sending upstream (the
    # interceptor's ``before`` in it), and from the server's answer to its first bytes written to the client;
    # None when the answer never reached the client
    own_s: float | None = None


class Interceptor(Protocol):
    async def before(self, path: str, headers: Mapping[str, str], body: dict) -> tuple[dict, object]:
        """The body to send upstream (the proxy sets "id_slot" and "cache_prompt" there) and a
        context object given back to :meth:`after`. Raising refuses the request (500, no ``after``);
        so does the client going away meanwhile (``before`` is cancelled, no ``after``). A body that
        keeps the client's values and only adds keys goes upstream as the client's own bytes with those
        keys appended: a change must replace a top-level value, never edit one in place."""
        ...

    async def after(self, ctx: object, result: Result) -> None:
        """Called exactly once for every request ``before`` accepted, once its answer has ended
        (the client has its last byte) or failed. An exception here is logged, nothing more."""
        ...

    def ended(self, ctx: object) -> None:
        """Told at once, synchronously, when that answer has ended, before ``after`` is scheduled (a
        request the client sends next may reach ``before`` ahead of ``after``)."""
        ...

    def sent(self, ctx: object) -> None:
        """Told once the request's body was handed to the upstream connection (at the latest with the
        answer's head; never when it could not be sent): what ``before`` held back from the request's path
        runs now, while the server works. Called inside the body's write: schedule, do not run, what costs.
        An exception is logged."""
        ...


def is_loopback_host(host: str) -> bool:
    """True only for a host that listens on loopback alone ("" and 0.0.0.0 listen everywhere)."""
    host = host.strip().strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # another name may resolve to any interface


def _error(status: int, message: str, type_: str) -> web.Response:
    """An error in llama-server's shape (compact JSON, as it writes it)."""
    return web.json_response({"error": {"code": status, "message": message, "type": type_}}, status=status,
                             dumps=_compact)


def _compact(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _upstream_body(raw: bytes, given: list[tuple[str, object]], sent: dict) -> bytes:
    """The body sent upstream for a client's JSON object ``raw`` (parsed: ``given``, its items) that the
    interceptor answered with ``sent``. When ``sent`` keeps every key of the client's with the very same
    value and only adds keys (``id_slot``, ``cache_prompt``), those are appended to the client's own
    bytes: a chat's whole history is not serialised again at every turn. Else ``sent`` serialised."""
    if given and len(sent) >= len(given) and all(k in sent and sent[k] is v for k, v in given):
        obj = raw.strip(b" \t\r\n")
        if obj[:1] == b"{" and obj[-1:] == b"}":  # UTF-8 JSON (a BOM or UTF-16 is serialised again below)
            keys = {k for k, _ in given}
            added = {k: v for k, v in sent.items() if k not in keys}
            if not added:
                return raw
            try:
                tail = json.dumps(added, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
            except ValueError:
                tail = None
            if tail is not None and tail != "{}":
                return obj[:-1] + b"," + tail[1:-1].encode() + b"}"
    return json.dumps(sent, ensure_ascii=False, separators=(",", ":")).encode()


def _error_message(final: dict | None, status: int) -> str:
    err = final.get("error") if isinstance(final, dict) else None
    if isinstance(err, dict) and err.get("message"):
        return f"HTTP {status}: {err['message']}"
    return f"HTTP {status}"


class _Collector:
    """Reads along the answer, without changing a byte, to find ``Result.final``: the whole body
    of a JSON answer, or for a server-sent event stream its ``data:`` lines (split anywhere by the
    chunks) of which it keeps the raw text of the last one, of the last carrying "timings" and of the
    last carrying a route's usage (Anthropic's ``message_start``), and parses only those at the end."""

    def __init__(self, stream: bool, arrived: float = 0.0):
        self.stream = stream
        # perf_counter() stamps of the proxy's own time (``Result.own_s``): the request's arrival, its
        # sending upstream, the server's answer, its first bytes written to the client
        self.arrived, self.sent, self.answered, self.relayed = arrived, 0.0, 0.0, 0.0
        self.status = 0
        self.sse = False
        self.disconnected = False
        self.error: str | None = None
        self._body = bytearray()
        self._tail = b""
        self._last: bytes | None = None
        self._last_timed: bytes | None = None
        self._last_usage: bytes | None = None  # Anthropic's message_start, a Responses event with usage
        self._event_error: str | None = None
        self._overflow = False

    def start(self, status: int, content_type: str) -> None:
        self.status = status
        self.sse = content_type.split(";")[0].strip().lower() == "text/event-stream"

    def feed(self, chunk: bytes) -> None:
        if self._overflow:
            return
        if not self.sse:
            self._body += chunk
            if len(self._body) > _MAX_JSON_KEPT:
                self._overflow, self._body = True, bytearray()
            return
        data = self._tail + chunk if self._tail else chunk
        lines = data.split(b"\n")
        self._tail = lines.pop()
        if len(self._tail) > _MAX_LINE:
            self._tail = b""
        for line in lines:
            self._line(line)

    def _line(self, line: bytes) -> None:
        line = line.rstrip(b"\r")
        field, sep, value = line.partition(b":")
        if not sep:
            return
        value = value.strip()
        if field == b"data":
            if value == b"[DONE]":
                return
            self._last = value
            if b'"timings"' in value:
                self._last_timed = value
            elif b'"cache_read_input_tokens"' in value or b'"input_tokens_details"' in value:
                self._last_usage = value
            if b'"error"' in value:
                self._note_error(value)
        elif field == b"error":  # an error event
            self._note_error(value)

    def _note_error(self, value: bytes) -> None:
        try:
            obj = json.loads(value)
        except ValueError:
            return
        err = obj.get("error", obj) if isinstance(obj, dict) else None
        if isinstance(err, dict) and "message" in err:
            self._event_error = str(err.get("message"))

    @staticmethod
    def _json(raw: bytes | bytearray | None) -> dict | None:
        if not raw:
            return None
        try:
            obj = json.loads(raw)
        except ValueError:  # also a UnicodeDecodeError
            return None
        return obj if isinstance(obj, dict) else None

    def result(self) -> Result:
        if self.sse:
            if self._tail and not self.disconnected:  # a last line without its newline
                self._line(self._tail)
                self._tail = b""
            final = self._json(self._last_timed) or self._json(self._last_usage) or self._json(self._last)
        else:
            final = self._json(self._body)
        error = self.error
        if error is None and self.status >= 400:
            error = _error_message(final, self.status)
        if error is None and self._event_error is not None:
            error = self._event_error
        own = None
        if self.arrived and self.sent and self.answered and self.relayed:
            own = (self.sent - self.arrived) + (self.relayed - self.answered)
        return Result(status=self.status, stream=self.stream, final=final, disconnected=self.disconnected,
                      error=error, own_s=own)


class ProxyServer:
    """An HTTP server on the running asyncio loop that passes every request on to ``upstream``."""

    def __init__(self, upstream: LlamaClient, *, interceptor: Interceptor | None = None,
                 api_key: str | None = None, slot_actions: bool = True, slots_endpoint: bool = True,
                 metrics: Callable[[], bytes] | None = None, on_idle: Callable[[], None] | None = None):
        self._upstream = upstream
        self._interceptor = interceptor
        self._api_key = api_key or None
        # False: the proxy's own --slot-save-path must not turn /slots/{id}?action=… on for clients
        self._slot_actions = slot_actions
        self._slots_endpoint = slots_endpoint  # False: the user's --no-slots, said to clients as the server says it
        self._metrics = metrics  # KV Valet's own families, served after the server's at /metrics
        self._on_idle = on_idle  # told when an answer's ``after`` ended and no intercepted request is in flight
        self._runner: web.AppRunner | None = None
        self.addresses: list[tuple[str, int]] = []  # (address, port) it listens on, once started
        self._url: str | None = None
        self._stopping = False
        self._inflight = TaskGroup("the proxy's request handlers")  # the handlers running now (stop() ends them)
        # intercepted requests now: in ``before`` (held by the proxy: a slot lease, a park, a restore), and
        # sent upstream with their answer not ended (what a gateway reads: app.proxy.metrics)
        self.waiting = 0
        self.running = 0

    def __repr__(self) -> str:
        key = "set" if self._api_key else "none"
        return f"<ProxyServer {self._url or 'not started'} -> {self._upstream.base_url}, api key {key}>"

    @property
    def url(self) -> str:
        """``http://HOST:PORT`` the proxy listens on (the port it got, when started on port 0)."""
        if self._url is None:
            raise RuntimeError("the proxy is not started")
        return self._url

    async def start(self, host: str | Sequence[str], port: int) -> None:
        """Listen on ``port`` of each address of ``host`` (one, a list, or llama-server's comma-separated
        ``--host`` value: ``127.0.0.1,::1``); port 0 takes a free port on the first and the same on the rest."""
        hosts = [h.strip() for h in (host.split(",") if isinstance(host, str) else host) if h.strip()] or [""]
        for h in hosts:
            if not is_loopback_host(h) and not self._api_key:
                raise ProxyRefused(
                    f"The proxy will not listen on {h or 'every interface'} without an API key: anyone on the "
                    "network could send prompts to the model and read, save, overwrite or restore its slots "
                    "through it. Give it an API key, or listen on 127.0.0.1.")
        if self._runner is not None:
            raise RuntimeError("the proxy is already started")
        app = web.Application(client_max_size=MAX_REQUEST_BYTES)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, handle_signals=False, access_log=None, handler_cancellation=True,
                               shutdown_timeout=_SHUTDOWN_S)
        await runner.setup()
        try:
            for h in hosts:
                site = web.TCPSite(runner, h or None, port)
                await site.start()
                port = port or runner.addresses[0][1]  # the first address's port, for the others too
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self._stopping = False
        self.addresses = [a[:2] for a in runner.addresses]
        host = hosts[0]
        bound_host, bound_port = runner.addresses[0][:2]
        shown = host if host and host not in ("0.0.0.0", "::") else bound_host
        self._url = f"http://[{shown}]:{bound_port}" if ":" in shown else f"http://{shown}:{bound_port}"
        log.info("proxy listening on %s for %s", ", ".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}"
                                                          for h, p in self.addresses), self._upstream.base_url)

    async def stop(self) -> None:
        """Stop listening, and end the requests still running at once: their clients are cut off,
        their upstream requests cancelled, and ``after`` sees ``disconnected=True`` with the error
        "the proxy stopped" (a generation can run for minutes: no grace period to wait out)."""
        runner, self._runner = self._runner, None
        if runner is None:
            return
        self._stopping = True
        await self._inflight.cancel_all()
        await runner.cleanup()
        log.info("proxy on %s stopped", self._url)

    # -- requests ----------------------------------------------------------------------------
    def _authorised(self, request: web.Request) -> bool:
        assert self._api_key is not None
        key = self._api_key.encode()
        auth = request.headers.get("Authorization", "")
        if auth[:7].lower() == "bearer " and hmac.compare_digest(auth[7:].strip().encode(), key):
            return True
        other = request.headers.get("X-Api-Key")
        return other is not None and hmac.compare_digest(other.strip().encode(), key)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        with self._inflight.holding(task):
            return await self._serve(request)

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        arrived = time.perf_counter()
        anonymous = False
        if (self._api_key and request.path not in PUBLIC and request.method != "OPTIONS"
                and not self._authorised(request)):
            if request.method not in ("GET", "HEAD") or request.path not in PUBLIC_IF_UPSTREAM:
                return _error(401, "Invalid API Key", "authentication_error")
            anonymous = True  # sent without any key: the upstream serves it publicly, or answers its own 401
        target = request.raw_path
        if not target.startswith("/") or target.startswith("//") or not target.isascii():
            return _error(400, "the request target must be a path", "invalid_request_error")
        if not self._slot_actions and request.method == "POST" and request.path.startswith("/slots/"):
            return _error(501, *SLOT_ACTIONS_OFF)
        if not self._slots_endpoint and request.method == "GET" and request.path == "/slots":
            return _error(501, *SLOTS_OFF)
        if self._metrics is not None and request.method == "GET" and request.path == OWN_METRICS_PATH:
            return web.Response(body=self._metrics(), headers={"Content-Type": METRICS_CONTENT_TYPE})
        if self._metrics is not None and request.method == "GET" and request.path == "/metrics":
            return await self._serve_metrics(request, target)
        body = await request.read()
        if self._interceptor is None or request.method != "POST" or request.path not in INTERCEPTED:
            resp, broken = await self._pass(request, target, request.headers, body, None, anonymous=anonymous)
            if broken:
                _cut(request)
            return resp
        try:
            parsed = json.loads(body)
        except ValueError:  # not JSON (or not UTF-8): passed through untouched, the server answers it
            parsed = None
        if not isinstance(parsed, dict):
            resp, broken = await self._pass(request, target, request.headers, body, None)
            if broken:
                _cut(request)
            return resp
        given = list(parsed.items())  # what the client sent, to see what ``before`` changed
        self.waiting += 1
        try:
            sent, ctx = await self._interceptor.before(request.path, request.headers, parsed)
        except Exception as e:
            log.exception("the proxy's interceptor failed before %s %s", request.method, request.path)
            return _error(500, f"the proxy could not prepare the request: {type(e).__name__}: {e}",
                          "server_error")
        finally:
            self.waiting -= 1
        collector = _Collector(bool(sent.get("stream")), arrived)
        broken = False
        self.running += 1
        try:
            content = _upstream_body(body, given, sent)
            headers = [(k, v) for k, v in request.headers.items() if k.lower() != "content-type"]
            headers.append(("Content-Type", "application/json"))
            resp, broken = await self._pass(request, target, _Pairs(headers), content, collector,
                                            on_sent=lambda: self._interceptor.sent(ctx))
            return resp
        except Exception as e:
            collector.error = collector.error or f"{type(e).__name__}: {e}"
            raise
        finally:
            self.running -= 1
            self._interceptor.ended(ctx)
            # shielded: a second cancellation (the proxy stopping) does not cut ``after`` short
            await asyncio.shield(track(self._after(ctx, collector, request.method, request.path),
                                       f"the proxy's after() for {request.method} {request.path}"))
            if broken:
                _cut(request)  # only now: closing the connection cancels this handler

    async def _serve_metrics(self, request: web.Request, target: str) -> web.StreamResponse:
        """The server's own metrics unchanged, with its headers, then KV Valet's families. A server
        without ``--metrics`` answers for itself (its 501): the profile said no metrics, and a
        client written for llama-server expects that; KV Valet's families alone stay at
        :data:`OWN_METRICS_PATH`."""
        assert self._metrics is not None
        try:
            async with self._upstream.forward("GET", target, headers=request.headers, content=None) as up:
                theirs = await up.aread()
                headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in up.headers.raw
                           if k.decode("latin-1").lower() not in _NOT_COPIED]
                if up.status_code != 200:
                    resp = web.Response(status=up.status_code, reason=up.reason_phrase or None, body=theirs)
                    for k, v in headers:
                        resp.headers.add(k, v)
                    return resp
        except ServerUnreachable as e:
            return _error(502, f"the server at {self._upstream.base_url} is unreachable: {e.reason}",
                          "unavailable_error")
        if theirs and not theirs.endswith(b"\n"):
            theirs += b"\n"
        resp = web.Response(body=theirs + self._metrics())
        for k, v in headers:
            resp.headers.add(k, v)
        return resp

    async def _after(self, ctx: object, collector: _Collector, method: str, path: str) -> None:
        assert self._interceptor is not None
        await _ready_io_first()
        try:
            await self._interceptor.after(ctx, collector.result())
        except Exception:
            log.exception("the proxy's interceptor failed after %s %s (status %s, disconnected %s)",
                          method, path, collector.status, collector.disconnected)
        if self._on_idle is not None and self.waiting == 0 and self.running == 0:
            try:
                self._on_idle()  # the work kept off the requests' path (a checkpoint, a garbage collection)
            except Exception:
                log.exception("the proxy's idle work failed after %s %s", method, path)

    async def _pass(self, request: web.Request, target: str, headers: Mapping[str, str], content: bytes,
                    collector: _Collector | None, *, anonymous: bool = False,
                    on_sent: Callable[[], None] | None = None) -> tuple[web.StreamResponse, bool]:
        """Send the request upstream and stream its answer back, chunk by chunk. Returns the
        response and whether the upstream answer broke off after it had started (the caller then
        cuts the client's connection, so the client sees an incomplete answer, not a short one)."""
        resp: web.StreamResponse | None = None
        if collector is not None:
            collector.sent = time.perf_counter()
        try:
            async with self._upstream.forward(request.method, target, headers=headers,
                                              content=content if content or request.method not in ("GET", "HEAD")
                                              else None, anonymous=anonymous, on_sent=on_sent) as up:
                if collector is not None:
                    collector.answered = time.perf_counter()
                resp = web.StreamResponse(status=up.status_code, reason=up.reason_phrase or None)
                for raw_k, raw_v in up.headers.raw:  # the names as the server wrote them (httpx lower-cases its view)
                    k, v = raw_k.decode("latin-1"), raw_v.decode("latin-1")
                    if k.lower() not in _NOT_COPIED:
                        resp.headers.add(k, v)
                length = up.headers.get("content-length")
                if length is not None and length.isdigit() and "transfer-encoding" not in up.headers:
                    resp.content_length = int(length)
                if collector is not None:
                    collector.start(up.status_code, up.headers.get("content-type", ""))
                await resp.prepare(request)
                async for chunk in up.aiter_raw():
                    await resp.write(chunk)  # the client first: reading along for the final chunk comes after
                    if collector is not None:
                        if not collector.relayed:
                            collector.relayed = time.perf_counter()
                        collector.feed(chunk)
                await resp.write_eof()
                return resp, False
        except ServerUnreachable as e:
            if collector is not None:
                collector.error = e.reason
                if collector.status == 0:
                    collector.status = 502
            if resp is None or not resp.prepared:
                log.warning("proxy: %s %s: the server is unreachable: %s", request.method, request.path, e.reason)
                return _error(502, f"the server at {self._upstream.base_url} is unreachable: {e.reason}",
                              "unavailable_error"), False
            log.warning("proxy: %s %s: the server's answer broke off: %s", request.method, request.path, e.reason)
            return resp, True
        except ConnectionResetError:  # a write to the client failed: it went away
            if collector is not None:
                collector.disconnected = True
            assert resp is not None
            return resp, False  # aiohttp sees the broken connection when it ends the response
        except asyncio.CancelledError:  # the client went away (aiohttp cancels the handler), or the proxy stops
            if collector is not None:
                collector.disconnected = True
                if self._stopping and collector.error is None:
                    collector.error = "the proxy stopped"
            raise


async def _ready_io_first() -> None:
    """Let the loop first run what the sockets have ready (the client reading its answer's end, other
    requests' bytes): the judging after an answer is bookkeeping, off every client's path. A callback
    due now runs after the I/O callbacks of its loop turn; one scheduled with ``call_soon`` would run
    before them."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    loop.call_at(loop.time(), _set_done, fut)
    await fut


def _set_done(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _cut(request: web.Request) -> None:
    """End the client's connection without a clean end of body."""
    if request.transport is not None:
        request.transport.close()


class _Pairs(Mapping[str, str]):
    """Header pairs (duplicates kept) behind the Mapping that ``forward`` takes."""

    def __init__(self, pairs: list[tuple[str, str]]):
        self._pairs = pairs

    def __getitem__(self, key: str) -> str:
        for k, v in self._pairs:
            if k.lower() == key.lower():
                return v
        raise KeyError(key)

    def __iter__(self):
        return (k for k, _ in self._pairs)

    def __len__(self) -> int:
        return len(self._pairs)

    def items(self):
        return list(self._pairs)
