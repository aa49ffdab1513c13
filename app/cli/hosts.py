"""``kv-valet hosts add|list|rm|check|profiles|sessions|status|start|stop`` and ``kv-valet service``.

``hosts``: the other machines, reached over SSH (app.remote): their profiles, parked sessions,
servers, started and stopped through their systemd user unit. ``service start|stop|status
PROFILE``: the host side of that (app.remote.unit), which the ``hosts`` commands run there.
"""

from __future__ import annotations

import asyncio
import json
import sys

from app.cli.errors import CliError, Exit


def add_commands(sub) -> None:
    h = sub.add_parser("hosts", help="other machines over SSH: their profiles, sessions and servers")
    hs = h.add_subparsers(dest="action", required=True)
    add = hs.add_parser("add", help="add a host (then check it)",
                        description="Add a host reached over SSH as you reach it (keys, agent, ~/.ssh/config, "
                                    "known_hosts). Its key must already be in known_hosts: connect once with ssh.")
    add.add_argument("name")
    add.add_argument("destination", help="user@host, host or an ~/.ssh/config alias")
    add.add_argument("--port", type=int, default=None)
    add.add_argument("--kv-valet", default="kv-valet", help="the kv-valet command on the host (a full path if it "
                                                            "is not on the PATH of a non-interactive login)")
    add.add_argument("--identity-file", default=None, help="a private key (default: agent, config, ~/.ssh/id_*)")
    add.add_argument("--force", action="store_true", help="replace a host of the same name")
    add.add_argument("--no-check", action="store_true", help="do not connect now")
    ls = hs.add_parser("list", help="the hosts")
    ls.add_argument("--json", action="store_true")
    rm = hs.add_parser("rm", help="forget a host (nothing on the host changes)")
    rm.add_argument("name")
    ck = hs.add_parser("check", help="connect, verify the host key, run kv-valet there")
    ck.add_argument("name")
    pr = hs.add_parser("profiles", help="the host's profiles")
    pr.add_argument("name")
    pr.add_argument("--json", action="store_true")
    se = hs.add_parser("sessions", help="the host's parked sessions")
    se.add_argument("name")
    se.add_argument("--profile", default=None)
    se.add_argument("--json", action="store_true")
    st = hs.add_parser("status", help="a server of the host: state, slots, VRAM per GPU, process")
    st.add_argument("name")
    st.add_argument("profile")
    st.add_argument("--json", action="store_true")
    for action in ("start", "stop"):
        a = hs.add_parser(action, help=f"{action} a profile's server on the host (its kv-valet-PROFILE user unit)")
        a.add_argument("name")
        a.add_argument("profile")
        a.add_argument("--json", action="store_true")
    h.set_defaults(run=cmd_hosts)

    sv = sub.add_parser("service", help="start, stop or status of a profile's server as its systemd user unit "
                                        "(detached 'serve' where no user manager runs)")
    sv.add_argument("action", choices=("start", "stop", "status"))
    sv.add_argument("profile")
    sv.add_argument("--json", action="store_true")
    sv.add_argument("--wait", type=float, default=120.0, metavar="SECONDS",
                    help="start: wait this long for the server to answer /health (0: do not wait)")
    sv.set_defaults(run=cmd_service)


def _host(name: str):
    from app.remote.host import RemoteHost
    from app.store.hosts import HostStore, HostsError

    try:
        return RemoteHost(HostStore().get(name))
    except HostsError as e:
        raise CliError(str(e)) from None


def _remote(name: str, work):
    """Run ``await work(host)`` on a connection to host ``name``; RemoteError -> a CLI error."""
    from app.remote.host import RemoteError

    async def go():
        async with _host(name) as host:
            return await work(host)

    try:
        return asyncio.run(go())
    except RemoteError as e:
        raise CliError(str(e)) from None


#: how long a command passed to a host may run (a check with --baseline restarts its server)
FORWARD_TIMEOUT_S = 3600.0


def add_host_option(parser) -> None:
    """``--host NAME``: run the command on that host instead (:func:`host_aware`)."""
    parser.add_argument("--host", default=None, metavar="NAME",
                        help="run it on a remote host (kv-valet hosts): that host's kv-valet, profiles, sessions "
                             "and servers; paths are the host's")


def host_aware(run):
    """``run``, or with ``--host NAME`` the same command line run by that host's kv-valet."""
    return lambda args: forward(args) if getattr(args, "host", None) else run(args)


def without_host(argv: list[str]) -> list[str]:
    """``argv`` less its ``--host NAME`` (or ``--host=NAME``, or an abbreviation argparse took)."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            return out + argv[i:]
        opt = a.split("=", 1)[0]
        if len(opt) >= 4 and "--host".startswith(opt):
            i += 1 if "=" in a else 2
            continue
        out.append(a)
        i += 1
    return out


def forward(args) -> int:
    """Run this command line (less ``--host``) on host ``args.host`` through its kv-valet; its
    stdout and stderr are printed as they are, and its exit status is this one's."""
    argv = without_host(list(args.cli_argv))
    status, out, err = _remote(args.host, lambda h: h.run_cli_as_is(argv, timeout=FORWARD_TIMEOUT_S))
    sys.stdout.write(out)
    sys.stdout.flush()
    if err:
        print(err, file=sys.stderr)
    return status


