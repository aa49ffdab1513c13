"""One journal engine for operations that must survive a crash: parks, A/B hides, moves in, proxy leases.

Both a park (save to a temporary name, verify, swap files in) and an A/B check
(move the sidecar aside for the second arm) leave the disk in an unusual state
while they run. Each writes a journal entry (``catalog.pending``) *before* it
touches a file, and removes it when the files are back in order. At start the
app and every CLI command finish or undo the entries whose owner is gone.

An entry names its **owner** (pid + process start time, so a reused pid is never
taken for the owner) and this process keeps the ids of the entries it is running
(**in flight**): recovery never touches an operation that is still running, in
this process (a second A/B started while the first one's sidecar is hidden) or
in another one (a CLI park while the window is open).

**Recovery** is one loop, :func:`recover`: every kind registers the function that finishes or
undoes its interrupted operations (:func:`recovers`, in the kind's own module: parks in
app.sessions.park_commit, A/B hides in app.sessions.sidecar_hide, moves in in app.sessions.move_in, the proxy's
slot leases in app.proxy.leases, whose journal lives in the conversation store); a caller names
the kinds it recovers (the session service all of the catalog's, a move's receiving side its
move-in commits, the proxy its leases). A kind that fails is logged and reported, and the others
still run. The catalog's kinds share the per-entry walk, :func:`replay` (a malformed entry
dropped, a running one left alone, the entry ended once its handler did its work).
"""

from __future__ import annotations

import enum
import logging
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from app.sessions.files_lock import files_locked
from app.store.catalog import Catalog

log = logging.getLogger(__name__)


class JournalKind(enum.StrEnum):
    PARK = "park"
    AB_HIDE = "ab-hide"
    MOVE_IN = "move-in"  # a moved/copied session's files renamed into place, its row not yet written
    PROXY_LEASE = "proxy-lease"  # the proxy's slot leases (their journal: the conversation store's)


#: The kinds journaled in the catalog's pending table, in the order a start recovers them.
CATALOG_KINDS = (JournalKind.AB_HIDE, JournalKind.MOVE_IN, JournalKind.PARK)


class ParkPhase(enum.StrEnum):
    SAVING = "saving"  # the server is writing the temporary state file
    COMMIT = "commit"  # verified: the files are being swapped into place


@dataclass(frozen=True)
class Owner:
    pid: int
    started: float  # psutil create_time of the owner process; 0.0 when unknown

    @classmethod
    def me(cls) -> "Owner":
        try:
            import psutil

            return cls(os.getpid(), psutil.Process().create_time())
        except Exception:  # report: start time unknown (0.0): another process could take this owner for dead
            log.warning("journal: cannot read the start time of this process (pid %d)", os.getpid(), exc_info=True)
            return cls(os.getpid(), 0.0)

    def is_me(self) -> bool:
        return self.pid == os.getpid()

    def alive_elsewhere(self) -> bool:
        """True when the owner is another process that is still running."""
        if not self.pid or self.is_me():
            return False
        try:
            import psutil

            proc = psutil.Process(self.pid)
            # A zombie is dead: SIGKILLed, not yet reaped by its parent (a window that ran a CLI,
            # a test); its flocks are gone already, so another process may be at its journal now.
            return abs(proc.create_time() - self.started) < 0.05 and proc.status() != psutil.STATUS_ZOMBIE
        except Exception:  # why: no such process, or one psutil cannot read: not a live owner of the journal
            return False


@dataclass
class ParkJournal:
    save_dir: str
    tmp: str  # temporary state file name (the server saves here)
    final: str  # the session's state file name
    backup: str  # where the previous state file waits until the commit is done
    name: str = ""
    profile: str = ""
    owner: Owner = Owner(0, 0.0)
    phase: ParkPhase = ParkPhase.SAVING
    ino: int | None = None  # inode of the new state file (tells "moved" from "not moved")
    record: dict[str, Any] | None = None  # the SessionRecord to write at commit

    @property
    def paths(self) -> tuple[Path, Path, Path, Path]:
        d = Path(self.save_dir)
        return d, d / self.tmp, d / self.final, d / self.backup


