"""The server service (app.servers.service) on the fake llama-server: the one target
resolver, one HTTP client per server, several servers at once, and the one park-then-stop
that never writes a second copy of a chat it just parked or resumed.

The fake server stands in for speed; the real server runs the same park-then-stop in
tests/real/test_real_serve_verdicts.py (serve's Ctrl-C) and the GUI quit tests."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from app import paths
from app.core.lifecycle import StopTrigger, TargetKind
from app.servers.service import ServerService, profile_target_id, resolve_target, url_target_id
from app.server.launcher import pid_record_path
from app.core.states import ServerState
from app.server.supervisor import PidRecord, write_pid_record
from app.store.catalog import Catalog
from app.store.profiles import ProfileStore
from tests.fake_server.profiles import fake_profile

PROMPT = " ".join(f"word{i}" for i in range(700))


async def complete(profile, prompt, slot):
    from app.server.client import LlamaClient

    async with LlamaClient(profile.url) as c:
        return await c.completion(prompt, slot_id=slot, n_predict=2)


# -- the one resolver ---------------------------------------------------------------------

def test_a_url_is_itself_with_the_environments_key(monkeypatch):
    monkeypatch.setenv("LLAMA_API_KEY", "from-env")
    spec = resolve_target("http://127.0.0.1:9/", save_dir="/srv/slots")
    assert (spec.id, spec.kind, spec.url) == ("url:http://127.0.0.1:9", TargetKind.URL, "http://127.0.0.1:9")
    assert spec.api_key == "from-env" and str(spec.save_dir) == "/srv/slots"
    assert "from-env" not in repr(spec)  # the key never reaches a log line or a traceback


def test_a_profile_is_its_url_its_key_its_save_folder_and_its_log_file_when_there_is_one(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_API_KEY", "from-env")
    profile = fake_profile(tmp_path, api_key="profile-key")
    spec = resolve_target("fake")
    assert (spec.id, spec.kind, spec.url, spec.api_key) == ("profile:fake", TargetKind.PROFILE, profile.url,
                                                            "profile-key")
    assert spec.log_path is None  # no server of this profile has written a log yet
    log_file = paths.server_log_path("fake")
    log_file.parent.mkdir(parents=True, exist_ok=True)
    log_file.write_text("main: server is listening\n")
    assert resolve_target("fake").log_path == log_file
    assert resolve_target("fake", api_key="given").api_key == "given"  # the user's --api-key wins


def test_a_profile_whose_server_outlived_an_earlier_kv_valet_is_that_server(tmp_path):
    fake_profile(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        rec = PidRecord(proc.pid, psutil.Process(proc.pid).create_time(), "http://127.0.0.1:9999", "fake",
                        ("llama-server",), time.time())
        write_pid_record(pid_record_path("fake"), rec)
        spec = resolve_target("fake")
        assert spec.kind is TargetKind.LEFTOVER and spec.url == "http://127.0.0.1:9999"
        assert spec.leftover.pid == proc.pid
    finally:
        proc.kill()
        proc.wait()
    # a record whose process is gone is stale: the profile's own URL again, the record removed
    assert resolve_target("fake").kind is TargetKind.PROFILE
    assert not pid_record_path("fake").exists()


# -- several servers, one client each ---------------------------------------------------------

async def test_two_profiles_at_once_each_with_one_client_and_one_session_service(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SIDECAR", "1")
    import dataclasses

    from tests.conftest import free_port

    a = fake_profile(tmp_path)
    b = dataclasses.replace(a, name="other", port=free_port())
    ProfileStore().save(b)
    servers = ServerService()
    try:
        ha, hb = await servers.launch(a), await servers.launch(b)
        assert ha is not None and hb is not None and set(servers.servers) == {"profile:fake", "profile:other"}
        sa, sb = await servers.sessions(ha.id), await servers.sessions(hb.id)
        assert sa is await servers.sessions(ha.id)  # one session service per server, shared
        # one HTTP client per server: the health watch, the sessions (and the Monitor, the load check)
        assert sa.target.client is ha.client is ha.supervisor._client
        assert sb.target.client is hb.client and ha.client is not hb.client
        await complete(a, PROMPT, 0)
        await sa.park(0, "on a")
        assert [r.profile for r in servers.catalog.list()] == ["fake"]  # no cross-talk
        assert [r.id for r in await sb.slot_rows() if (r.tokens_held or 0) > 0] == []
    finally:
        await servers.aclose()
    assert ha.supervisor.state is ServerState.STOPPED and hb.supervisor.state is ServerState.STOPPED


def prompt_logged(handle, slot: int):
    """A future: the server logged the end of a prompt's processing on ``slot``."""
    import asyncio

    from app.server.logparse import Kind

    fut = asyncio.get_running_loop().create_future()

    def on_line(item) -> None:
        if not fut.done() and item.event.kind is Kind.PROMPT_EVAL and item.event.slot == slot:
            fut.set_result(None)

    handle.supervisor.on_line(on_line)
    return fut


# -- the one park-then-stop ----------------------------------------------------------------------

