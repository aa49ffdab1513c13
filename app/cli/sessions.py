"""``kv-valet park | resume | resume-all | sessions``: the Sessions tab without a window.

Each command connects a :class:`SessionService` (which also finishes or undoes
a park or an A/B hide a crash interrupted) and prints what it returns.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import asdict
from pathlib import Path

from app.cli.connect import connect, open_catalog
from app.cli.errors import CliError, Exit, note
from app.cli.hosts import add_host_option, forward, host_aware
from app.cli.keys import add_key_option, key_from_args


def add_commands(sub) -> None:
    pk = sub.add_parser("park", help="save slot KV caches to disk (never loses the previous copy)")
    pk.add_argument("target", help="profile name (its server must be running) or server URL")
    which = pk.add_mutually_exclusive_group()
    which.add_argument("--slot", type=int, help="slot id to park (default: the first slot that holds tokens)")
    which.add_argument("--all", action="store_true", help="park every slot that holds tokens")
    pk.add_argument("--name", default=None, help="session name (default: date, time and slot; "
                                                 "with --all: the prefix)")
    pk.add_argument("--save-dir", default=None, help="the server's --slot-save-path (required for a URL)")
    pk.add_argument("--and-stop", action="store_true", help="with --all: then stop the server and remember "
                                                           "the slots for resume-all")
    pk.add_argument("--json", action="store_true", help="print one JSON object (errors too, same exit status)")
    add_key_option(pk)
    add_host_option(pk)
    pk.set_defaults(run=host_aware(lambda a: _run(cmd_park, a)))

    rs = sub.add_parser("resume", help="restore a parked session into a slot")
    rs.add_argument("target", help="profile name or server URL")
    rs.add_argument("session")
    rs.add_argument("--slot", type=int, default=None,
                    help="slot id (default: the slot it was parked from if empty, else the first empty slot)")
    rs.add_argument("--yes", action="store_true", help="resume despite warnings (slot not empty, re-prefill, a file that is not "
                    "the one parked)")
    rs.add_argument("--unless-files-changed", action="store_true",
                    help="even with --yes, leave a park whose files are not the ones it wrote parked (what the "
                         "conversation proxy asks of a host)")
    rs.add_argument("--unless-hazard", action="store_true",
                    help="even with --yes, leave it parked when the restore would roll back onto another chat's "
                         "context checkpoints (the proxy re-processes instead)")
    rs.add_argument("--unless-useless", choices=("chat", "exact"), default=None,
                    help="even with --yes, leave it parked where the resume matrix measured that a restore buys "
                         "the next turn nothing on this server (chat: a chat client's next turn; exact: a text "
                         "prompt continued)")
    rs.add_argument("--save-dir", default=None, help="the server's --slot-save-path (required for a URL)")
    rs.add_argument("--json", action="store_true", help="print one JSON object (errors too, same exit status)")
    add_key_option(rs)
    add_host_option(rs)
    rs.set_defaults(run=host_aware(lambda a: _run(cmd_resume, a)))

    ra = sub.add_parser("resume-all", help="resume the sessions 'park --all --and-stop' left, into the same slots")
    ra.add_argument("profile")
    add_key_option(ra)
    add_host_option(ra)
    ra.set_defaults(run=host_aware(lambda a: _run(cmd_resume_all, a)))

    ss = sub.add_parser("sessions", help="list, show, rename or delete parked sessions; disk usage")
    ssa = ss.add_subparsers(dest="action", required=True)
    ls = ssa.add_parser("list", help="list sessions, most recent first")
    ls.add_argument("--profile", default=None)
    ls.add_argument("--json", action="store_true")
    ls.add_argument("--host", default=None, metavar="NAME", help="the sessions parked on a remote host (kv-valet hosts)")
    sh = ssa.add_parser("show", help="everything known about one session")
    sh.add_argument("name")
    sh.add_argument("--profile", default=None)
    sh.add_argument("--json", action="store_true")
    add_host_option(sh)
    du = ssa.add_parser(
        "du", help="disk usage per profile: sessions, state files and sidecars",
        description="Disk usage of the parked sessions, one line per profile: 'profile X: N sessions, "
                    "SIZE (state files Z, sidecars W)', then the total. Sidecars are looked at on disk first; "
                    "a state file two sessions share counts once. The Sessions tab shows the same line "
                    "under its table.")
    du.add_argument("--profile", default=None, help="only this profile")
    du.add_argument("--json", action="store_true", help="bytes per profile as JSON")
    add_host_option(du)
    rm = ssa.add_parser(
        "rm", help="delete a session (or every session older than N days): catalog row, state file, sidecar",
        description="Delete one session by name, or with --older-than every session last parked more than "
                    "DAYS days ago (in one profile with --profile). --older-than without --yes only lists "
                    "what would go and the space it would free, and deletes nothing.")
    rm.add_argument("name", nargs="?", help="the session to delete (not with --older-than)")
    rm.add_argument("--profile", default=None)
    rm.add_argument("--older-than", type=float, default=None, metavar="DAYS",
                    help="every session last parked more than DAYS days ago (fractions allowed)")
    rm.add_argument("--yes", action="store_true", help="with --older-than: delete them (else: only list them)")
    add_host_option(rm)
    rn = ssa.add_parser("rename", help="rename a session (the file keeps its name)")
    rn.add_argument("old")
    rn.add_argument("new")
    rn.add_argument("--profile", default=None)
    add_host_option(rn)
    ss.set_defaults(run=cmd_sessions)
    rm.add_argument("--json", action="store_true", help="with a name: say what was deleted as JSON")
    from app.cli.move import add_commands

    add_commands(ssa)  # move, copy, and the other machine's side of a move (facts, receive)


def _run(cmd, args) -> int:
    if getattr(args, "json", False):
        return _json_errors(lambda: _call(cmd, args))
    return _call(cmd, args)


def _call(cmd, args) -> int:
    catalog = open_catalog()
    try:
        return asyncio.run(cmd(args, catalog))
    finally:
        catalog.close()


def _json_errors(run) -> int:
    """``run()`` for a command given ``--json``: a failure is one JSON object on stdout too
    (``{"ok": false, "error", "details", "exit"}``), and the exit status stays what it would be."""
    try:
        return run()
    except CliError as e:
        return _json_error(str(e), e.details, e.exit, e.refused)
    except Exception as e:  # report: as JSON, as app.cli.main reports it on stderr (a profile's errors too)
        return _json_error(str(e), [], Exit.FAIL)


def _json_error(message: str, details: list[str], status: int, refused: str | None = None) -> int:
    out = {"ok": False, "error": message, "details": list(details), "exit": int(status)}
    if refused is not None:  # a resume left parked on purpose (--unless-…): which check said so
        out["refused"] = refused
    print(json.dumps(out, ensure_ascii=False))
    return status


def _sizes_and_files(rec) -> dict:
    """A session's sizes and the files it is made of, as ``park|resume --json`` print them."""
    return {"state_size": rec.state_size, "sidecar_size": rec.sidecar_size, "size": rec.state_size + rec.sidecar_size,
            "files": [str(rec.state_path)] + ([str(Path(rec.save_dir) / rec.sidecar_file)] if rec.sidecar_file else [])}


