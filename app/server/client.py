"""The one HTTP client for llama-server (async, httpx).

One long-lived ``httpx.AsyncClient`` per server URL. Every request has a
timeout; slot save/restore get a long one of their own because 100K-token
states take minutes on real GPUs. Errors become ``ServerError`` (the server
answered with an error body) or ``ServerUnreachable`` (no answer at all).

The proxy's pass-through (:meth:`LlamaClient.forward`) to a server reached over plain TCP goes
through aiohttp's client instead (its session made on the loop that first forwards): every chat
request of the proxy makes this hop, and httpx's (h11, anyio, its cookie jar, all in Python) cost
about 1 ms of CPU per request where aiohttp's C parser costs 0.1 ms (measured for issue #38 item
3, the proxy's added latency). Once this client has forwarded on the running loop (a proxy's client),
its own JSON requests take that session too: the slot reads, restores and parks, and the token checks
the proxy makes on a request's path (a restore's own cost fell from 2.1 to 1.65 ms at the median in
``bench_proxy``, 5 December 2026). A server reached through a custom transport (an SSH channel, a
test's mock) keeps httpx for it too. aiohttp is imported by the first forward (a CLI command that only
asks the server something does not pay for its import).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from json import dumps as _json_dumps
from json import loads as _json_loads
from typing import Any
from urllib.parse import urlencode

import httpx

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 10.0
SLOT_ACTION_TIMEOUT = 30 * 60.0  # 100K-token states: minutes, not seconds
COMPLETION_TIMEOUT = 60 * 60.0  # a full re-prefill of 100K tokens took 12 min in the seeds
# forward(): a connection is quick to make, but a prefill sends nothing for minutes
FORWARD_TIMEOUT = httpx.Timeout(COMPLETION_TIMEOUT, connect=DEFAULT_TIMEOUT)
STALE_RETRIES = 2  # forward(): a pooled connection the server had closed is retried on another
#: request headers forward() never passes on: hop-by-hop (RFC 9110 7.6.1) and what httpx sets
#: itself (host, content-length); authorization and x-api-key are the proxy client's, never
#: the server's (the client's own key replaces them), accept-encoding is asked as identity.
NOT_FORWARDED = frozenset({
    "connection", "keep-alive", "transfer-encoding", "te", "trailer", "trailers", "upgrade", "host",
    "content-length", "expect", "authorization", "x-api-key", "accept-encoding",
})


class ServerError(Exception):
    """The server answered with an error (``{"error": {"code","message","type"}}``)."""

    def __init__(self, status: int, message: str, type_: str = "", path: str = ""):
        self.status = status
        self.message = message
        self.type = type_
        self.path = path
        super().__init__(f"{path}: HTTP {status}: {message}" if path else f"HTTP {status}: {message}")


class ServerUnreachable(Exception):
    def __init__(self, url: str, reason: str):
        self.url = url
        self.reason = reason
        self.status = None
        self.message = reason
        super().__init__(f"cannot reach {url}: {reason}")


@dataclass(frozen=True)
class Health:
    status: int  # HTTP status; 0 when unreachable
    ok: bool
    loading: bool
    message: str


class LlamaClient:
    def __init__(self, base_url: str, api_key: str | None = None, *, transport: httpx.AsyncBaseTransport | None = None,
                 network_backend: Any = None):
        """``network_backend``: an httpcore network backend that opens the connections instead of
        TCP sockets (app.remote: SSH channels to a remote host's loopback server)."""
        self.base_url = base_url.rstrip("/")
        if network_backend is not None and transport is None:
            transport = _transport_over(network_backend)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._auth = headers.get("Authorization")  # forward()'s, on the aiohttp path
        # forward() over aiohttp: only to a server reached over plain TCP (see the module's doc)
        self._plain_tcp = transport is None
        self._aio: Any = None  # an aiohttp.ClientSession
        self._aio_loop: asyncio.AbstractEventLoop | None = None
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=DEFAULT_TIMEOUT,
            transport=transport,
            # Loopback server: never route through a proxy from the environment.
            trust_env=False,
        )

    async def aclose(self) -> None:
        aio, self._aio = self._aio, None
        if aio is not None and self._aio_loop is asyncio.get_running_loop():
            await aio.close()
        await self._client.aclose()

    async def __aenter__(self) -> "LlamaClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _request(self, method: str, path: str, *, json: Any = None, timeout: float | None = None,
                       params: dict | None = None) -> httpx.Response:
        try:
            return await self._client.request(
                method, path, json=json, params=params,
                timeout=timeout if timeout is not None else DEFAULT_TIMEOUT,
            )
        except httpx.TimeoutException as e:
            raise ServerUnreachable(self.base_url, f"timed out ({type(e).__name__})") from None
        except httpx.TransportError as e:
            raise ServerUnreachable(self.base_url, _transport_reason(e)) from None

    async def _json(self, method: str, path: str, *, json: Any = None, timeout: float | None = None,
                    params: dict | None = None) -> Any:
        """The JSON answer of a request (``ServerError``, ``ServerUnreachable``). Once this client has
        forwarded on the running loop (a proxy's client: its slot reads, restores and parks, its token
        checks sit on a request's path), over the forward's aiohttp session: the same request and the
        same errors, for a tenth of httpx's CPU."""
        if self._aio is not None and self._aio_loop is asyncio.get_running_loop() and not self._aio.closed:
            return await self._json_aio(method, path, json, timeout, params)
        r = await self._request(method, path, json=json, timeout=timeout, params=params)
        return _decode(r, path)

    async def _json_aio(self, method: str, path: str, body: Any, timeout: float | None,
                        params: dict | None) -> Any:
        target = path + ("?" + urlencode(params) if params else "")
        headers = [("Accept", "*/*"), ("accept-encoding", "identity")]
        content = None
        if body is not None:
            content = _json_dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
            headers.append(("Content-Type", "application/json"))
        async with self._forward_aio(method, target, headers, content,
                                     DEFAULT_TIMEOUT if timeout is None else timeout, False) as r:
            raw = await r.aread()
        return _decode_raw(r.status_code, r.reason_phrase, raw, path)

    @contextlib.asynccontextmanager
    async def forward(self, method: str, path: str, *, headers: Mapping[str, str], content: bytes | None,
                      params: Mapping[str, str] | None = None, timeout: float | None = None,
                      anonymous: bool = False, on_sent: Callable[[], None] | None = None
                      ) -> AsyncIterator[httpx.Response]:
        """Send a request as a proxy passes it on, and yield the response unread (streaming): the
        caller reads ``status_code``, ``headers`` and ``aiter_raw()`` chunks as they come.

        ``path`` is the raw path and query (``/slots/0?action=save``), sent to this server whatever
        it holds (never another host). Hop-by-hop headers, ``host`` and ``content-length`` are not
        passed on; the caller's ``authorization`` (and ``x-api-key``) is replaced by this client's
        own key, if it has one; the body is asked for uncompressed, so the raw bytes are the
        server's text; ``anonymous``: sent with no key at all (the server decides whether it serves the
        path publicly). ``timeout``: seconds between bytes (default an hour: a long prefill sends
        nothing); connecting gives up after ``DEFAULT_TIMEOUT``.

        Connections: from (and back to) this client's keep-alive pool. Leaving the block before
        the body is read closes the connection, which makes llama-server stop generating. After an
        event stream llama-server (b11434) closes the connection although it announced keep-alive,
        so that connection is shut here rather than pooled (the next request would race the close);
        a request that meets a pooled connection the server closed before answering is sent again
        on another, at most ``STALE_RETRIES`` times.

        ``on_sent``: called once, as soon as the request's body was handed to the connection (over
        aiohttp: the server has it to work on while the caller does what it held back), at the latest
        with the answer's head (no body, or over httpx); an exception it raises is logged.

        Errors: ``ServerUnreachable`` when the server cannot be reached or the connection breaks
        (also while the caller reads the body); ``ValueError`` for a path that is not a path."""
        if on_sent is not None:
            on_sent = _once(on_sent)
        if not path.startswith("/"):
            raise ValueError(f"not a path: {path[:80]!r}")
        listed = {t.strip().lower() for k, v in headers.items() if k.lower() == "connection" for t in v.split(",")}
        out = [(k, v) for k, v in headers.items()
               if (low := k.lower()) not in NOT_FORWARDED and low not in listed and not low.startswith("proxy-")]
        out.append(("accept-encoding", "identity"))
        if self._plain_tcp and params is None:
            async with self._forward_aio(method, path, out, content, timeout, anonymous, on_sent) as r:
                yield r
            return
        base = self._client.base_url
        url = base.copy_with(raw_path=base.raw_path.rstrip(b"/") + path.encode("ascii", "strict"))
        t = FORWARD_TIMEOUT if timeout is None else httpx.Timeout(timeout, connect=DEFAULT_TIMEOUT)
        request = self._client.build_request(method, url, headers=out, content=content, params=params, timeout=t)
        if anonymous:
            for name in ("authorization", "x-api-key"):
                request.headers.pop(name, None)
        for attempt in range(STALE_RETRIES + 1):
            try:
                r = await self._client.send(request, stream=True)
                if on_sent is not None:
                    on_sent()
                break
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
                if attempt == STALE_RETRIES:  # not a stale connection: the server breaks them
                    raise ServerUnreachable(self.base_url, _transport_reason(e)) from None
            except httpx.TimeoutException as e:
                raise ServerUnreachable(self.base_url, f"timed out ({type(e).__name__})") from None
            except httpx.TransportError as e:
                raise ServerUnreachable(self.base_url, _transport_reason(e)) from None
        try:
            yield r
        except httpx.TimeoutException as e:
            raise ServerUnreachable(self.base_url, f"timed out ({type(e).__name__})") from None
        except httpx.TransportError as e:
            raise ServerUnreachable(self.base_url, _transport_reason(e)) from None
        finally:
            if r.headers.get("content-type", "").startswith("text/event-stream"):
                _shut_connection(r)
            await r.aclose()

    def _session(self) -> Any:
        """forward()'s aiohttp session, on the running loop (a new one when the loop changed)."""
        import aiohttp

        loop = asyncio.get_running_loop()
        if self._aio is None or self._aio.closed or self._aio_loop is not loop:
            self._aio_loop = loop
            # no cookie jar (a proxy keeps no server's cookies), llama-server's long header lines taken
            self._aio = aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False,
                                              max_line_size=65536, max_field_size=65536)
        return self._aio

    @contextlib.asynccontextmanager
    async def _forward_aio(self, method: str, path: str, headers: list[tuple[str, str]], content: bytes | None,
                           timeout: float | None, anonymous: bool,
                           on_sent: Callable[[], None] | None = None) -> AsyncIterator["_Forwarded"]:
        """forward() over aiohttp, with httpx's behaviour: no redirect followed, no ``Content-Type``
        made up for a body sent without one, the same errors, retries and connection handling."""
        import aiohttp
        import yarl

        if self._auth is not None and not anonymous:
            headers = headers + [("Authorization", self._auth)]
        url = yarl.URL(self.base_url + path, encoded=True)
        t = aiohttp.ClientTimeout(total=None, sock_connect=DEFAULT_TIMEOUT,
                                  sock_read=COMPLETION_TIMEOUT if timeout is None else timeout)
        session = self._session()
        data: Any = content
        if on_sent is not None and content:
            data = _telling_payload()(content, on_sent)
        for attempt in range(STALE_RETRIES + 1):
            try:
                r = await session.request(method, url, headers=headers, data=data, timeout=t,
                                          allow_redirects=False, skip_auto_headers=("Content-Type",))
                if on_sent is not None:
                    on_sent()  # (no body: with the answer's head)
                break
            except aiohttp.ClientConnectorError as e:
                raise ServerUnreachable(self.base_url, _aio_reason(e)) from None
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                    getattr(aiohttp, "ClientConnectionResetError", aiohttp.ServerDisconnectedError)) as e:
                if attempt == STALE_RETRIES:  # not a stale connection: the server breaks them
                    raise ServerUnreachable(self.base_url, _aio_reason(e)) from None
            except aiohttp.ClientError as e:  # a timeout among them
                raise ServerUnreachable(self.base_url, _aio_reason(e)) from None
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            # never pooled (see forward()): aiohttp hands a connection back at the body's end, already done
            # when the whole answer came with its headers (then the connection is closed now; its bytes are read)
            if r.connection is not None:
                r.connection.protocol.force_close()
            elif (proto := getattr(r, "_protocol", None)) is not None:
                proto.close()
        try:
            yield _Forwarded(r, self.base_url)
        finally:
            if r.content.at_eof():
                r.release()
            else:
                r.close()  # an answer left unread: closing its connection makes llama-server stop generating

    # -- endpoints -----------------------------------------------------
    async def health(self, timeout: float = 2.0) -> Health:
        try:
            r = await self._request("GET", "/health", timeout=timeout)
        except ServerUnreachable as e:
            return Health(0, False, False, e.reason)
        if r.status_code == 200:
            return Health(200, True, False, "ok")
        msg = _error_message(r)
        return Health(r.status_code, False, r.status_code == 503, msg)

    async def props(self) -> dict:
        return await self._json("GET", "/props")

    async def slots(self) -> list[dict]:
        return await self._json("GET", "/slots")

    async def save_slot(self, slot_id: int, filename: str) -> dict:
        return await self._slot_action(slot_id, "save", {"filename": filename})

    async def restore_slot(self, slot_id: int, filename: str) -> dict:
        return await self._slot_action(slot_id, "restore", {"filename": filename})

    async def erase_slot(self, slot_id: int) -> dict:
        return await self._slot_action(slot_id, "erase", None)

    async def _slot_action(self, slot_id: int, action: str, body: dict | None) -> dict:
        return await self._json(
            "POST", f"/slots/{int(slot_id)}", params={"action": action}, json=body,
            timeout=SLOT_ACTION_TIMEOUT,
        )

    async def completion(self, prompt: str | list[int], *, slot_id: int | None = None, n_predict: int = 8,
                         cache_prompt: bool = True, extra: dict | None = None) -> dict:
        body: dict[str, Any] = {"prompt": prompt, "n_predict": n_predict, "cache_prompt": cache_prompt,
                                "stream": False}
        if slot_id is not None:
            body["id_slot"] = slot_id
        if extra:
            body.update(extra)
        t0 = time.perf_counter()
        result = await self._json("POST", "/completion", json=body, timeout=COMPLETION_TIMEOUT)
        result.setdefault("_client_ms", (time.perf_counter() - t0) * 1000.0)
        return result

    async def stream_completion(self, prompt: str | list[int], *, slot_id: int | None = None, n_predict: int = 64,
                                cache_prompt: bool = True, extra: dict | None = None,
                                timeout: float = COMPLETION_TIMEOUT) -> AsyncIterator[dict]:
        """``POST /completion`` with ``"stream": true``: yields each server-sent event's JSON
        object (``data: {...}``) as it arrives, the last one with ``"stop": true`` and its
        ``timings``. Close the generator (``contextlib.aclosing``) or cancel its consumer to
        drop the request; the server stops the task when the connection goes.

        Errors: ``ServerError`` (an HTTP error, or an ``error`` event in the stream),
        ``ServerUnreachable`` (no answer, or the connection broke)."""
        body: dict[str, Any] = {"prompt": prompt, "n_predict": n_predict, "cache_prompt": cache_prompt,
                                "stream": True}
        if slot_id is not None:
            body["id_slot"] = slot_id
        if extra:
            body.update(extra)
        path = "/completion"
        try:
            async with self._client.stream("POST", path, json=body,
                                           timeout=httpx.Timeout(timeout, connect=DEFAULT_TIMEOUT)) as r:
                if r.status_code >= 400:
                    await r.aread()
                    _decode(r, path)  # raises ServerError
                try:
                    async for event in _events(r, path):
                        yield event
                finally:
                    # b11434 closes a streamed answer's connection while announcing keep-alive: never
                    # hand it back to the pool (the shared client's next request would meet it closed)
                    _shut_connection(r)
        except httpx.TimeoutException as e:
            raise ServerUnreachable(self.base_url, f"timed out ({type(e).__name__})") from None
        except httpx.TransportError as e:
            raise ServerUnreachable(self.base_url, _transport_reason(e)) from None

    async def tokenize(self, content: str) -> list[int]:
        return (await self._json("POST", "/tokenize", json={"content": content}))["tokens"]

    async def token_ids(self, content: str) -> list[int]:
        """The ids of :meth:`tokenize_pieces` without their pieces (no BOS added, special tokens parsed):
        a third less time at the server and on the wire for a long text."""
        body = {"content": content, "add_special": False, "parse_special": True}
        return [int(t) for t in (await self._json("POST", "/tokenize", json=body))["tokens"]]

    async def tokenize_pieces(self, content: str) -> list[tuple[int, str]]:
        """(id, text) of each token of ``content`` (no BOS added, special tokens parsed). A piece that
        is not valid UTF-8 comes as its bytes: decoded here with replacement characters."""
        body = {"content": content, "add_special": False, "parse_special": True, "with_pieces": True}
        out = []
        for t in (await self._json("POST", "/tokenize", json=body))["tokens"]:
            piece = t.get("piece", "")
            out.append((int(t["id"]), piece if isinstance(piece, str) else bytes(piece).decode("utf-8", "replace")))
        return out

    async def apply_template(self, body: dict) -> str:
        """The prompt the server renders for a chat request ``body`` (``POST /apply-template``)."""
        return (await self._json("POST", "/apply-template", json=body))["prompt"]

    async def detokenize(self, tokens: list[int]) -> str:
        return (await self._json("POST", "/detokenize", json={"tokens": tokens}))["content"]

    async def metrics(self) -> str:
        r = await self._request("GET", "/metrics")
        if r.status_code != 200:
            raise ServerError(r.status_code, _error_message(r), path="/metrics")
        return r.text


