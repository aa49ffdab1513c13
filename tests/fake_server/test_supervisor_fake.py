"""Supervisor against the fake llama-server: fast fault injection."""

from __future__ import annotations

import asyncio
import os
import signal
import socket

import psutil
import pytest

from app.core.profile import LaunchProfile, ProfileError
from app.server.launcher import make_supervisor, pid_record_path, plan_launch
from app.server.outcome import Cause
from app.core.states import ServerState
from app.server.supervisor import LaunchError, StartFailed, find_leftover_server
from tests.conftest import free_port

FAKE = os.path.join(os.path.dirname(__file__), "fake_llama_server.py")


@pytest.fixture
def profile(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 64)
    return LaunchProfile(name="fake", model=str(model), server_binary=FAKE, port=free_port(), ctx_size=2048,
                         parallel=2)


async def wait_for_line(sup, text: str, timeout: float = 120.0) -> None:
    """Wait until a log line containing ``text`` was delivered (event-driven, bounded)."""
    if any(text in line for line in sup.log.tail(200)):
        return
    seen = asyncio.get_running_loop().create_future()
    sup.on_line(lambda item: seen.done() or text not in item.event.line or seen.set_result(True))
    await asyncio.wait_for(seen, timeout)


def recorder(sup):
    states = []
    sup.on_state(lambda s, o: states.append(s))
    return states


async def test_start_reaches_ready_through_loading_and_stop_leaves_no_process(profile, monkeypatch):
    # the fake loads until the supervisor has said Loading (SIGUSR1 ends the load): no timed window
    monkeypatch.setenv("FAKE_LOAD_SECONDS", "600")
    plan = plan_launch(profile)
    assert plan.argv[-2:] == ["-lv", "4"]  # cache events are trace-level in build 11434
    sup = make_supervisor(plan)
    states = recorder(sup)
    starting = asyncio.ensure_future(sup.start())
    try:
        await sup.wait_state(ServerState.LOADING, timeout=120)
        assert not starting.done()
        os.kill(sup.pid, signal.SIGUSR1)
        await asyncio.wait_for(starting, 120)
        assert sup.state == ServerState.READY
        assert states[:3] == [ServerState.STARTING, ServerState.LOADING, ServerState.READY]
        pid = sup.pid
        assert find_leftover_server(pid_record_path("fake")).pid == pid
        # the log reaches the buffer in batches from the reader thread: wait for the line
        await wait_for_line(sup, "listening on")
    finally:
        starting.cancel()  # done by now, unless the test failed before
        await sup.aclose()
    assert states[-2:] == [ServerState.STOPPING, ServerState.STOPPED]
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert sup.outcome.cause == Cause.STOPPED_BY_USER
    assert find_leftover_server(pid_record_path("fake")) is None


async def stop_while_a_completion_runs(sup, n_predict: int = 4, extra: dict | None = None
                                       ) -> tuple[asyncio.Task, int | None]:
    """Stop ``sup`` once its server shows a completion running; the completion's task and the exit code."""
    from app.server.client import LlamaClient

    async with LlamaClient(sup.url) as client:
        running = asyncio.ensure_future(client.completion("The quick brown fox", slot_id=1, n_predict=n_predict,
                                                          extra=extra))
        while not any(s.get("is_processing") for s in await client.slots()):
            await asyncio.sleep(0.02)  # polling /slots, as a user's Monitor does; not a timed window
        proc = sup.proc
        await sup.stop()
        await asyncio.gather(running, return_exceptions=True)
    return running, proc.returncode


async def test_a_stop_while_a_request_runs_ends_with_the_servers_second_sigterm_not_a_kill(profile, monkeypatch):
    # Build 11434 stays after "cleaning up before exit" while a request runs (captured:
    # 04-stop-during-generation.log): the supervisor ends it with the second SIGTERM the server
    # answers at once, long before its SIGKILL (a minute here: a kill would fail the test by its code).
    monkeypatch.setenv("FAKE_COMPLETION_DELAY", "600")
    monkeypatch.setenv("FAKE_STOP_WAITS", "1")
    sup = make_supervisor(plan_launch(profile), stop_timeout_s=60)
    states = recorder(sup)
    try:
        await sup.start()
        _, code = await stop_while_a_completion_runs(sup)
        await wait_for_line(sup, "Received second interrupt")
    finally:
        await sup.aclose()
    assert code == 1  # the server's own exit(1), not -9
    assert sup.forced_after_cleanup
    assert states[-2:] == [ServerState.STOPPING, ServerState.STOPPED]
    assert sup.outcome.cause == Cause.STOPPED_BY_USER


async def test_a_stop_while_idle_needs_no_second_sigterm(profile, monkeypatch):
    monkeypatch.setenv("FAKE_STOP_WAITS", "1")
    sup = make_supervisor(plan_launch(profile), stop_timeout_s=3600)
    try:
        await sup.start()
        proc = sup.proc
        await sup.stop()
    finally:
        await sup.aclose()
    assert proc.returncode == 0 and not sup.forced_after_cleanup
    assert not any("second interrupt" in line for line in sup.log.tail(50))


