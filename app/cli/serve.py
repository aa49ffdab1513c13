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
    sv.add_argument("--park-timeout", type=float, default=120.0, metavar="SECONDS",
                    help="on SIGTERM, SIGHUP or Ctrl-C, park every slot that holds tokens before stopping, "
                         "for at most this long (default 120); a second signal stops at once")
    sv.add_argument("--no-park", action="store_true", help="stop without parking the slots")
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
    from app import paths
    from app.store.catalog import Catalog

    catalog = Catalog(paths.catalog_path())
    # Verdicts (also of resumes other processes do), the time-saved ledger and the
    # prefill-rate samples: a session service on the ready server, wired as in the window.
    sessions = ServeSessions(catalog, profile, plan, sup)
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
    now = asyncio.Event()  # a second signal: stop without waiting for the parks
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        (now if stop.is_set() else stop).set()

    # A logout, a reboot (systemd stops the unit) and Ctrl-C all end here: park first.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, on_signal)
    print(f"[kv-valet] {' '.join(plan.argv[:1])} … (profile '{profile.name}', {plan.url})", file=sys.stderr)
    for note in plan.notes:
        print(f"[kv-valet] {note}", file=sys.stderr)
    try:
        await sup.start()
    except (LaunchError, StartFailed) as e:
        print(f"error: server did not start: {e}", file=sys.stderr)
        await sup.aclose()
        await sessions.aclose()
        catalog.close()
        return EXIT_FAIL
    print(f"[kv-valet] ready at {plan.url}; Ctrl-C parks the slots and stops the server", file=sys.stderr)
    ended = asyncio.Event()  # the server ended by itself (crash, or stopped by another tool)
    sup.on_state(lambda s, o: ended.set() if (s == ServerState.CRASHED and not profile.auto_restart)
                 or (s == ServerState.STOPPED and not stop.is_set()) else None)
    waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(ended.wait())]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for w in waiters:
        w.cancel()
    if stop.is_set() and not args.no_park and sup.state == ServerState.READY:
        await park_before_stop(profile, plan, sup, catalog, args.park_timeout, now, sessions=sessions)
    outcome, final_state = sup.outcome, sup.state
    await sup.aclose()
    await sessions.aclose()
    catalog.close()
    if ended.is_set() and outcome and final_state == ServerState.CRASHED:
        print(f"error: server crashed: {outcome.summary()}", file=sys.stderr)
        return EXIT_FAIL
    if ended.is_set() and outcome:
        print(f"[kv-valet] server {outcome.cause.value}", file=sys.stderr)
        return EXIT_OK
    print("[kv-valet] server stopped", file=sys.stderr)
    return EXIT_OK


