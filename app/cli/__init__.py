"""``kv-valet``: no arguments opens the window; subcommands run headless.

One module per command group; each adds its parser and sets ``run``. The
commands are thin: the workflows (park, resume, check) are the same Qt-free
:class:`app.sessions.service.SessionService` the window uses, so a shutdown hook
can park sessions without a display. Exit codes: :class:`app.cli.errors.Exit`.
"""

from __future__ import annotations

import argparse
import logging
import sys

from app import __version__
from app.cli.errors import CliError, Exit, error


def build_parser() -> argparse.ArgumentParser:
    from app.cli import (build_server, check, conversations, doctor, hosts, install, loadcheck, profiles, serve,
                         sessions, settings, status)

    p = argparse.ArgumentParser(prog="kv-valet", description="Park and resume llama-server sessions.")
    p.add_argument("--version", action="version", version=f"kv-valet {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--start", metavar="PROFILE", default=None,
                   help="with no command: open the window and start PROFILE's server (a desktop autostart "
                        "entry's line); says on stdout when it is Ready")
    sub = p.add_subparsers(dest="command")
    for group in (profiles, serve, status, sessions, conversations, check, doctor, loadcheck, install, settings,
                  build_server, hosts):
        group.add_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.command is None:
        from app.cli.gui import open_window

        return open_window(start=args.start)
    if args.start is not None:
        parser.error("--start opens the window: give it without a command (kv-valet --start PROFILE)")
    args.cli_argv = list(sys.argv[1:] if argv is None else argv)  # what `--host NAME` passes on (app.cli.hosts)
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        return Exit.INTERRUPTED
    except BrokenPipeError:  # `kv-valet … | head`: the reader left; nothing to say
        sys.stderr.close()
        return Exit.OK
    except CliError as e:
        error(str(e), e.details)
        return e.exit
    except Exception as e:  # report: a clear message on stderr, not a traceback (-v raises it)
        from app.core.profile import ProfileError
        from app.sessions.service import ServiceError
        from app.store.catalog import CatalogError

        if isinstance(e, ProfileError):
            for err in e.errors:
                error(f"{e.profile_name + ': ' if e.profile_name else ''}{err}")
            return Exit.FAIL
        if args.verbose and not isinstance(e, (ServiceError, CatalogError)):
            raise
        error(str(e))
        return Exit.FAIL


if __name__ == "__main__":
    sys.exit(main())
