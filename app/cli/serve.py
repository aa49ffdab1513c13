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
    sv.add_argument("profile")
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

    profile = load_profile(args.profile)
    if getattr(args, "proxy", False):
        profile = profile.replace(proxy=True)
    from app.proxy.service import ProxyFront  # the proxy in front when the profile says so

    service = ServerService(park_timeout_s=args.park_timeout, front=ProxyFront())
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
        _say(f"ready at {proxy.http.url if proxy else handle.url}; Ctrl-C parks the slots and stops the server")
        if proxy is not None:
            # what the start-up made (modules, the stores, the server's plan) stays for the process's life:
            # out of the collector's way, so a full collection does not pause a proxied stream for it
            import gc

            gc.collect()
            gc.freeze()
        waiters = [loop.create_task(stop.wait()), loop.create_task(ended.wait())]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        sup = handle.supervisor
        if stop.is_set() and sup.state == ServerState.READY:
            if args.no_park:
                await sup.stop()
            else:
                # under systemd (the unit `kv-valet install-service` writes) the stop is the unit's
                trigger = StopTrigger.UNIT_STOP if os.environ.get("INVOCATION_ID") else StopTrigger.SERVE
                _say(f"{POLICY[trigger].doing} (a second signal stops at once)")
                _report_parks(await service.park_then_stop(tid, trigger), profile.name)
        outcome, final_state = sup.outcome, sup.state
        if proxy is not None:
            await proxy.stop()
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
