"""The host side of start/stop: ``kv-valet service start|stop|status PROFILE`` on the machine itself.

Where a systemd user manager answers, the profile's server is the user unit
``kv-valet-<profile>.service`` that ``kv-valet install-service PROFILE`` writes: start, stop
and status are ``systemctl --user`` on it (stopping it parks the slots: ``serve`` does that
on SIGTERM). Where none answers (a container, a login without lingering: ``systemctl --user``
says "Failed to connect to bus"), the answer says so, and the server is run the way the unit
would run it, ``kv-valet serve PROFILE --quiet``, detached in its own session, with a record
(pid and start time) under the data folder's ``run/``; stop sends it SIGTERM (it parks, then
stops the server) and waits for it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable

import psutil

from app import paths
from app import files

#: how long stop waits for serve to park and stop (the unit's TimeoutStopSec)
STOP_TIMEOUT_S = 150.0
#: a detached serve that exits within this long did not start (bad profile, port taken)
EARLY_EXIT_S = 1.5
#: how often a start looks at /health while the model loads
READY_POLL_S = 0.25

Runner = Callable[[list[str]], "subprocess.CompletedProcess[str]"]


def _run(argv: list[str]) -> "subprocess.CompletedProcess[str]":
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=120)
    except FileNotFoundError:
        return subprocess.CompletedProcess(argv, 127, "", f"{argv[0]}: not found")


def service_line(data: dict) -> str:
    """One line for a person from :meth:`UnitControl.do`'s answer: a systemd unit is named only where one
    is installed; the detached ``serve`` says it is one."""
    pid = f" (pid {data['pid']})" if data.get("pid") else ""
    profile = data.get("profile", "?")
    if data.get("manager") == "detached":
        state = "running" if data.get("active") else "not running"
        return f"kv-valet serve {profile} (detached, no systemd unit): {state}{pid}"
    if not data.get("installed"):
        return (f"{data.get('unit')}: not installed (kv-valet install-service {profile} writes it)"
                + (f", {data.get('state')}{pid}" if data.get("active") else ""))
    return f"{data.get('unit')}: {data.get('state')}{pid}"


class UnitError(Exception):
    """Start or stop failed; the message says why and what to do."""


def unit_name(profile: str) -> str:
    safe = "".join(c if c.isalnum() or c in "_-." else "_" for c in profile)
    return f"kv-valet-{safe}.service"


@dataclass
class UnitControl:
    """start / stop / status of one profile's server on this machine. ``run`` runs an argv and
    returns a CompletedProcess (tests record it); ``serve_argv`` is what the detached fallback runs."""

    profile: str
    run: Runner = _run
    serve_argv: list[str] = field(default_factory=list)

    def __post_init__(self):
        if not self.serve_argv:
            self.serve_argv = [sys.executable, "-m", "app.cli", "serve", self.profile, "--quiet"]

    @property
    def unit(self) -> str:
        return unit_name(self.profile)

    def systemctl(self, *args: str) -> "subprocess.CompletedProcess[str]":
        return self.run(["systemctl", "--user", *args])

    def user_manager(self) -> tuple[bool, str]:
        """(reachable, why not): ``systemctl --user show-environment`` answers only where the user's
        manager runs."""
        r = self.systemctl("show-environment")
        if r.returncode == 0:
            return True, ""
        why = (r.stderr or r.stdout or "").strip().splitlines()
        return False, why[0] if why else f"systemctl --user exited {r.returncode}"

    # -- the three actions -----------------------------------------------------------------------

    def do(self, action: str, *, wait_s: float = 0) -> dict:
        """start, stop or status; a start then waits up to ``wait_s`` seconds for the server's
        /health to answer 200 (``ready`` in the answer), and fails at once if it exits meanwhile."""
        ok, why = self.user_manager()
        if ok:
            out = {"start": self._unit_start, "stop": self._unit_stop, "status": self._unit_status}[action]()
            running = lambda: self._unit_status()["state"] in ("active", "activating")  # noqa: E731
        else:
            out = {"start": self._detached_start, "stop": self._detached_stop,
                   "status": self._detached_status}[action]()
            out["note"] = (f"no systemd user manager here ({why}): the server runs as a detached "
                           f"'kv-valet serve {self.profile}' instead of the unit {self.unit}")
            running = lambda: self._live() is not None  # noqa: E731
        if action == "start" and wait_s > 0:
            out["ready"] = self._wait_ready(wait_s, running)
            if not out["ready"] and not running():
                raise UnitError(f"the server of {self.profile} stopped while starting: {self._tail()}")
        return out

    def _tail(self) -> str:
        try:
            lines = self._log_path().read_text(encoding="utf-8", errors="replace").strip().splitlines()
        except OSError:
            return f"see journalctl --user -u {self.unit}"
        return " | ".join(lines[-5:]) or "no output"

    def _wait_ready(self, timeout: float, running: Callable[[], bool]) -> bool:
        """Poll the profile's /health until 200, the server's process is gone, or ``timeout``."""
        import asyncio

        from app.server.client import LlamaClient
        from app.store.profiles import ProfileStore

        url = ProfileStore().load(self.profile).url

        async def poll() -> bool:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            async with LlamaClient(url) as client:
                while True:
                    if (await client.health()).ok:
                        return True
                    if not running() or loop.time() > deadline:
                        return False
                    await asyncio.sleep(READY_POLL_S)

        return asyncio.run(poll())

    def _unit_status(self) -> dict:
        r = self.systemctl("show", self.unit, "--property=LoadState,ActiveState,SubState,MainPID")
        props = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
        pid = int(props.get("MainPID", "0") or 0)
        return {"unit": self.unit, "manager": "systemd", "profile": self.profile,
                "installed": props.get("LoadState") == "loaded", "active": props.get("ActiveState") == "active",
                "state": props.get("ActiveState", "unknown"), "sub_state": props.get("SubState", ""),
                "pid": pid or None}

    def _unit_action(self, action: str) -> dict:
        r = self.systemctl(action, self.unit)
        if r.returncode != 0:
            text = (r.stderr or r.stdout).strip()
            hint = (f" Install it on this host with: kv-valet install-service {self.profile}"
                    if "not found" in text or "not loaded" in text else "")
            raise UnitError(f"systemctl --user {action} {self.unit} failed: {text}.{hint}")
        return self._unit_status()

    def _unit_start(self) -> dict:
        return self._unit_action("start")

    def _unit_stop(self) -> dict:
        return self._unit_action("stop")

    # -- no user manager: kv-valet serve, detached -------------------------------------------------

    def record_path(self):
        return paths.runtime_dir() / f"serve-{self.unit.removesuffix('.service')}.json"

    def _live(self) -> psutil.Process | None:
        rec = files.read_json_object(self.record_path())
        try:
            proc = psutil.Process(int(rec["pid"]))
            if abs(proc.create_time() - float(rec["started"])) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE:
                return proc
        except (KeyError, TypeError, ValueError, psutil.Error):
            pass
        return None

    def _detached_status(self) -> dict:
        proc = self._live()
        return {"unit": self.unit, "manager": "detached", "profile": self.profile, "installed": False,
                "active": proc is not None, "state": "active" if proc else "inactive", "sub_state": "",
                "pid": proc.pid if proc else None, "log": str(self._log_path())}

    def _log_path(self):
        return paths.state_dir() / "logs" / f"serve-{self.unit.removesuffix('.service')}.out"

    def _detached_start(self) -> dict:
        if self._live() is not None:
            return self._detached_status()
        from app.store.profiles import ProfileStore

        ProfileStore().load(self.profile)  # an unknown profile: its clear error, before anything starts
        log = self._log_path()
        files.private_dir(log.parent)
        with files.open_private(log, "ab") as out:
            proc = subprocess.Popen(self.serve_argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, close_fds=True)
        try:
            code = proc.wait(timeout=EARLY_EXIT_S)  # a bounded check for an immediate failure
        except subprocess.TimeoutExpired:
            code = None
        if code is not None:
            raise UnitError(f"kv-valet serve {self.profile} exited at once (status {code}): {self._tail()}")
        started = psutil.Process(proc.pid).create_time()
        files.private_dir(self.record_path().parent)
        files.write_atomic(self.record_path(), json.dumps({"pid": proc.pid, "started": started,
                                                           "argv": self.serve_argv}))
        return self._detached_status()

    def _detached_stop(self) -> dict:
        proc = self._live()
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)  # serve parks the slots, then stops its server
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except psutil.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            except psutil.NoSuchProcess:
                pass
        try:
            self.record_path().unlink()
        except FileNotFoundError:
            pass
        return self._detached_status()
