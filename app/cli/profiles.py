"""``kv-valet profiles list|show|import``: launch profiles without a window."""

from __future__ import annotations

import json
import sys

from app.cli.errors import Exit

EXIT_OK, EXIT_FAIL, EXIT_USAGE = Exit.OK, Exit.FAIL, Exit.USAGE


def add_commands(sub) -> None:
    pr = sub.add_parser("profiles", help="list, show or import launch profiles")
    prs = pr.add_subparsers(dest="action", required=True)
    ls = prs.add_parser("list", help="list profiles")
    ls.add_argument("--json", action="store_true", help="one JSON list (no API keys: has_api_key says if one is set)")
    ls.add_argument("--host", default=None, metavar="NAME", help="the profiles of a remote host (kv-valet hosts)")
    sh = prs.add_parser("show", help="show a profile and the command line it launches")
    sh.add_argument("name")
    im = prs.add_parser("import", help='import a llama-server command line: import "llama-server -m x.gguf ..."')
    im.add_argument("command_line")
    im.add_argument("--name", default=None, help="profile name (default: from the model file name)")
    im.add_argument("--force", action="store_true", help="overwrite a profile of the same name")
    pr.set_defaults(run=cmd_profiles)


def cmd_profiles(args) -> int:
    from app.core.argv import preview
    from app.core.hazards import hazard_prefix, hazards
    from app.servers.service import DiscoveryError, find_server_binary, slot_save_path_for
    from app.store.profiles import ProfileStore

    store = ProfileStore()
    if args.action == "list" and getattr(args, "host", None):
        from app.cli.hosts import remote_profiles

        return remote_profiles(args.host, args.json)
    if args.action == "list":
        store.ensure_default()
        profiles, errors = store.load_all()
        if args.json:
            from app.remote.listing import profile_summary

            print(json.dumps([profile_summary(p) for p in profiles], indent=1, ensure_ascii=False))
        from app.remote.listing import model_note, profile_summary

        for prof in profiles if not args.json else ():
            print(f"{prof.name:<20} {prof.url:<28} {prof.model}{model_note(profile_summary(prof))}")
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
            print(f"# {hazard_prefix(h)}: {h.text}")
        return EXIT_OK
    if args.action == "import":
        from app.servers.service import import_command_line

        prof, path = import_command_line(args.command_line, args.name, overwrite=args.force, store=store)
        print(f"saved profile '{prof.name}' to {path}")
        for h in hazards(prof):
            print(f"{hazard_prefix(h)}: {h.text}")
        return EXIT_OK
    return EXIT_USAGE

