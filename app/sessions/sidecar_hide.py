"""The A/B's hidden sidecar (app.sessions.ab): ``<state>.ckpt`` moved aside to
``<state>.ckpt.kvv-hidden`` for the arm without it, journaled in the catalog *before* the rename
and always put back; :func:`recover_hidden_sidecars` puts back what a crash left hidden."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from app.sessions.check_report import CheckError
from app.sessions.journal import HideJournal, Journal, JournalKind, Owner, Recovery, recovers, replay
from app.store.catalog import Catalog

log = logging.getLogger(__name__)

HIDDEN_SUFFIX = ".kvv-hidden"


def _hidden_path(sidecar: Path) -> Path:
    return sidecar.with_name(sidecar.name + HIDDEN_SUFFIX)


def hide_sidecar(catalog: Catalog, sidecar: Path) -> tuple[int, Path]:
    """Move ``sidecar`` aside, journaled first. Returns (journal id, hidden path)."""
    hidden = _hidden_path(sidecar)
    if hidden.exists():
        running = [e for e in Journal(catalog).in_flight(JournalKind.AB_HIDE)
                   if isinstance(e.entry, HideJournal) and e.entry.hidden == str(hidden)]
        if running:
            raise CheckError(f"another A/B check is running on this session ({hidden.name} is hidden): "
                             "wait until it has finished")
        raise CheckError(f"{hidden.name} already exists: a previous A/B did not finish; "
                         "restart the app to put it back")
    journal = Journal(catalog)
    jid = journal.begin(HideJournal(str(sidecar), str(hidden), sidecar.stat().st_size, Owner.me()))
    try:
        os.rename(sidecar, hidden)
    except OSError:
        journal.end(jid)
        raise
    return jid, hidden


def _put_back(sidecar: Path, hidden: Path) -> str | None:
    """Rename ``hidden`` back to ``sidecar``; a message when it could not be done."""
    if not hidden.exists():
        return None if sidecar.exists() else f"{sidecar.name} is gone (neither it nor {hidden.name} exists)"
    if sidecar.exists():
        return (f"{sidecar.name} was written again while hidden; the older copy stays as {hidden.name}")
    os.rename(hidden, sidecar)
    return None


def unhide_sidecar(catalog: Catalog, jid: int, sidecar: Path, hidden: Path) -> None:
    msg = _put_back(sidecar, hidden)
    if msg:
        log.warning(msg)
    Journal(catalog).end(jid)


@recovers(JournalKind.AB_HIDE)
def recover_hidden_sidecars(run: Recovery) -> list[str]:
    """Put back every sidecar an A/B left hidden (the app or the server died mid-A/B). A/B
    checks still running, here or in another process, are left alone. Run at start
    (:func:`app.sessions.journal.recover`) and before an A/B."""
    assert run.catalog is not None

    def handle(e: HideJournal) -> str | None:
        sidecar, hidden = Path(e.sidecar), Path(e.hidden)
        existed = hidden.exists()
        msg = _put_back(sidecar, hidden)
        if msg:
            log.warning(msg)
            return None
        return f"put back the sidecar {sidecar} that an interrupted A/B check had hidden" if existed else None

    return replay(run.catalog, JournalKind.AB_HIDE, handle, lambda e: f"the sidecar {e.sidecar} an A/B check hid")
