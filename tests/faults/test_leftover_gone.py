"""A leftover server that goes away while it is being adopted (seen running llama.cpp's own server
tests through the proxy: the previous `kv-valet serve` was killed mid-stop, its server still
stopping). The launch that follows must not fail on it: it is reported, stopped as before, and the
launch goes on."""

from __future__ import annotations

from app.core.profile import LaunchProfile
from app.servers.events import Notice
from app.servers.launch import adopt_leftovers


class _Rec:
    pid, url = 4242, "http://127.0.0.1:1"

    def is_alive(self) -> bool:
        return False


class _Front:
    async def save_leftover(self, servers, handle, profile, rec):
        raise ConnectionError("cannot reach http://127.0.0.1:1: connection refused")


class _Servers:
    def __init__(self):
        self.front, self.events, self.calls = _Front(), [], []

    def leftovers(self, names):
        return [_Rec()]

    def notify(self, ev):
        self.events.append(ev)

    async def attach(self, url, leftover=None):
        self.calls.append(("attach", url))
        return type("H", (), {"id": "t1"})()

    async def park_then_stop(self, tid, trigger):  # not reached: the save failed first
        raise AssertionError("park after a failed save")

    async def remove(self, tid):
        self.calls.append(("remove", tid))

    async def stop_leftover(self, rec):
        self.calls.append(("stop_leftover", rec.pid))


async def test_a_leftover_gone_mid_adoption_is_reported_and_stopped_and_the_launch_goes_on(tmp_path):
    servers = _Servers()
    said = await adopt_leftovers(servers, LaunchProfile(name="p", model=str(tmp_path / "m.gguf")))
    assert servers.calls == [("attach", "http://127.0.0.1:1"), ("remove", "t1"), ("stop_leftover", 4242)]
    assert len(said) == 1 and "went away while being adopted" in said[0] and "connection refused" in said[0]
    failed = [e for e in servers.events if isinstance(e, Notice) and not e.ok]
    assert failed and "nothing saved" in failed[-1].message