def park_json(r, profile: str) -> dict:
    """One park's outcome (app.sessions.park.ParkResult) as ``park --json`` prints it."""
    rec = r.record
    d = {"ok": r.ok, "slot": r.slot_id,
         "error": r.error, "warnings": list(r.warnings), "unchanged": r.unchanged, "profile": profile}
    if rec is not None:
        d.update(session=rec.name, slot=rec.slot_id, tokens=rec.n_tokens, **_sizes_and_files(rec),
                 save_ms=rec.save_ms, sidecar={"status": str(rec.sidecar_status), "reason": rec.sidecar_reason,
                                                "checkpoints": rec.sidecar_count})
    return d


# -- park --------------------------------------------------------------------


async def cmd_park(args, catalog) -> int:
    from app.sessions.park import ParkResult, describe
    from app.sessions.service import ServiceError

    if args.and_stop and not args.all:
        raise CliError("--and-stop parks every slot: use it with --all", Exit.USAGE)
    svc = await connect(catalog, args.target, save_dir=args.save_dir, api_key=key_from_args(args))
    try:
        stopped = None
        if args.all and args.and_stop:
            outcome = await svc.park_all_and_stop(args.name)
            if outcome.error:
                raise CliError(f"could not park: {outcome.error}")
            results, stopped = outcome.results, outcome.stopped
        elif args.all:
            results = await svc.park_all(args.name)
        else:
            try:
                results = [await svc.park(args.slot, args.name, on_progress=lambda text: print(
                    f"[kv-valet] park: {text}", file=sys.stderr, flush=True))]
            except ServiceError as e:
                results = [ParkResult(None, None, [], args.slot, str(e))]
        if args.json:
            if stopped is False:
                raise CliError("not stopping the server: a slot was not parked (its tokens would be lost)")
            parked = [park_json(r, svc.profile_name) for r in results]
            print(json.dumps({"ok": all(r.ok for r in results), "profile": svc.profile_name, "sessions": parked,
                              "stopped": stopped, **(parked[0] if len(parked) == 1 else {})}, ensure_ascii=False))
            return Exit.FAIL if any(not r.ok for r in results) else Exit.OK
        if not results:
            print("no slot holds tokens: nothing to park")
        for r in results:
            print(describe(r))
            for w in r.warnings:
                print(f"  warning: {w}")
        if stopped is False:
            raise CliError("not stopping the server: a slot was not parked (its tokens would be lost)")
        if stopped:
            print(f"server of profile '{svc.profile_name}' stopped; "
                  f"'kv-valet resume-all {svc.profile_name}' restores the slots")
        return Exit.FAIL if any(not r.ok for r in results) else Exit.OK
    finally:
        await svc.aclose()


