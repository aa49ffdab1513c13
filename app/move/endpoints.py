"""The two sides a move runs between, both the :class:`Endpoint` the transfer drives.

:class:`LocalEndpoint`: a profile on this machine, over the app's catalog (its facts from
:mod:`app.move.facts`, its commit :func:`app.move.receive.adopt`). :class:`RemoteEndpoint`: a
profile on a host reached over SSH (``run_cli`` runs that host's ``kv-valet`` with ``--json``,
``sftp()`` opens its files; app.remote provides the host object), whose commit runs the same code
there.
"""

from __future__ import annotations

import asyncio
import logging
import os
import posixpath
from dataclasses import fields
from pathlib import Path
from typing import Any, AsyncIterator, Protocol

from app import files as fileio
from app.core.compat import SessionFacts, TargetFacts
from app.move.facts import describe_target, slots_ctx, source_session
from app.move.receive import adopt, settle
from app.move.values import SourceFile, SourceSession, check_move_id
from app.sessions.move_in import temp_name
from app.store.catalog import Catalog, SessionRecord

log = logging.getLogger(__name__)

#: A remote commit (``receive --commit``) may take this long, plus a second per COMMIT_MIN_RATE bytes:
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

    async def open_temp(self, tmp_name: str) -> Writer: ...

    async def commit(self, manifest: dict[str, Any]) -> SessionRecord: ...

    async def abort(self, move_id: str) -> SessionRecord | None: ...

    async def delete(self, name: str) -> None: ...


class _LocalWriter:
    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, fileio.PRIVATE_FILE_MODE)

    async def write(self, data: bytes) -> None:
        fd = self._fd
        assert fd is not None

        def put() -> None:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]

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

    async def open_temp(self, tmp_name: str) -> Writer:
        folder = await self._save_dir()
        await asyncio.to_thread(fileio.private_dir, folder)
        return _LocalWriter(folder / tmp_name)

    async def commit(self, manifest: dict[str, Any]) -> SessionRecord:
        folder = await self._save_dir()
        assert self._facts is not None
        return await asyncio.to_thread(adopt, self.catalog, self.profile, folder, manifest,
                                       model_path=self._facts.model_path, receipt=False)

    async def abort(self, move_id: str) -> SessionRecord | None:
        """Settle move ``move_id`` here (:func:`app.move.receive.settle`): its row when its commit listed the
        session, else None (rolled back: its files removed)."""
        folder = await self._save_dir()
        listed, messages = await asyncio.to_thread(settle, self.catalog, move_id, folder)
        for msg in messages:
            log.warning("move: %s", msg)
        return listed

    async def delete(self, name: str) -> None:
        from app.sessions.records import delete_session

        await asyncio.to_thread(delete_session, self.catalog, name, self.profile)


class _SftpWriter:
    def __init__(self, f):
        self._f = f

    async def write(self, data: bytes) -> None:
        await self._f.write(data)

    async def close(self) -> None:
        await self._f.close()


class RemoteEndpoint:
    """A profile on another host. ``host`` offers ``await run_cli(args) -> parsed JSON`` (that
    host's ``kv-valet``; each call here passes ``--json``) and ``await sftp()`` (an asyncssh
    SFTP client): app.remote.host.RemoteHost. The target's work runs there, in
    ``kv-valet sessions receive`` (:func:`app.move.receive.adopt`, the same code as here)."""

    def __init__(self, host, host_name: str, profile: str):
        self.host = host
        self.profile = profile
        self.where = f"{host_name}:{profile}"
        self._facts: TargetFacts | None = None

    async def describe(self) -> TargetFacts:
        from dataclasses import replace

        data = await self.host.run_cli(["sessions", "receive", self.profile, "--describe", "--json"])
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
        data = await self.host.run_cli(["sessions", "facts", name, "--profile", self.profile, "--json"])
        known = {f.name for f in fields(SessionRecord)}
        rec = SessionRecord(**{k: v for k, v in data["record"].items() if k in known})
        files = [SourceFile(f["suffix"], f["path"], int(f["size"])) for f in data["files"]]
        return SourceSession(rec, SessionFacts.from_dict(data["facts"]), files)

    async def read(self, file: SourceFile, chunk: int) -> AsyncIterator[bytes]:
        sftp = await self.host.sftp()
        async with sftp.open(file.path, "rb") as f:
            while data := await f.read(chunk):
                yield data

    async def _save_dir(self) -> str:
        if self._facts is None:
            await self.describe()
        assert self._facts is not None
        return self._facts.save_dir

    async def open_temp(self, tmp_name: str) -> Writer:
        sftp = await self.host.sftp()
        return _SftpWriter(await sftp.open(posixpath.join(await self._save_dir(), tmp_name), "wb"))

    async def commit(self, manifest: dict[str, Any]) -> SessionRecord:
        import json

        move_id = check_move_id(manifest["move_id"])
        w = await self.open_temp(temp_name(move_id, ".json"))
        try:
            await w.write(json.dumps(manifest).encode())
        finally:
            await w.close()
        # the host reads every byte back (SHA-256) and syncs it to its disk: time for a slow disk
        size = sum(int(f.get("size", 0)) for f in manifest.get("files", ()))
        data = await self.host.run_cli(["sessions", "receive", self.profile, "--commit", move_id, "--json"],
                                       timeout=COMMIT_TIMEOUT_S + size / COMMIT_MIN_RATE)
        known = {f.name for f in fields(SessionRecord)}
        return SessionRecord(**{k: v for k, v in data["record"].items() if k in known})

    async def abort(self, move_id: str) -> SessionRecord | None:
        """``receive --abort ID`` there (:func:`app.sessions.move_in.settle_move` on the host, on a new
        connection when the last one was cut): the row when the host had listed the session, else None
        (rolled back)."""
        data = await self.host.run_cli(["sessions", "receive", self.profile, "--abort", check_move_id(move_id),
                                        "--json"])
        committed = data.get("committed") if isinstance(data, dict) else None  # absent: an older kv-valet
        if not isinstance(committed, dict):
            return None
        known = {f.name for f in fields(SessionRecord)}
        return SessionRecord(**{k: v for k, v in committed.items() if k in known})

    async def delete(self, name: str) -> None:
        await self.host.run_cli(["sessions", "rm", name, "--profile", self.profile, "--json"])
