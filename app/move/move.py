"""Move or copy a parked session to another target: a profile here, or ``HOST:PROFILE``.

A parked session is a catalog row, a state file in the profile's ``--slot-save-path``
folder and maybe its checkpoint sidecar (``<state>.ckpt``). A move:

1. asks the source for the session (row, file sizes, header facts) and the target for
   its facts (profile, model identity, binary, folder), and runs the compatibility
   rules (:mod:`app.core.compat`) **before any byte moves**: a refusal names its remedy;
2. streams each file in chunks to a temporary name in the target folder
   (``kvv-move-<id>.state.part``, ``kvv-move-<id>.ckpt.part``), computing its SHA-256
   on the way and reporting bytes done / total;
3. commits at the target: the target checks each temporary file's size and SHA-256
   (read back from its disk) and the state file's header, then, under the catalog's
   files lock, renames the sidecar and the state file into place (both or neither) and
   writes the target catalog's row (:func:`adopt`: the same code runs on a remote host,
   through its ``kv-valet sessions receive``);
4. for a move (not a copy), deletes the source only after the target confirmed.

The commit is journaled (``catalog.pending``, kind ``move-in``: app.sessions.journal) before the
first rename: a process killed between the renames and the row leaves an entry that the
next move, ``kv-valet sessions ...``, ``kv-valet receive`` and the app's connect
(:func:`recover_moves`) finish (every file in place or still at its temporary name, size and
SHA-256 as sent: the session is listed) or roll back (the files are removed). A commit that
listed the session leaves a receipt (its move id) at the target.

A commit whose answer the sender lost (the SSH connection cut, the host's ``receive --commit``
killed, at any step) is settled: the sender asks the target again, on a new connection
(``receive --abort ID``: :func:`app.sessions.move_in.settle_move`, which waits for a commit of it
still running there). Listed there (its receipt, or its row written): the sender deletes its
source and says the answer was lost (a warning). Not listed: it is rolled back there and the
source is kept (the error says so). Either way one listed copy. Only a target that cannot be
asked leaves the outcome open: the error says so and how to tell. The sender itself killed
after the target listed the session and before the source was deleted leaves two copies:
both are whole and listed, as after a copy; nothing is lost (the CLI says so).

A failure or an interruption anywhere before the commit (an exception, a cancelled
task, Ctrl-C, a checksum mismatch, a full disk) removes the temporary files and leaves
the source as it was; nothing is listed at the target until its row is written. A
temporary file a crash left behind is never listed (listings read the catalog) and is
removed by the next move into that folder once nobody has written it for
:data:`STALE_AFTER_S`.

Endpoints: :class:`LocalEndpoint` (a profile on this machine) and :class:`RemoteEndpoint`
(a profile on a host reached over SSH: ``run_cli`` runs that host's ``kv-valet`` with
``--json``, ``sftp()`` opens its files; app.remote provides the host object). Front ends
call :func:`preview` (the rules only, e.g. while dragging) and :func:`move_session`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import posixpath
import re
import secrets
import shutil
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Protocol

from app import paths
from app import files as fileio
from app.core.compat import Compatibility, Problem, SessionFacts, TargetFacts, check_move
from app.core.park_files import FoundFile, ParkedFiles, compare
from app.sessions.journal import Recovery
from app.sessions.move_in import (MOVE_PREFIX, SIDECAR_SUFFIXES, discard_temps, recover_moves, settle_move,
                                  sha256_of, temp_name, write_receipt)
from app.store.catalog import Catalog, CatalogError, SessionRecord

log = logging.getLogger(__name__)

CHUNK = 4 << 20
#: A temporary file of a move nobody has written for this long is a crash's leftover.
STALE_AFTER_S = 600.0
_ID_RE = re.compile(r"[0-9a-f]{12}")
_TEMP_RE = re.compile(r"kvv-move-[0-9a-f]{12}\.(state|ckpt|checkpoints|json)\.part")
#: A remote commit (``receive --commit``) may take this long, plus a second per COMMIT_MIN_RATE bytes:
#: past it the sender gives up and aborts (a commit whose process died there is rolled back then).
COMMIT_TIMEOUT_S = 120.0
COMMIT_MIN_RATE = 20e6

ProgressFn = Callable[[int, int], None]


class MoveError(Exception):
    """A move that cannot be done or failed; the message is user-facing."""


class MoveRefused(MoveError):
    """A compatibility rule (or the name at the target) refuses the move; nothing was copied."""

    def __init__(self, compat: Compatibility):
        self.compat = compat
        self.reasons = [str(p) for p in compat.refusals]
        super().__init__("; ".join(self.reasons))


class MoveCancelled(MoveError):
    """Raised from a progress callback to stop a move (the source stays as it was)."""


# --------------------------------------------------------------------------- values


@dataclass(frozen=True)
class SourceFile:
    suffix: str  # "" for the state file, ".ckpt" / ".checkpoints" for its sidecar
    path: str  # on the source's machine
    size: int

    @property
    def role(self) -> str:
        return "state" if not self.suffix else "sidecar"


@dataclass
class SourceSession:
    record: SessionRecord
    facts: SessionFacts
    files: list[SourceFile]
    #: a local source's files against what its park wrote, read here (app.sessions.files_check: sizes and
    #: checkpoint positions); None for another machine's (its sizes are compared, its bytes as they are sent)
    files_problems: list[str] | None = None

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass
class MoveResult:
    record: SessionRecord  # as stored at the target
    source: str
    target: str
    moved: bool  # the source was deleted (a move that finished)
    bytes: int
    warnings: list[str] = field(default_factory=list)
    source_kept: str | None = None  # a move whose source could not be deleted: why


def parse_target(text: str) -> tuple[str | None, str]:
    """``PROFILE`` -> (None, PROFILE); ``HOST:PROFILE`` -> (HOST, PROFILE). Profile names hold no ':'."""
    host, sep, profile = text.rpartition(":")
    if not sep:
        return None, text
    if not host or not profile:
        raise MoveError(f"'{text}': give a profile, or HOST:PROFILE")
    return host, profile


def check_move_id(move_id: str) -> str:
    if not isinstance(move_id, str) or not _ID_RE.fullmatch(move_id):
        raise MoveError(f"not a move id: {move_id!r}")
    return move_id


# --------------------------------------------------------------------------- this machine's facts


def session_facts(rec: SessionRecord) -> SessionFacts:
    """What ``rec`` needs from the server that restores it (reads the file headers only)."""
    from app.server.sidecar import read_facts
    from app.server.statefile import StateFileError, read_state_header

    try:
        version = read_state_header(rec.state_path).version
    except StateFileError:
        version = None
    try:
        sc = read_facts(rec.state_path)
    except OSError:
        sc = None
    present = sc is not None and sc.present
    # the space check (app.core.compat's "disk space") needs the files' actual sizes, which a parked
    # session has: a prediction (app.core.park_size) is only for a park that has not run; the catalog's
    # recorded sizes stand in when the files cannot be read here
    size = sum(f.size for f in _files_of(rec)) or (rec.state_size + (rec.sidecar_size or 0))
    return SessionFacts(
        name=rec.name, n_tokens=rec.n_tokens, model_name=os.path.basename(rec.model_path or ""),
        model_size=rec.model_size, model_sha256=rec.model_sha256, model_quick_id=rec.model_quick_id,
        cache_type_k=rec.cache_type_k, cache_type_v=rec.cache_type_v, flash_attn=rec.flash_attn,
        swa_full=bool(rec.swa_full), memory_kind=str(rec.memory_kind), server_build=rec.server_build,
        state_version=version, sidecar_kind=sc.kind if present else None,
        sidecar_version=sc.version if present else None,
        sidecar_count=(len(sc.checkpoints) or (sc.count or 0)) if present else 0, total_bytes=size)


def _files_of(rec: SessionRecord) -> list[SourceFile]:
    out = []
    for suffix in ("", *SIDECAR_SUFFIXES):
        p = Path(str(rec.state_path) + suffix)
        if p.is_file() and not p.is_symlink():
            out.append(SourceFile(suffix, str(p), p.stat().st_size))
    return out


def source_session(catalog: Catalog, name: str, profile: str | None) -> SourceSession:
    """The session ``name`` of ``profile`` here, its files and facts; raises MoveError."""
    from app.sessions.records import AmbiguousName, get_session, leaves_its_folder

    try:
        rec = get_session(catalog, name, profile)
    except AmbiguousName:
        raise  # the caller says how to name the profile (the CLI: --profile)
    except CatalogError as e:
        raise MoveError(str(e)) from None
    if leaves_its_folder(rec) or rec.state_path.is_symlink():
        raise MoveError(f"the state file of '{name}' is a symbolic link: KV Valet does not move it")
    files = _files_of(rec)
    if not files or files[0].suffix:
        raise MoveError(f"the state file of '{name}' is missing: {rec.state_path}")
    from app.sessions.files_check import look

    problems = list(look(catalog, rec, hash_changed=False).problems)  # the bytes are hashed as they are sent
    return SourceSession(rec, session_facts(rec), files, problems)


def _nearest_existing(folder: Path) -> Path | None:
    for p in (folder, *folder.parents):
        if p.exists():
            return p
    return None


def _binary_keys(profile) -> tuple[str | None, list[str]]:
    from app.tools.diagnose import build_keys
    from app.server.discovery import DiscoveryError, binary_info, find_server_binary

    try:
        found = find_server_binary(profile.server_binary)
        _caps, version = binary_info(found.path)
    except (DiscoveryError, OSError) as e:
        log.info("move: the binary of profile %s is not known: %s", profile.name, e)
        return None, []
    return found.path, build_keys(version)


def _learnt_state_version(catalog: Catalog, keys: list[str]) -> int | None:
    from app.core.compat import base_build
    from app.server.statefile import StateFileError, read_state_header

    bases = {base_build(k) for k in keys}
    for r in catalog.list():
        if base_build(r.server_build) in bases:
            try:
                return read_state_header(r.state_path).version
            except StateFileError:
                continue
    return None


def _folder_and_model(profile) -> tuple[object, Path, str]:
    """(the profile as launched, its save folder, its model path) on this machine."""
    from app.core.argv import absorb_extra_args
    from app.server.launcher import slot_save_path_for

    profile = absorb_extra_args(profile)[0]
    model = str(Path(profile.model).expanduser()) if profile.model else ""
    return profile, Path(slot_save_path_for(profile)).expanduser(), model


def receiving_folder(profile_name: str) -> tuple[Path, str]:
    """(save folder, model path) of ``profile_name`` here: all a commit or an abort needs (the
    rules ran at :func:`describe_target`). Raises MoveError for an unknown profile."""
    from app.core.profile import ProfileError
    from app.server.targets import load_profile

    try:
        return _folder_and_model(load_profile(profile_name))[1:]
    except ProfileError as e:
        raise MoveError(str(e)) from None


def _target_facts_sync(catalog: Catalog, profile, where: str) -> TargetFacts:
    from app.core.rules import Facts, slot_ctx
    from app.core.sidecar_behaviour import Behaviour
    from app.sessions.behaviour import identify_server

    profile, save_dir, model_path = _folder_and_model(profile)
    for msg in recover_moves(Recovery(catalog)):
        log.warning("move: %s", msg)
    clean_stale(save_dir)
    binary, keys = _binary_keys(profile)
    log_path = paths.server_log_path(profile.name)
    behaviour = Behaviour.UNKNOWN
    for key in keys:
        behaviour = identify_server(catalog, key, log_path=log_path if log_path.is_file() else None, binary=binary)
        if behaviour is not Behaviour.UNKNOWN:
            break
    probe = _nearest_existing(save_dir)
    free = None
    if probe is not None:
        with contextlib.suppress(OSError):
            free = shutil.disk_usage(probe).free
    return TargetFacts(
        where=where, profile=profile.name, save_dir=str(save_dir),
        model_path=model_path, cache_type_k=profile.cache_type_k or "f16", cache_type_v=profile.cache_type_v or "f16",
        flash_attn=profile.flash_attn or "auto", swa_full=bool(profile.swa_full),
        ctx_checkpoints=32 if profile.ctx_checkpoints is None else profile.ctx_checkpoints,
        n_ctx_slot=slot_ctx(profile, Facts()), build=keys[0] if keys else "", build_keys=tuple(keys),
        state_version=_learnt_state_version(catalog, keys), behaviour=behaviour.value, free_bytes=free,
        names=tuple(r.name for r in catalog.list(profile.name)))


async def describe_target(catalog: Catalog, profile_name: str, *, where: str | None = None) -> TargetFacts:
    """The facts of ``profile_name`` on this machine for the move rules (also cleans up the
    leftovers of crashed moves into its folder). Raises MoveError for an unknown profile."""
    from dataclasses import replace

    from app.core.profile import ProfileError
    from app.sessions.park import model_identity
    from app.server.targets import load_profile

    try:
        profile = load_profile(profile_name)
    except ProfileError as e:
        raise MoveError(str(e)) from None
    facts = await asyncio.to_thread(_target_facts_sync, catalog, profile, where or f"profile '{profile_name}'")
    ident = await model_identity(facts.model_path, kind=False)
    facts = replace(facts, model_size=ident.size, model_sha256=ident.sha256, model_quick_id=ident.quick_id)
    if facts.n_ctx_slot is None:  # the profile sets no -c: its running server knows what a slot holds
        n_ctx = await running_slot_ctx(profile)
        if n_ctx is not None:
            facts = replace(facts, n_ctx_slot=n_ctx)
    return facts


#: how long a move waits for a running server's GET /slots (a server that does not run answers at once)
SLOTS_TIMEOUT_S = 5.0


def slots_ctx(slots: Any) -> int | None:
    """Tokens a slot holds by a ``GET /slots`` answer (``n_ctx`` per slot; the smallest), or None."""
    ns = [s["n_ctx"] for s in slots if isinstance(s, dict) and type(s.get("n_ctx")) is int and s["n_ctx"] > 0] \
        if isinstance(slots, list) else []
    return min(ns) if ns else None


async def running_slot_ctx(profile) -> int | None:
    """Tokens a slot of ``profile``'s server holds when that server runs here (its ``GET /slots``,
    through the server service's resolver: the server an earlier KV Valet left running, else the
    profile's URL); None when it does not run or does not say."""
    from app.server.targets import client_for
    from app.server.client import ServerError, ServerUnreachable

    try:
        async with client_for(profile) as client:
            return slots_ctx(await asyncio.wait_for(client.slots(), SLOTS_TIMEOUT_S))
    except (ServerError, ServerUnreachable, OSError, asyncio.TimeoutError, ValueError) as e:
        log.info("move: the server of profile %s does not say its slot context: %s", profile.name, e)
        return None


