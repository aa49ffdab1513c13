"""What every cell of the fault matrix shares: a server to kill, an app process to kill,
a way to freeze either at an exact file event, small and read-only filesystems, and the
one consistency check every cell ends with."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from app import paths
from app.sessions.service import SessionService
from app.server.launcher import make_supervisor, plan_launch
from app.core.states import SidecarStatus
from app.server.sidecar import fnv1a64_file, inspect_sidecar
from app.server.statefile import read_state_header
from app.core.states import ServerState
from app.store.catalog import Catalog, SessionRecord

ROOT = Path(__file__).resolve().parents[2]
FREEZE = Path(__file__).with_name("freeze.py")
TMP_PREFIX = "kvv-tmp-"

# About 170 tokens: a fill costs a second or two on two shared cores, a park a few MB.
SHORT = ("The valet parks each car in a numbered bay and writes the bay on a ticket. "
         "When the owner returns, the valet reads the ticket and fetches the car without searching. ") * 5
MORE = " The owner tips the valet, and the valet writes the tip on the ticket too."


# -- the server ------------------------------------------------------------------------------------


class Server:
    """One llama-server under the app's Supervisor, in the test's event loop."""

    def __init__(self, profile):
        self.profile = profile
        self.sup = None
        self.plan = None

    async def start(self) -> "Server":
        if self.sup is not None:
            await self.sup.aclose()
        self.plan = await asyncio.to_thread(plan_launch, self.profile)
        self.sup = make_supervisor(self.plan)
        await self.sup.start()
        return self

    @property
    def pid(self) -> int:
        assert self.sup is not None and self.sup.pid is not None
        return self.sup.pid

    @property
    def save_dir(self) -> Path:
        return Path(self.profile.slot_save_path)

    async def kill(self):
        """SIGKILL the llama-server process; the supervisor's Outcome says why it ended."""
        os.kill(self.pid, signal.SIGKILL)
        await self.sup.wait_state(ServerState.CRASHED, ServerState.STOPPED, timeout=120)
        return self.sup.outcome

    async def service(self) -> tuple[SessionService, Catalog]:
        """A SessionService on a new Catalog object: what an app start does (recovery included)."""
        catalog = Catalog(paths.catalog_path())
        svc = await SessionService.connect(catalog, url=self.plan.url, profile=self.profile,
                                           log_buffer=self.sup.log, build=self.plan.build, supervisor=self.sup)
        return svc, catalog

    async def park(self, slot: int, name: str):
        """Park ``slot`` as ``name`` through a fresh service (an app start); the session record."""
        svc, cat = await self.service()
        try:
            return (await svc.park(slot, name)).record
        finally:
            await svc.aclose()
            cat.close()

    async def fill(self, slot: int, prompt: str = SHORT, n_predict: int = 2) -> dict:
        from app.server.client import LlamaClient

        async with LlamaClient(self.plan.url) as c:
            return await c.completion(prompt, slot_id=slot, n_predict=n_predict)

    async def aclose(self) -> None:
        if self.sup is not None:
            await self.sup.aclose()


# -- app processes ---------------------------------------------------------------------------------


class Proc:
    """A KV Valet process (the CLI or tests/faults/driver.py) whose output the test reads line by line."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc
        self.lines: list[str] = []

    @classmethod
    async def start(cls, *argv: str) -> "Proc":
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=str(ROOT), env=os.environ.copy(), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        return cls(proc)

    @classmethod
    async def driver(cls, **spec) -> "Proc":
        return await cls.start(sys.executable, "-m", "tests.faults.driver", json.dumps(spec))

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def expect(self, *starts: str, timeout: float = 120) -> str:
        """The next stdout line that starts with one of ``starts`` (fails on EOF first)."""
        async def read() -> str:
            while True:
                raw = await self.proc.stdout.readline()
                if not raw:
                    err = (await self.proc.stderr.read()).decode(errors="replace")
                    raise AssertionError(f"the app process ended before {starts}: {self.lines}\n{err}")
                line = raw.decode(errors="replace").rstrip("\n")
                self.lines.append(line)
                if line.startswith(starts):
                    return line

        return await asyncio.wait_for(read(), timeout)

    def send(self, line: str) -> None:
        self.proc.stdin.write(line.encode() + b"\n")

    async def kill(self) -> str:
        """SIGKILL; returns what it wrote on stderr."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        _out, err = await self.proc.communicate()
        assert self.proc.returncode == -signal.SIGKILL
        return err.decode(errors="replace")

    async def finish(self, timeout: float = 120) -> tuple[int, str, str]:
        out, err = await asyncio.wait_for(self.proc.communicate(), timeout)
        return self.proc.returncode, "\n".join(self.lines + [out.decode(errors="replace")]), err.decode(errors="replace")


