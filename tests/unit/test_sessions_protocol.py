"""One Sessions protocol for every kind of server (issue #27): a server here (SessionService,
launched or attached) and a host's (app.servers.remote_sessions.RemoteSessions over its own
``kv-valet … --json``) answer the same calls with the same results; their capabilities say what a
kind cannot do. The host here is a stand-in answering as app.cli.sessions prints."""

from __future__ import annotations


import pytest

from app.core.states import Health, SidecarStatus
from app.remote.host import RemoteError
from app.servers.remote_sessions import RemoteSessions
from app.sessions.park import ParkResult
from app.sessions.protocol import REMOTE, Capabilities, Sessions
from app.core.confirmation import NeedsConfirmation
from app.sessions.resume import ResumeFailed, ResumeResult
from app.sessions.service import ServiceError
from app.store.catalog import Catalog, SessionRecord
from tests.unit.test_pending_verdicts import service
from tests.unit.test_server_list import STATUS

LISTED = [{"name": "chat", "profile": "there", "state_file": "chat.bin", "save_dir": "/srv/kv", "n_tokens": 900,
           "state_size": 2 ** 20, "slot_id": 0, "unknown_field_of_a_newer_kv_valet": 1}]
PARKED = {"ok": True, "profile": "there", "stopped": None,
          "sessions": [{"ok": True, "session": "again", "slot": 0, "tokens": 1234, "state_size": 3 * 2**20,
                        "sidecar_size": 0, "size": 3 * 2**20, "save_ms": 12.5, "profile": "there",
                        "warnings": ["slow disk"], "unchanged": False,
                        "sidecar": {"status": "not needed", "reason": "dense model", "checkpoints": 0}}]}
RESUMED = {"ok": True, "session": "chat", "profile": "there", "slot": 1, "tokens": 900, "restore_ms": 12.34,
           "state_size": 2 ** 20, "sidecar_size": 0, "warnings": [], "hazard": None}


class StandInHost:
    """A host whose kv-valet lists LISTED, answers STATUS, and answers ``answers[command]`` to a
    ``run_cli`` (what it parsed of the ``--json`` output); every call is recorded."""

    name = "gpu-box"

    def __init__(self, **answers):
        self.answers, self.calls = answers, []

    async def sessions(self, profile=None):
        self.calls.append(("sessions", profile))
        return list(LISTED)

    async def status(self, profile):
        self.calls.append(("status", profile))
        return dict(STATUS)

    async def run_cli(self, argv, *, timeout=60, ok_exits=(0,)):
        self.calls.append((list(argv), tuple(ok_exits)))
        answer = self.answers[argv[0]]
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_both_kinds_are_sessions_and_their_capabilities_say_what_they_cannot_do(tmp_path):
    with Catalog(tmp_path / "catalog.sqlite") as cat:
        here = service(cat)
        there = RemoteSessions(StandInHost(), "there")
        for s in (here, there):
            assert isinstance(s, Sessions)
        assert here.host is None and there.host == "gpu-box" and there.target_id == "gpu-box:there"
        # attached (no stopper, no restarter): everything but stopping and an A/B across restarts
        assert here.capabilities == Capabilities(park_and_stop=False, check_across_restarts=False)
        assert here.running and "first Park asks for its --slot-save-path" in here.describe()
        here.stopper = lambda: None
        assert here.capabilities.park_and_stop
        # a host's: park and resume there; no check (nor across restarts), no files of its here
        assert there.capabilities is REMOTE
        assert not (REMOTE.check or REMOTE.check_across_restarts or REMOTE.local_files or REMOTE.resume_all
                    or REMOTE.park_and_stop or REMOTE.choose_save_dir) and REMOTE.park and REMOTE.resume
        assert not there.running and "asking the host" in there.describe()