async def _launched(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SIDECAR", "1")
    profile = fake_profile(tmp_path)
    servers = ServerService()
    handle = await servers.launch(profile)
    assert handle is not None
    return servers, handle, profile


async def test_a_stop_right_after_a_named_park_writes_no_second_copy(tmp_path, monkeypatch):
    """A user's report: Ctrl-C to serve right after `park --name` wrote a second, dated copy."""
    servers, handle, profile = await _launched(tmp_path, monkeypatch)
    try:
        await complete(profile, PROMPT, 0)
        svc = await servers.sessions(handle.id)
        await svc.park(0, "mine")
        report = await servers.park_then_stop(handle.id, StopTrigger.SERVE)
    finally:
        await servers.aclose()
    assert report.stopped and report.complete
    assert [(r.slot_id, r.unchanged, r.record.name) for r in report.results] == [(0, True, "mine")]
    with Catalog(paths.catalog_path()) as cat:
        assert [r.name for r in cat.list("fake")] == ["mine"]
    from app.sessions.resume_plan import load_resume_plan

    assert [(e.slot, e.session) for e in load_resume_plan("fake")] == [(0, "mine")]  # Resume all brings it back


async def test_a_park_by_another_process_counts_too(tmp_path, monkeypatch):
    """`kv-valet park --name` runs in its own process: what it parked (the catalog, since this
    server started) keeps the stop from writing the same chat again."""
    servers, handle, profile = await _launched(tmp_path, monkeypatch)
    try:
        await complete(profile, PROMPT, 0)
        other = ServerService(connect_sessions=False)  # the CLI's own service, its own catalog connection
        try:
            h = other.reach("fake")
            await (await other.sessions(h.id)).park(0, "by the cli")
        finally:
            await other.aclose()
        report = await servers.park_then_stop(handle.id, StopTrigger.SERVE)
    finally:
        await servers.aclose()
    assert [(r.unchanged, r.record.name) for r in report.results] == [(True, "by the cli")]
    with Catalog(paths.catalog_path()) as cat:
        assert [r.name for r in cat.list("fake")] == ["by the cli"]


async def test_a_slot_that_goes_on_from_a_resumed_session_updates_that_session(tmp_path, monkeypatch):
    servers, handle, profile = await _launched(tmp_path, monkeypatch)
    try:
        await complete(profile, PROMPT, 0)
        svc = await servers.sessions(handle.id)
        parked = (await svc.park(0, "chat")).record
        await svc.resume("chat", 1, force=True)
        logged = prompt_logged(handle, 1)
        await complete(profile, PROMPT + " and then some more words of the same chat", 1)
        await logged  # the server's log told how much of the prompt it took from the cache
        report = await servers.park_then_stop(handle.id, StopTrigger.QUIT)
    finally:
        await servers.aclose()
    by_slot = {r.slot_id: r for r in report.results}
    assert by_slot[1].ok and not by_slot[1].unchanged and by_slot[1].record.name == "chat"
    assert by_slot[1].record.n_tokens > parked.n_tokens  # the session now holds the longer chat
    assert by_slot[0].unchanged and by_slot[0].record.name == "chat"
    with Catalog(paths.catalog_path()) as cat:
        assert [r.name for r in cat.list("fake")] == ["chat"]  # no dated copy of the same chat
        assert not [p for p in (tmp_path / "data").rglob("*.prev.bin")]  # the older copy went once verified


async def test_another_chat_in_a_slot_is_parked_under_a_dated_name(tmp_path, monkeypatch):
    servers, handle, profile = await _launched(tmp_path, monkeypatch)
    try:
        await complete(profile, PROMPT, 0)
        svc = await servers.sessions(handle.id)
        await svc.park(0, "first")
        await complete(profile, "a different conversation " * 40, 0)
        report = await servers.park_then_stop(handle.id, StopTrigger.SERVE)
    finally:
        await servers.aclose()
    [r] = report.results
    assert r.ok and not r.unchanged and r.record.name.endswith(" slot 0") and r.record.name != "first"


async def test_a_user_stop_keeps_the_server_when_a_slot_could_not_be_parked(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SAVE_ERROR", "1")  # the server refuses every save
    servers, handle, profile = await _launched(tmp_path, monkeypatch)
    try:
        await complete(profile, PROMPT, 0)
        user = await servers.park_then_stop(handle.id, StopTrigger.USER)
        assert user.failed and not user.stopped and handle.supervisor.state is ServerState.READY
        quit_ = await servers.park_then_stop(handle.id, StopTrigger.QUIT)  # the app is going anyway
        assert quit_.failed and quit_.stopped and handle.supervisor.state is ServerState.STOPPED
    finally:
        await servers.aclose()


async def test_the_park_is_bounded_by_the_one_timeout_and_by_a_second_signal(tmp_path, monkeypatch):
    servers, handle, profile = await _launched(tmp_path, monkeypatch)
    try:
        await complete(profile, PROMPT, 0)
        svc = await servers.sessions(handle.id)
        import asyncio

        started = asyncio.Event()

        async def stuck(prefix=None, *, remember=False):
            started.set()
            await asyncio.Event().wait()

        monkeypatch.setattr(svc, "park_all", stuck)
        task = asyncio.ensure_future(servers.park_then_stop(handle.id, StopTrigger.SIGNAL))
        await started.wait()
        servers.interrupt_park()
        report = await task
        assert report.interrupted == "a second signal" and report.stopped
    finally:
        await servers.aclose()
