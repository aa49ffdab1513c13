"""``kv-valet serve PROFILE``: start a profile's server and supervise it in the foreground."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from app.cli.errors import Exit

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAIL = Exit.OK, Exit.FAIL


def add_commands(sub) -> None:
    sv = sub.add_parser("serve", help="start a profile's server and supervise it in the foreground "
                                      "(Ctrl-C stops it)")
    sv.add_argument("profile", nargs="?", default=None,
                    help="a profile here, or HOST:PROFILE (a host of `kv-valet hosts`, with --proxy: "
                         "the proxy here in front of that host's server, over SSH)")
    sv.add_argument("--command-line", default=None, metavar="LINE",
                    help='instead of PROFILE: a llama-server command line ("llama-server -m x.gguf ..."), imported '
                         "as a profile first, replacing one of the same name (as `kv-valet profiles import --force`), "
                         "then served")
    sv.add_argument("--name", default=None, metavar="NAME",
                    help="with --command-line: the profile's name (default: from the model file name)")
    sv.add_argument("--quiet", action="store_true", help="do not echo the server log")
    sv.add_argument("--park-timeout", type=float, default=None, metavar="SECONDS",
                    help="on SIGTERM, SIGHUP or Ctrl-C, park every slot that holds tokens before stopping, "
                         "for at most this long (default: the park_timeout_s setting, 120 s unless changed); "
                         "a second signal stops at once")
    sv.add_argument("--no-park", action="store_true", help="stop without parking the slots")
    sv.add_argument("--proxy", action="store_true",
                    help="put the conversation proxy on the profile's host and port (the server moves to a "
                         "private loopback port): every request pinned to a slot, conversations parked and "
                         "restored by themselves, each request judged (also: proxy = true in the profile)")
    sv.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                    help="with --proxy: publish the server's KV events (blocks stored and removed in its slots and "
                         "parks, all cleared on a restart; vLLM's ZMQ format, for KV-aware routers) on a ZMQ PUB "
                         "socket bound at ENDPOINT, e.g. tcp://127.0.0.1:5557 (another address shows every "
                         "conversation's token ids to whoever reaches it); off unless given")
    sv.add_argument("--port", type=int, default=None, metavar="PORT",
                    help="with HOST:PROFILE: the port the proxy listens on here, on 127.0.0.1 (default: the "
                         "host profile's own port)")
    sv.set_defaults(run=lambda args: asyncio.run(cmd_serve(args)))


def _say(text: str) -> None:
    print(f"[kv-valet] {text}", file=sys.stderr, flush=True)


async def cmd_serve(args) -> int:
    """The server service (app.servers.service) in the foreground: it launches the server,
    connects the session service when it is Ready (verdicts, also of resumes other processes
    do, the time-saved ledger, the prefill-rate samples), and ends in its one park-then-stop."""
    import os

    from app.core.lifecycle import POLICY, StopTrigger
    from app.core.states import ServerState
    from app.tools.cache_health import CacheHealth
    from app.servers.service import ServerService, load_profile, profile_target_id
    from app.servers.events import LaunchPlanned, LaunchRefused, Notice, Progress, SessionsChanged, StateChanged

    command_line = getattr(args, "command_line", None)
    if (args.profile is None) == (command_line is None):
        print("error: give PROFILE or --command-line LINE (one of them)", file=sys.stderr)
        return Exit.USAGE
    if getattr(args, "name", None) is not None and command_line is None:
        print("error: --name names the profile of --command-line", file=sys.stderr)
        return Exit.USAGE
    if command_line is not None:
        from app.servers.service import import_command_line

        # a line that cannot be read or a value the profile refuses: raised, said as `profiles import` says it
        imported, path = import_command_line(command_line, args.name, overwrite=True)
        _say(f"imported the command line as profile '{imported.name}' ({path})")
        args.profile = imported.name
    host_name, _sep, remote_profile = args.profile.rpartition(":")
    if host_name:
        if not getattr(args, "proxy", False):
            print(f"error: '{args.profile}' is a host's profile: `kv-valet serve {args.profile} --proxy` puts the "
                  f"conversation proxy here in front of its server; `kv-valet hosts start {host_name} "
                  f"{remote_profile}` starts that server there", file=sys.stderr)
            return EXIT_FAIL
        if getattr(args, "kv_events", None):
            print("error: --kv-events is for a server here: a host's server behind the proxy here publishes "
                  "none (its parks are read there)", file=sys.stderr)
            return Exit.USAGE
        return await serve_remote(args, host_name, remote_profile)
    if getattr(args, "port", None) is not None:
        print("error: --port is for HOST:PROFILE (a profile here listens where it says)", file=sys.stderr)
        return EXIT_FAIL
    profile = load_profile(args.profile)
    if getattr(args, "proxy", False):
        profile = profile.replace(proxy=True)
    kv_events = getattr(args, "kv_events", None)
    if kv_events and not profile.proxy:
        print("error: --kv-events needs the proxy (--proxy, or proxy = true in the profile): the proxy is what "
              "knows each slot's tokens", file=sys.stderr)
        return Exit.USAGE
    from app.proxy.front import ProxyFront  # the proxy in front when the profile says so

    service = ServerService(park_timeout_s=args.park_timeout, front=ProxyFront(kv_events=kv_events))
    tid = profile_target_id(profile.name)
    # The Cache health detectors, as in the window: findings with the known issue and the remedy.
    health = CacheHealth()
    health.on_finding(lambda f: _say(f"{f.severity}: {f.message}"
                                     + "".join(f"\n[kv-valet]   remedy: {r.label}" for r in f.remedies)
                                     + (f"\n[kv-valet]   known from: {f.source}" if f.source else "")))
    stop = asyncio.Event()
    ended = asyncio.Event()  # the server ended by itself (crash, or stopped by another tool)
    refused: list[str] = []

    def on_event(ev) -> None:
        if isinstance(ev, Progress):
            print(f"\rassembling the default model: {ev.percent} %", end="" if ev.percent < 100 else "\n",
                  file=sys.stderr)
        elif isinstance(ev, LaunchPlanned):
            sup = service.get(tid).supervisor
            if not args.quiet:
                sup.on_line(lambda item: print(item.event.line, file=sys.stderr, flush=True))
            sup.on_line(health.feed)
            _say(f"{' '.join(ev.plan.argv[:1])} … (profile '{profile.name}', {ev.plan.url})")
            for note in ev.plan.notes:
                _say(note)
        elif isinstance(ev, LaunchRefused):
            refused.append(ev.message)
        elif isinstance(ev, StateChanged):
            if ev.detail in ("checking the profile…", "refused"):  # the service's own steps, not the server's
                return
            h = service.get(ev.target_id)
            if h is None or h.supervisor is None:
                return  # a killed app's leftover server, attached only to be parked and stopped (its Notices say it)
            _say(f"server {ev.state.value}" + (f": {ev.outcome.summary()}" if ev.outcome is not None
                                               and ev.state is ServerState.CRASHED else ""))
            if ev.state is ServerState.CRASHED and ev.outcome is not None:
                health.crashed(ev.outcome)
            if (ev.state is ServerState.CRASHED and not profile.auto_restart) or \
                    (ev.state is ServerState.STOPPED and not stop.is_set()):
                ended.set()
        elif isinstance(ev, SessionsChanged) and ev.sessions is not None:
            ev.sessions.on_verdict(_print_verdict)
            for msg in ev.sessions.recovery_messages:
                _say(f"recovered: {msg}")
        elif isinstance(ev, Notice):
            _say(ev.message.replace("the Sessions tab", "for verdicts") if not ev.ok else ev.message)

    service.on_event(on_event)
    now_count = 0

    def on_signal() -> None:
        nonlocal now_count
        if stop.is_set():
            now_count += 1
            service.interrupt_park()  # a second signal: stop without waiting for the parks
        stop.set()

    # A logout, a reboot (systemd stops the unit) and Ctrl-C all end here: park first.
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, on_signal)
    try:
        from app.servers.launch import launch_profile

        handle, proxy = await launch_profile(service, profile)
        if handle is None:
            h = service.get(tid)
            outcome = h.supervisor.outcome if h is not None and h.supervisor is not None else None
            why = refused[0] if refused else (outcome.summary() if outcome is not None else "refused")
            print(f"error: server did not start: {why}", file=sys.stderr)
            return EXIT_FAIL
        if proxy is not None:
            proxy.on_record(_print_request)
            _say(f"conversation proxy at {proxy.http.url} (the server listens on {handle.url}, loopback only)")
            if proxy.notice():
                _say(proxy.notice())
            if proxy.warming is not None:
                proxy.warming.add_done_callback(_say_warmed)
        router = handle.profile is not None and handle.profile.router
        _say(f"ready at {proxy.http.url if proxy else handle.url}; Ctrl-C "
             + ("stops the router and its child servers" if router else "parks the slots and stops the server"))
        collections = None
        if proxy is not None:
            # the start-up's objects out of the collector's way, and its collections between requests
            from app.core.gc_moments import collect_between_requests

            collections = collect_between_requests(proxy.on_idle)
        waiters = [loop.create_task(stop.wait()), loop.create_task(ended.wait())]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        sup = handle.supervisor
        if stop.is_set() and sup.state == ServerState.READY:
            if args.no_park:
                if proxy is not None:  # first: none of its requests (a judgment's /slots) still runs at the stop
                    await proxy.stop()
                await sup.stop()
            else:
                # under systemd (the unit `kv-valet install-service` writes) the stop is the unit's
                trigger = StopTrigger.UNIT_STOP if os.environ.get("INVOCATION_ID") else StopTrigger.SERVE
                _say(f"{POLICY[trigger].doing} (a second signal stops at once)")
                _report_parks(await service.park_then_stop(tid, trigger), profile.name)
        outcome, final_state = sup.outcome, sup.state
        if proxy is not None:
            await proxy.stop()
        if collections is not None:
            collections.stop()
    finally:
        await service.aclose()
    if ended.is_set() and outcome and final_state == ServerState.CRASHED:
        print(f"error: server crashed: {outcome.summary()}", file=sys.stderr)
        return EXIT_FAIL
    if ended.is_set() and outcome:
        _say(f"server {outcome.cause.value}")
        return EXIT_OK
    _say("server stopped")
    return EXIT_OK


async def serve_remote(args, host_name: str, profile: str) -> int:
    """``kv-valet serve HOST:PROFILE --proxy``: the conversation proxy here, on 127.0.0.1, in front of the
    host's server over SSH (app.proxy.remote); Ctrl-C parks its conversations on the host and stops the
    proxy, the host's server keeps running."""
    from app.core.background import track
    from app.proxy.remote import RemoteProxyError, start_remote_proxy
    from app.remote.host import RemoteError, RemoteHost
    from app.settings import load_or_defaults
    from app.store.hosts import HostsError, HostStore

    if not profile:
        print(f"error: '{args.profile}': give HOST:PROFILE", file=sys.stderr)
        return EXIT_FAIL
    try:
        host = RemoteHost(HostStore().get(host_name))
    except HostsError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAIL
    stop, now = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        (now if stop.is_set() else stop).set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, on_signal)
    try:
        try:
            front = await start_remote_proxy(host, host_name, profile, port=args.port, say=_say)
        except (RemoteError, RemoteProxyError) as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_FAIL
        except OSError as e:  # the port here is taken
            print(f"error: the proxy cannot listen here: {e.strerror or e}", file=sys.stderr)
            return EXIT_FAIL
        front.proxy.on_record(_print_request)
        _say(f"conversation proxy at {front.proxy.url}, in front of '{profile}' on {host_name} "
             f"({front.server_url} there, reached through SSH)")
        _say(f"ready at {front.proxy.url}; Ctrl-C parks the conversations on {host_name} and stops the proxy "
             "(the host's server keeps running)")
        await stop.wait()
        if args.no_park:
            await front.stop(park=False)
        else:
            prefs, _problem = load_or_defaults()
            timeout = args.park_timeout if args.park_timeout is not None else prefs.park_timeout_s
            _say(f"parking the proxy's conversations on {host_name} (a second signal stops at once)")
            stopping = track(front.stop(timeout=timeout), f"parking the proxy's conversations on {host_name}")
            interrupt = track(now.wait(), "waiting for a second signal")
            await asyncio.wait({stopping, interrupt}, return_when=asyncio.FIRST_COMPLETED)
            interrupt.cancel()
            if not stopping.done():
                _say("parking interrupted: stopping now")
                stopping.cancel()  # its own finally stops the proxy
                await asyncio.gather(stopping, return_exceptions=True)
            elif stopping.exception() is not None:
                raise stopping.exception()
            else:
                parked, why = stopping.result()
                if parked:
                    _say(f"parked on {host_name}: " + ", ".join(f"conversation {c} as 'proxy-{c}'" for c in parked))
                if why:
                    _say(f"not every conversation was parked: {why}")
        _say(f"proxy stopped; the server of '{profile}' on {host_name} keeps running "
             f"(kv-valet hosts stop {host_name} {profile} stops it)")
        return EXIT_OK
    finally:
        await host.close()


