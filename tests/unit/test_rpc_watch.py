"""RPC workers of a profile: --rpc parsing, the rule, the TCP probe and the watcher (app.monitor.rpc)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from pathlib import Path
from types import SimpleNamespace

from app.core.findings import Severity
from app.core.profile import LaunchProfile, RpcWorker, parse_rpc_workers
from app.core.profile_check import validate
from app.core.rules import diagnose
from app.monitor.rpc import RULE_UNREACHABLE, RpcWatcher, parse_rpc_line, parse_ss_rtt, probe_connect, remaining_rpc


def P(**kw) -> LaunchProfile:
    return LaunchProfile(name="p", model="m.gguf", **kw)


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rpc_value_is_read_as_llama_server_reads_it():
    workers, problems = parse_rpc_workers("10.0.0.2:50052, gpu-box:50053")
    assert workers == [RpcWorker("10.0.0.2", 50052), RpcWorker("gpu-box", 50053)] and problems == []
    assert workers[1].endpoint == "gpu-box:50053"
    _w, problems = parse_rpc_workers("h,h:x,:5,h:0,h:70000,h:٥")
    assert problems == ["'h' is not HOST:PORT", "'h:x' is not HOST:PORT", "':5' is not HOST:PORT",
                        "'h:0' is not HOST:PORT", "'h:70000' is not HOST:PORT", "'h:٥' is not HOST:PORT"]
    assert parse_rpc_workers(None) == ([], [])


def test_a_profile_with_a_bad_worker_is_refused_and_diagnosed_with_a_fix():
    assert [e.field for e in validate(P(rpc="10.0.0.2:50052"), check_files=False)] == []
    errors = validate(P(rpc="10.0.0.2:50052,gpu-box"), check_files=False)
    assert [e.field for e in errors] == ["rpc"] and "'gpu-box' is not HOST:PORT" in errors[0].message
    [f] = [f for f in diagnose(P(rpc="10.0.0.2:50052,gpu-box", parallel=1)) if f.rule_id == "rpc-endpoint-invalid"]
    assert f.severity is Severity.ERROR and "Failed to parse endpoint" in f.message
    assert f.remedies[0].changes == {"rpc": "10.0.0.2:50052"}
    [f] = [f for f in diagnose(P(rpc="gpu-box", parallel=1)) if f.rule_id == "rpc-endpoint-invalid"]
    assert f.remedies[0].changes == {"rpc": None}
    assert not [f for f in diagnose(P(rpc="10.0.0.2:50052", parallel=1)) if f.rule_id == "rpc-endpoint-invalid"]


def test_the_seed_002_hazard_shows_for_a_profile_using_rpc():
    ids = [f.rule_id for f in diagnose(P(rpc="10.0.0.2:50052", parallel=2))]
    assert "rpc-prompt-cache" in ids
    assert "rpc-prompt-cache" not in [f.rule_id for f in diagnose(P(rpc="10.0.0.2:50052", parallel=2, cache_ram=0))]


def test_remove_a_worker_from_the_value():
    assert remaining_rpc("a:1,b:2", RpcWorker("a", 1)) == "b:2"
    assert remaining_rpc("a:1", RpcWorker("a", 1)) is None


def test_the_kernel_rtt_is_read_from_ss_output():
    # a real `ss -tinH state established` info line (iproute2 6.x)
    line = ("\t bbr wscale:10,10 rto:204 rtt:0.024/0.01 ato:40 mss:36864 pmtu:65535 rcvmss:694 advmss:65483 "
            "cwnd:14 bytes_sent:3280 minrtt:0.004 snd_wnd:73728")
    assert parse_ss_rtt(line) == 0.024
    assert parse_ss_rtt("") is None


async def test_probe_connect_tells_listening_from_refused():
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        ok = await probe_connect(RpcWorker("127.0.0.1", port))
        assert ok.ok and ok.rtt_ms is not None and ok.rtt_ms >= 0
    refused = await probe_connect(RpcWorker("127.0.0.1", closed_port()))
    assert not refused.ok and "refused" in refused.why
    unresolved = await probe_connect(RpcWorker("no-such-host.invalid", 50052))
    assert not unresolved.ok and "resolve" in unresolved.why


async def test_the_watcher_reports_a_worker_that_goes_away_with_its_remedies():
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    other = f"127.0.0.1:{closed_port()}"
    value = f"127.0.0.1:{port},{other}"
    watcher = RpcWatcher(value)
    seen: list[list] = []
    watcher.on_change(seen.append)
    [up, down] = await watcher.check()
    assert up.reachable and up.state == "listening" and up.rtt_source == "connect" and up.rtt_ms is not None
    assert down.reachable is False and "refused" in down.why
    [f] = watcher.findings
    assert f.rule_id == RULE_UNREACHABLE and f.severity is Severity.ERROR and f.details["endpoint"] == other
    assert f"Start rpc-server on 127.0.0.1 with -p {other.split(':')[1]}" in f.remedies[0].label
    assert f.remedies[0].changes == {}  # done on the worker's machine, not in the profile
    assert f.remedies[1].changes == {"rpc": f"127.0.0.1:{port}"}
    assert len(seen) == 1 and watcher.changed.is_set()

    server.close()
    await server.wait_closed()
    await watcher.check()
    assert [st.reachable for st in watcher.statuses.values()] == [False, False]
    assert {f.details["endpoint"] for f in watcher.findings} == {f"127.0.0.1:{port}", other}
    assert "127.0.0.1:" in watcher.statuses[f"127.0.0.1:{port}"].describe()


async def test_a_worker_the_server_is_connected_to_is_not_probed():
    """rpc-server serves one client and listens with a backlog of 1: a worker in use is judged by the
    server's own connection (here this test process stands in for the server), never by a connect."""
    accepted: list[asyncio.StreamWriter] = []
    server = await asyncio.start_server(lambda r, w: accepted.append(w), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    probes: list[RpcWorker] = []

    async def probe(worker, timeout):
        probes.append(worker)
        raise AssertionError("a worker in use was probed")

    _r, client = await asyncio.open_connection("127.0.0.1", port)
    try:
        watcher = RpcWatcher(f"127.0.0.1:{port}", pid=os.getpid, probe=probe, rtt_of=lambda conn: 0.031)
        [st] = await watcher.check()
        assert st.reachable and st.state == "connected" and st.rtt_ms == 0.031 and st.rtt_source == "connection"
        assert probes == [] and watcher.findings == []
    finally:
        client.close()
        for w in accepted:
            w.close()
        server.close()
        await server.wait_closed()


async def test_the_loop_runs_rounds_until_stopped():
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        watcher = RpcWatcher(f"127.0.0.1:{port}", interval=0.01)
        watcher.start()
        assert watcher.is_running
        await asyncio.wait_for(watcher.wait_for(lambda w: w.rounds >= 3), 30)
        await watcher.stop()
        assert not watcher.is_running
    assert RpcWatcher("").workers == [] and not RpcWatcher("").is_running


# -- the server's log: lines of a real capture (tests/fixtures/rpc-b11434/) ------------------------

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "rpc-b11434"


def fixture_lines(name: str) -> list[str]:
    return (FIXTURES / name).read_text().splitlines()


def test_a_real_run_tells_the_device_memory_and_buffers_then_the_lost_worker():
    watcher = RpcWatcher("127.0.0.1:50052")
    events = [ev for ev in (watcher.feed(line) for line in fixture_lines("01-start-complete-worker-killed.log")) if ev]
    assert [e.kind for e in events] == ["memory", "device", "buffer", "buffer", "buffer", "buffer", "worker-crashed"]
    st = watcher.statuses["127.0.0.1:50052"]
    assert st.device == "RPC0" and st.memory_mib == (24105.0, 24105.0)
    assert st.buffers_mib == {"model": 235.16, "KV": 18.0, "compute": 19.02}  # two KV caches: 3 + 15 MiB
    assert len(st.log_lines) == 7 and "Remote RPC server crashed" in st.log_lines[-1]
    [f] = watcher.findings
    assert f.rule_id == "rpc-worker-lost" and f.severity is Severity.ERROR
    assert st.describe() == "127.0.0.1:50052: not checked yet (holds model 235 MiB, KV 18 MiB, compute 19 MiB)"


def test_a_worker_down_at_start_and_a_build_without_rpc_are_findings_with_remedies():
    watcher = RpcWatcher("127.0.0.1:49775,127.0.0.1:50052")
    for line in fixture_lines("02-start-worker-down.log"):
        watcher.feed(line)
    [f] = watcher.findings
    assert f.rule_id == "rpc-worker-connect-failed" and f.details["endpoint"] == "127.0.0.1:49775"
    assert f.remedies[0].changes == {"rpc": "127.0.0.1:50052"}
    stock = RpcWatcher("127.0.0.1:50052")
    for line in fixture_lines("03-stock-build-no-rpc.log"):
        stock.feed(line)
    assert stock.unsupported
    [f] = stock.findings
    assert f.rule_id == "rpc-not-in-build" and f.remedies[0].changes == {"server_binary": "kvv-built"}
    assert f.remedies[1].changes == {"rpc": None}


def test_lines_about_other_things_are_not_rpc():
    lines = (fixture_lines("01-start-complete-worker-killed.log") + fixture_lines("rpc-server.log"))
    unrelated = [line for line in lines if "RPC" not in line and "Failed to connect" not in line]
    assert unrelated and all(parse_rpc_line(line) is None for line in unrelated)


async def test_status_carries_the_workers_and_what_the_log_said(tmp_path, monkeypatch):
    from app.cli import status

    log = tmp_path / "server.log"
    log.write_text("\n".join(fixture_lines("01-start-complete-worker-killed.log")[:200]) + "\n")
    spec = SimpleNamespace(profile=P(rpc=f"127.0.0.1:{closed_port()}"), log_path=log)
    monkeypatch.setattr("app.servers.service.resolve_target", lambda target: spec)
    watcher = await status._rpc_workers("p", None)
    [st] = watcher.statuses.values()
    assert st.reachable is False and watcher.findings[0].rule_id == RULE_UNREACHABLE
    assert st.to_dict()["reachable"] is False and json.dumps(watcher.to_list())
    monkeypatch.setattr("app.servers.service.resolve_target", lambda target: SimpleNamespace(profile=P(),
                                                                                                   log_path=None))
    assert await status._rpc_workers("p", None) is None  # no --rpc: nothing to say