# --------------------------------------------------------------------------- the target's side


def clean_stale(save_dir: str | os.PathLike, *, now: float | None = None,
                max_age: float = STALE_AFTER_S) -> list[Path]:
    """Remove the temporary files of moves nobody has written for ``max_age`` seconds."""
    folder = Path(save_dir)
    if not folder.is_dir():
        return []
    now = time.time() if now is None else now
    removed = []
    for p in folder.glob(MOVE_PREFIX + "*"):
        if not _TEMP_RE.fullmatch(p.name):
            continue
        try:
            if p.lstat().st_mtime < now - max_age:
                p.unlink()
                removed.append(p)
        except FileNotFoundError:
            continue
    return removed


def discard(save_dir: str | os.PathLike, move_id: str) -> list[Path]:
    """Remove every temporary file of move ``move_id`` (an aborted or finished move)."""
    return discard_temps(save_dir, check_move_id(move_id))


def _free_state_name(catalog: Catalog, save_dir: Path, name: str) -> str:
    """``<slug>.bin`` (or ``<slug>-N.bin``) that no session, no file and no stray sidecar holds."""
    from app.sessions.park import slugify

    taken = {r.state_file for r in catalog.list() if Path(r.save_dir) == save_dir}
    base = slugify(name)
    for i in range(1, 1000):
        cand = f"{base}.bin" if i == 1 else f"{base}-{i}.bin"
        if cand in taken or any(os.path.lexists(save_dir / (cand + s)) for s in ("", *SIDECAR_SUFFIXES)):
            continue
        return cand
    raise MoveError(f"no free file name for '{name}' in {save_dir}")


