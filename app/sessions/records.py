"""Catalog-level session management: list, rename, delete, disk usage, clean-up.

A rename changes the catalog name only: the state file keeps its name, because
the server addresses it by file name and a rename of the file would race a
restore in flight. A delete removes the catalog row first (so a crash cannot
leave a row pointing at missing files), then the state file and its sidecars.

"Older than N days" means *parked* more than N days ago: ``updated_at``, the
time of the last park (or rename) of that name, which is also the order the
list shows. A chat parked again every evening is not old however long ago it
was first parked.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from app.core.units import fmt_bytes
from app.sessions.park_commit import SIDECAR_SUFFIXES
from app.store.catalog import Catalog, CatalogError, SessionRecord

DAY_S = 86400.0


def list_sessions(catalog: Catalog, profile: str | None = None, *, verify_hash: bool = False) -> list[SessionRecord]:
    """The sessions, each with its sidecar re-checked on disk (app.sessions.sidecar_check)."""
    from app.sessions.sidecar_check import recheck_all

    records = [r for r in catalog.list(profile) if not leaves_its_folder(r)]
    return recheck_all(catalog, records, verify_hash=verify_hash)


def leaves_its_folder(rec: SessionRecord) -> bool:
    """The state file is a symbolic link out of its save folder (put there after the park):
    not a session of ours, never followed: not listed (and a delete removes the link only)."""
    state = rec.state_path
    if not state.is_symlink():
        return False
    try:
        return Path(rec.save_dir).resolve() not in state.resolve().parents
    except (OSError, RuntimeError):  # a loop of links
        return True


class AmbiguousName(CatalogError):
    """Several profiles have a session of this name and none was named: the caller says how to
    name one (the CLI: its ``--profile``)."""

    def __init__(self, name: str, profiles: list[str]):
        self.name, self.profiles = name, sorted(profiles)
        super().__init__(f"several sessions are named '{name}' (profiles: {', '.join(self.profiles)})")


def _one(catalog: Catalog, name: str, profile: str | None) -> SessionRecord:
    if profile is not None:
        rec = catalog.get(profile, name)
        if rec is None:
            raise CatalogError(f"no session named '{name}' in profile '{profile}'")
        return rec
    matches = [r for r in catalog.list() if r.name == name]
    if not matches:
        raise CatalogError(f"no session named '{name}'")
    if len(matches) > 1:
        raise AmbiguousName(name, [r.profile for r in matches])
    return matches[0]


def get_session(catalog: Catalog, name: str, profile: str | None = None, *,
                verify_hash: bool = False) -> SessionRecord:
    from app.sessions.sidecar_check import recheck

    return recheck(catalog, _one(catalog, name, profile), verify_hash=verify_hash)


def rename_session(catalog: Catalog, old: str, new: str, profile: str | None = None) -> SessionRecord:
    new = new.strip()
    if not new:
        raise CatalogError("a session name cannot be empty")
    rec = _one(catalog, old, profile)
    return catalog.rename(rec.profile, old, new)


def delete_session(catalog: Catalog, name: str, profile: str | None = None) -> list[Path]:
    """Delete the session's row, state file and sidecars; returns the files removed.

    Under the catalog's files lock (app.sessions.files_lock): another process re-parking this
    session at the same moment must not get its new file unlinked after its row is written.
    """
    from app.sessions.files_lock import files_locked

    with files_locked(catalog, timeout=5.0):  # the window waits on its GUI thread: not long
        rec = _one(catalog, name, profile)
        catalog.delete(rec.profile, rec.name)
        state = rec.state_path
        # Another session may share the file only if the catalog says so: keep it then.
        if any(r.state_path == state for r in catalog.list()):
            return []
        return _remove_files(state)


def _remove_files(state: Path) -> list[Path]:
    """Unlink a state file and its sidecars (after its catalog row is gone); the files removed."""
    removed = []
    for p in [state] + [Path(str(state) + s) for s in SIDECAR_SUFFIXES]:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            removed.append(p)
    return removed


def _state_key(rec: SessionRecord) -> str:
    return os.path.normpath(os.path.join(rec.save_dir, rec.state_file))


# -- disk usage -----------------------------------------------------------------------------------------


@dataclass
class Usage:
    """What a set of sessions holds on disk. A state file two sessions share counts once."""

    sessions: int = 0
    state_bytes: int = 0
    sidecar_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.sidecar_bytes


def total_usage(usages) -> Usage:
    """The sum of several :class:`Usage` (e.g. the values of :func:`disk_usage`)."""
    t = Usage()
    for u in usages:
        t.sessions += u.sessions
        t.state_bytes += u.state_bytes
        t.sidecar_bytes += u.sidecar_bytes
    return t


def usage_of(records: list[SessionRecord]) -> Usage:
    """Sessions and bytes of ``records`` (sizes as the catalog has them; a listing re-checks sidecars)."""
    u = Usage()
    seen: set[str] = set()
    for r in records:
        u.sessions += 1
        key = _state_key(r)
        if key in seen:
            continue
        seen.add(key)
        u.state_bytes += r.state_size
        u.sidecar_bytes += r.sidecar_size
    return u


def disk_usage(catalog: Catalog, profile: str | None = None, *,
               records: list[SessionRecord] | None = None) -> dict[str, Usage]:
    """Disk usage per profile, profiles in name order.

    ``records``: sessions already listed (the window passes what it shows);
    by default the catalog's, each sidecar re-checked first (its size may have
    changed since the park).
    """
    if records is None:
        records = list_sessions(catalog, profile)
    by_profile: dict[str, list[SessionRecord]] = {}
    for r in records:
        if profile is None or r.profile == profile:
            by_profile.setdefault(r.profile, []).append(r)
    return {p: usage_of(by_profile[p]) for p in sorted(by_profile)}


def describe_usage(profile: str | None, u: Usage) -> str:
    """``profile X: N sessions, Y GiB (state files Z, sidecars W)``; ``total: ...`` for profile None."""
    who = "total" if profile is None else f"profile {profile}"
    return (f"{who}: {u.sessions:,} session{'' if u.sessions == 1 else 's'}, {fmt_bytes(u.total_bytes)} "
            f"(state files {fmt_bytes(u.state_bytes)}, sidecars {fmt_bytes(u.sidecar_bytes)})")


# -- delete older than ----------------------------------------------------------------------------------


def cutoff(days: float, now: float | None = None) -> float:
    """The time ``days`` days before ``now``: sessions parked before it are "older"."""
    if days < 0:
        raise ValueError(f"the number of days cannot be negative ({days:g})")
    return (time.time() if now is None else now) - days * DAY_S


def older_than(catalog: Catalog, days: float, profile: str | None = None, *,
               now: float | None = None) -> list[SessionRecord]:
    """Sessions last parked more than ``days`` days before ``now`` (all profiles when None), oldest first."""
    limit = cutoff(days, now)
    return sorted((r for r in catalog.list(profile) if r.updated_at < limit), key=lambda r: (r.updated_at, r.id))


def delete_older_than(catalog: Catalog, days: float, profile: str | None = None, *,
                      now: float | None = None) -> list[SessionRecord]:
    """Delete every session last parked more than ``days`` days before ``now``; returns those removed.

    Pass the ``now`` of the :func:`older_than` the user confirmed: the same
    cutoff then deletes those sessions and no other (one parked again since
    then is newer and stays). Each goes as :func:`delete_session` does it: the
    catalog row first, then its files, unless another session still uses the
    state file.
    """
    doomed = older_than(catalog, days, profile, now=now)
    if not doomed:
        return []
    from app.sessions.files_lock import files_locked

    removed = []
    with files_locked(catalog):  # no other process's park commits in the middle (app.sessions.files_lock)
        users = Counter(_state_key(r) for r in catalog.list())
        for rec in doomed:
            current = catalog.get(rec.profile, rec.name)
            if current is None or current.id != rec.id or current.updated_at != rec.updated_at:
                continue  # deleted or parked again meanwhile: not the session that was judged old
            if not catalog.delete(rec.profile, rec.name):
                continue
            removed.append(rec)
            key = _state_key(rec)
            users[key] -= 1
            if users[key] <= 0:
                _remove_files(rec.state_path)
    return removed
