"""The one way a test starts a llama.cpp program that loads a model (llama-server, the sidecar-built
server, rpc-server) without going through KV Valet: as KV Valet's launcher does.

The app's launch plan (:func:`app.server.launcher.plan_launch`) starts the server in the environment
:func:`app.server.launcher.launch_environment` gives: on a CPU that lists AMX inside a virtual machine
llama-server's repacked AMX kernels die in the warm-up (SIGILL, exit -4), so it runs with
``LLAMA_ARG_REPACK=false``. A test that starts a binary itself with a bare ``subprocess.Popen`` misses
that and fails on such a machine where the app would not; tests/unit/test_llama_server_starts.py fails
the suite on any such start outside this module (``--version`` and ``--help`` calls load no model and
are fine).

    proc = start_llama_server([binary, "-m", model, "--port", str(port)], log=folder / "server.log")
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, log=folder / "server.log")
        ...
    finally:
        stop(proc)
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Mapping, Sequence

#: how long a server may take to answer /health: a guard against a hang (two busy cores load Gemma 3 270M
#: in seconds; a stalled start is what this catches), not a claim about speed
HEALTH_TIMEOUT_S = 300.0


def server_environment(argv: Sequence[str | os.PathLike], env: Mapping[str, str] | None = None, *,
                       knows_no_repack: bool = True) -> dict[str, str]:
    """The whole environment ``argv`` is started with: ``env`` (default: this process's environment)
    with what KV Valet's launcher adds (:func:`app.server.launcher.launch_environment`)."""
    from app.server.launcher import launch_environment

    return launch_environment([str(a) for a in argv], knows_no_repack=knows_no_repack,
                              base=dict(os.environ if env is None else env))


def start_llama_server(argv: Sequence[str | os.PathLike], *, log: IO[bytes] | str | os.PathLike | int,
                       env: Mapping[str, str] | None = None, knows_no_repack: bool = True,
                       **popen_kw) -> subprocess.Popen:
    """Start ``argv`` (a llama.cpp program and its arguments) as KV Valet would.

    ``log``: where its stdout and stderr go, together: an open binary file, a path (appended to) or
    ``subprocess.DEVNULL``. ``env``: the environment to build on (default: this process's), for a test
    that adds or removes something (``KVV_SIDECAR_MODE``). stdin is ``/dev/null`` unless given. Other
    keywords go to :class:`subprocess.Popen` (``start_new_session``...)."""
    argv = [str(a) for a in argv]
    popen_kw.setdefault("stdin", subprocess.DEVNULL)
    full_env = server_environment(argv, env, knows_no_repack=knows_no_repack)
    if isinstance(log, (str, os.PathLike)):
        with open(log, "ab") as f:  # the child holds its own descriptor
            return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=full_env, **popen_kw)
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=full_env, **popen_kw)


def _log_tail(log: str | os.PathLike | None, n: int = 3000) -> str:
    if log is None:
        return ""
    try:
        return "\n" + Path(log).read_text(errors="replace")[-n:]
    except OSError:
        return ""


def wait_healthy(url: str, proc: subprocess.Popen, *, timeout: float = HEALTH_TIMEOUT_S,
                 log: str | os.PathLike | None = None) -> None:
    """Until ``url``/health answers 200; fails at once if the process ends first (with the log's tail),
    and after ``timeout`` seconds (a guard against a hang)."""
    deadline = time.monotonic() + timeout
    interval = 0.01
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before it was healthy"
                               + _log_tail(log))
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not healthy after {timeout:.0f} s" + _log_tail(log))
        time.sleep(interval)  # polling a starting process for its /health: quickly at first, then every 0.1 s
        interval = min(interval * 1.5, 0.1)


def stop(proc: subprocess.Popen, timeout: float = 60.0) -> int:
    """SIGTERM, then SIGKILL after ``timeout`` seconds; the exit status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait(timeout=timeout)