async def test_kill_9_gives_crashed_with_outcome_and_auto_restart_recovers(profile):
    sup = make_supervisor(plan_launch(profile.replace(auto_restart=True)), backoff_s=(0.05,))
    try:
        await sup.start()
        first = sup.pid
        crashed = asyncio.ensure_future(sup.wait_state(ServerState.CRASHED, timeout=120))
        await asyncio.sleep(0)
        os.kill(first, signal.SIGKILL)
        await crashed
        assert sup.outcome.cause == Cause.KILLED and sup.outcome.signal == signal.SIGKILL
        await sup.wait_state(ServerState.READY, timeout=120)
        assert sup.pid != first and sup.restart_times
    finally:
        await sup.aclose()


async def test_assert_abort_is_classified_with_its_text(profile, monkeypatch):
    monkeypatch.setenv("FAKE_ABORT_ON_SAVE", "1")
    sup = make_supervisor(plan_launch(profile))
    try:
        await sup.start()
        from app.server.client import LlamaClient, ServerUnreachable

        async with LlamaClient(sup.url) as c:
            with pytest.raises(ServerUnreachable):
                await c.save_slot(0, "x.bin")
        await sup.wait_state(ServerState.CRASHED, timeout=120)
        assert sup.outcome.cause == Cause.ASSERT
        assert "tensor not allocated" in sup.outcome.detail
    finally:
        await sup.aclose()


async def test_port_in_use_refused_before_launch_naming_the_port(profile):
    with socket.socket() as s:
        s.bind(("127.0.0.1", profile.port))
        s.listen()
        sup = make_supervisor(plan_launch(profile))
        with pytest.raises(LaunchError, match=f"port {profile.port} on 127.0.0.1 is already in use"):
            await sup.start()
        assert sup.proc is None
        await sup.aclose()


async def test_missing_model_is_refused_before_launch(profile):
    with pytest.raises(ProfileError, match="model file not found"):
        plan_launch(profile.replace(model="/nonexistent/model.gguf"))


async def test_model_that_fails_to_load_is_reported_at_once(profile, tmp_path):
    # The file exists (so the profile check passes) but the server cannot load it.
    sup = make_supervisor(plan_launch(profile), load_timeout_s=120)
    os.unlink(profile.model)
    with pytest.raises(StartFailed) as e:
        await sup.start()
    assert e.value.outcome.cause == Cause.MODEL_UNREADABLE
    assert sup.state == ServerState.CRASHED
    await sup.aclose()


async def test_second_start_awaits_the_first(profile):
    sup = make_supervisor(plan_launch(profile))
    try:
        await asyncio.gather(sup.start(), sup.start())
        assert sup.state == ServerState.READY
    finally:
        await sup.aclose()


async def test_orderly_shutdown_from_another_tool_is_stopped_not_crashed(profile):
    """`kv-valet park --and-stop` SIGTERMs a server that `kv-valet serve` supervises."""
    sup = make_supervisor(plan_launch(profile.replace(auto_restart=True)), backoff_s=(0.05,))
    try:
        await sup.start()
        stopped = asyncio.ensure_future(sup.wait_state(ServerState.STOPPED, ServerState.CRASHED, timeout=120))
        await asyncio.sleep(0)
        os.kill(sup.pid, signal.SIGTERM)
        assert await stopped == ServerState.STOPPED
        assert sup.outcome.cause == Cause.EXITED_CLEANLY and sup.outcome.exit_code == 0
        assert sup.restart_times == []  # an orderly shutdown is not restarted
    finally:
        await sup.aclose()


async def test_every_line_goes_to_the_profiles_log_file(profile):
    """The ring buffer drops old lines; the log file keeps them, with a header per launch."""
    from app import paths

    sup = make_supervisor(plan_launch(profile), log_capacity=5)
    try:
        await sup.start()
        pid = sup.pid
    finally:
        await sup.aclose()
    assert sup.log_file_path == paths.server_log_path("fake")
    text = sup.log_file_path.read_text()
    assert text.startswith("===== ") and f"pid {pid}:" in text.splitlines()[0]
    assert "listening on" in text and len(sup.log) == 5  # the buffer kept 5, the file everything
    assert text.rstrip().splitlines()[-1].endswith("exit: stopped by the user") or "===== exit:" in text


def test_serve_prints_the_crash_cause_and_remedy(tmp_path, monkeypatch):
    """`kv-valet serve` runs the Cache health detectors too (seed 002's abort)."""
    import subprocess
    import sys
    import urllib.request

    from app.store.profiles import ProfileStore

    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 64)
    port = free_port()
    ProfileStore().save(LaunchProfile(name="crashy", model=str(model), server_binary=FAKE, port=port,
                                      ctx_size=2048, parallel=2))
    env = dict(os.environ, FAKE_ABORT_ON_IDLE_SAVE="1")
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "crashy", "--quiet"], env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:  # wait for Ready from the CLI's own output
            if "ready at" in line:
                break
        for slot in (0, 1):  # the second request saves idle slot 0, which holds tokens: abort
            req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", method="POST",
                                         data=b'{"prompt": "hello there", "n_predict": 2, "id_slot": %d}' % slot,
                                         headers={"Content-Type": "application/json"})
            try:
                urllib.request.urlopen(req, timeout=10).read()
            except OSError:
                pass
        err = proc.stderr.read()
        assert proc.wait(timeout=120) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "error: llama-server aborted with GGML_ASSERT" in err
    assert "remedy: Turn the prompt cache off (--cache-ram 0)" in err and "llama.cpp #26128" in err
