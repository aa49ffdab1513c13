"""A profile using an RPC worker: the real rpc-server and llama-server built with RPC on (one build,
tests/sidecar-server/build), Gemma 3 270M on the CPU, one slot. The watcher (app.monitor.rpc) sees the
worker reachable with a round-trip time while the server uses it, and unreachable, as a finding with its
remedy, once the worker is killed."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from app.core.profile import LaunchProfile
from app.monitor.rpc import RULE_UNREACHABLE, RpcWatcher
from app.server.client import LlamaClient
from tests.conftest import free_port
from tests.llama_server import start_llama_server
from tests.real.helpers import start_server

pytestmark = [pytest.mark.real_server]

BUILD_SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "sidecar-server" / "build"


def _cached(*flags: str) -> pathlib.Path:
    r = subprocess.run([sys.executable, str(BUILD_SCRIPT), "--cached-only", *flags], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        pytest.fail(f"the server built with RPC on is not in the cache: run {BUILD_SCRIPT} --rpc ({r.stderr.strip()})")
    return pathlib.Path(lines[-1])


@pytest.fixture(scope="module")
def rpc_build() -> tuple[pathlib.Path, pathlib.Path]:
    """(llama-server, rpc-server) of one cached build with RPC on."""
    server, worker = _cached("--rpc"), _cached("--rpc-server")
    assert server.parent == worker.parent  # built together, from the same sources
    return server, worker


async def test_a_profile_with_a_real_rpc_worker_is_watched(rpc_build, real_model, tmp_path):
    server_bin, worker_bin = rpc_build
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    worker = start_llama_server([worker_bin, "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                                log=subprocess.DEVNULL, start_new_session=True)
    sup = None
    try:
        profile = LaunchProfile(name="real-rpc", model=real_model, server_binary=str(server_bin), port=free_port(),
                                ctx_size=1024, parallel=1, gpu_layers="99", rpc=endpoint,
                                slot_save_path=str(tmp_path / "slots") + "/")
        holder: dict = {}
        watcher = RpcWatcher(profile.rpc, pid=lambda: holder["sup"].pid if "sup" in holder else None,
                             interval=0.2)
        watcher.start()
        # the worker listens (a probe by connect: nothing uses it yet)
        await asyncio.wait_for(watcher.wait_for(lambda w: w.statuses[endpoint].reachable is True), 120)
        assert watcher.statuses[endpoint].state == "listening" and watcher.statuses[endpoint].rtt_ms is not None

        plan, sup = await asyncio.wait_for(start_server(profile), 300)
        holder["sup"] = sup
        for line in sup.log.since(0):  # what it logged while starting (the device and its buffers)
            watcher.feed(line)
        sup.on_line(watcher.feed)
        async with LlamaClient(plan.url) as client:
            out = await asyncio.wait_for(client.completion("The valet parks the car", n_predict=4), 300)
        assert out.get("content") is not None and out.get("tokens_predicted", 4) >= 1

        await asyncio.wait_for(watcher.wait_for(lambda w: w.statuses[endpoint].state == "connected"), 120)
        st = watcher.statuses[endpoint]
        assert st.reachable and st.rtt_ms is not None and st.rtt_ms > 0
        assert watcher.findings == []
        # what the server logged about it: the device, the worker's memory, what it holds there
        assert st.device == "RPC0" and st.memory_mib is not None and st.memory_mib[0] > 0
        assert st.buffers_mib["model"] > 100 and st.buffers_mib["KV"] > 0  # Gemma 3 270M: ~235 MiB of weights

        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)
        await asyncio.wait_for(watcher.wait_for(
            lambda w: any(f.rule_id == RULE_UNREACHABLE for f in w.findings)), 120)
        st = watcher.statuses[endpoint]
        assert st.reachable is False and "refused" in st.why
        [f] = [f for f in watcher.findings if f.rule_id == RULE_UNREACHABLE]
        assert f.details["endpoint"] == endpoint
        assert [r.label for r in f.remedies] == [
            f"Start rpc-server on 127.0.0.1 with -p {port} (on that machine: rpc-server -H <its address> -p {port})",
            f"Remove {endpoint} from --rpc"]
        assert f.remedies[1].changes == {"rpc": None}
        await watcher.stop()
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=30)
        if sup is not None:
            await sup.stop()