async def cli(*args: str, timeout: float = 120) -> tuple[int, str, str]:
    """``kv-valet ARGS`` as a user runs it (same data folders): (exit status, stdout, stderr)."""
    p = await Proc.start(sys.executable, "-m", "app.cli", *args)
    p.proc.stdin.close()
    return await p.finish(timeout)


class Freezer:
    """tests/faults/freeze.py: SIGSTOP a process at the first matching file event."""

    def __init__(self, proc: Proc):
        self.p = proc
        self._hit: asyncio.Task | None = None

    @classmethod
    async def watch(cls, folder: Path, regex: str, events: str, pid: int, *, open_by: int | None = None) -> "Freezer":
        argv = [sys.executable, str(FREEZE), str(folder), regex, events, str(pid)]
        if open_by is not None:
            argv += ["--open-by", str(open_by)]
        f = cls(await Proc.start(*argv))
        await f.p.expect("ready", timeout=120)
        return f

    async def hit(self, timeout: float = 120) -> dict:
        return json.loads(await self.p.expect("{", timeout=timeout))

    def hit_task(self, timeout: float = 120) -> asyncio.Task:
        """:meth:`hit` as a task this freezer owns: :meth:`stop` settles it before it reads the
        watcher's pipes (two readers on one pipe raise "read() called while another coroutine is
        already waiting")."""
        self._hit = asyncio.ensure_future(self.hit(timeout))
        return self._hit

    def done(self) -> bool:
        return self.p.proc.returncode is not None

    async def stop(self, *, frozen_pid: int | None = None) -> None:
        """Kill the watcher and read what it left. A pending :meth:`hit_task` is cancelled and
        awaited first. ``frozen_pid``: the watched process, let go (SIGCONT) if the watcher froze
        it after all (the test moves on without killing it: the operation had finished first)."""
        if self.p.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.p.proc.kill()
        if self._hit is not None:
            self._hit.cancel()
            await asyncio.wait({self._hit})
            froze = not self._hit.cancelled() and self._hit.exception() is None
            if froze and frozen_pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(frozen_pid, signal.SIGCONT)
        await self.p.proc.communicate()


# -- filesystems -----------------------------------------------------------------------------------


def _unavailable(reason: str):
    if os.environ.get("CI"):
        pytest.fail(f"[CI] this fault needs {reason}; the CI machine must allow it (run the tests as root "
                    "in a container with CAP_SYS_ADMIN, or a VM)")
    pytest.skip(reason)


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, check=False)