class ServeSessions:
    """The session service ``serve`` holds while its server is Ready (connected again
    after an auto-restart): through ``SessionService.connect(supervisor=...)`` it gets the
    window's wiring (app.jobs.wiring), so verdicts, also of a ``kv-valet resume`` run
    meanwhile, the time-saved ledger and the prefill-rate samples work headless. Each
    verdict is printed as a ``[kv-valet] verdict`` line."""

    def __init__(self, catalog, profile, plan, sup):
        from app.server.supervisor import ServerState

        self.catalog, self.profile, self.plan, self.sup = catalog, profile, plan, sup
        self.service = None
        self._connecting: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self._ready_state = ServerState.READY
        self._gone_states = (ServerState.STOPPED, ServerState.CRASHED)
        sup.on_state(self._on_state)

    def _spawn(self, coro, what: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._task_done(t, what))
        return task

    def _task_done(self, task: asyncio.Task, what: str) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            e = task.exception()
            log.error("serve '%s': %s failed", self.profile.name, what, exc_info=e)
            print(f"[kv-valet] {what} failed: {e!r}", file=sys.stderr, flush=True)

    def _on_state(self, state, outcome) -> None:
        if self._closed:
            return
        if state == self._ready_state:
            self._connecting = self._spawn(self._connect(), "connecting the session service (verdicts)")
        elif state in self._gone_states and self.service is not None:
            svc, self.service = self.service, None
            self._spawn(svc.aclose(), "closing the session service")

    async def _connect(self):
        from app.jobs.service import ServiceError, SessionService

        try:
            svc = await SessionService.connect(
                self.catalog, url=self.plan.url, profile=self.profile, save_dir=self.plan.slot_save_path,
                log_buffer=self.sup.log, build=self.plan.build, supervisor=self.sup, stopper=self.sup.stop)
        except ServiceError as e:
            print(f"[kv-valet] no verdicts for now: cannot connect to the server: {e}", file=sys.stderr, flush=True)
            return None
        if self._closed or self.sup.state != self._ready_state:
            await svc.aclose()
            return None
        old, self.service = self.service, svc
        if old is not None:
            await old.aclose()
        svc.on_verdict(self._print_verdict)
        for msg in svc.recovery_messages:
            print(f"[kv-valet] recovered: {msg}", file=sys.stderr, flush=True)
        return svc

    def _print_verdict(self, slot_id: int, session: str | None, verdict) -> None:
        who = f"'{session}'" if session else "the restored session"
        print(f"[kv-valet] verdict {verdict.kind} for {who} (slot {slot_id}): {verdict.reason}", file=sys.stderr,
              flush=True)

    async def current(self):
        """The connected service (after a connection in flight), or None."""
        if self._connecting is not None and not self._connecting.done():
            await asyncio.wait({self._connecting})
        return None if self._closed else self.service

    async def aclose(self) -> None:
        self._closed = True
        if self._connecting is not None and not self._connecting.done():
            # it closes what it connects once it sees _closed; a server that stopped answering
            # cannot hold the stop up for long
            done, _ = await asyncio.wait({self._connecting}, timeout=15)
            if not done:
                self._connecting.cancel()
        svc, self.service = self.service, None
        if svc is not None:
            await svc.aclose()
        tasks = list(self._tasks)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


async def park_before_stop(profile, plan, sup, catalog, timeout: float, now: asyncio.Event, *,
                           sessions: ServeSessions | None = None) -> None:
    """Park every slot that holds tokens (and write the resume plan) before the server
    stops: at most ``timeout`` seconds, and not at all once ``now`` is set. Uses the
    session service ``sessions`` holds when it is connected, else connects one."""
    import time

    from app.jobs.park import describe
    from app.jobs.service import ServiceError, SessionService

    print("[kv-valet] parking the slots before stopping (a second signal stops at once)", file=sys.stderr,
          flush=True)

    async def park() -> None:
        held = await sessions.current() if sessions is not None else None
        svc = held or await SessionService.connect(catalog, url=plan.url, profile=profile, build=plan.build,
                                                   log_buffer=sup.log, stopper=sup.stop)
        try:
            outcome = await svc.park_all_and_stop(f"{time.strftime('%Y-%m-%d %H-%M')} at stop", stop_if_failed=True)
        finally:
            if svc is not held:
                await svc.aclose()
        if not outcome.results:
            print("[kv-valet] no slot holds tokens: nothing to park", file=sys.stderr)
        for r in outcome.results:
            print(f"[kv-valet] {describe(r)}", file=sys.stderr)
        if outcome.plan:
            print(f"[kv-valet] 'kv-valet resume-all {profile.name}' (or Resume all in the window) puts them back",
                  file=sys.stderr, flush=True)

    task = asyncio.ensure_future(park())
    interrupt = asyncio.ensure_future(now.wait())
    try:
        done, _ = await asyncio.wait({task, interrupt}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            why = "a second signal" if interrupt in done else f"the {timeout:g} s limit"
            print(f"[kv-valet] parking interrupted by {why}: stopping now", file=sys.stderr, flush=True)
        elif task.exception() is not None:
            e = task.exception()
            print(f"[kv-valet] could not park: {e if isinstance(e, ServiceError) else repr(e)}", file=sys.stderr)
    finally:
        for t in (task, interrupt):
            t.cancel()
        await asyncio.gather(task, interrupt, return_exceptions=True)