# -- resume ------------------------------------------------------------------


async def cmd_resume(args, catalog) -> int:
    from app.core.confirmation import NeedsConfirmation
    from app.core.park_files import NOT_PARKED_FILES
    from app.sessions.resume import ResumeFailed, ResumeHazard, ResumeMismatch, ResumeRefused, ResumeUseless

    svc = await connect(catalog, args.target, save_dir=args.save_dir, api_key=key_from_args(args))
    try:
        try:
            res = await svc.resume(args.session, args.slot, force=args.yes,
                                   avoid_mismatch=bool(getattr(args, "unless_files_changed", False)),
                                   avoid_hazard=bool(getattr(args, "unless_hazard", False)),
                                   avoid_useless=getattr(args, "unless_useless", None))
        except ResumeMismatch as e:
            raise CliError(f"{NOT_PARKED_FILES}: '{args.session}' was left parked", details=e.problems,
                           refused="files-changed") from None
        except ResumeHazard as e:
            raise CliError(f"'{args.session}' was left parked: {e.hazard}", details=[e.hazard],
                           refused="hazard") from None
        except ResumeUseless as e:
            raise CliError(f"'{args.session}' was left parked: {e.reasons[0]}", details=e.reasons,
                           refused="useless") from None
        except ResumeRefused as e:
            raise CliError(f"cannot resume '{args.session}':", details=e.reasons) from None
        except NeedsConfirmation as e:
            raise CliError(f"not resumed: '{args.session}' needs confirmation (pass --yes to resume anyway):",
                           details=e.warnings) from None
        except ResumeFailed as e:
            raise CliError(str(e)) from None
        if args.json:
            rec = res.record
            print(json.dumps({"ok": True, "session": rec.name, "profile": svc.profile_name, "slot": res.slot_id,
                              "tokens": res.n_restored, "restore_ms": res.restore_ms, **_sizes_and_files(rec),
                              "warnings": list(res.warnings), "hazard": res.hazard}, ensure_ascii=False))
            return Exit.OK
        print(f"resumed '{res.record.name}' into slot {res.slot_id}: {res.n_restored:,} tokens "
              f"in {res.restore_ms:,.1f} ms")
        for w in res.warnings:
            print(f"  warning: {w}")
        return Exit.OK
    finally:
        await svc.aclose()