@contextlib.contextmanager
def small_fs(where: Path, size_bytes: int):
    """A filesystem of ``size_bytes`` mounted on ``where`` (created empty): tmpfs; else
    an ext4 image on a loop device. Fails under CI when neither can be mounted."""
    where.mkdir(parents=True, exist_ok=True)
    size_k = max(64, size_bytes // 1024)
    r = _run("mount", "-t", "tmpfs", "-o", f"size={size_k}k,mode=0755", f"kvv-full-{uuid.uuid4().hex[:6]}",
             str(where))
    image = None
    if r.returncode != 0:
        image = where.with_name(where.name + ".img")
        with open(image, "wb") as f:
            f.truncate(max(size_bytes, 2 * 1024 * 1024))
        r2 = _run("mkfs.ext4", "-q", "-m", "0", str(image))
        r3 = _run("mount", "-o", "loop", str(image), str(where)) if r2.returncode == 0 else r2
        if r3.returncode != 0:
            image.unlink(missing_ok=True)
            _unavailable(f"a small filesystem (mount tmpfs: {r.stderr.strip()}; loop ext4: {r3.stderr.strip()})")
    try:
        yield where
    finally:
        if _run("umount", str(where)).returncode != 0:
            _run("umount", "-l", str(where))
        if image is not None:
            image.unlink(missing_ok=True)


@contextlib.contextmanager
def read_only(folder: Path):
    """``folder`` read-only in place (a read-only bind mount of itself): root cannot write there either."""
    r = _run("mount", "--bind", str(folder), str(folder))
    if r.returncode != 0:
        _unavailable(f"a read-only bind mount (mount --bind: {r.stderr.strip()})")
    r = _run("mount", "-o", "remount,bind,ro", str(folder))
    if r.returncode != 0:
        _run("umount", str(folder))
        _unavailable(f"a read-only bind mount (remount,ro: {r.stderr.strip()})")
    try:
        yield folder
    finally:
        if _run("umount", str(folder)).returncode != 0:
            _run("umount", "-l", str(folder))


def fill_up(folder: Path) -> int:
    """Write a filler file until the filesystem of ``folder`` has no space left; its size."""
    n = 0
    chunk = b"\0" * 65536
    with open(folder / "filler", "wb", buffering=0) as f:
        while True:
            try:
                n += f.write(chunk)
            except OSError:
                break
        with contextlib.suppress(OSError):
            for size in (4096, 512, 64, 1):
                while True:
                    n += f.write(b"\0" * size)
    return n


# -- the check every cell ends with ----------------------------------------------------------------


@dataclass
class Listed:
    name: str
    n_tokens: int
    state_file: str
    sidecar_status: str


def assert_consistent(save_dirs, *, profile: str | None = None) -> dict[str, Listed]:
    """Nothing half-done is left and the catalog and the files agree.

    * no journal entry is open (a park or an A/B hide someone must finish);
    * every listed session's state file exists, parses, holds the tokens and has the
      size the catalog says, and a sidecar next to it belongs to it (a PKCL v2 one
      carries the state file's hash: a sidecar paired with another save fails here);
    * no temporary file (``kvv-tmp-*``: a save, a previous copy, a half sidecar) and no
      sidecar hidden by an A/B is left in a save folder, and every state file and
      sidecar there belongs to a listed session.

    Returns the sessions by name.
    """
    with Catalog(paths.catalog_path()) as cat:
        pending = cat.list_pending()
        records: list[SessionRecord] = cat.list(profile)
    assert pending == [], f"journal entries left open: {pending}"
    listed: dict[str, Listed] = {}
    owned: set[Path] = set()
    for rec in records:
        path = rec.state_path
        assert path.is_file(), f"session '{rec.name}' is listed but its state file {path} is missing"
        header = read_state_header(path)
        assert header.token_count == rec.n_tokens, (rec.name, header.token_count, rec.n_tokens)
        assert path.stat().st_size == rec.state_size, (rec.name, path.stat().st_size, rec.state_size)
        report = inspect_sidecar(path, rec.n_tokens, str(rec.memory_kind), state_hash=lambda p=path: fnv1a64_file(p))
        if report.path is not None:
            assert report.status is SidecarStatus.PRESENT_VALID, (rec.name, report.status, report.reason)
            owned.add(report.path)
        owned.add(path)
        listed[rec.name] = Listed(rec.name, rec.n_tokens, rec.state_file, str(rec.sidecar_status))
    for d in {Path(x) for x in save_dirs}:
        if not d.is_dir():
            continue
        for f in sorted(d.iterdir()):
            assert not f.name.startswith(TMP_PREFIX), f"temporary file left behind: {f}"
            assert not f.name.endswith(".kvv-hidden"), f"sidecar left hidden: {f}"
            if f.suffix in (".bin", ".ckpt", ".checkpoints", ".tmp"):
                assert f in owned, f"{f} is in the save folder but no listed session owns it ({sorted(listed)})"
    return listed


def state_bytes(save_dir: Path, state_file: str) -> bytes:
    return (Path(save_dir) / state_file).read_bytes()