@dataclass
class HideJournal:
    sidecar: str
    hidden: str
    size: int
    owner: Owner


@dataclass
class MoveInJournal:
    """The commit of a move into ``save_dir`` (app.move.receive.adopt): the verified temporary
    files (``kvv-move-<move_id>.<role>.part``) are renamed to ``final`` + suffix, then the row
    ``record`` is written. ``files``: suffix ("" for the state file) -> {"size", "sha256",
    "ino"} of each verified file (a rename keeps the inode)."""

    save_dir: str
    move_id: str
    final: str
    files: dict[str, dict[str, Any]]
    record: dict[str, Any]
    owner: Owner = Owner(0, 0.0)


Entry = ParkJournal | HideJournal | MoveInJournal
_KIND_OF = {ParkJournal: JournalKind.PARK, HideJournal: JournalKind.AB_HIDE, MoveInJournal: JournalKind.MOVE_IN}

# Journal ids of operations running in this process.
_IN_FLIGHT: set[int] = set()


def _payload(entry: Entry) -> dict[str, Any]:
    d = asdict(entry)
    owner = d.pop("owner")
    d["pid"], d["pid_ctime"] = owner["pid"], owner["started"]
    return d


def _decode(kind: str, payload: dict[str, Any]) -> Entry:
    """The typed entry; raises KeyError/TypeError/ValueError on a malformed payload."""
    p = dict(payload)
    owner = Owner(int(p.pop("pid", 0) or 0), float(p.pop("pid_ctime", 0.0) or 0.0))
    if kind == JournalKind.PARK:
        p["phase"] = ParkPhase(p.get("phase", ParkPhase.SAVING))
        known = {f for f in ParkJournal.__dataclass_fields__} - {"owner"}
        return ParkJournal(owner=owner, **{k: v for k, v in p.items() if k in known})
    if kind == JournalKind.AB_HIDE:
        return HideJournal(sidecar=str(p["sidecar"]), hidden=str(p["hidden"]), size=int(p.get("size", 0)),
                           owner=owner)
    if kind == JournalKind.MOVE_IN:
        return MoveInJournal(save_dir=str(p["save_dir"]), move_id=str(p["move_id"]), final=str(p["final"]),
                             files={str(k): dict(v) for k, v in dict(p["files"]).items()},
                             record=dict(p["record"]), owner=owner)
    raise ValueError(f"unknown journal kind {kind!r}")


@dataclass
class JournalEntry:
    id: int
    kind: JournalKind
    entry: Entry | None  # None: malformed (recovery drops it)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    def active(self) -> bool:
        """Running now, here or in another live process: recovery must leave it alone."""
        if self.id in _IN_FLIGHT:
            return True
        return self.entry is not None and self.entry.owner.alive_elsewhere()