_RESET = {"id": None, "last_restore_ms": None, "last_n_restored": None, "last_restore_at": None,
          "last_verdict": None, "last_verdict_reason": None, "time_saved_s": 0.0, "last_time_saved_s": None,
          "files_verified": ""}  # the sender's stamps: the first look here hashes (parked_files travels: same bytes)


def _verify_temps(save_dir: Path, move_id: str, files: list[dict], n_tokens: int) -> None:
    from app.server.statefile import StateFileError, read_state_header

    suffixes = [f.get("suffix", "") for f in files]
    if suffixes.count("") != 1 or any(s not in ("", *SIDECAR_SUFFIXES) for s in suffixes):
        raise MoveError("the move's manifest does not name one state file and its sidecars")
    for f in files:
        p = save_dir / temp_name(move_id, f["suffix"])
        if not p.is_file() or p.is_symlink():
            raise MoveError(f"the copied {'state file' if not f['suffix'] else 'sidecar'} is not there: {p.name}")
        size = p.stat().st_size
        if size != int(f["size"]):
            raise MoveError(f"{p.name} has {size:,} bytes, {int(f['size']):,} were sent")
        digest = sha256_of(p)
        if digest != f["sha256"]:
            raise MoveError(f"checksum mismatch: {p.name} arrived with SHA-256 {digest[:12]}…, "
                            f"{str(f['sha256'])[:12]}… was sent")
    try:
        header = read_state_header(save_dir / temp_name(move_id, ""))
    except StateFileError as e:
        raise MoveError(f"the copied state file is not usable: {e}") from None
    if n_tokens and header.token_count != n_tokens:
        raise MoveError(f"the copied state file holds {header.token_count:,} tokens, the session "
                        f"{n_tokens:,}: it changed during the move")