async def cmd_resume_all(args, catalog) -> int:
    from app.sessions.resume_plan import load_resume_plan

    if not load_resume_plan(args.profile):
        print(f"no resume plan for profile '{args.profile}' (made by 'park --all --and-stop')")
        return Exit.OK
    svc = await connect(catalog, args.profile, api_key=key_from_args(args))
    try:
        outcomes = await svc.resume_all()
    finally:
        await svc.aclose()
    for o in outcomes:
        if o.ok:
            print(f"resumed '{o.entry.session}' into slot {o.entry.slot}: {o.result.n_restored:,} tokens")
            for w in o.result.warnings:
                print(f"  warning: {w}")
        else:
            print(f"slot {o.entry.slot}: '{o.entry.session}' not resumed: {o.error}")
    return Exit.OK if all(o.ok for o in outcomes) else Exit.FAIL


# -- sessions ----------------------------------------------------------------


def _size(n: int) -> str:
    """A session's size, as the Sessions tab writes it (app.core.units, the app's one formatter)."""
    from app.core.units import fmt_bytes

    return fmt_bytes(n)


def list_line(r) -> str:
    """One session of ``kv-valet sessions list``."""
    from app.core.units import fmt_duration

    saved = fmt_duration(r.time_saved_s) if r.time_saved_s or r.last_time_saved_s is not None else "-"
    return (f"{r.name:<28} {r.profile:<16} {r.n_tokens:>8,} tok "
            f"{_size(r.state_size + r.sidecar_size):>10}  saved {saved:>8}  sidecar {r.sidecar_status}")


def _when(ts: float) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))


def _rm_older_than(args, catalog) -> int:
    import time

    from app.core.units import fmt_bytes
    from app.sessions.records import cutoff, delete_older_than, older_than, usage_of

    if args.name is not None:
        raise CliError("give a session name or --older-than, not both", Exit.USAGE)
    if args.older_than < 0:
        raise CliError("--older-than: the number of days cannot be negative", Exit.USAGE)
    now = time.time()
    before = _when(cutoff(args.older_than, now))
    where = f" in profile '{args.profile}'" if args.profile else ""
    doomed = older_than(catalog, args.older_than, args.profile, now=now)
    if not doomed:
        print(f"no session{where} was parked before {before}")
        return Exit.OK
    for r in doomed:
        print(f"  {r.name:<28} {r.profile:<16} parked {_when(r.updated_at)} "
              f"{fmt_bytes(r.state_size + r.sidecar_size):>10}")
    if not args.yes:
        u = usage_of(doomed)
        print(f"{u.sessions:,} session{'s' if u.sessions != 1 else ''}{where} parked before {before} would be "
              f"deleted ({fmt_bytes(u.total_bytes)}): pass --yes to delete")
        return Exit.OK
    removed = delete_older_than(catalog, args.older_than, args.profile, now=now)
    u = usage_of(removed)
    print(f"deleted {u.sessions:,} session{'s' if u.sessions != 1 else ''}{where} parked before {before} "
          f"({fmt_bytes(u.total_bytes)} freed)")
    if len(removed) < len(doomed):
        print(f"{len(doomed) - len(removed)} of them changed meanwhile (deleted or parked again) and were kept")
    return Exit.OK


