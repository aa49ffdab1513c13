"""The two sides a move runs between, both the :class:`Endpoint` the transfer drives.

:class:`LocalEndpoint`: a profile on this machine, over the app's catalog (its facts from
:mod:`app.move.facts`, its commit :func:`app.move.receive.adopt`). :class:`RemoteEndpoint`: a
profile on a host reached over SSH (``run_cli`` runs that host's ``kv-valet`` with ``--json``,
``sftp()`` opens its files; app.remote provides the host object), whose commit runs the same code
there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import posixpath
import shlex
from dataclasses import fields
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Protocol

from app import files as fileio
from app.core.compat import SessionFacts, TargetFacts
from app.move.facts import describe_target, slots_ctx, source_session
from app.move.receive import ReadBack, adopt, settle
from app.move.values import ChecksumMismatch, MoveError, SourceFile, SourceSession, check_move_id
from app.sessions.move_in import temp_name
from app.store.catalog import Catalog, SessionRecord

log = logging.getLogger(__name__)

#: A remote commit (``move-host``'s ``commit``) may take this long, plus a second per COMMIT_MIN_RATE bytes:
#: past it the sender gives up and aborts (a commit whose process died there is rolled back then).
COMMIT_TIMEOUT_S = 120.0
COMMIT_MIN_RATE = 20e6


class Writer(Protocol):
    async def write(self, data: bytes) -> None: ...

    async def close(self) -> None: ...


class Endpoint(Protocol):
    """One side of a move. ``where`` names it in messages ("profile 'b'", "gpu-box:b")."""

    where: str
    profile: str

    async def describe(self) -> TargetFacts: ...

    async def session(self, name: str) -> SourceSession: ...

    def read(self, file: SourceFile, chunk: int) -> AsyncIterator[bytes]: ...

    async def open_temp(self, move_id: str, suffix: str) -> Writer: ...

    async def commit(self, manifest: dict[str, Any]) -> SessionRecord: ...

    async def abort(self, move_id: str) -> SessionRecord | None: ...

    async def delete(self, name: str) -> None: ...

    async def end(self) -> None:
        """The move is over: end what it held open (a host's process)."""


class _LocalWriter:
    """A temporary file here; each chunk is read back and hashed once written (:class:`ReadBack`), in the
    same worker, so the commit reads back only what it did not read yet."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, fileio.PRIVATE_FILE_MODE)
        self.read_back = ReadBack(path)
        self._n = 0

    async def write(self, data: bytes) -> None:
        fd = self._fd
        assert fd is not None

        def put() -> None:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            self._n += len(data)
            self.read_back.advance(self._n)

        await asyncio.to_thread(put)

    async def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                await asyncio.to_thread(os.fsync, fd)
            finally:
                os.close(fd)


class LocalEndpoint:
    """A profile on this machine, over the app's catalog."""

    def __init__(self, catalog: Catalog, profile: str | None):
        self.catalog = catalog
        self.profile = profile or ""
        self.where = f"profile '{profile}'" if profile else "this machine"
        self._facts: TargetFacts | None = None
        self._read_back: dict[tuple[str, str], ReadBack] = {}

    async def describe(self) -> TargetFacts:
        self._facts = await describe_target(self.catalog, self.profile, where=self.where)
        return self._facts

    async def _save_dir(self) -> Path:
        if self._facts is None:
            await self.describe()
        assert self._facts is not None
        return Path(self._facts.save_dir)

    async def session(self, name: str) -> SourceSession:
        s = await asyncio.to_thread(source_session, self.catalog, name, self.profile or None)
        if not self.profile:
            self.profile, self.where = s.record.profile, f"profile '{s.record.profile}'"
        return s

    async def read(self, file: SourceFile, chunk: int) -> AsyncIterator[bytes]:
        f = await asyncio.to_thread(open, file.path, "rb")
        try:
            while data := await asyncio.to_thread(f.read, chunk):
                yield data
        finally:
            f.close()

    async def open_temp(self, move_id: str, suffix: str) -> Writer:
        folder = await self._save_dir()
        await asyncio.to_thread(fileio.private_dir, folder)
        w = _LocalWriter(folder / temp_name(move_id, suffix))
        self._read_back[move_id, suffix] = w.read_back
        return w

    async def commit(self, manifest: dict[str, Any]) -> SessionRecord:
        folder = await self._save_dir()
        assert self._facts is not None
        move_id = check_move_id(manifest["move_id"])
        read = {s: rb for (m, s), rb in self._read_back.items() if m == move_id}
        try:
            return await asyncio.to_thread(adopt, self.catalog, self.profile, folder, manifest,
                                           model_path=self._facts.model_path, receipt=False, read_back=read)
        finally:
            self._forget(move_id)

    def _forget(self, move_id: str | None = None) -> None:
        for key in [k for k in self._read_back if move_id is None or k[0] == move_id]:
            self._read_back.pop(key).close()

    async def abort(self, move_id: str) -> SessionRecord | None:
        """Settle move ``move_id`` here (:func:`app.move.receive.settle`): its row when its commit listed the
        session, else None (rolled back: its files removed)."""
        folder = await self._save_dir()
        self._forget(move_id)
        listed, messages = await asyncio.to_thread(settle, self.catalog, move_id, folder)
        for msg in messages:
            log.warning("move: %s", msg)
        return listed

    async def delete(self, name: str) -> None:
        from app.sessions.records import delete_session

        await asyncio.to_thread(delete_session, self.catalog, name, self.profile)

    async def end(self) -> None:
        self._forget()


class _SftpWriter:
    """A temporary file at the host, written over SFTP with two writes in flight (at their own
    offsets): :meth:`write` returns once the write before it is done, so the next chunk is read and
    hashed while this one travels. Each write done, in order, is told to the host's process, which
    reads it back meanwhile (app.move.host_side ``written``)."""

    def __init__(self, f, tell: Callable[[int], None]):
        self._f = f
        self._tell = tell
        self._sent = 0
        self._pending: asyncio.Task | None = None

    async def _done(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            self._tell(await pending)

    async def _put(self, data: bytes, offset: int) -> int:
        await self._f.write(data, offset)
        return offset + len(data)

    async def write(self, data: bytes) -> None:
        await self._done()
        self._pending = asyncio.create_task(self._put(data, self._sent))
        self._sent += len(data)

    async def close(self) -> None:
        try:
            await self._done()  # a cancelled wait cancels the write in flight with it
        finally:
            await self._f.close()


class _HostProcess:
    """A host's ``kv-valet sessions move-host PROFILE`` (app.move.host_side): one process for a
    whole move, started on first use on the host's SSH connection; :meth:`ask` sends a request line and
    reads its answer line, :meth:`tell` sends one that has none. A request whose answer did not come
    (a timeout, a cut connection, a cancellation) ends the process: the next request starts another."""

    def __init__(self, host, profile: str, where: str):
        self.host, self.profile, self.where = host, profile, where
        self._proc = None
        self._lock = asyncio.Lock()

    @property
    def _shown(self) -> str:
        return shlex.join([self.host.cfg.kv_valet, "sessions", "move-host", self.profile])

    @property
    def alive(self) -> bool:
        return self._proc is not None

    async def _started(self):
        import asyncssh

        if self._proc is None:
            # RemoteHost runs whole commands only (run_cli): this one converses, on the same connection
            conn = await self.host._connection()
            try:
                self._proc = await conn.create_process(self._shown, encoding=None)
            except (asyncssh.Error, OSError) as e:
                raise self._error(f"the SSH connection failed: {e}", "unreachable") from None
        return self._proc

    def _error(self, text: str, kind: str, status: int | None = None, stderr: str = ""):
        from app.remote.host import RemoteError

        return RemoteError(f"`{self._shown}` on {self.host.label}: {text}", kind=kind, host=self.host.name,
                           exit_status=status, stderr=stderr)

    async def ask(self, op: str, *, timeout: float = 60.0, **args: Any) -> dict[str, Any]:
        """The answer of request ``op`` (``args`` its fields); MoveError with the host's message when it
        could not do it, RemoteError when it did not answer."""
        import asyncssh

        async with self._lock:
            proc = await self._started()
            try:
                proc.stdin.write(json.dumps({"op": op, **args}).encode() + b"\n")
                line = await asyncio.wait_for(proc.stdout.readline(), timeout)
            except (asyncio.TimeoutError, TimeoutError):
                self._drop()
                raise self._error(f"no answer to {op} in {timeout:.0f} s", "timeout") from None
            except (asyncssh.Error, OSError) as e:
                self._drop()
                raise self._error(f"the SSH connection failed: {e}", "unreachable") from None
            except BaseException:  # a cancellation: its answer would come to the next request
                self._drop()
                raise
            if not line:
                raise await self._ended()
        try:
            answer = json.loads(line)
        except ValueError:
            self._drop()
            raise self._error(f"did not answer JSON: {line[:200]!r}. Is kv-valet there as recent as this one?",
                              "output") from None
        if "error" in answer:
            bad = answer.get("checksum")
            if isinstance(bad, dict):
                raise ChecksumMismatch(f"{self.where}: {answer['error']}", file=str(bad.get("file", "")),
                                       got=str(bad.get("got", "")), expected=str(bad.get("expected", "")))
            raise MoveError(f"{self.where}: {answer['error']}")
        return dict(answer["ok"])

    def tell(self, op: str, **args: Any) -> None:
        import asyncssh

        if self._proc is not None:
            with contextlib.suppress(asyncssh.Error, OSError):
                self._proc.stdin.write(json.dumps({"op": op, **args}).encode() + b"\n")

    async def _ended(self):
        """The process ended before its answer: why (its exit status and stderr)."""
        import asyncssh

        from app.remote.host import COMMAND_NOT_FOUND

        proc, self._proc = self._proc, None
        err, status = "", None
        with contextlib.suppress(asyncssh.Error, OSError, asyncio.TimeoutError, TimeoutError):
            done = await proc.wait(timeout=10)
            status = done.exit_status
            err = (done.stderr or b"").decode("utf-8", "replace").strip()
        if status == COMMAND_NOT_FOUND:
            return self._error(f"kv-valet was not found there ({err or 'command not found'}); give its full path "
                               "with kv-valet hosts add … --kv-valet PATH --force", "not-found", status, err)
        hint = " Is kv-valet there as recent as this one?" if status == 2 else ""
        return self._error(f"ended (exit {status}) before it answered: {err[-500:] or 'no message'}.{hint}",
                           "command", status, err)

    def _drop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.close()

    async def close(self) -> None:
        """End the process: the end of its input, after which it ends by itself (it has answered every
        request; nothing waits for it to exit)."""
        import asyncssh

        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(asyncssh.Error, OSError):
                proc.stdin.write_eof()
            proc.close()


class RemoteEndpoint:
    """A profile on another host. ``host`` offers ``await run_cli(args) -> parsed JSON`` (that
    host's ``kv-valet``; each call here passes ``--json``) and ``await sftp()`` (an asyncssh
    SFTP client): app.remote.host.RemoteHost. Everything the move asks there is answered by one
    ``kv-valet sessions move-host PROFILE`` process (:class:`_HostProcess`, app.move.host_side: the
    same code as here), ended by :meth:`end`."""

    def __init__(self, host, host_name: str, profile: str):
        self.host = host
        self.profile = profile
        self.where = f"{host_name}:{profile}"
        self._facts: TargetFacts | None = None
        self._proc = _HostProcess(host, profile, self.where)

    async def describe(self) -> TargetFacts:
        from dataclasses import replace

        data = await self._proc.ask("describe")
        self._facts = replace(TargetFacts.from_dict(data["target"]), where=self.where)
        if self._facts.n_ctx_slot is None:  # no -c there, and the host did not reach its server: ask its status
            from app.remote.host import RemoteError

            try:
                n_ctx = slots_ctx((await self.host.status(self.profile)).get("slots"))
            except RemoteError as e:
                log.info("move: the status of %s does not say its slot context: %s", self.where, e)
                n_ctx = None
            if n_ctx is not None:
                self._facts = replace(self._facts, n_ctx_slot=n_ctx)
        return self._facts

    async def session(self, name: str) -> SourceSession:
        data = await self._proc.ask("facts", name=name)
        known = {f.name for f in fields(SessionRecord)}
        rec = SessionRecord(**{k: v for k, v in data["record"].items() if k in known})
        files = [SourceFile(f["suffix"], f["path"], int(f["size"])) for f in data["files"]]
        return SourceSession(rec, SessionFacts.from_dict(data["facts"]), files)

    async def read(self, file: SourceFile, chunk: int) -> AsyncIterator[bytes]:
        """The file's chunks, the next one asked for while this one is used (two reads in flight)."""
        sftp = await self.host.sftp()
        async with sftp.open(file.path, "rb") as f:
            ahead = asyncio.create_task(f.read(chunk, 0))
            offset = 0
            try:
                while data := await ahead:
                    offset += len(data)
                    ahead = asyncio.create_task(f.read(chunk, offset))
                    yield data
            finally:
                ahead.cancel()
                await asyncio.gather(ahead, return_exceptions=True)

    async def _save_dir(self) -> str:
        if self._facts is None:
            await self.describe()
        assert self._facts is not None
        return self._facts.save_dir

    async def open_temp(self, move_id: str, suffix: str) -> Writer:
        sftp = await self.host.sftp()
        f = await sftp.open(posixpath.join(await self._save_dir(), temp_name(move_id, suffix)), "wb")
        return _SftpWriter(f, lambda upto: self._proc.tell("written", move_id=move_id, suffix=suffix, upto=upto))

    async def commit(self, manifest: dict[str, Any]) -> SessionRecord:
        check_move_id(manifest["move_id"])
        # the host reads back what it did not read yet (SHA-256) and syncs it to its disk: time for a slow disk
        size = sum(int(f.get("size", 0)) for f in manifest.get("files", ()))
        data = await self._proc.ask("commit", manifest=manifest, timeout=COMMIT_TIMEOUT_S + size / COMMIT_MIN_RATE)
        known = {f.name for f in fields(SessionRecord)}
        return SessionRecord(**{k: v for k, v in data["record"].items() if k in known})

    async def abort(self, move_id: str) -> SessionRecord | None:
        """Settle ``move_id`` there (:func:`app.sessions.move_in.settle_move` on the host): through the
        move's process while it answers, else ``receive --abort ID`` (on a new connection when the last
        one was cut): the row when the host had listed the session, else None (rolled back)."""
        check_move_id(move_id)
        data = None
        if self._proc.alive:
            from app.remote.host import RemoteError

            try:
                data = await self._proc.ask("abort", move_id=move_id)
            except RemoteError as e:  # cut meanwhile: asked again below, on a new connection if need be
                log.info("move: %s did not answer the abort of %s: %s", self.where, move_id, e)
            for msg in (data or {}).get("messages") or ():
                log.warning("move: %s: %s", self.where, msg)
        if data is None:
            data = await self.host.run_cli(["sessions", "receive", self.profile, "--abort", move_id, "--json"])
        committed = data.get("committed") if isinstance(data, dict) else None  # absent: an older kv-valet
        if not isinstance(committed, dict):
            return None
        known = {f.name for f in fields(SessionRecord)}
        return SessionRecord(**{k: v for k, v in committed.items() if k in known})

    async def delete(self, name: str) -> None:
        await self._proc.ask("delete", name=name)

    async def end(self) -> None:
        await self._proc.close()
