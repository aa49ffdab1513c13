"""Catalog-level session management: list, rename, delete.

A rename changes the catalog name only: the state file keeps its name, because
the server addresses it by file name and a rename of the file would race a
restore in flight. A delete removes the catalog row first (so a crash cannot
leave a row pointing at missing files), then the state file and its sidecars.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from app.jobs.park import SIDECAR_SUFFIXES
from app.store.catalog import Catalog, CatalogError, SessionRecord


def list_sessions(catalog: Catalog, profile: str | None = None, *, verify_hash: bool = False) -> list[SessionRecord]:
    """The sessions, each with its sidecar re-checked on disk (app.jobs.sidecar_check)."""
    from app.jobs.sidecar_check import recheck_all

    return recheck_all(catalog, catalog.list(profile), verify_hash=verify_hash)


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
        raise CatalogError(f"several sessions are named '{name}' (profiles: "
                           f"{', '.join(sorted(r.profile for r in matches))}): pass --profile")
    return matches[0]


def get_session(catalog: Catalog, name: str, profile: str | None = None, *,
                verify_hash: bool = False) -> SessionRecord:
    from app.jobs.sidecar_check import recheck

    return recheck(catalog, _one(catalog, name, profile), verify_hash=verify_hash)


def rename_session(catalog: Catalog, old: str, new: str, profile: str | None = None) -> SessionRecord:
    new = new.strip()
    if not new:
        raise CatalogError("a session name cannot be empty")
    rec = _one(catalog, old, profile)
    return catalog.rename(rec.profile, old, new)


def delete_session(catalog: Catalog, name: str, profile: str | None = None) -> list[Path]:
    """Delete the session's row, state file and sidecars; returns the files removed."""
    rec = _one(catalog, name, profile)
    catalog.delete(rec.profile, rec.name)
    removed = []
    state = rec.state_path
    # Another session may share the file only if the catalog says so: keep it then.
    if any(r.state_path == state for r in catalog.list()):
        return removed
    for p in [state] + [Path(str(state) + s) for s in SIDECAR_SUFFIXES]:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            removed.append(p)
    return removed