def _say_warmed(task) -> None:
    """The proxy's warm start ended: which parked conversations wait in a slot now (its failure is
    logged by the task's tracker)."""
    if task.cancelled() or task.exception() is not None:
        return
    warmed = task.result()
    if warmed:
        _say(f"warm start: restored {len(warmed)} parked conversation{'s' if len(warmed) != 1 else ''} into "
             f"free slots ({', '.join(warmed)}): their next turn starts at once")


def _print_request(rec) -> None:
    figures = f"cache_n {rec.cache_n:,}, prompt_n {rec.prompt_n:,}" if rec.cache_n is not None and \
        rec.prompt_n is not None else "no timings"
    why = f": {rec.explanation.cause.value} ({rec.explanation.detail})" if rec.explanation is not None else ""
    restored = f", restored from '{rec.restored_from}'" if rec.restored_from else ""
    _say(f"request {rec.verdict.value} conversation {rec.conversation} slot {rec.slot} ({figures}{restored}){why}")


def _print_verdict(slot_id: int, session: str | None, verdict) -> None:
    who = f"'{session}'" if session else "the restored session"
    _say(f"verdict {verdict.kind} for {who} (slot {slot_id}): {verdict.reason}")


def _report_parks(report, profile_name: str) -> None:
    from app.sessions.park import describe

    if report.interrupted:
        _say(f"parking interrupted by {report.interrupted}: stopping now")
    elif report.error:
        _say(f"could not park: {report.error}")
    elif not report.results:
        _say("no slot holds tokens: nothing to park")
    for r in report.results:
        _say(describe(r))
    if report.plan:
        _say(f"'kv-valet resume-all {profile_name}' (or Resume all in the window) puts them back")
