"""The slot leases when the server dies under a request (issue #19, the server killed mid-generation):
the stream breaks before the supervisor sees the crash, so the request's slot is freed first, for a
reason not yet known, and the restart noticed after it is then that reason."""

from __future__ import annotations

from app.proxy.lease_table import SlotState
from app.core.conversation import Cause
from tests.unit.test_proxy_leases import FakeBackend, conv, make, store, turn  # noqa: F401  (store: fixture)


async def test_a_request_that_failed_just_before_a_restart_is_lost_to_the_restart(store):
    be = FakeBackend()
    leases = make(2, backend=be, store=store)
    a, b = conv("A"), conv("B")
    await turn(leases, be, a, 100)
    running = await leases.acquire(b, 200)
    leases.release(running, 0, ok=False)  # the stream broke: the server was killed
    assert leases.lost_cause("B") == (Cause.UNKNOWN, None)
    leases.note_server_restarted()  # the supervisor sees the crash after the proxy saw the broken stream
    assert leases.lost_cause("B") == (Cause.SERVER_RESTARTED, None)
    assert leases.lost_cause("A") == (Cause.SERVER_RESTARTED, None)
    assert all(v.state is SlotState.FREE for v in leases.snapshot())
    again = await leases.acquire(b, 200)
    assert again.restarted and again.slot_context.lost is Cause.SERVER_RESTARTED