class Journal:
    """The catalog's pending table, typed."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog

    def begin(self, entry: Entry) -> int:
        kind = _KIND_OF[type(entry)]
        jid = self.catalog.add_pending(str(kind), _payload(entry))
        _IN_FLIGHT.add(jid)
        return jid

    def end(self, jid: int) -> None:
        """The operation is over (done or undone): forget the entry."""
        try:
            self.catalog.remove_pending(jid)
        finally:
            _IN_FLIGHT.discard(jid)

    def entries(self, kind: JournalKind) -> list[JournalEntry]:
        out = []
        for jid, k, payload, _at in self.catalog.list_pending():
            if k != kind:
                continue
            try:
                entry: Entry | None = _decode(k, payload)
            except (KeyError, TypeError, ValueError):
                entry = None
            out.append(JournalEntry(jid, JournalKind(k), entry, payload))
        return out

    def in_flight(self, kind: JournalKind) -> list[JournalEntry]:
        return [e for e in self.entries(kind) if e.active()]


# --------------------------------------------------------------------------- recovery


@dataclass(frozen=True)
class Recovery:
    """What one recovery run is given; each kind reads what it needs.

    ``catalog``: the catalog whose pending table holds the entries (the catalog's kinds).
    ``save_dirs``: the folders a park recovery sweeps for leftover temporary files.
    ``roll_back``: the id of a move its sender gave up on: rolled back whatever its state.
    ``lock_held``: the caller holds the catalog's files lock already (else the run takes it).
    ``subject``/``same_process``: the object whose journal is read (the proxy's slot leases),
    and whether the server outlived the crash (it kept its slots)."""

    catalog: Catalog | None = None
    save_dirs: tuple[Path, ...] = ()
    roll_back: str | None = None
    lock_held: bool = False
    subject: Any = None
    same_process: bool = False


RecoverFn = Callable[[Recovery], list[str]]
_RECOVERERS: dict[JournalKind, RecoverFn] = {}


@dataclass(frozen=True)
class Recoverer:
    """A kind's registered recovery. Calling it runs it through :func:`recover` (the files lock,
    a failure logged and reported): ``recover_moves(Recovery(catalog))``."""

    kind: JournalKind
    fn: RecoverFn

    def __call__(self, run: Recovery) -> list[str]:
        return recover([self.kind], run)


def recovers(kind: JournalKind) -> Callable[[RecoverFn], Recoverer]:
    """Register the decorated function as the recovery of ``kind`` (one per kind)."""
    def register(fn: RecoverFn) -> Recoverer:
        _RECOVERERS[kind] = fn
        return Recoverer(kind, fn)
    return register


def recover(kinds: Sequence[JournalKind], run: Recovery) -> list[str]:
    """The one recovery loop: run the recovery of each of ``kinds``, in that order, once; returns
    what was done, for the user. A kind that raises is logged and reported in the returned
    messages, and the others still run. A kind nobody registered (its module not imported) is a
    programming error: LookupError. The catalog's kinds run under its files lock (two processes
    starting at once never both finish one operation)."""
    missing = [str(k) for k in kinds if k not in _RECOVERERS]
    if missing:
        raise LookupError(f"no recovery registered for {', '.join(missing)}: import the module of that kind")
    if run.catalog is not None and not run.lock_held and any(k in CATALOG_KINDS for k in kinds):
        with files_locked(run.catalog):
            return recover(kinds, replace(run, lock_held=True))
    messages: list[str] = []
    for kind in kinds:
        try:
            messages += _RECOVERERS[kind](run)
        except Exception as exc:  # report: one kind failing must not keep the others from recovering
            log.exception("journal: the recovery of the %s operations failed", kind)
            messages.append(f"could not recover the interrupted {kind} operations: {exc}")
    return messages


def replay(catalog: Catalog, kind: JournalKind, handle: Callable[[Any], str | None],
           describe: Callable[[Any], str]) -> list[str]:
    """The walk over the catalog's entries of ``kind`` every catalog kind shares: a malformed
    entry is dropped, an operation still running (here or in another live process) left alone;
    ``handle(entry)`` finishes or undoes one (its message, or None) and the entry is ended; an
    OSError leaves the entry for the next start and says so (``describe(entry)`` names it)."""
    journal = Journal(catalog)
    messages: list[str] = []
    for e in journal.entries(kind):
        if e.entry is None:
            journal.end(e.id)
            messages.append(f"dropped a malformed {kind} journal entry #{e.id}")
            continue
        if e.active():
            continue
        try:
            msg = handle(e.entry)
        except OSError as exc:
            messages.append(f"could not recover {describe(e.entry)}: {exc}")
            continue
        if msg:
            messages.append(msg)
        journal.end(e.id)
    return messages