def _decode(r: httpx.Response, path: str) -> Any:
    return _decode_raw(r.status_code, r.reason_phrase, r.content, path)


def _decode_raw(status: int, reason: str, raw: bytes, path: str) -> Any:
    """An answer's JSON; ``ServerError`` for an error status (the server's message) or a body not JSON."""
    try:
        body = _json_loads(raw)
    except ValueError:
        body = None
    if status >= 400:
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict):
            raise ServerError(status, str(err.get("message", "")), str(err.get("type", "")), path)
        raise ServerError(status, raw.decode("utf-8", "replace")[:300] or reason, "", path)
    if body is None:
        raise ServerError(status, f"not JSON: {raw.decode('utf-8', 'replace')[:200]!r}", "", path)
    return body


def _safe_json(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return None


def _error_message(r: httpx.Response) -> str:
    body = _safe_json(r)
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", ""))
    return r.text[:200]


async def _events(r: httpx.Response, path: str) -> AsyncIterator[dict]:
    """The JSON objects of a server-sent event stream, until ``[DONE]``; an ``error`` raises."""
    async for line in r.aiter_lines():
        if not line or line.startswith(":"):
            continue  # event separator, SSE comment
        field, _, value = line.partition(":")
        value = value.strip()
        if field == "data" and value == "[DONE]":
            return
        if field not in ("data", "error"):
            continue
        try:
            event = _json_loads(value)
        except ValueError:
            raise ServerError(r.status_code, f"bad event in the stream: {line[:200]!r}", "", path) from None
        err = event.get("error") if isinstance(event, dict) else None
        if field == "error" or err is not None:
            err = err if isinstance(err, dict) else (event if isinstance(event, dict) else {})
            code = err.get("code")
            raise ServerError(code if isinstance(code, int) else r.status_code,
                              str(err.get("message", event)), str(err.get("type", "")), path)
        yield event


def _transport_over(network_backend: Any) -> httpx.AsyncBaseTransport:
    """httpx's own transport (request and response mapping, errors) on a pool whose connections
    ``network_backend`` opens: httpx 0.28 takes no backend argument, so its pool is replaced
    (tests/ssh drive a real server through it)."""
    import httpcore

    transport = httpx.AsyncHTTPTransport()
    transport._pool = httpcore.AsyncConnectionPool(network_backend=network_backend, max_connections=10)
    return transport


def _shut_connection(r: httpx.Response) -> None:
    """Shut the response's socket: the pool then sees the connection closed (readable at EOF) and
    drops it instead of handing it to the next request."""
    stream = r.extensions.get("network_stream")
    sock = stream.get_extra_info("socket") if stream is not None else None
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed


class _Forwarded:
    """An aiohttp answer as forward() yields it: what the proxy reads of httpx's response. Reading
    its body raises ``ServerUnreachable`` when the connection breaks; nothing else is turned into it
    (a write to the proxy's own client that fails raises aiohttp's ConnectionResetError, a ClientError
    too, and must stay the client's going away)."""

    def __init__(self, r: Any, base_url: str):  # an aiohttp.ClientResponse
        self._r = r
        self._url = base_url
        self.status_code = r.status
        self.reason_phrase = r.reason or ""
        self.headers = _ForwardedHeaders(r)

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (chunked framing removed, nothing decompressed)."""
        import aiohttp

        it = self._r.content.iter_any().__aiter__()
        while True:
            try:
                chunk = await it.__anext__()
            except StopAsyncIteration:
                return
            except aiohttp.ClientError as e:
                raise ServerUnreachable(self._url, _aio_reason(e)) from None
            yield chunk

    async def aread(self) -> bytes:
        import aiohttp

        try:
            return await self._r.read()
        except aiohttp.ClientError as e:
            raise ServerUnreachable(self._url, _aio_reason(e)) from None


class _ForwardedHeaders:
    """The answer's headers: ``raw`` as the server wrote them, ``get`` and ``in`` without case."""

    def __init__(self, r: Any):
        self.raw = r.raw_headers
        self._h = r.headers

    def get(self, name: str, default: Any = None) -> Any:
        return self._h.get(name, default)

    def __contains__(self, name: object) -> bool:
        return name in self._h


def _aio_reason(e: Exception) -> str:
    """What went wrong, in the words httpx's path gives."""
    import aiohttp

    if isinstance(e, aiohttp.ClientConnectorError) and isinstance(e.os_error, ConnectionRefusedError):
        return "connection refused (is the server running?)"
    if isinstance(e, asyncio.TimeoutError):
        return f"timed out ({type(e).__name__})"
    return str(e) or type(e).__name__


def _transport_reason(e: Exception) -> str:
    text = str(e) or type(e).__name__
    if "Connection refused" in text or "ConnectError" in type(e).__name__:
        return "connection refused (is the server running?)"
    return text


def _once(cb: Callable[[], None]) -> Callable[[], None]:
    """``cb`` called at its first call only, an exception it raises logged (it runs inside the body's write)."""
    told = False

    def call() -> None:
        nonlocal told
        if told:
            return
        told = True
        try:
            cb()
        except Exception:  # report: the request goes on; the caller's own work failed
            log.exception("the work held until a forwarded request was sent failed")
    return call


_TELLING: Any = None


def _telling_payload() -> Any:
    """aiohttp's bytes body that calls ``on_sent`` once its bytes are written (made at the first use: aiohttp
    is imported by the first forward)."""
    global _TELLING
    if _TELLING is None:
        from aiohttp import payload

        class TellingBytes(payload.BytesPayload):
            def __init__(self, value: bytes, on_sent: Callable[[], None]):
                super().__init__(value)
                self._on_sent = on_sent

            async def write_with_length(self, writer: Any, content_length: int | None) -> None:
                await super().write_with_length(writer, content_length)
                self._on_sent()

        _TELLING = TellingBytes
    return _TELLING

