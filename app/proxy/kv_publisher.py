"""The ZMQ side of the proxy's KV events (:mod:`app.proxy.kv_events` builds them): a publisher socket
that sends each batch as vLLM's ``ZmqEventPublisher`` does (``vllm/distributed/kv_events.py``): the
multipart message ``[topic, seq, payload]``, ``seq`` an 8-byte big-endian counter from 0, so a
subscriber sees a gap when it missed one.

The socket is an XPUB, which a SUB socket (vLLM's subscriber example, Dynamo's relay) reads as it reads
a PUB, and which also tells the publisher when a subscriber arrives: it then gets the whole current
state (``AllBlocksCleared``, then every block held), so a router started after the proxy, or one that
reconnected, knows what the server holds without vLLM's replay socket (not offered here). That state
goes to every subscriber (a PUB socket cannot address one): to the others it is the same truth again.

It binds (the consumer connects, as to vLLM's ``tcp://*:5557``); the endpoint is the user's, on
127.0.0.1 unless they name another address, which shows every conversation's token ids to whoever
can reach it. Sending never blocks the proxy's loop: the socket drops what a slow subscriber cannot
take (past its high-water mark) instead of waiting.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable

import zmq
import zmq.asyncio

from app.core.background import TaskGroup
from app.proxy.kv_events import Event, encode_batch

log = logging.getLogger(__name__)

#: batches a slow subscriber may fall behind before the socket drops them for it (vLLM's default)
HWM = 100_000


class KvEventPublisher:
    """One XPUB socket bound at ``endpoint`` (``tcp://127.0.0.1:5557``, ``ipc:///path``, a
    ``tcp://127.0.0.1:*`` port of the system's choice). ``on_subscribe()`` is called when a subscriber
    to this topic arrives (on the running loop)."""

    def __init__(self, endpoint: str, *, topic: str = "", on_subscribe: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.endpoint, self.topic = endpoint, topic.encode("utf-8")
        self._clock = clock
        self._seq = 0
        self._on_subscribe = on_subscribe
        self._socket = zmq.asyncio.Context.instance().socket(zmq.XPUB)
        self._socket.setsockopt(zmq.SNDHWM, HWM)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's arrival, not only a topic's first
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError:
            self._socket.close()
            raise
        #: the address bound (a ``tcp://…:*`` endpoint gets its port here)
        self.bound = self._socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.sent = 0
        self._tasks = TaskGroup("the KV events' socket")
        self._tasks.start(self._listen(), f"subscribers of {self.bound}")

    async def _listen(self) -> None:
        """Subscriptions as they arrive: ``\\x01`` and the topic prefix subscribed to."""
        while True:
            try:
                frame = await self._socket.recv()
            except zmq.ZMQError as e:
                if self._socket.closed or e.errno == zmq.ENOTSOCK:
                    return
                raise
            if frame[:1] == b"\x01" and self.topic.startswith(frame[1:]) and self._on_subscribe is not None:
                self._on_subscribe()

    def publish(self, events: Iterable[Event]) -> None:
        """Send ``events`` as one batch (nothing when there are none)."""
        events = list(events)
        if not events or self._socket.closed:
            return
        payload = encode_batch(self._clock(), events)
        try:
            self._socket.send_multipart([self.topic, self._seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        except zmq.Again:  # the socket drops rather than blocks; said all the same
            log.warning("KV events batch %d dropped: no room on %s", self._seq, self.bound)
        self._seq += 1
        self.sent += 1

    async def close(self) -> None:
        await self._tasks.cancel_all()
        self._socket.close(linger=0)
