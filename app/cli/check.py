"""``kv-valet check PROFILE|URL SESSION``: prove whether a resume skips the prefill.

Restores the session into a slot of a running server, sends a short question
twice (exact tokens, then text), optionally runs the sidecar A/B and a baseline
full prefill, prints the table and the verdict.

By default each probe's greedy output is also compared with a cold prefill of the same
prompt (the output check, app.core.output_check); ``--no-output-check`` turns it off.

Exit status: 0 HIT or PARTIAL, 3 DISCARDED (the restore bought nothing), 4 DIFFERS (warm but
wrong: the output differs from a cold prefill), 1 errors (no server, no session, a refused
restore...).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from app.cli.errors import CliError, Exit
from app.cli.keys import add_key_option, key_from_args
from app.core.verdict import VerdictKind


def add_commands(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("check", help="restore a parked session and prove whether the resume skips the prefill",
                       description="Restore SESSION into a slot, send a short question as exact tokens and as "
                                   "text, and judge the first query (cache_n / prompt_n); compare its greedy output with a "
                                   "cold prefill's (the output check). Exit 0 HIT/PARTIAL, 3 DISCARDED, "
                                   "4 DIFFERS (output differs from a cold prefill), 1 error.")
    p.add_argument("target", metavar="PROFILE|URL", help="a profile name, or the URL of a running server")
    p.add_argument("session", help="the parked session's name")
    p.add_argument("--slot", type=int, default=None,
                   help="slot to restore into (default: the slot it was parked from if empty, else the first "
                        "empty slot)")
    p.add_argument("--yes", action="store_true", help="restore over a slot that holds tokens, or a park whose "
                   "files are not the ones it wrote (another chat's sidecar copied over its own)")
    p.add_argument("--ab", action="store_true", help="also run the A/B: with the checkpoint sidecar and with it hidden")
    p.add_argument("--baseline", action="store_true", help="also time a full prefill of the same tokens in an empty slot"
                                                           " (implies --ab)")
    p.add_argument("--no-output-check", dest="output_check", action="store_false",
                   help="do not compare each probe's greedy output with a cold prefill of the same prompt (saves "
                        "one full prefill per probe prompt; without it a wrong restore can pass as a HIT)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--save-dir", default=None, help="the server's --slot-save-path folder (needed with a URL)")
    add_key_option(p)
    p.add_argument("--log-file", default=None,
                   help="the server's log file (-lv 4), to see sidecar loads and forced re-processing "
                        "(default for a profile: the log KV Valet writes, see 'Server log files')")
    p.add_argument("--question", default=None, help="the probe question (default: a short one)")
    p.add_argument("--protocol", choices=("restarts", "one-process"), default=None,
                   help="'restarts': every probe in a fresh server process, as the seed's A/B (needs a server "
                        "KV Valet runs: for a profile whose server is not running, this command starts it and "
                        "stops it after); 'one-process': every probe in the running server, a probe that reused "
                        "an earlier probe's checkpoints labelled confounded. Default: restarts when this command "
                        "runs the server, else one process")
    p.add_argument("--export", action="append", default=[], metavar="FILE",
                   help="also write the report to FILE (.md, .csv, .json, or .png for the chart); may repeat")
    from app.cli.hosts import add_host_option, host_aware

    add_host_option(p)
    p.set_defaults(run=host_aware(run_check))
    return p


def run_check(args) -> int:
    from app.cli.connect import open_catalog

    catalog = open_catalog()
    try:
        return asyncio.run(_run(args, catalog))
    finally:
        catalog.close()


async def _run(args, catalog) -> int:
    from app.cli.connect import connect
    from app.sessions.check_export import to_csv, to_json, to_markdown
    from app.sessions.check_report import DEFAULT_QUESTION
    from app.core.confirmation import NeedsConfirmation
    from app.sessions.service import ServiceError
    from app.sessions.watch import FileLogBuffer

    for f in args.export:
        if Path(f).suffix.lower() not in (".md", ".csv", ".json", ".png"):
            raise CliError(f"cannot export to {Path(f).name}: use .md, .csv, .json or .png", Exit.USAGE)
    from app.servers.service import resolve_target

    # the given log file, else the one KV Valet writes for every server it launches (serve, the window)
    log_path = resolve_target(args.target, log_file=args.log_file).log_path
    log_buffer = FileLogBuffer(log_path) if log_path else None
    protocol = {"restarts": "across restarts", "one-process": "one process", None: None}[args.protocol]
    sup = None
    try:
        svc = await connect(catalog, args.target, save_dir=args.save_dir, api_key=key_from_args(args),
                            log_buffer=log_buffer)
    except ServiceError as e:
        if "://" in args.target or "is not running" not in str(e) or protocol == "one process":
            raise CliError(str(e)) from None
        svc, sup = await _own_server(catalog, args.target)  # the seed's protocol needs a server we run
    question = args.question if args.question is not None else DEFAULT_QUESTION

    def progress(what: str):  # where the check is, on stderr (a 32K-token prefill takes minutes on a CPU)
        return lambda text: print(f"[kv-valet] {what}: {text}", file=sys.stderr, flush=True)

    try:
        report = await svc.check(args.session, args.slot, force=args.yes, question=question, protocol=protocol,
                                 output_check=args.output_check, on_progress=progress("check"))
        if args.ab or args.baseline:
            report.ab = await svc.ab(args.session, report.slot_id, force=True, baseline=args.baseline,
                                     question=question, protocol=protocol, output_check=args.output_check,
                                     on_progress=progress("A/B"))
    except NeedsConfirmation as e:
        raise CliError("not checked (pass --yes to go on):", details=e.warnings) from None
    except ServiceError as e:
        raise CliError(str(e)) from None
    finally:
        await svc.aclose()
        if sup is not None:
            await sup.aclose()

    print(to_json(report) if args.json else to_markdown(report), end="")
    for f in args.export:
        path = Path(f)
        if path.suffix.lower() == ".png":
            from app.cli.gui import export_png

            if not export_png(report, path):
                raise CliError(f"could not write {path}")
            continue
        writer = {".md": to_markdown, ".csv": to_csv, ".json": to_json}[path.suffix.lower()]
        path.write_text(writer(report), encoding="utf-8")
    if report.verdict.kind is VerdictKind.DIFFERS or (
            report.ab is not None and any(r.verdict.kind is VerdictKind.DIFFERS for r in report.ab.rows)):
        return Exit.DIFFERS
    if report.verdict.kind is VerdictKind.DISCARDED:
        return Exit.DISCARDED
    if report.verdict.kind in (VerdictKind.HIT, VerdictKind.PARTIAL):
        return Exit.OK
    return Exit.FAIL


async def _own_server(catalog, name: str):
    """Start the profile's server for this command (stopped at its end), so the check can
    restart it between probes: (SessionService, its ServerService)."""

    from app.servers.service import ServerService, load_profile

    from app.servers.events import LaunchRefused

    profile = load_profile(name)
    print(f"[kv-valet] the server of '{profile.name}' is not running: starting it for this check "
          "(it is stopped at the end)", file=sys.stderr, flush=True)
    servers = ServerService(catalog, connect_sessions=False)
    refused: list[str] = []
    servers.on_event(lambda ev: refused.append(ev.message) if isinstance(ev, LaunchRefused) else None)
    try:
        handle = await servers.launch(profile)
        if handle is None:
            h = servers.servers.get(f"profile:{profile.name}")
            outcome = h.supervisor.outcome if h is not None and h.supervisor is not None else None
            why = refused[0] if refused else outcome.summary() if outcome is not None else "it did not start"
            raise CliError(f"the server of '{profile.name}' did not start: {why}")
        for n in handle.plan.notes:
            print(f"[kv-valet] {n}", file=sys.stderr)
        svc = await servers.sessions(handle.id)
    except BaseException:
        await servers.aclose()
        raise
    return svc, servers
