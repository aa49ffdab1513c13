"""One socket write per turn of the event loop for an SSH connection, not one per SSH packet.

asyncssh hands each packet it sends to its transport on its own: a data packet of at most the
channel's packet size (32 KiB from OpenSSH's sshd), and before each one an SSH_MSG_IGNORE packet, so
a 1 GiB upload made about 74,000 ``send()`` system calls (a fifth of the sender's time in a profile
of ``tests/bench/bench_move.py``, where the move was 1.28x scp's time at 1 GiB). :class:`BatchedWrites`
stands between the connection and its transport: the packets written during one callback of the
event loop go out as one write at the start of the next, in the order they were written.

The connection's transport is asyncssh's private attribute ``_transport`` (set when the connection
is made, reset to None when it closes); where a later asyncssh names it otherwise, nothing is
wrapped and the connection works as before, only slower (:func:`batch_writes` says False, logged).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import asyncssh

log = logging.getLogger(__name__)


class BatchedWrites:
    """A transport's stand-in: :meth:`write` queues; the queue goes to the transport as one write in
    a callback scheduled by the first write after a flush. Everything else is the transport's.

    A close or an abort the connection schedules after its last writes (asyncssh's ``call_soon``)
    runs after the flush scheduled before it, so a disconnect message still leaves first."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self._queued: list[bytes] = []
        self.writes = 0  # writes made to the transport (for the tests)

    def write(self, data: bytes) -> None:
        if not self._queued:
            self._loop.call_soon(self._flush)
        self._queued.append(data)

    def _flush(self) -> None:
        queued, self._queued = self._queued, []
        if not queued or self._transport.is_closing():
            return  # closed meanwhile: the connection has seen (or will see) its loss
        self.writes += 1
        try:
            self._transport.write(queued[0] if len(queued) == 1 else b"".join(queued))
        except ConnectionError as e:  # report: as asyncssh's own write would; the loss reaches the connection
            log.debug("ssh connection: a write failed (%s)", e)

    def __getattr__(self, name: str) -> Any:  # get_extra_info, close, abort, is_closing, ...
        return getattr(self._transport, name)


def batch_writes(conn: Any) -> bool:
    """Put :class:`BatchedWrites` between asyncssh connection ``conn`` and its transport (once).
    False when ``conn`` has no transport where this asyncssh version keeps it."""
    transport = getattr(conn, "_transport", None)
    if isinstance(transport, BatchedWrites):
        return True
    if transport is None or not callable(getattr(transport, "write", None)):
        log.info("ssh connection: asyncssh %s keeps no _transport to batch writes on; writing packet by packet",
                 asyncssh.__version__)
        return False
    conn._transport = BatchedWrites(transport, asyncio.get_running_loop())
    return True

