"""``kv-valet status URL|PROFILE``: slots, GPUs, server process and host figures."""

from __future__ import annotations

import asyncio
import json

from app.cli.errors import Exit
from app.cli.keys import add_key_option, key_from_args

EXIT_OK, EXIT_FAIL = Exit.OK, Exit.FAIL


def add_commands(sub) -> None:
    st = sub.add_parser("status", help="slots, GPUs, server process and host figures of a running server")
    st.add_argument("url", help="server URL, e.g. http://127.0.0.1:8080, or a profile name")
    st.add_argument("--json", action="store_true", help="one JSON object")
    st.add_argument("--host", default=None, metavar="NAME", help="a profile's server on a remote host (kv-valet hosts)")
    add_key_option(st)
    st.set_defaults(run=lambda args: _remote_status(args) if args.host else asyncio.run(cmd_status(args)))


def _remote_status(args) -> int:
    """``status PROFILE --host NAME``: the host's own ``kv-valet status``, its output and exit status as they are."""
    from app.cli.hosts import forward

    return forward(args)


async def cmd_status(args) -> int:
    from app.core.states import Health
    from app.monitor.gpu import GpuMonitor
    from app.monitor.process import ProcessMonitor
    from app.monitor.snapshot import format_snapshot, snapshot_to_dict, take_snapshot
    from app.servers.service import client_for

    url, api_key, cache_ram, pid = _resolve_target(args.url)
    async with client_for(args.url, api_key=key_from_args(args)) as client:
        async def fetch_health():
            return await client.health()

        proc = ProcessMonitor(pid) if pid else None
        snap = await take_snapshot(fetch_health, client.slots, GpuMonitor(), proc, {}, cache_ram, url)
        behaviour = await _sidecar_behaviour(client, args.url) if snap.health is Health.OK else None
    workers = await _rpc_workers(args.url, pid)
    from app.core.sidecar_behaviour import LABELS

    if args.json:
        data = snapshot_to_dict(snap)
        data["sidecar_behaviour"] = behaviour.value if behaviour is not None else None
        data["rpc_workers"] = [st.to_dict() for st in workers.statuses.values()] if workers else []
        data["rpc_findings"] = [{"rule_id": f.rule_id, "severity": f.severity.value, "message": f.message,
                                 "remedies": [r.label for r in f.remedies]} for f in workers.findings] if workers else []
        print(json.dumps(data, indent=2))
    else:
        print(format_snapshot(snap))
        if behaviour is not None:
            print(f"Checkpoint sidecars: {LABELS[behaviour]}")
        for st in (workers.statuses.values() if workers else ()):
            print(f"RPC worker {st.describe()}")
        for f in (workers.findings if workers else ()):
            print(f"{f.severity.value}: {f.message}" + "".join(f"\n  remedy: {r.label}" for r in f.remedies))
    return EXIT_OK if snap.health is Health.OK else EXIT_FAIL


async def _sidecar_behaviour(client, target: str):
    """What the server's build does with checkpoint sidecars (app.sessions.behaviour)."""
    from app import paths
    from app.sessions.behaviour import identify_server
    from app.server.client import ServerError, ServerUnreachable
    from app.store.catalog import Catalog

    try:
        build = str((await client.props()).get("build_info") or "unknown")
    except (ServerError, ServerUnreachable):
        return None
    from app.servers.service import resolve_target

    spec = resolve_target(target)
    binary = (spec.profile.server_binary or None) if spec.profile is not None else None
    with Catalog(paths.catalog_path()) as catalog:
        return identify_server(catalog, build, log_path=spec.log_path, binary=binary)


async def _rpc_workers(target: str, pid: int | None):
    """The profile's RPC workers (``--rpc``), checked once, with what its log said about them;
    None when the target is not a profile using --rpc (app.monitor.rpc)."""
    from app.servers.service import resolve_target
    from app.monitor.rpc import RpcWatcher, feed_log_file

    spec = resolve_target(target)
    if spec.profile is None or not spec.profile.rpc:
        return None
    watcher = RpcWatcher(spec.profile.rpc, pid=lambda: pid)
    if spec.log_path is not None:
        await asyncio.to_thread(feed_log_file, watcher, spec.log_path)
    await watcher.check()
    return watcher


def _resolve_target(target: str):
    """A URL, or a profile name (then its URL, key, cache budget and live pid): the server
    service's one resolver (app.servers.service.resolve_target)."""
    from app.servers.service import listening_pid, resolve_target

    spec = resolve_target(target)
    cache_ram = spec.profile.effective_cache_ram if spec.profile is not None else None
    pid = spec.leftover.pid if spec.leftover is not None else listening_pid(spec.url)
    return spec.url, spec.api_key, cache_ram, pid
