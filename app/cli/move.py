"""``kv-valet sessions move|copy|facts|receive``: a parked session to another profile or host.

``move``/``copy`` run here (app.move.transfer); ``move-host`` is what another machine's
``kv-valet`` runs on this one over SSH for a move, one process answering all its requests
(app.move.host_side); ``facts`` and ``receive`` answer one each: the source's session and files,
and the target's facts, commit and abort (the same code a local move runs; ``receive --abort``
settles a commit whose ``move-host`` the sender lost).
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import asdict

from app.cli.errors import CliError, Exit, note


def add_commands(ssa) -> None:
    for verb, what in (("move", "move a parked session to another profile or host (copy, then delete here)"),
                       ("copy", "copy a parked session to another profile or host (keep it here)")):
        p = ssa.add_parser(verb, help=what, description=(
            f"{what[0].upper()}{what[1:]}. TARGET is a profile on this machine or HOST:PROFILE (a host of "
            "'kv-valet hosts'). The compatibility rules run first (model, K/V types, flash attention, "
            "--swa-full, state-file and sidecar versions, --ctx-checkpoints, slot context, disk space, name); "
            "then the files are copied with a SHA-256 check and renamed into place at the target, which "
            "lists the session only once it is whole. A move deletes the source only after the target "
            "listed the session: interrupted in between, it leaves both copies, each whole and listed."))
        p.add_argument("name", help="the parked session")
        p.add_argument("--to", required=True, metavar="TARGET", help="PROFILE or HOST:PROFILE")
        p.add_argument("--from", dest="source", default=None, metavar="SOURCE",
                       help="the profile (or HOST:PROFILE) it is in (default: the only session of that name here)")
        p.add_argument("--rename", default=None, metavar="NEW", help="its name at the target")
        p.add_argument("--restore", action="store_true",
                       help="then restore it at the target (its server must run) and judge a first query")
        p.add_argument("--slot", type=int, default=None, help="with --restore: the slot (default: the app's choice)")
        p.add_argument("--no-output-check", dest="output_check", action="store_false",
                       help="with --restore: judge by the tokens and checkpoints reused alone, without comparing "
                            "the output with a cold prefill of the chat (faster; see kv-valet check)")
        p.add_argument("--yes", action="store_true", help="move it even when a file is not the one parked "
                       "(another chat's sidecar copied over its own)")
        p.add_argument("--json", action="store_true", help="print one JSON object")
        p.set_defaults(run=lambda a, keep=(verb == "copy"): cmd_move(a, keep))
    f = ssa.add_parser("facts", help="a session's facts and files, for a move from this machine (JSON)")
    f.add_argument("name")
    f.add_argument("--profile", default=None)
    f.add_argument("--json", action="store_true")
    f.set_defaults(run=cmd_facts)
    r = ssa.add_parser("receive", help="the target's side of a move into PROFILE (JSON; run by another kv-valet)")
    r.add_argument("profile")
    step = r.add_mutually_exclusive_group(required=True)
    step.add_argument("--describe", action="store_true", help="the target's facts for the move rules")
    step.add_argument("--commit", metavar="ID", help="check the copied files and list the session")
    step.add_argument("--abort", metavar="ID", help="settle a move its sender gave up on: its row when the commit "
                      "listed the session (the sender deletes its source), else its files removed")
    r.add_argument("--json", action="store_true")
    r.set_defaults(run=cmd_receive)
    h = ssa.add_parser("move-host", help="this machine's side of one move into or out of PROFILE, its requests on "
                       "stdin (JSON lines; run by another kv-valet over SSH)")
    h.add_argument("profile")
    h.set_defaults(run=cmd_move_host)


def _catalog():
    from app.cli.connect import open_catalog

    return open_catalog()


def _print(data) -> None:
    print(json.dumps(data, indent=1, ensure_ascii=False))


class _Progress:
    """``moving 'x': 12.0 MiB of 33.1 MiB (36%)`` on stderr, rewritten in place."""

    def __init__(self, label: str):
        self.label = label
        self.shown = -1

    def __call__(self, done: int, total: int) -> None:
        from app.core.units import fmt_bytes

        pct = 100 if not total else done * 100 // total
        if pct == self.shown:
            return
        self.shown = pct
        end = "\n" if done >= total else ""
        print(f"\r{self.label}: {fmt_bytes(done)} of {fmt_bytes(total)} ({pct}%)", end=end, file=sys.stderr,
              flush=True)


def _endpoint(spec: str | None, catalog, hosts: dict):
    from app.move.endpoints import LocalEndpoint, RemoteEndpoint
    from app.move.values import MoveError, parse_target

    try:
        host, profile = parse_target(spec) if spec else (None, None)
    except MoveError as e:
        raise CliError(str(e), Exit.USAGE) from None
    if host is None:
        return LocalEndpoint(catalog, profile)
    if host not in hosts:
        from app.cli.hosts import _host

        hosts[host] = _host(host)
    return RemoteEndpoint(hosts[host], host, profile)


def cmd_move(args, keep: bool) -> int:
    from app.move.transfer import move_session
    from app.move.values import MoveError, MoveRefused

    catalog = _catalog()
    hosts: dict = {}
    verb = "copy" if keep else "move"
    committed: list = []

    def on_committed(result) -> None:
        committed.append(result)
        if not keep and not args.json:
            note(f"'{args.name}' is listed at {result.target}: deleting it at {result.source} "
                 "(interrupted now, both copies remain)")

    async def go():
        try:
            source = _endpoint(args.source, catalog, hosts)
            target = _endpoint(args.to, catalog, hosts)
            progress = None if args.json else _Progress(f"{'copying' if keep else 'moving'} '{args.name}'")
            result = await move_session(source, args.name, target, keep_source=keep, new_name=args.rename,
                                        on_progress=progress, on_committed=on_committed,
                                        force=getattr(args, "yes", False))
            restored = await _restore(args, target, result.record.name, catalog, hosts) if args.restore else None
            return result, restored
        finally:
            for h in hosts.values():
                await h.close()

    try:
        result, restored = asyncio.run(go())
    except MoveRefused as e:
        raise CliError(f"cannot {verb} '{args.name}':", details=e.reasons) from None
    except MoveError as e:
        raise CliError(f"{verb} of '{args.name}' failed: {e}") from None
    except KeyboardInterrupt:
        if committed:
            r = committed[0]
            note(f"{verb} interrupted after '{args.name}' was copied to {r.target} as '{r.record.name}' (listed, "
                 f"SHA-256 checked): " + ("it is kept at the source too" if keep else
                                          "both copies remain (kv-valet sessions rm to delete one)"))
        else:
            note(f"{verb} interrupted: '{args.name}' is kept where it was, nothing was added at the target")
        return Exit.INTERRUPTED
    except Exception as e:
        from app.remote.host import RemoteError

        if isinstance(e, RemoteError):
            raise CliError(f"{verb} of '{args.name}' failed: {e}") from None
        raise
    finally:
        catalog.close()
    if args.json:
        _print({"record": asdict(result.record), "source": result.source, "target": result.target,
                "moved": result.moved, "bytes": result.bytes, "warnings": result.warnings,
                "source_kept": result.source_kept, "restore": restored})
    else:
        r = result.record
        print(f"{'moved' if result.moved else 'copied'} '{args.name}' from {result.source} to {result.target}"
              f" as '{r.name}': {r.n_tokens:,} tokens, {result.bytes:,} bytes, SHA-256 checked ({r.state_file})")
        for w in result.warnings:
            print(f"  warning: {w}")
        if result.source_kept:
            print(f"  warning: {result.source_kept}")
        if restored:
            v = restored["verdict"]
            print(f"restored into slot {restored['slot_id']}: {restored['n_restored']:,} tokens; first query: "
                  f"{v['kind']}: {v['reason']}")
    return Exit.OK if not result.source_kept else Exit.FAIL


async def _restore(args, target, name: str, catalog, hosts: dict) -> dict:
    """Restore ``name`` at the move's target and judge a first query, through that server's Sessions
    (app.servers.restore_after_move): a running server here, or the host's (its ``kv-valet check``)."""
    from app.core.confirmation import NeedsConfirmation
    from app.move.values import parse_target
    from app.servers.restore_after_move import restore_and_judge
    from app.sessions.service import ServiceError

    host, _profile = parse_target(args.to) if args.to else (None, None)
    if host is not None:
        from app.servers.remote_sessions import RemoteSessions

        return await restore_and_judge(RemoteSessions(hosts[host], target.profile), name, args.slot,
                                       output_check=args.output_check)
    from app.cli.connect import connect

    svc = await connect(catalog, target.profile)
    try:
        return await restore_and_judge(svc, name, args.slot, output_check=args.output_check)
    except (ServiceError, NeedsConfirmation) as e:
        raise CliError(f"copied, but the restore at {target.where} failed: {e}") from None
    finally:
        await svc.aclose()


