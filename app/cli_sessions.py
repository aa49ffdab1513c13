"""Session subcommands of ``kv-valet``: park, resume, resume-all, sessions.

The same Qt-free jobs as the window (app.jobs.park / resume / sessions), so a
shutdown hook can park without a display. Every command first finishes or
rolls back a park a crash interrupted (app.jobs.park.recover_interrupted).

Exit codes: 0 ok, 1 failure or refusal, 2 usage.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import asdict
from pathlib import Path

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
COMMANDS = ("park", "resume", "resume-all", "sessions")


def add_session_commands(sub) -> None:
    pk = sub.add_parser("park", help="save slot KV caches to disk (never loses the previous copy)")
    pk.add_argument("target", help="profile name (its server must be running) or server URL")
    which = pk.add_mutually_exclusive_group(required=True)
    which.add_argument("--slot", type=int, help="slot id to park")
    which.add_argument("--all", action="store_true", help="park every slot that holds tokens")
    pk.add_argument("--name", default=None, help="session name (default: date, time and slot; "
                                                 "with --all: the prefix)")
    pk.add_argument("--save-dir", default=None, help="the server's --slot-save-path (required for a URL)")
    pk.add_argument("--and-stop", action="store_true", help="then stop the server and remember the slots "
                                                           "for resume-all")
    pk.add_argument("--api-key", default=None)

    rs = sub.add_parser("resume", help="restore a parked session into a slot")
    rs.add_argument("target", help="profile name or server URL")
    rs.add_argument("session")
    rs.add_argument("--slot", type=int, default=None, help="slot id (default: the first empty slot)")
    rs.add_argument("--yes", action="store_true", help="resume despite warnings (slot not empty, re-prefill)")
    rs.add_argument("--save-dir", default=None, help="the server's --slot-save-path (required for a URL)")
    rs.add_argument("--api-key", default=None)

    ra = sub.add_parser("resume-all", help="resume the sessions 'park --all --and-stop' left, into the same slots")
    ra.add_argument("profile")
    ra.add_argument("--api-key", default=None)

    ss = sub.add_parser("sessions", help="list, show, rename or delete parked sessions")
    ssa = ss.add_subparsers(dest="action", required=True)
    ls = ssa.add_parser("list", help="list sessions, most recent first")
    ls.add_argument("--profile", default=None)
    ls.add_argument("--json", action="store_true")
    sh = ssa.add_parser("show", help="everything known about one session")
    sh.add_argument("name")
    sh.add_argument("--profile", default=None)
    sh.add_argument("--json", action="store_true")
    rm = ssa.add_parser("rm", help="delete a session: its catalog row, state file and sidecar")
    rm.add_argument("name")
    rm.add_argument("--profile", default=None)
    rn = ssa.add_parser("rename", help="rename a session (the file keeps its name)")
    rn.add_argument("old")
    rn.add_argument("new")
    rn.add_argument("--profile", default=None)


def run_session_command(args) -> int:
    if args.command not in COMMANDS:
        print(f"error: unknown command {args.command}", file=sys.stderr)
        return EXIT_USAGE
    from app import paths
    from app.store.catalog import Catalog, CatalogError

    catalog = Catalog(paths.catalog_path())
    try:
        _recover(catalog, getattr(args, "save_dir", None))
        if args.command == "sessions":
            return cmd_sessions(args, catalog)
        if args.command == "park":
            return asyncio.run(cmd_park(args, catalog))
        if args.command == "resume":
            return asyncio.run(cmd_resume(args, catalog))
        return asyncio.run(cmd_resume_all(args, catalog))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except CatalogError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAIL
    finally:
        catalog.close()


class UsageError(Exception):
    pass


def _err(text: str) -> None:
    print(text, file=sys.stderr)


def _recover(catalog, extra_dir) -> None:
    from app.jobs.park import known_save_dirs, recover_interrupted

    for msg in recover_interrupted(catalog, known_save_dirs(catalog, [extra_dir] if extra_dir else [])):
        _err(f"[kv-valet] {msg}")


# -- connecting --------------------------------------------------------------


class _Conn:
    """A connected ServerTarget, plus what --and-stop needs."""

    def __init__(self, target, client, pid_record=None):
        self.target, self.client, self.pid_record = target, client, pid_record

    async def stop(self):  # the Supervisor interface park_all_and_stop uses
        from app.server.supervisor import terminate_leftover

        if self.pid_record is None:
            raise RuntimeError("--and-stop needs a server that KV Valet launched (a profile's server)")
        await asyncio.to_thread(terminate_leftover, self.pid_record)


async def _connect(target_arg: str, save_dir: str | None, api_key: str | None, catalog) -> _Conn:
    import os

    from app.jobs.target import ServerTarget
    from app.server.client import LlamaClient

    if "://" in target_arg:
        if not save_dir:
            raise UsageError("--save-dir is required with a server URL (the server's --slot-save-path)")
        client = LlamaClient(target_arg, api_key or os.environ.get("LLAMA_API_KEY"))
        await _require_up(client, target_arg)
        return _Conn(await ServerTarget.connect(client, catalog, save_dir=save_dir), client)

    from app.server.launcher import _read_key_file, pid_record_path
    from app.server.supervisor import find_leftover_server
    from app.store.profiles import ProfileStore

    prof = ProfileStore().load(target_arg)
    rec = find_leftover_server(pid_record_path(prof.name))
    url = rec.url if rec else prof.url
    key = api_key or prof.api_key or _read_key_file(prof.api_key_file) or os.environ.get("LLAMA_API_KEY")
    client = LlamaClient(url, key)
    await _require_up(client, f"the server of profile '{prof.name}' ({url})")
    target = await ServerTarget.connect(client, catalog, profile=prof, save_dir=save_dir)
    return _Conn(target, client, rec)


async def _require_up(client, what: str) -> None:
    h = await client.health()
    if not h.ok:
        await client.aclose()
        state = "is still loading its model" if h.loading else f"is not running ({h.message})"
        raise RuntimeError(f"{what} {state}")


# -- park --------------------------------------------------------------------


async def cmd_park(args, catalog) -> int:
    from app.jobs.park import ParkError, ParkResult, describe, park_all, park_slot
    from app.jobs.park_all_stop import write_resume_plan
    from app.server.client import ServerError, ServerUnreachable

    conn = await _connect(args.target, args.save_dir, args.api_key, catalog)
    try:
        if args.and_stop and conn.pid_record is None:
            raise UsageError("--and-stop needs a profile whose server KV Valet launched")
        if args.all:
            results = await park_all(conn.target, prefix=args.name)
            if not results:
                print("no slot holds tokens: nothing to park")
        else:
            try:
                results = [await park_slot(conn.target, args.slot, args.name)]
            except (ParkError, ServerError, ServerUnreachable) as e:
                results = [ParkResult(None, None, [], args.slot, str(e))]
        for r in results:
            print(describe(r))
            for w in r.warnings:
                print(f"  warning: {w}")
        failed = [r for r in results if not r.ok]
        if args.and_stop:
            write_resume_plan(conn.target.profile_name, results)
            if failed:
                _err("error: not stopping the server: a slot was not parked")
            else:
                await conn.stop()
                print(f"server of profile '{conn.target.profile_name}' stopped; "
                      f"'kv-valet resume-all {conn.target.profile_name}' restores the slots")
        return EXIT_FAIL if failed else EXIT_OK
    finally:
        await conn.client.aclose()


# -- resume ------------------------------------------------------------------


async def cmd_resume(args, catalog) -> int:
    from app.jobs.park import ParkError
    from app.jobs.resume import ResumeFailed, ResumeNeedsConfirmation, ResumeRefused, resume_session

    conn = await _connect(args.target, args.save_dir, args.api_key, catalog)
    try:
        try:
            res = await resume_session(conn.target, args.session, args.slot, force=args.yes)
        except ResumeRefused as e:
            _err(f"refused: cannot resume '{args.session}':")
            for r in e.reasons:
                _err(f"  - {r}")
            return EXIT_FAIL
        except ResumeNeedsConfirmation as e:
            _err(f"not resumed: '{args.session}' needs confirmation:")
            for w in e.warnings:
                _err(f"  - {w}")
            _err("pass --yes to resume anyway")
            return EXIT_FAIL
        except (ResumeFailed, ParkError) as e:
            _err(f"error: {e}")
            return EXIT_FAIL
        print(f"resumed '{res.record.name}' into slot {res.slot_id}: {res.n_restored:,} tokens "
              f"in {res.restore_ms:,.1f} ms")
        for w in res.warnings:
            print(f"  warning: {w}")
        return EXIT_OK
    finally:
        await conn.client.aclose()


async def cmd_resume_all(args, catalog) -> int:
    from app.jobs.park_all_stop import clear_resume_plan, load_resume_plan, resume_all

    plan = load_resume_plan(args.profile)
    if not plan:
        print(f"no resume plan for profile '{args.profile}' (made by 'park --all --and-stop')")
        return EXIT_OK
    conn = await _connect(args.profile, None, args.api_key, catalog)
    try:
        results = await resume_all(conn.target, plan, force=True)
    finally:
        await conn.client.aclose()
    for r in results:
        if r["ok"]:
            res = r["result"]
            print(f"resumed '{r['session']}' into slot {r['slot']}: {res.n_restored:,} tokens")
            for w in r["warnings"]:
                print(f"  warning: {w}")
        else:
            print(f"slot {r['slot']}: '{r['session']}' not resumed: {r['error']}")
    if all(r["ok"] for r in results):
        clear_resume_plan(args.profile)
        return EXIT_OK
    return EXIT_FAIL


# -- sessions ----------------------------------------------------------------


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def cmd_sessions(args, catalog) -> int:
    from app.jobs.sessions import delete_session, get_session, list_sessions, rename_session

    if args.action == "list":
        recs = list_sessions(catalog, args.profile)
        if args.json:
            print(json.dumps([asdict(r) for r in recs], indent=1, ensure_ascii=False))
            return EXIT_OK
        if not recs:
            print("no parked sessions")
        for r in recs:
            print(f"{r.name:<28} {r.profile:<16} {r.n_tokens:>8,} tok {_mb(r.state_size + r.sidecar_size):>10}  "
                  f"sidecar {r.sidecar_status}")
        return EXIT_OK
    if args.action == "show":
        r = get_session(catalog, args.name, args.profile)
        if args.json:
            d = asdict(r)
            d["history"] = [asdict(e) for e in catalog.history(r.id)] if r.id is not None else []
            print(json.dumps(d, indent=1, ensure_ascii=False))
            return EXIT_OK
        rows = [("name", r.name), ("profile", r.profile), ("state file", str(r.state_path)),
                ("size", _mb(r.state_size) + (f" + sidecar {_mb(r.sidecar_size)}" if r.sidecar_size else "")),
                ("tokens", f"{r.n_tokens:,} (slot {r.slot_id}, n_ctx {r.n_ctx_slot:,})"),
                ("model", f"{r.model_path} ({r.memory_kind})"),
                ("KV types", f"{r.cache_type_k}/{r.cache_type_v}"), ("build", r.server_build),
                ("sidecar", f"{r.sidecar_status} ({r.sidecar_count} checkpoints): {r.sidecar_reason}")]
        if r.last_restore_ms is not None:
            rows.append(("last resume", f"{r.last_n_restored:,} tokens in {r.last_restore_ms:,.1f} ms"))
        if r.last_verdict:
            rows.append(("verdict", f"{r.last_verdict}: {r.last_verdict_reason or ''}"))
        for k, v in rows:
            print(f"{k + ':':<13}{v}")
        return EXIT_OK
    if args.action == "rm":
        removed = delete_session(catalog, args.name, args.profile)
        print(f"deleted '{args.name}'" + (f" ({', '.join(Path(p).name for p in removed)})" if removed else ""))
        return EXIT_OK
    if args.action == "rename":
        r = rename_session(catalog, args.old, args.new, args.profile)
        print(f"renamed '{args.old}' to '{r.name}'")
        return EXIT_OK
    return EXIT_USAGE
