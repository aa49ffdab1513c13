"""How the CLI gets an API key without showing it to ``ps``.

A key given as a command-line argument is visible to every user of the machine
in ``/proc/PID/cmdline``; so the CLI takes it from ``$LLAMA_API_KEY``, from a
file (``--api-key-file``, which must not be readable by others), or from the
profile (:func:`app.server.launcher.resolve_api_key`).
"""

from __future__ import annotations

import argparse
import os
import stat

from app.cli.errors import CliError, Exit


class _RefuseKeyArgument(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error("--api-key would show the key to every user of this machine (ps, /proc); "
                     "use --api-key-file FILE or $LLAMA_API_KEY")


def add_key_option(parser) -> None:
    parser.add_argument("--api-key-file", default=None, metavar="FILE",
                        help="read the API key from FILE (chmod 600); default: the profile's key, "
                             "else $LLAMA_API_KEY. There is no --api-key: ps would show it")
    # Said explicitly, so that "--api-key" is not taken as an abbreviation of --api-key-file.
    parser.add_argument("--api-key", nargs="?", action=_RefuseKeyArgument, help=argparse.SUPPRESS)


def key_from_args(args) -> str | None:
    """The key of ``--api-key-file`` (None when not given: the service resolves it)."""
    path = getattr(args, "api_key_file", None)
    if not path:
        return None
    path = os.path.expanduser(path)
    try:
        st = os.stat(path)
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise CliError(f"{path} can be read by other users: chmod 600 it", Exit.USAGE)
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line and not line.startswith("#"):
                    return line
    except OSError as e:
        raise CliError(f"cannot read the API key file {path}: {e.strerror or e}", Exit.USAGE) from None
    raise CliError(f"the API key file {path} holds no key", Exit.USAGE)