async def test_a_hosts_sessions_list_and_slots_like_a_server_here():
    host = StandInHost()
    there = RemoteSessions(host, "there")
    changed, queued = [], []
    there.on_change(lambda: changed.append(there.sessions()))
    there.on_queue(lambda: queued.append(there.queue_labels()))
    assert await there.load()
    [rec] = there.sessions()
    assert isinstance(rec, SessionRecord) and (rec.name, rec.n_tokens, rec.save_dir) == ("chat", 900, "/srv/kv")
    assert sorted(c[0] for c in host.calls) == ["sessions", "status"] and len(changed) == 2  # the list, the status
    assert queued == [["asking gpu-box"], []]  # the tab's busy line while the host answers
    assert there.health is Health.OK and there.running and str(there.save_dir) == "/srv/kv"
    assert "'there' on gpu-box: Ready" in there.describe() and "1 / 2 slots in use" in there.describe()
    calls = len(host.calls)
    assert [r.id for r in await there.slot_rows()] == [0, 1] and len(host.calls) == calls  # no SSH call
    there.set_status({**STATUS, "health": "unreachable: connection refused"})
    assert not there.running and len(changed) == 3
    there.set_status({**STATUS, "health": "unreachable: connection refused"})
    assert len(changed) == 3  # the same status: nobody is told


async def test_a_hosts_list_is_shown_before_its_status_comes():
    """The host's ``status --json`` asks its server (an HTTP client started there): the records it
    listed are announced first, the status when it comes; a status that fails after the list says why."""
    import asyncio

    class SlowStatus(StandInHost):
        def __init__(self, fail=False):
            super().__init__()
            self.answer, self.fail = asyncio.Event(), fail

        async def status(self, profile):
            self.calls.append(("status", profile))
            await self.answer.wait()
            if self.fail:
                raise RemoteError("connection reset", kind="unreachable", host=self.name)
            return dict(STATUS)

    host = SlowStatus()
    there = RemoteSessions(host, "there")
    seen = []
    listed = asyncio.Event()
    there.on_change(lambda: (seen.append((there.listings, [r.name for r in there.sessions()], there.loaded)),
                             listed.set()))
    loading = asyncio.ensure_future(there.load())
    await listed.wait()
    assert seen == [(1, ["chat"], False)] and not there.running and "asking the host" in there.describe()
    host.answer.set()
    assert await loading and seen[-1] == (1, ["chat"], True) and there.running

    failing = SlowStatus(fail=True)
    there = RemoteSessions(failing, "there")
    listed.clear()
    there.on_change(lambda: listed.set())
    loading = asyncio.ensure_future(there.load())
    await listed.wait()
    failing.answer.set()
    assert not await loading and there.sessions()[0].name == "chat"
    assert there.describe() == "gpu-box did not answer: connection reset"


async def test_a_load_cancelled_while_the_host_lists_cancels_its_status_too():
    import asyncio

    class Stuck(StandInHost):
        def __init__(self):
            super().__init__()
            self.status_cancelled = asyncio.Event()
            self.listing = asyncio.Event()

        async def sessions(self, profile=None):
            self.listing.set()
            await asyncio.Event().wait()

        async def status(self, profile):
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.status_cancelled.set()
                raise

    host = Stuck()
    loading = asyncio.ensure_future(RemoteSessions(host, "there").load())
    await host.listing.wait()
    loading.cancel()
    await asyncio.gather(loading, return_exceptions=True)
    assert host.status_cancelled.is_set()


async def test_a_host_that_does_not_answer_is_said_not_raised():
    class Gone(StandInHost):
        async def status(self, profile):
            raise RemoteError("connection reset", kind="unreachable", host=self.name)

        async def sessions(self, profile=None):
            raise RemoteError("connection reset", kind="unreachable", host=self.name)

    there = RemoteSessions(Gone(), "there")
    assert not await there.load()
    assert there.describe() == "gpu-box did not answer: connection reset" and there.sessions() == []