def adopt(catalog: Catalog, profile_name: str, save_dir: str | os.PathLike, manifest: dict[str, Any], *,
          model_path: str = "", receipt: bool = True) -> SessionRecord:
    """The target's half of a move: check the temporary files (size, SHA-256 read back from
    this disk, state header), then rename them into place and write the catalog row, under
    the catalog's files lock and a journal entry (:func:`recover_moves`); returns the stored
    row. On any failure the temporary files are removed and nothing is listed.
    ``model_path``: the target profile's model. ``receipt``: leave the move's receipt for a
    sender in another process that may lose this answer (:func:`settle_move`); a move within
    this process has the answer."""
    folder = Path(save_dir)
    move_id = check_move_id(manifest.get("move_id", ""))
    try:
        name = str(manifest["name"]).strip()
        files = list(manifest["files"])
        src = dict(manifest["record"])
        if not name:
            raise MoveError("a session name cannot be empty")
        _verify_temps(folder, move_id, files, int(src.get("n_tokens") or 0))
        from app.sessions.files_lock import files_locked

        with files_locked(catalog):
            for msg in recover_moves(Recovery(catalog, lock_held=True)):  # a commit a killed process left: its name, its files
                log.info("move %s: %s", move_id, msg)
            if catalog.get(profile_name, name) is not None:
                raise MoveError(f"profile '{profile_name}' already has a session named '{name}'")
            final = _free_state_name(catalog, folder, name)
            sidecar = next((f["suffix"] for f in files if f["suffix"]), None)
            known = {f.name for f in fields(SessionRecord)}
            values = {k: v for k, v in src.items() if k in known}
            values.update(_RESET)
            values.update(name=name, profile=profile_name, save_dir=str(folder), state_file=final,
                          sidecar_file=final + sidecar if sidecar else None,
                          model_path=model_path or values.get("model_path", ""),
                          notes=f"copied from {manifest.get('source') or src.get('profile', '?')}")
            rec = SessionRecord(**values)
            stored = _commit(catalog, folder, move_id, final, files, rec, receipt=receipt)
    finally:
        discard(folder, move_id)
    return stored


