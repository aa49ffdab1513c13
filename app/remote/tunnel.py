"""HTTP to a remote host's loopback server through SSH ``direct-tcpip`` channels.

An httpcore network backend: every TCP connection the HTTP pool would open is an SSH
channel of the host's one connection instead, opened to the address as the remote host
sees it (``127.0.0.1:8080`` is the host's own loopback). Nothing listens on a port, here
or there: no ``forward_local_port``, no socket a local process could reach.
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterable

import asyncssh
import httpcore

#: bytes of one channel read (asyncssh's own window is 2 MiB)
_READ_CHUNK = 256 * 1024


class SSHChannelStream(httpcore.AsyncNetworkStream):
    """One ``direct-tcpip`` channel as httpcore's network stream."""

    def __init__(self, reader: asyncssh.SSHReader, writer: asyncssh.SSHWriter, where: str):
        self._reader = reader
        self._writer = writer
        self._where = where

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            return await asyncio.wait_for(self._reader.read(max_bytes), timeout)
        except asyncio.TimeoutError:
            raise httpcore.ReadTimeout(f"no answer from {self._where} through SSH in {timeout} s") from None
        except (asyncssh.Error, OSError) as e:
            raise httpcore.ReadError(f"SSH channel to {self._where}: {e}") from None

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        try:
            self._writer.write(buffer)
            await asyncio.wait_for(self._writer.drain(), timeout)
        except asyncio.TimeoutError:
            raise httpcore.WriteTimeout(f"{self._where} took no data through SSH in {timeout} s") from None
        except (asyncssh.Error, OSError, BrokenPipeError) as e:
            raise httpcore.WriteError(f"SSH channel to {self._where}: {e}") from None

    async def aclose(self) -> None:
        self._writer.close()
        try:
            await self._writer.channel.wait_closed()
        except (asyncssh.Error, OSError):
            pass  # the connection went first: the channel is closed all the same

    async def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("TLS through the SSH tunnel is not supported: the server is on the host's loopback")

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":  # the pool drops a kept-alive connection the server closed
            return self._reader.at_eof()
        return None


class SSHNetworkBackend(httpcore.AsyncNetworkBackend):
    """Opens each connection as a channel of ``conn`` (an :class:`asyncssh.SSHClientConnection`,
    or a zero-argument coroutine function returning one: the host connects on first use)."""

    def __init__(self, conn_or_factory: Any, host_label: str = "the host"):
        self._conn = conn_or_factory
        self._label = host_label

    async def _connection(self) -> asyncssh.SSHClientConnection:
        if isinstance(self._conn, asyncssh.SSHClientConnection):
            return self._conn
        return await self._conn()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        where = f"{host}:{port} on {self._label}"
        try:
            conn = await asyncio.wait_for(self._connection(), timeout)
            reader, writer = await asyncio.wait_for(conn.open_connection(host, port), timeout)
        except asyncio.TimeoutError:
            raise httpcore.ConnectTimeout(f"opening an SSH channel to {where} took over {timeout} s") from None
        except asyncssh.ChannelOpenError as e:
            # sshd says "Connection refused" when nothing listens there on the host
            raise httpcore.ConnectError(f"{where}: {e.reason or e}") from None
        except (asyncssh.Error, OSError) as e:
            raise httpcore.ConnectError(f"SSH to {self._label}: {e}") from None
        return SSHChannelStream(reader, writer, where)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("unix sockets are not forwarded")

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
