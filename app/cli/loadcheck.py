"""``kv-valet loadcheck URL|PROFILE --streams N --seconds T``: inter-token gaps under load.

Runs N parallel streaming completions for T seconds against a server on this
machine and prints, per stream, the gap between consecutive tokens (p50 / p99 /
max) and every stall above ``--stall-ms`` (seed 004: saving idle slots to the
prompt cache stalls every stream). Run it before and after a remedy.

Progress goes to stderr, the table (or ``--json``) to stdout. Exit 0 when the
run completed, 1 on errors (no server, not loopback, every request failed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from app.cli.errors import CliError, Exit
from app.cli.keys import add_key_option, key_from_args


def _bounded(kind, lo, hi, what):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what}: not a number: {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{what} must be {lo:g}..{hi:g}, not {text}")
        return value
    return parse


def add_commands(sub) -> argparse.ArgumentParser:
    from app.tools.loadcheck_limits import MAX_N_PREDICT, MAX_SECONDS, MAX_STREAMS, MIN_SECONDS

    p = sub.add_parser(
        "loadcheck", help="N parallel streams for T seconds: inter-token gaps and stalls per stream",
        description="Send N parallel streaming completions, back to back, for T seconds to a server on this "
                    "machine and report per stream the gap between consecutive tokens (p50 / p99 / max) and "
                    "every stall above --stall-ms. Compare before and after a remedy (e.g. dropping "
                    "--cache-idle-slots). Exit 0 when it ran, 1 on errors.")
    p.add_argument("target", metavar="URL|PROFILE", help="a loopback server URL (http://127.0.0.1:8080) or a "
                                                         "profile name (its server must be running)")
    p.add_argument("--streams", type=_bounded(int, 1, MAX_STREAMS, "--streams"), required=True, metavar="N",
                   help=f"parallel streams, 1..{MAX_STREAMS}")
    p.add_argument("--seconds", type=_bounded(float, MIN_SECONDS, MAX_SECONDS, "--seconds"), required=True,
                   metavar="T", help=f"how long, {MIN_SECONDS:g}..{MAX_SECONDS:g} s")
    p.add_argument("--stall-ms", type=_bounded(float, 1, 600000, "--stall-ms"), default=500.0, metavar="MS",
                   help="a gap above this is a stall (default 500)")
    p.add_argument("--n-predict", type=_bounded(int, 1, MAX_N_PREDICT, "--n-predict"), default=64, metavar="N",
                   help="tokens per request (default 64)")
    p.add_argument("--prompt", default=None, help="the prompt (default: a short story, different per stream)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_key_option(p)
    p.set_defaults(run=lambda args: asyncio.run(cmd_loadcheck(args)))
    return p


def resolve_target(target: str) -> tuple[str, str | None]:
    """(URL, API key) of a URL (key: $LLAMA_API_KEY) or a profile (its key, else $LLAMA_API_KEY):
    the server service's one resolver."""
    from app.servers.service import resolve_target as resolve

    spec = resolve(target)
    return spec.url, spec.api_key


class _Progress:
    """One line on stderr: rewritten in place on a terminal, every 10 % otherwise."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._last_step = -1

    def __call__(self, fraction: float, tokens: int) -> None:
        text = f"[kv-valet] load check {fraction * 100:3.0f}% · {tokens:,} tokens"
        if self.tty:
            self.stream.write("\r" + text)
            self.stream.flush()
            return
        step = int(fraction * 10)
        if step != self._last_step:
            self._last_step = step
            print(text, file=self.stream, flush=True)

    def done(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


async def cmd_loadcheck(args) -> int:
    from app.tools.loadcheck import LoadCheckError, check_loopback, run_load_check, to_dict, to_markdown
    from app.servers.service import client_for

    url, _key = resolve_target(args.target)
    try:
        check_loopback(url)
    except LoadCheckError as e:
        raise CliError(str(e)) from None
    progress = _Progress()
    try:
        async with client_for(args.target, api_key=key_from_args(args)) as client:
            report = await run_load_check(client, streams=args.streams, seconds=args.seconds,
                                          stall_ms=args.stall_ms, prompt=args.prompt, n_predict=args.n_predict,
                                          on_progress=progress)
    except LoadCheckError as e:
        raise CliError(str(e)) from None
    finally:
        progress.done()
    if args.json:
        print(json.dumps(to_dict(report), indent=2))
    else:
        print(to_markdown(report), end="")
    return Exit.OK