def cmd_facts(args) -> int:
    from app.move.facts import source_session
    from app.move.values import MoveError

    catalog = _catalog()
    try:
        s = source_session(catalog, args.name, args.profile)
    except MoveError as e:
        raise CliError(str(e)) from None
    finally:
        catalog.close()
    _print({"record": asdict(s.record), "facts": s.facts.to_dict(),
            "files": [{"suffix": f.suffix, "path": f.path, "size": f.size} for f in s.files]})
    return Exit.OK


def cmd_move_host(args) -> int:
    """One move's host process (app.move.host_side): its requests on stdin, its answers on stdout."""
    from app.move.host_side import serve

    catalog = _catalog()
    try:
        serve(catalog, args.profile, sys.stdin.buffer, sys.stdout.buffer)
    finally:
        catalog.close()
    return Exit.OK


def cmd_receive(args) -> int:
    from app.move.facts import describe_target, receiving_folder
    from app.move.receive import adopt, discard, manifest_path, settle
    from app.move.values import MoveError, check_move_id

    catalog = _catalog()
    try:
        for move_id in (args.commit, args.abort):
            if move_id is not None:
                check_move_id(move_id)
        if args.describe:
            facts = asyncio.run(describe_target(catalog, args.profile, where=f"profile '{args.profile}'"))
            _print({"target": facts.to_dict()})
            return Exit.OK
        # commit and abort need the folder only (the rules ran at --describe): no binary or model look-ups
        save_dir, model_path = receiving_folder(args.profile)
        if args.abort:  # the sender gave up, or lost the commit's answer: settle it (app.sessions.move_in)
            listed, messages = settle(catalog, args.abort, save_dir)
            for msg in messages:
                note(msg)
            _print({"committed": asdict(listed) if listed is not None else None})
            return Exit.OK
        manifest_file = manifest_path(save_dir, args.commit)
        try:
            manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            discard(save_dir, args.commit)
            raise CliError(f"the move's manifest {manifest_file.name} is not readable: {e}") from None
        if manifest.get("move_id") != args.commit:
            discard(save_dir, args.commit)
            raise CliError(f"the manifest {manifest_file.name} is of another move")
        rec = adopt(catalog, args.profile, save_dir, manifest, model_path=model_path)
        _print({"record": asdict(rec)})
        return Exit.OK
    except MoveError as e:
        raise CliError(str(e)) from None
    finally:
        catalog.close()