def _commit(catalog: Catalog, folder: Path, move_id: str, final: str, files: list[dict],
            rec: SessionRecord, *, receipt: bool = True) -> SessionRecord:
    """Rename the verified temporary files to ``final`` (+ suffix) and write ``rec``, under a
    journal entry written first (the files lock held by the caller)."""
    from app.sessions.journal import Journal, MoveInJournal, Owner

    journaled: dict[str, dict[str, Any]] = {}
    for f in files:
        tmp = folder / temp_name(move_id, f["suffix"])
        fileio.make_private(tmp)
        _fsync_file(tmp)  # an SFTP upload is not on the disk yet: the row must never outlive the bytes
        journaled[f["suffix"]] = {"size": int(f["size"]), "sha256": str(f["sha256"]), "ino": tmp.stat().st_ino}
    journal = Journal(catalog)
    jid = journal.begin(MoveInJournal(save_dir=str(folder), move_id=move_id, final=final, files=journaled,
                                      record=asdict(rec), owner=Owner.me()))
    placed: list[Path] = []
    try:
        for f in sorted(files, key=lambda f: f["suffix"] == ""):  # the sidecar first, the state file last
            dest = folder / (final + f["suffix"])
            os.replace(folder / temp_name(move_id, f["suffix"]), dest)
            placed.append(dest)
        fileio.fsync_dir(folder)
        stored = catalog.add_or_replace(rec)
    except BaseException:
        for p in placed:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        journal.end(jid)
        raise
    # listed: the receipt tells a sender that lost this answer (a cut connection) what became of its move
    if receipt:
        write_receipt(catalog, move_id, stored)
    journal.end(jid)
    return stored


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- endpoints


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
        """Settle move ``move_id`` here (:func:`settle_move`): its row when its commit listed the
        session, else None (rolled back: its files removed)."""
        folder = await self._save_dir()
        listed, messages = await asyncio.to_thread(settle_move, self.catalog, check_move_id(move_id), folder)
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
    ``kv-valet sessions receive`` (:func:`adopt`, the same code as here)."""

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
        """``receive --abort ID`` there (:func:`settle_move` on the host, on a new connection when the
        last one was cut): the row when the host had listed the session, else None (rolled back)."""
        data = await self.host.run_cli(["sessions", "receive", self.profile, "--abort", check_move_id(move_id),
                                        "--json"])
        committed = data.get("committed") if isinstance(data, dict) else None  # absent: an older kv-valet
        if not isinstance(committed, dict):
            return None
        known = {f.name for f in fields(SessionRecord)}
        return SessionRecord(**{k: v for k, v in committed.items() if k in known})

    async def delete(self, name: str) -> None:
        await self.host.run_cli(["sessions", "rm", name, "--profile", self.profile, "--json"])


# --------------------------------------------------------------------------- the move


def _files_problems(src: SourceSession, sent: list[dict[str, Any]] | None = None) -> list[str]:
    """The source's files against what its park wrote (app.core.park_files): their sizes before the copy,
    their SHA-256 as sent (``sent``) after it. Empty when they are the parked ones or none were recorded."""
    state = Path(src.record.state_file).name
    by_suffix = {f.suffix: f for f in src.files}
    found = {f["suffix"]: FoundFile(f["suffix"], state + f["suffix"], int(f["size"]), str(f["sha256"]))
             for f in sent} if sent is not None else \
        {sfx: FoundFile(sfx, state + sfx, f.size) for sfx, f in by_suffix.items()}
    return list(compare(ParkedFiles.from_json(src.record.parked_files), found, state_name=state).problems)


def _files_problem(text: str) -> Problem:
    return Problem("parked files", text, "move it anyway with --yes, or park the chat again")


async def preview(source: Endpoint, name: str, target: Endpoint, *, new_name: str | None = None,
                  force: bool = False) -> tuple[SourceSession, TargetFacts, Compatibility]:
    """The rules only, nothing copied: what a move of ``name`` to ``target`` would meet. A file that is
    not the one parked is a refusal (a warning with ``force``)."""
    src = await source.session(name)
    facts = await target.describe()
    compat = check_move(src.facts, facts, name=new_name or src.record.name)
    if source.where == target.where:
        compat = Compatibility((Problem("target", f"'{name}' is in {target.where} already",
                                        "choose another profile or host"), *compat.refusals), compat.warnings)
    problems = src.files_problems if src.files_problems is not None else _files_problems(src)
    foreign = tuple(_files_problem(p) for p in problems)
    if foreign:
        compat = Compatibility(compat.refusals, (*foreign, *compat.warnings)) if force else \
            Compatibility((*foreign, *compat.refusals), compat.warnings)
    return src, facts, compat


def _tell(on_progress: ProgressFn | None, done: int, total: int) -> None:
    if on_progress is not None:
        on_progress(done, total)  # may raise (MoveCancelled): the move stops and cleans up


async def move_session(source: Endpoint, name: str, target: Endpoint, *, keep_source: bool = False,
                       new_name: str | None = None, on_progress: ProgressFn | None = None,
                       chunk: int = CHUNK, on_committed: Callable[[MoveResult], None] | None = None,
                       force: bool = False) -> MoveResult:
    """Copy session ``name`` from ``source`` to ``target`` (as ``new_name``), then, unless
    ``keep_source``, delete it at the source. Raises MoveRefused before anything is
    copied, MoveError (or the callback's, or the task's cancellation) after cleaning up.

    A cancellation that arrives while the target commits waits for the commit's outcome
    (it renames and lists together, or not at all); ``on_committed(result)`` is called as
    soon as the target listed the session, before the source is deleted: a caller that is
    interrupted after that knows both copies exist."""
    src, facts, compat = await preview(source, name, target, new_name=new_name, force=force)
    if not compat.ok:
        raise MoveRefused(compat)
    move_id = secrets.token_hex(6)
    total, done = src.total_bytes, 0
    sent: list[dict[str, Any]] = []
    try:
        _tell(on_progress, 0, total)
        for f in src.files:
            writer = await target.open_temp(temp_name(move_id, f.suffix))
            h, n = hashlib.sha256(), 0
            try:
                async with contextlib.aclosing(source.read(f, chunk)) as chunks:
                    # the next chunk is read while this one is hashed (off the loop) and written:
                    # reads, writes and hashing overlap (tests/bench/bench_move.py)
                    upcoming = await anext(chunks, None)
                    while upcoming is not None:
                        data = upcoming
                        upcoming, _, _ = await _together(_next(chunks), asyncio.to_thread(h.update, data),
                                                         writer.write(data))
                        n += len(data)
                        done += len(data)
                        _tell(on_progress, done, total)
            finally:
                await writer.close()
            if n != f.size:
                raise MoveError(f"the {f.role} file of '{name}' changed size during the move ({f.size:,} → "
                                f"{n:,} bytes): parked again meanwhile? Try again")
            sent.append({"suffix": f.suffix, "size": n, "sha256": h.hexdigest()})
        # the bytes sent are the parked ones (hashed as they went): else nothing is listed (``force``: said)
        foreign = tuple(_files_problem(p) for p in _files_problems(src, sent))
        if foreign and not force:
            raise MoveRefused(Compatibility(foreign, ()))
        compat = Compatibility(compat.refusals, (*compat.warnings, *(p for p in foreign
                                                                      if p not in compat.warnings)))
        manifest = {"move_id": move_id, "name": new_name or src.record.name, "source": source.where,
                    "record": asdict(src.record), "files": sent}
    except BaseException as exc:
        await _abort(target, move_id)
        if isinstance(exc, OSError):
            raise MoveError(f"the copy to {target.where} failed: {exc.strerror or exc} (the source is kept; "
                            "nothing was added there)") from None
        raise
    warnings = [str(p) for p in compat.warnings]
    cancelled: BaseException | None = None
    commit = asyncio.create_task(target.commit(manifest))  # awaited below, even when cancelled
    try:
        try:
            stored = await asyncio.shield(commit)
        except asyncio.CancelledError as e:
            cancelled = e
            stored = await commit  # its outcome decides what the move did; the cancellation goes on below
    except BaseException as exc:  # why: the commit failed or its answer was lost: _settle asks, re-raises unless listed
        stored = await _settle(target, move_id, exc, name, source.where)
        warnings.append(f"the answer of the commit at {target.where} was lost ({_why(exc)}); asked again, "
                        f"{target.where} had listed '{stored.name}'")
        if cancelled is None and isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt)):
            cancelled = exc
    result = MoveResult(stored, source.where, target.where, False, done, warnings)
    _committed(on_committed, result)
    if cancelled is not None:
        raise cancelled
    if not keep_source:
        try:
            await source.delete(src.record.name)
            result.moved = True
        except Exception as e:  # report: the copy stands; the source is kept, and the result says why (logged)
            log.warning("move of %r: copied to %s but the source could not be deleted", name, target.where,
                        exc_info=True)
            result.source_kept = f"copied, but the source could not be deleted: {e}"
    return result


def _committed(on_committed: Callable[[MoveResult], None] | None, result: MoveResult) -> None:
    if on_committed is None:
        return
    try:
        on_committed(result)
    except Exception:  # report: a broken display must not undo a committed move (logged)
        log.exception("move: the on_committed callback failed")


async def _next(chunks: AsyncIterator[bytes]) -> bytes | None:
    return await anext(chunks, None)


async def _together(*coros) -> list:
    """Run ``coros`` at once and return their results; the first failure (or a cancellation)
    cancels the others, waits for them, and is raised as it is."""
    tasks = [asyncio.create_task(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _abort(target: Endpoint, move_id: str) -> None:
    try:
        listed = await asyncio.shield(target.abort(move_id))
    except Exception:  # report: the move's own error goes on; a leftover is cleaned by the next move (logged)
        log.warning("move %s: could not remove the temporary files at %s", move_id, target.where, exc_info=True)
        return
    if listed is not None:  # cannot be: no commit was asked for (logged)
        log.error("move %s: %s listed '%s' before any commit", move_id, target.where, listed.name)


def _why(exc: BaseException) -> str:
    if isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt)):
        return "interrupted"
    return str(exc) or type(exc).__name__


async def _settle(target: Endpoint, move_id: str, exc: BaseException, name: str, source: str) -> SessionRecord:
    """The commit of ``move_id`` failed or its answer was lost: ask the target (again, on a new
    connection for a host) what became of it. Returns the row it listed (the caller goes on as
    after a commit: the source is deleted), or raises: the target rolled it back (the source is
    kept), or could not be asked (both copies may exist: the message says how to tell)."""
    try:
        listed = await asyncio.shield(target.abort(move_id))
    except Exception as e:  # report: the outcome is unknown; the move fails and says so (logged)
        log.warning("move %s: cannot ask %s what became of the commit", move_id, target.where, exc_info=True)
        raise MoveError(f"the commit at {target.where} was cut ({_why(exc)}) and {target.where} could not be asked "
                        f"what became of it ({e}): '{name}' is kept at {source}; if {target.where} lists it "
                        "too, the commit finished there: delete one of the two copies") from None
    if listed is not None:
        return listed
    if isinstance(exc, (MoveError, asyncio.CancelledError, KeyboardInterrupt)):
        raise exc
    raise MoveError(f"the commit at {target.where} failed ({_why(exc)}); {target.where} rolled it back: "
                    f"'{name}' is kept at {source}, nothing was added there") from None
