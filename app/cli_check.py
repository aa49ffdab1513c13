"""``kv-valet check PROFILE|URL SESSION``: prove whether a resume skips the prefill.

Restores the session into a slot of a running server, sends a short question
twice (exact tokens, then text), optionally runs the sidecar A/B and a baseline
full prefill, prints the table and the verdict.

Exit status: 0 HIT or PARTIAL, 3 DISCARDED (the restore bought nothing),
1 errors (no server, no session, a refused restore...).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

EXIT_OK, EXIT_FAIL, EXIT_DISCARDED = 0, 1, 3


def add_check_command(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("check", help="restore a parked session and prove whether the resume skips the prefill",
                       description="Restore SESSION into a slot, send a short question as exact tokens and as "
                                   "text, and judge the first query (cache_n / prompt_n). Exit 0 HIT/PARTIAL, "
                                   "3 DISCARDED, 1 error.")
    p.add_argument("target", metavar="PROFILE|URL", help="a profile name, or the URL of a running server")
    p.add_argument("session", help="the parked session's name")
    p.add_argument("--slot", type=int, default=None, help="slot to restore into (default: the slot it was parked from)")
    p.add_argument("--ab", action="store_true", help="also run the A/B: with the checkpoint sidecar and with it hidden")
    p.add_argument("--baseline", action="store_true", help="also time a full prefill of the same tokens in an empty slot"
                                                           " (implies --ab)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--save-dir", default=None, help="the server's --slot-save-path folder (needed with a URL)")
    p.add_argument("--api-key", default=None, help="API key (default: $LLAMA_API_KEY or the profile's)")
    p.add_argument("--log-file", default=None,
                   help="the server's log file (-lv 4), to see sidecar loads and forced re-processing")
    p.add_argument("--question", default=None, help="the probe question (default: a short one)")
    p.add_argument("--export", action="append", default=[], metavar="FILE",
                   help="also write the report to FILE (.md, .csv, .json, or .png for the chart); may repeat")
    p.set_defaults(func=run_check)
    return p


def run_check(args) -> int:
    try:
        return asyncio.run(_run(args))
    except KeyboardInterrupt:
        return 130


def _err(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return EXIT_FAIL


async def _run(args) -> int:
    from app import paths
    from app.core.profile import ProfileError
    from app.jobs.check import (DEFAULT_QUESTION, CheckError, ab_check, check_resume, recover_hidden_sidecars,
                                to_csv, to_json, to_markdown)
    from app.jobs.target import ServerTarget
    from app.jobs.verdict import VerdictKind
    from app.jobs.watch import FileLogBuffer
    from app.server.client import LlamaClient, ServerError, ServerUnreachable
    from app.store.catalog import Catalog, CatalogError

    try:
        catalog = Catalog(paths.catalog_path())
    except CatalogError as e:
        return _err(str(e))
    try:
        for path in recover_hidden_sidecars(catalog):
            print(f"put back the sidecar {path} that an interrupted A/B had hidden", file=sys.stderr)
        profile = None
        if args.target.startswith(("http://", "https://")):
            url = args.target.rstrip("/")
            if not args.save_dir:
                return _err("with a URL, pass --save-dir: the server's --slot-save-path folder")
            save_dir = args.save_dir
            api_key = args.api_key or os.environ.get("LLAMA_API_KEY")
        else:
            from app.server.launcher import slot_save_path_for
            from app.store.profiles import ProfileStore

            store = ProfileStore()
            try:
                profile = store.ensure_default() if args.target == "default" else store.load(args.target)
            except ProfileError as e:
                return _err(str(e))
            url = profile.url
            save_dir = args.save_dir or slot_save_path_for(profile)
            api_key = args.api_key or profile.api_key or os.environ.get("LLAMA_API_KEY")
        async with LlamaClient(url, api_key) as client:
            health = await client.health()
            if not health.ok:
                hint = f": start it with `kv-valet serve {args.target}`" if profile else ""
                state = "is still loading" if health.loading else f"does not answer ({health.message})"
                return _err(f"the server at {url} {state}{hint}")
            log = FileLogBuffer(args.log_file) if args.log_file else None
            target = await ServerTarget.connect(client, catalog, profile=profile, save_dir=save_dir, log=log)
            record = _find_session(catalog, target.profile_name, args.session)
            if record is None:
                return _err(f"no parked session named '{args.session}' for {target.profile_name}")
            slot_id = args.slot if args.slot is not None else record.slot_id
            slots = await client.slots()
            if args.slot is None and slot_id not in [s.get("id") for s in slots]:
                slot_id = 0
            question = args.question if args.question is not None else DEFAULT_QUESTION
            report = await check_resume(target, record, slot_id, question=question)
            if args.ab or args.baseline:
                report.ab = await ab_check(target, record, slot_id, baseline=args.baseline, question=question)
    except (CheckError, ServerError, ServerUnreachable, CatalogError) as e:
        return _err(str(e))
    finally:
        catalog.close()

    print(to_json(report) if args.json else to_markdown(report), end="")
    for f in args.export:
        path = Path(f)
        if path.suffix.lower() == ".png":
            from app.ui.check_view import export_png  # the window's own chart, drawn offscreen

            if not export_png(report, path):
                return _err(f"could not write {path}")
            continue
        writer = {".md": to_markdown, ".csv": to_csv, ".json": to_json}.get(path.suffix.lower())
        if writer is None:
            return _err(f"cannot export to {path.name}: use .md, .csv, .json or .png")
        path.write_text(writer(report), encoding="utf-8")
    if report.verdict.kind is VerdictKind.DISCARDED:
        return EXIT_DISCARDED
    if report.verdict.kind in (VerdictKind.HIT, VerdictKind.PARTIAL):
        return EXIT_OK
    return EXIT_FAIL


def _find_session(catalog, profile: str, name: str):
    rec = catalog.get(profile, name)
    if rec is not None:
        return rec
    matches = [r for r in catalog.list() if r.name == name]
    return matches[0] if len(matches) == 1 else None
