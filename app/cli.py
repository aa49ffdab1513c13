"""``kv-valet``: no arguments opens the window; subcommands run headless.

The CLI runs the same Qt-free code as the window (profiles, supervisor,
park/resume jobs), so a shutdown hook can park sessions without a display.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys

from app import __version__

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_DISCARDED = 0, 1, 2, 3


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kv-valet", description="Park and resume llama-server sessions.")
    p.add_argument("--version", action="version", version=f"kv-valet {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command")

    pr = sub.add_parser("profiles", help="list, show or import launch profiles")
    prs = pr.add_subparsers(dest="action", required=True)
    prs.add_parser("list", help="list profiles")
    sh = prs.add_parser("show", help="show a profile and the command line it launches")
    sh.add_argument("name")
    im = prs.add_parser("import", help='import a llama-server command line: import "llama-server -m x.gguf ..."')
    im.add_argument("command_line")
    im.add_argument("--name", default=None, help="profile name (default: from the model file name)")
    im.add_argument("--force", action="store_true", help="overwrite a profile of the same name")

    sv = sub.add_parser("serve", help="start a profile's server and supervise it in the foreground (Ctrl-C stops it)")
    sv.add_argument("profile")
    sv.add_argument("--quiet", action="store_true", help="do not echo the server log")

    st = sub.add_parser("status", help="slots, GPUs, server process and host figures of a running server")
    st.add_argument("url", help="server URL, e.g. http://127.0.0.1:8080, or a profile name")
    st.add_argument("--json", action="store_true", help="one JSON object")
    st.add_argument("--api-key", default=None, help="API key (default: $LLAMA_API_KEY or the profile's)")

    from app.cli_check import add_check_command
    from app.cli_sessions import add_session_commands

    add_session_commands(sub)
    add_check_command(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.command is None:
        from app.ui.app import run_gui

        return run_gui()
    try:
        if args.command == "profiles":
            return cmd_profiles(args)
        if args.command == "serve":
            return asyncio.run(cmd_serve(args))
        if args.command == "status":
            return asyncio.run(cmd_status(args))
        if args.command == "check":
            from app.cli_check import run_check

            return run_check(args)
        from app.cli_sessions import run_session_command

        return run_session_command(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a clear message, not a traceback
        from app.core.profile import ProfileError

        if isinstance(e, ProfileError):
            for err in e.errors:
                print(f"error: {e.profile_name + ': ' if e.profile_name else ''}{err}", file=sys.stderr)
            return EXIT_FAIL
        if args.verbose:
            raise
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAIL


# -- profiles ----------------------------------------------------------------

def cmd_profiles(args) -> int:
    from app.core.argv import parse_command_line, preview
    from app.core.hazards import hazards
    from app.core.profile import check
    from app.server.discovery import DiscoveryError, binary_info, find_server_binary
    from app.server.launcher import slot_save_path_for
    from app.store.profiles import ProfileStore

    store = ProfileStore()
    if args.action == "list":
        store.ensure_default()
        profiles, errors = store.load_all()
        for prof in profiles:
            print(f"{prof.name:<20} {prof.url:<28} {prof.model}")
        for e in errors:
            print(f"error: {e}", file=sys.stderr)
        return EXIT_OK if not errors else EXIT_FAIL
    if args.action == "show":
        if args.name == "default":
            store.ensure_default()
        prof = store.load(args.name)
        from app.core.argv import to_argv
        from app.store.profiles import to_toml

        shown = prof.replace(api_key="••••••") if prof.api_key else prof
        print(to_toml(shown).rstrip())
        print()
        try:
            binary = find_server_binary(prof.server_binary).path
        except DiscoveryError as e:
            binary = "llama-server"
            print(f"# {e}")
        print("# command line:")
        print(preview(to_argv(prof, binary, slot_save_path=slot_save_path_for(prof))))
        for h in hazards(prof):
            print(f"# warning: {h.text}")
        return EXIT_OK
    if args.action == "import":
        takes_value = None
        try:
            caps, _ = binary_info(find_server_binary("").path)
            takes_value = caps.takes_value
        except (DiscoveryError, OSError):
            pass
        prof = parse_command_line(args.command_line, "imported", takes_value=takes_value)
        name = args.name or _name_from_model(prof.model) or "imported"
        prof = check(prof.replace(name=name), check_files=False)
        path = store.save(prof, overwrite=args.force)
        print(f"saved profile '{name}' to {path}")
        for h in hazards(prof):
            print(f"warning: {h.text}")
        return EXIT_OK
    return EXIT_USAGE


def _name_from_model(model: str) -> str:
    import re
    from pathlib import Path

    stem = Path(model).name.removesuffix(".gguf") if model else ""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-.")[:64]


# -- serve -------------------------------------------------------------------

async def cmd_serve(args) -> int:
    from app.server.launcher import make_supervisor, plan_launch
    from app.server.supervisor import LaunchError, ServerState, StartFailed
    from app.store.profiles import ProfileStore

    store = ProfileStore()
    if args.profile == "default":
        store.ensure_default()
    profile = store.load(args.profile)

    def progress(done: int, total: int) -> None:
        print(f"\rassembling the default model: {done * 100 // max(total, 1)} %", end="", file=sys.stderr)
        if done >= total:
            print(file=sys.stderr)

    plan = await asyncio.to_thread(plan_launch, profile, on_model_progress=progress)
    sup = make_supervisor(plan)
    if not args.quiet:
        sup.on_line(lambda item: print(item.event.line, file=sys.stderr, flush=True))
    # Measure the profile's prefill rate from every prompt the server processes
    # (the resume warning's re-prefill estimate uses it).
    from app import paths
    from app.store.catalog import Catalog

    catalog = Catalog(paths.catalog_path())

    def record_prefill(item) -> None:
        ev = item.event
        if ev.kind.value == "prompt_eval" and ev.fields.get("n_tokens", 0) >= 32:
            catalog.record_prefill(profile.name, ev.fields["n_tokens"], ev.fields["ms"])

    sup.on_line(record_prefill)
    sup.on_state(lambda s, o: print(f"[kv-valet] server {s.value}" + (f": {o.summary()}" if o and s in
                                    (ServerState.CRASHED,) else ""), file=sys.stderr, flush=True))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"[kv-valet] {' '.join(plan.argv[:1])} … (profile '{profile.name}', {plan.url})", file=sys.stderr)
    try:
        await sup.start()
    except (LaunchError, StartFailed) as e:
        print(f"error: server did not start: {e}", file=sys.stderr)
        await sup.aclose()
        catalog.close()
        return EXIT_FAIL
    print(f"[kv-valet] ready at {plan.url}; Ctrl-C stops the server", file=sys.stderr)
    ended = asyncio.Event()  # the server ended by itself (crash, or stopped by another tool)
    sup.on_state(lambda s, o: ended.set() if (s == ServerState.CRASHED and not profile.auto_restart)
                 or (s == ServerState.STOPPED and not stop.is_set()) else None)
    waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(ended.wait())]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for w in waiters:
        w.cancel()
    outcome, final_state = sup.outcome, sup.state
    await sup.aclose()
    catalog.close()
    if ended.is_set() and outcome and final_state == ServerState.CRASHED:
        print(f"error: server crashed: {outcome.summary()}", file=sys.stderr)
        return EXIT_FAIL
    if ended.is_set() and outcome:
        print(f"[kv-valet] server {outcome.cause.value}", file=sys.stderr)
        return EXIT_OK
    print("[kv-valet] server stopped", file=sys.stderr)
    return EXIT_OK


# -- status ------------------------------------------------------------------

async def cmd_status(args) -> int:
    import os

    from app.monitor.gpu import GpuMonitor
    from app.monitor.process import ProcessMonitor
    from app.monitor.snapshot import format_snapshot, snapshot_to_dict, take_snapshot
    from app.server.client import LlamaClient

    url, api_key, cache_ram, pid = _resolve_target(args.url)
    api_key = args.api_key or api_key or os.environ.get("LLAMA_API_KEY")
    async with LlamaClient(url, api_key) as client:
        async def fetch_health():
            return await client.health()

        proc = ProcessMonitor(pid) if pid else None
        snap = await take_snapshot(fetch_health, client.slots, GpuMonitor(), proc, {}, cache_ram, url)
    if args.json:
        print(json.dumps(snapshot_to_dict(snap), indent=2))
    else:
        print(format_snapshot(snap))
    return EXIT_OK if snap.health == "ok" else EXIT_FAIL


def _resolve_target(target: str):
    """A URL, or a profile name (then its URL, key, cache budget and live pid)."""
    if "://" in target:
        return target, None, None, _pid_listening_on(target)
    from app.server.launcher import pid_record_path
    from app.server.supervisor import find_leftover_server
    from app.store.profiles import ProfileStore

    prof = ProfileStore().load(target)
    rec = find_leftover_server(pid_record_path(prof.name))
    return prof.url, prof.api_key, prof.effective_cache_ram, (rec.pid if rec else _pid_listening_on(prof.url))


def _pid_listening_on(url: str) -> int | None:
    from urllib.parse import urlparse

    import psutil

    port = urlparse(url).port
    if not port:
        return None
    try:
        for c in psutil.net_connections(kind="tcp"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                return c.pid
    except (psutil.Error, OSError):
        return None
    return None


if __name__ == "__main__":
    sys.exit(main())
