"""app.remote.batched_writes: the packets an SSH connection writes during one callback of the event loop
leave as one transport write, in order; a transport closed meanwhile gets none; the rest is the transport's."""

from __future__ import annotations

import asyncio
import logging

from app.remote.batched_writes import BatchedWrites, batch_writes


class Transport:
    def __init__(self):
        self.written: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 22)}.get(name, default)


async def turn() -> None:
    """The event loop's callbacks scheduled before this one have run."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    loop.call_soon(done.set_result, None)
    await done


class Conn:
    def __init__(self, transport):
        self._transport = transport


async def test_one_callbacks_writes_leave_together_in_order_and_the_next_ones_after():
    t = Transport()
    conn = Conn(t)
    assert batch_writes(conn) and batch_writes(conn)  # once: the second call keeps the first stand-in
    b = conn._transport
    assert isinstance(b, BatchedWrites) and b._transport is t
    for part in (b"ignore", b"data-1", b"ignore", b"data-2"):
        b.write(part)
    assert t.written == []  # not before this callback ends
    await turn()
    assert t.written == [b"ignoredata-1ignoredata-2"] and b.writes == 1
    b.write(b"disconnect")
    await turn()
    assert t.written[1:] == [b"disconnect"]  # one packet goes as it is
    assert b.get_extra_info("peername") == ("127.0.0.1", 22)


async def test_a_transport_closed_before_the_flush_is_not_written():
    t = Transport()
    b = BatchedWrites(t, asyncio.get_running_loop())
    b.write(b"late")
    t.closing = True
    await turn()
    assert t.written == [] and b.writes == 0


async def test_a_connection_without_a_transport_is_left_as_it_is(caplog):
    caplog.set_level(logging.INFO, logger="app.remote.batched_writes")
    conn = Conn(None)
    assert batch_writes(conn) is False and conn._transport is None
    assert "writing packet by packet" in caplog.text
