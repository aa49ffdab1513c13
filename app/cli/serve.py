"""``kv-valet serve PROFILE``: start a profile's server and supervise it in the foreground."""

from __future__ import annotations

import asyncio
import signal
import sys

from app.cli.errors import Exit

EXIT_OK, EXIT_FAIL = Exit.OK, Exit.FAIL


def add_commands(sub) -> None:
    sv = sub.add_parser("serve", help="start a profile's server and supervise it in the foreground "
                                      "(Ctrl-C stops it)")
    sv.add_argument("profile")
    sv.add_argument("--quiet", action="store_true", help="do not echo the server log")
    sv.set_defaults(run=lambda args: asyncio.run(cmd_serve(args)))


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
    from app.jobs.service import record_prefill_sample
    from app.store.catalog import Catalog

    catalog = Catalog(paths.catalog_path())
    sup.on_line(lambda item: record_prefill_sample(catalog, profile.name, item.event))
    # The Cache health detectors, as in the window: findings with the known issue and the remedy.
    from app.jobs.cache_health import CacheHealth

    health = CacheHealth()
    health.on_finding(lambda f: print(f"[kv-valet] {f.severity}: {f.message}"
                                      + "".join(f"\n[kv-valet]   remedy: {r.label}" for r in f.remedies)
                                      + (f"\n[kv-valet]   known from: {f.source}" if f.source else ""),
                                      file=sys.stderr, flush=True))
    sup.on_line(health.feed)
    sup.on_state(lambda s, o: health.crashed(o) if s == ServerState.CRASHED and o else None)
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