def _print_json(data) -> None:
    print(json.dumps(data, indent=1, ensure_ascii=False))


def remote_profiles(name: str, as_json: bool) -> int:
    profiles = _remote(name, lambda h: h.profiles())
    if as_json:
        _print_json(profiles)
    from app.remote.listing import model_note

    for p in profiles if not as_json else ():
        print(f"{p.get('name', '?'):<20} {p.get('url', ''):<28} {p.get('model', '')}{model_note(p)}")
    return Exit.OK


def remote_sessions(name: str, profile: str | None, as_json: bool) -> int:
    from app.core.units import fmt_bytes

    sessions = _remote(name, lambda h: h.sessions(profile))
    if as_json:
        _print_json(sessions)
        return Exit.OK
    for s in sessions:
        size = (s.get("state_size") or 0) + (s.get("sidecar_size") or 0)
        print(f"{s.get('name', '?'):<32} {s.get('profile', ''):<16} {s.get('n_tokens', 0):>8,} tokens  "
              f"{fmt_bytes(size)}")
    if not sessions:
        print(f"no parked sessions on {name}")
    return Exit.OK


def remote_status(name: str, profile: str, as_json: bool) -> int:
    """The host's ``kv-valet status PROFILE``: its output, and its exit status (1: the server is down)."""
    if as_json:
        data = _remote(name, lambda h: h.status(profile))
        _print_json(data)
        from app.core.states import Health

        return Exit.OK if Health.parse(data.get("health"))[0] is Health.OK else Exit.FAIL
    status, text, err = _remote(name, lambda h: h.run_cli_as_is(["status", profile]))
    sys.stdout.write(text)
    if err:
        print(err, file=sys.stderr)
    if status not in (Exit.OK, Exit.FAIL):
        raise CliError(f"`kv-valet status {profile}` on {name} exited {status}")
    return status


def cmd_hosts(args) -> int:
    from app.store.hosts import HostConfig, HostStore, HostsError

    store = HostStore()
    try:
        if args.action == "add":
            cfg = HostConfig(name=args.name, destination=args.destination, port=args.port,
                             kv_valet=args.kv_valet, identity_file=args.identity_file)
            path = store.save(cfg, overwrite=args.force)
            print(f"saved host '{cfg.name}' to {path}")
            return Exit.OK if args.no_check else _check(cfg.name)
        if args.action == "list":
            hosts = store.all()
            if args.json:
                _print_json([h.to_dict() for h in hosts])
            for h in hosts if not args.json else ():
                print(f"{h.name:<16} {h.destination}{f':{h.port}' if h.port else ''}  ({h.kv_valet})")
            return Exit.OK
        if args.action == "rm":
            if not store.remove(args.name):
                raise CliError(f"no host named '{args.name}'")
            print(f"removed host '{args.name}'")
            return Exit.OK
    except HostsError as e:
        raise CliError(str(e)) from None
    if args.action == "check":
        return _check(args.name)
    if args.action == "profiles":
        return remote_profiles(args.name, args.json)
    if args.action == "sessions":
        return remote_sessions(args.name, args.profile, args.json)
    if args.action == "status":
        return remote_status(args.name, args.profile, args.json)
    if args.action in ("start", "stop"):
        from app.remote.unit import service_line

        data = _remote(args.name, lambda h: h.systemd(args.action, args.profile))
        if args.json:
            _print_json(data)
        else:
            if data.get("note"):
                print(f"note: {data['note']}")
            print(f"{args.name}: {service_line(data)}")
        return Exit.OK
    return Exit.USAGE


def _check(name: str) -> int:
    async def check(host):
        version = (await host.run_cli_text(["--version"])).strip()
        profiles = await host.profiles()
        return version, profiles

    from app.remote.listing import model_note

    version, profiles = _remote(name, check)
    print(f"{name}: host key verified, logged in, {version}, {len(profiles)} profile(s): "
          + ", ".join(p.get("name", "?") for p in profiles))
    for p in profiles:
        note = model_note(p)
        if note:
            print(f"note: profile '{p.get('name', '?')}' on {name}: model {p.get('model', '')}{note}")
    return Exit.OK


def cmd_service(args) -> int:
    from app.remote.unit import UnitControl, UnitError

    try:
        data = UnitControl(args.profile).do(args.action, wait_s=args.wait)
    except UnitError as e:
        raise CliError(str(e)) from None
    if args.json:
        _print_json(data)
    else:
        from app.remote.unit import service_line

        if data.get("note"):
            print(f"note: {data['note']}", file=sys.stderr)
        print(service_line(data))
    return Exit.OK
