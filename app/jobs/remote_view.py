"""What the window shows and does for a remote host's server (issue #20), Qt-free.

The window's faces (app.ui.host_dialog, app.ui.remote_view, app.ui.session_move) only paint
what these decide:

* :func:`check_host` — a host just added: connect (its key checked against known_hosts),
  log in, run its ``kv-valet --version`` and list its profiles; the outcome in one sentence,
  a refusal with its remedy (app.remote.host.RemoteError's message).
* :func:`session_records` / :func:`slot_rows_of` — the host's ``sessions list --json`` and
  ``status --json`` as the Sessions tab's records and the slot chooser's rows.
* :func:`park` / :func:`resume` — through the host's own ``kv-valet park|resume``.
* :func:`restore_and_judge` — after a move, the session restored at the target and judged by a
  first query: ``SessionService.check`` here, ``kv-valet check --json`` on a host.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from app.monitor.slots import SlotRow
from app.store.catalog import SessionRecord

log = logging.getLogger(__name__)

#: exit status of ``kv-valet check`` when the resume bought nothing (app.cli.errors.Exit.DISCARDED)
CHECK_DISCARDED = 3
#: what the Log tab says for a remote server: its host's kv-valet has no command that prints a log
NO_REMOTE_LOG = ("The log of a server on {host} is not shown here: its kv-valet has no command that prints it. "
                 "On {host}: journalctl --user -u kv-valet-{profile} (systemd), or the file `kv-valet status "
                 "{profile}` names.")

_RECORD_FIELDS = {f.name for f in dataclasses.fields(SessionRecord)}
_SLOT_FIELDS = [f.name for f in dataclasses.fields(SlotRow)]


async def check_host(host) -> tuple[bool, str]:
    """Connect to ``host`` (app.remote.host.RemoteHost), run its kv-valet and list its
    profiles: (ok, what to tell the user). A refused key or login is said with its remedy."""
    from app.remote.host import RemoteError

    try:
        version = (await host.run_cli_text(["--version"], timeout=60)).strip()
        profiles = await host.profiles()
    except RemoteError as e:
        return False, str(e)
    names = ", ".join(str(p.get("name", "?")) for p in profiles) or "none yet"
    return True, (f"{host.name}: host key verified, logged in, {version or 'kv-valet'}; "
                  f"{len(profiles)} profile(s): {names}")


def session_records(entries: list[dict]) -> list[SessionRecord]:
    """A host's ``kv-valet sessions list --json`` as catalog records (most recent first, as listed)."""
    out = []
    for e in entries or ():
        try:
            out.append(SessionRecord(**{k: v for k, v in e.items() if k in _RECORD_FIELDS}))
        except TypeError as err:  # a field this version needs is missing: an older kv-valet there
            log.warning("a session listed by the host could not be read: %s (%s)", e.get("name"), err)
    return out


def slot_rows_of(status: dict) -> list[SlotRow]:
    """The slots in a host's ``kv-valet status --json`` as the slot chooser's rows."""
    rows = []
    for s in status.get("slots") or ():
        if isinstance(s, dict):
            rows.append(SlotRow(**{k: s.get(k) for k in _SLOT_FIELDS}))
    return rows


def status_line(host: str, profile: str, status: dict) -> str:
    """One line of what a host's server does now: health, slots in use, VRAM per GPU."""
    health = str(status.get("health") or "not running")
    slots = [s for s in status.get("slots") or () if isinstance(s, dict)]
    held = sum(1 for s in slots if s.get("busy") or (s.get("tokens_held") or 0) > 0)
    parts = [f"'{profile}' on {host}: {'Ready' if health == 'ok' else health}"]
    if slots:
        parts.append(f"{held} / {len(slots)} slots in use")
    gpus = (status.get("gpu") or {}).get("gpus") or ()
    for g in gpus:
        used, total = g.get("mem_used"), g.get("mem_total")
        if used is not None and total:
            parts.append(f"GPU{g.get('index', '?')} {used / 2**30:.1f}/{total / 2**30:.1f} GiB")
    if not gpus and (status.get("gpu") or {}).get("message"):
        parts.append(str(status["gpu"]["message"]))
    return " · ".join(parts)


async def park(host, profile: str, slot: int | None, name: str | None) -> str:
    """Park ``slot`` of the host's ``profile`` server through its own ``kv-valet park``: what it said."""
    argv = ["park", profile] + (["--slot", str(slot)] if slot is not None else []) + (["--name", name] if name else [])
    return (await host.run_cli_text(argv, timeout=600)).strip()


async def resume(host, profile: str, name: str, slot: int | None) -> str:
    """Resume ``name`` into the host's ``profile`` server through its own ``kv-valet resume``."""
    argv = ["resume", profile, name, "--yes"] + (["--slot", str(slot)] if slot is not None else [])
    return (await host.run_cli_text(argv, timeout=600)).strip()


async def restore_and_judge(endpoint, name: str, slot: int | None = None, *, server_service=None,
                            target_id: str | None = None) -> dict[str, Any]:
    """Restore ``name`` at ``endpoint`` (app.jobs.move: a profile here, or a host's) and judge a
    first query: ``{"slot_id", "n_restored", "verdict": {"kind", "reason"}}``. Here, through the
    running server's session service (``server_service.sessions(target_id)``)."""
    from app.jobs.move import LocalEndpoint

    if isinstance(endpoint, LocalEndpoint):
        from app.jobs.check import report_dict

        svc = await server_service.sessions(target_id)
        d = report_dict(await svc.check(name, slot, force=True))
    else:
        argv = ["check", endpoint.profile, name, "--yes", "--json"] + (["--slot", str(slot)] if slot is not None
                                                                       else [])
        d = await endpoint.host.run_cli(argv, timeout=600, ok_exits=(0, CHECK_DISCARDED))
    return {"slot_id": d.get("slot_id"), "n_restored": d.get("n_restored"), "verdict": d.get("verdict") or {}}


def verdict_text(restored: dict[str, Any]) -> str:
    """The restore's outcome in one sentence."""
    v = restored.get("verdict") or {}
    n = restored.get("n_restored")
    return (f"Restored into slot {restored.get('slot_id')} ({n:,} tokens); first query: {v.get('kind', '?')}"
            + (f" — {v['reason']}" if v.get("reason") else "") + ".") if n is not None else \
        f"Restore: {v.get('kind', '?')} {v.get('reason', '')}".strip()
