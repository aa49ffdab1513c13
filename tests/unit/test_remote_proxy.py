"""The proxy here in front of a host's server (app.proxy.remote): its slot operations go through the one
door to a server's slots (SessionBackend over the host's RemoteSessions), which are the host's own
``kv-valet park|resume --json``, argv lists; its refusals say the remedy. A stand-in host answers the
JSON a host's kv-valet prints (the real one over a real sshd: tests/ssh/test_ssh_proxy.py)."""

from __future__ import annotations

import re

import pytest

from app.core.conversation import Cause
from app.proxy.explain import USELESS_RESTORE, _restore_avoided
from app.proxy.lease_parks import RestoreAvoided
from app.proxy.remote import RemoteProxyError, start_remote_proxy
from app.proxy.session_backend import RestoreFor, SessionBackend
from app.servers.remote_sessions import RemoteSessions
from app.sessions.resume import ResumeFailed
from app.sessions.service import ServiceError


def backend_of(host) -> tuple[SessionBackend, RemoteSessions]:
    sessions = RemoteSessions(host, "big")
    return SessionBackend.of(None, sessions), sessions


class Host:
    name = "box"

    def __init__(self, answers=None, profiles=None):
        self.answers = answers or {}
        self.calls: list[list[str]] = []
        self._profiles = profiles or []

    async def run_cli(self, argv, **kw):
        self.calls.append(list(argv))
        return self.answers[argv[0]]

    async def run_cli_as_is(self, argv, **kw):
        self.calls.append(list(argv))
        return 0, "", ""

    async def profiles(self):
        return self._profiles


async def test_a_park_and_a_restore_are_the_hosts_own():
    host = Host({"park": {"ok": True, "sessions": [{"session": "proxy-c1", "slot": 1, "tokens": 300,
                                                     "state_size": 1000, "sidecar_size": 24}]},
                 "resume": {"ok": True, "session": "proxy-c1", "slot": 1, "tokens": 300, "restore_ms": 12.0}})
    backend, sessions = backend_of(host)
    assert await backend.save(1, "proxy-c1") == 300
    assert backend.parked_size("proxy-c1") == 1024
    backend.requests["proxy-c1"] = RestoreFor("/v1/chat/completions", {"messages": []})  # a chat turn's restore
    assert await backend.restore(1, "proxy-c1") == 300
    backend.delete_park("proxy-c1")
    await sessions.settled()
    # the host's own checks, as the proxy makes them here: never onto another chat's checkpoints, never
    # where a restore buys the turn nothing, never a park whose files changed; no listing asked (nobody
    # shows this server's sessions list)
    assert host.calls == [["park", "big", "--json", "--slot", "1", "--name", "proxy-c1"],
                          ["resume", "big", "proxy-c1", "--json", "--yes", "--slot", "1", "--unless-hazard",
                           "--unless-useless", "chat", "--unless-files-changed"],
                          ["sessions", "rm", "proxy-c1", "--profile", "big"]]
    assert backend.parked_size("proxy-c1") == 0


async def test_a_refused_park_raises_with_the_hosts_reason():
    host = Host({"park": {"ok": False, "error": "no space left on the host's disk", "exit": 1}})
    backend, _ = backend_of(host)
    with pytest.raises(ServiceError, match="no space left"):
        await backend.save(0, "proxy-c1")


async def test_a_park_whose_files_changed_on_the_host_stays_parked_and_is_explained():
    """The host's kv-valet leaves it parked (--unless-files-changed) and says why in the words the proxy's
    explanation reads: the restore is avoided, not failed (the tests/fake_server/test_park_files_cli.py
    case shows the host's side)."""
    host = Host({"resume": {"ok": False, "error": "its files are not the ones parked: 'proxy-c1' was left parked",
                            "details": ["not the sidecar this session parked (s.bin.ckpt): last checkpoint at "
                                        "1,923, parked with 2,185"], "exit": 1, "refused": "files-changed"}})
    backend, _ = backend_of(host)
    with pytest.raises(RestoreAvoided) as caught:
        await backend.restore(1, "proxy-c1")
    assert str(caught.value) == ("its files are not the ones parked: not the sidecar this session parked (s.bin.ckpt): "
                                 "last checkpoint at 1,923, parked with 2,185")
    said = _restore_avoided("proxy-c1", str(caught.value), None)
    assert said.cause is Cause.PARK_NOT_ITS_OWN and "last checkpoint at 1,923, parked with 2,185" in said.detail
    # the host's other refusals, as a server here makes them: a hazard, a restore that buys nothing
    host.answers["resume"] = {"ok": False, "error": "'proxy-c1' was left parked: onto chat B's checkpoints",
                              "details": ["onto chat B's checkpoints"], "exit": 1, "refused": "hazard"}
    with pytest.raises(RestoreAvoided, match="^onto chat B's checkpoints$"):
        await backend.restore(1, "proxy-c1")
    host.answers["resume"] = {"ok": False, "error": "'proxy-c1' was left parked: Gemma 3 on build 11434 …",
                              "details": ["Gemma 3 on build 11434 re-prefills"], "exit": 1, "refused": "useless"}
    with pytest.raises(RestoreAvoided, match=f"^{USELESS_RESTORE}: Gemma 3 on build 11434 re-prefills$"):
        await backend.restore(1, "proxy-c1")
    # any other refusal stays the host's error: the restore failed
    host.answers["resume"] = {"ok": False, "error": "slot 1 is busy", "exit": 1}
    with pytest.raises(ResumeFailed, match="slot 1 is busy"):
        await backend.restore(1, "proxy-c1")


@pytest.mark.parametrize("profiles, says", [
    ([{"name": "other", "url": "http://127.0.0.1:8080"}], "box has no profile 'big' (its profiles: other)"),
    ([{"name": "big", "url": "http://127.0.0.1:8080", "has_api_key": True}], "asks for an API key"),
    ([{"name": "big", "url": ""}], "names no URL"),
])
async def test_what_cannot_be_fronted_is_refused_with_the_remedy(profiles, says):
    with pytest.raises(RemoteProxyError, match=re.escape(says)):
        await start_remote_proxy(Host(profiles=profiles), "box", "big")