def cmd_sessions(args) -> int:
    from app.sessions.records import delete_session, get_session, list_sessions, rename_session

    if args.action == "list" and args.host:
        from app.cli.hosts import remote_sessions

        return remote_sessions(args.host, args.profile, args.json)
    if getattr(args, "host", None):  # show, du, rm, rename: that host's kv-valet does it
        return forward(args)
    catalog = open_catalog()
    try:
        if any(kind == "move-in" for _id, kind, _p, _at in catalog.list_pending()):  # JournalKind.MOVE_IN
            from app.sessions.journal import Recovery  # only then: a listing stays as quick as it was
            from app.sessions.move_in import recover_moves

            for msg in recover_moves(Recovery(catalog)):  # a move into here a killed process left half-committed
                note(msg)
        if args.action == "list":
            recs = list_sessions(catalog, args.profile, verify_hash=True)
            if args.json:
                print(json.dumps([asdict(r) for r in recs], indent=1, ensure_ascii=False))
                return Exit.OK
            if not recs:
                print("no parked sessions")
            from app.core.units import fmt_duration

            for r in recs:
                print(list_line(r))
            if recs:
                total = sum(r.time_saved_s for r in recs)
                print(f"time saved by resumes: {fmt_duration(total)} (tokens reused x the measured prefill "
                      "rate; a resume that re-prefilled counts 0)")
            return Exit.OK
        if args.action == "show":
            from app.sessions.files_check import look

            r = get_session(catalog, args.name, args.profile, verify_hash=True)
            files = look(catalog, r)  # the park's files against what it wrote (app.core.park_files)
            if args.json:
                d = asdict(r)
                d["files_check"] = files.to_dict()
                d["history"] = [asdict(e) for e in catalog.history(r.id)] if r.id is not None else []
                print(json.dumps(d, indent=1, ensure_ascii=False))
                return Exit.OK
            rows = [("name", r.name), ("profile", r.profile), ("state file", str(r.state_path)),
                    ("size", _size(r.state_size) + (f" + sidecar {_size(r.sidecar_size)}" if r.sidecar_size else "")),
                    ("tokens", f"{r.n_tokens:,} (slot {r.slot_id}, n_ctx {r.n_ctx_slot:,})"),
                    ("model", f"{r.model_path} ({r.memory_kind})"),
                    ("KV types", f"{r.cache_type_k}/{r.cache_type_v}"), ("build", r.server_build),
                    ("sidecar", f"{r.sidecar_status} ({r.sidecar_count} checkpoints): {r.sidecar_reason}"),
                    ("files", files.sentence + (" (a resume, check or move asks for --yes)" if files.refuses else ""))]
            if r.last_restore_ms is not None:
                rows.append(("last resume", f"{r.last_n_restored:,} tokens in {r.last_restore_ms:,.1f} ms"))
            if r.last_verdict:
                rows.append(("verdict", f"{r.last_verdict}: {r.last_verdict_reason or ''}"))
            for k, v in rows:
                print(f"{k + ':':<13}{v}")
            return Exit.OK
        if args.action == "du":
            from app.sessions.records import describe_usage, disk_usage, total_usage

            usage = disk_usage(catalog, args.profile)
            if args.json:
                print(json.dumps({p: {**asdict(u), "total_bytes": u.total_bytes} for p, u in usage.items()},
                                 indent=1, ensure_ascii=False))
                return Exit.OK
            if not usage:
                print("no parked sessions" + (f" in profile '{args.profile}'" if args.profile else ""))
            for p, u in usage.items():
                print(describe_usage(p, u))
            if len(usage) > 1:
                print(describe_usage(None, total_usage(usage.values())))
            return Exit.OK
        if args.action == "rm" and args.older_than is not None:
            return _rm_older_than(args, catalog)
        if args.action == "rm":
            if args.name is None:
                raise CliError("give the name of the session to delete, or --older-than DAYS", Exit.USAGE)
            removed = delete_session(catalog, args.name, args.profile)
            if args.json:
                print(json.dumps({"deleted": args.name, "files": [str(p) for p in removed]}))
                return Exit.OK
            print(f"deleted '{args.name}'" + (f" ({', '.join(Path(p).name for p in removed)})" if removed else ""))
            return Exit.OK
        if args.action == "rename":
            r = rename_session(catalog, args.old, args.new, args.profile)
            print(f"renamed '{args.old}' to '{r.name}'")
            return Exit.OK
        return Exit.USAGE
    finally:
        catalog.close()