async def test_park_on_a_host_answers_a_park_result_and_lists_again():
    host = StandInHost(park=PARKED)
    there = RemoteSessions(host, "there")
    there.on_change(lambda: None)  # a tab shows its list
    result = await there.park(0, "again")
    assert (["park", "there", "--json", "--slot", "0", "--name", "again"], (0, 1)) in host.calls
    assert isinstance(result, ParkResult) and result.ok and result.slot_id == 0 and result.warnings == ["slow disk"]
    rec = result.record
    assert (rec.name, rec.n_tokens, rec.state_size, rec.save_ms) == ("again", 1234, 3 * 2**20, 12.5)
    assert rec.sidecar_status is SidecarStatus.NOT_NEEDED and rec.sidecar_reason == "dense model"
    assert there.listings == 1  # listed again after the park
    assert there.park_bytes("again") == 3 * 2**20  # its size as the park said (the proxy's disk budget)

    unseen = RemoteSessions(StandInHost(park=PARKED), "there")  # nobody shows its list (the proxy's door)
    await unseen.park(0, "again")
    assert unseen.listings == 0 and [c[0][0] for c in unseen.remote.calls] == ["park"]  # no SSH round trip

    nothing = RemoteSessions(StandInHost(park={"ok": True, "profile": "there", "sessions": []}), "there")
    with pytest.raises(ServiceError, match="nothing to park"):
        await nothing.park(None, None)
    refused = RemoteSessions(StandInHost(park={"ok": False, "profile": "there", "sessions": [
        {"ok": False, "slot": 7, "error": "slot 7 does not exist"}]}), "there")
    with pytest.raises(ServiceError, match="slot 7 does not exist"):
        await refused.park(7, None)
    with pytest.raises(ServiceError, match="no JSON object"):
        await RemoteSessions(StandInHost(park=None), "there").park(None, None)


async def test_park_all_on_a_host_says_each_slot():
    answer = {"ok": False, "profile": "there", "sessions": [PARKED["sessions"][0],
                                                            {"ok": False, "slot": 1, "error": "disk full"}]}
    host = StandInHost(park=answer)
    ok, failed = await RemoteSessions(host, "there").park_all("nightly")
    assert (["park", "there", "--all", "--json", "--name", "nightly"], (0, 1)) in host.calls
    assert ok.ok and ok.record.name == "again" and not failed.ok and failed.error == "disk full"


async def test_resume_on_a_host_asks_what_the_host_asks_and_answers_a_resume_result():
    needs = RemoteError("not resumed", output={"ok": False, "error": "not resumed: 'chat' needs confirmation (pass "
                                               "--yes to resume anyway):", "details": ["slot 1 holds 50 tokens"]})
    host = StandInHost(resume=needs)
    there = RemoteSessions(host, "there")
    with pytest.raises(NeedsConfirmation) as e:
        await there.resume("chat", 1)
    assert e.value.warnings == ["slot 1 holds 50 tokens"]
    assert host.calls[-1] == (["resume", "there", "chat", "--json", "--slot", "1"], (0, 1))
    host.answers["resume"] = RESUMED
    result = await there.resume("chat", 1, force=True)
    assert (["resume", "there", "chat", "--json", "--yes", "--slot", "1"], (0, 1)) in host.calls
    assert isinstance(result, ResumeResult) and (result.slot_id, result.n_restored, result.restore_ms) == \
        (1, 900, 12.34) and result.record.name == "chat"
    host.answers["resume"] = {"ok": False, "error": "cannot resume 'x':", "details": ["no parked session named 'x'"],
                              "exit": 1}
    with pytest.raises(ResumeFailed, match="cannot resume 'x': no parked session named 'x'"):
        await there.resume("x", 0)


async def test_what_a_host_cannot_do_is_refused_with_where_it_runs():
    there = RemoteSessions(StandInHost(), "there")
    for call in (there.check("chat"), there.ab("chat"), there.park_all_and_stop()):
        with pytest.raises(ServiceError, match="runs there"):
            await call
    assert await there.resume_all() == [] and there.resume_plan() == [] and not await there.verify_sidecar_hashes()


def test_the_words_for_a_host_that_are_kept():
    from app.servers.remote_sessions import status_line
    from app.servers.restore_after_move import verdict_text

    assert status_line("gpu-box", "there", {"health": "unreachable: refused"}) == "'there' on gpu-box: unreachable: refused"
    assert verdict_text({"slot_id": 1, "n_restored": 900, "verdict": {"kind": "HIT", "reason": "reused"}}) == \
        "Restored into slot 1 (900 tokens); first query: HIT — reused."
