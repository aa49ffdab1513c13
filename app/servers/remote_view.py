"""What the window shows and does for a remote host's server (issue #20), Qt-free.

The window's faces (app.ui.dialogs.host, app.ui.servers.remote_view, app.ui.sessions.move) only paint
what these decide:

* :func:`check_host` — a host just added: connect (its key checked against known_hosts),
  log in, run its ``kv-valet --version`` and list its profiles; the outcome in one sentence,
  a refusal with its remedy (app.remote.host.RemoteError's message).
* :func:`session_records` / :func:`slot_rows_of` — the host's ``sessions list --json`` and
  ``status --json`` as the Sessions tab's records and the slot chooser's rows;
  :func:`snapshot_of` — that status as the Monitor tab's snapshot; :func:`remote_state` /
  :func:`state_text` — the status bar's "Ready on gpu-box".
* :func:`park` / :func:`resume` — through the host's own ``kv-valet park|resume --json``.
* :func:`restore_and_judge` — after a move, the session restored at the target and judged by a
  first query: ``SessionService.check`` here, ``kv-valet check --json`` on a host.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from app.core.states import Health, ServerState, health_text
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
    health, why = Health.parse(status.get("health"))
    slots = [s for s in status.get("slots") or () if isinstance(s, dict)]
    held = sum(1 for s in slots if s.get("busy") or (s.get("tokens_held") or 0) > 0)
    parts = [f"'{profile}' on {host}: {'Ready' if health is Health.OK else health_text(health, why)}"]
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


def remote_state(status: dict | None, row_state) -> ServerState:
    """The state of a host's server: Ready when its ``status --json`` says health ok, Loading
    while it loads, else Stopped; ``row_state`` (the server list's) until the host answered."""
    if not status:
        return row_state
    return Health.parse(status.get("health"))[0].state()


def state_text(state, host: str) -> str:
    """The status bar's words for a host's server: "Ready on gpu-box", "Stopped on gpu-box"."""
    return f"{state} on {host}"


def snapshot_of(status: dict, *, host: str, profile: str, taken_at: float):
    """A host's ``kv-valet status PROFILE --json`` (app.monitor.snapshot.snapshot_to_dict) as the
    Monitor tab's Snapshot: its slots (fill, tokens, state), its GPUs (VRAM used/total, the
    server's share), its process and host RAM. Fields an older kv-valet lacks stay empty."""
    from app.monitor.gpu import GpuSample, GpuSnapshot
    from app.monitor.process import HostSample, ProcessSample
    from app.monitor.snapshot import Snapshot
    from app.monitor.warnings import MonitorWarning

    g = status.get("gpu") or {}
    gpus = tuple(GpuSample(**_known(GpuSample, d)) for d in g.get("gpus") or () if isinstance(d, dict))
    gpu = GpuSnapshot(bool(g.get("available")), str(g.get("message") or ""), gpus, g.get("driver_version"))
    p = status.get("process")
    proc = ProcessSample(**{**_known(ProcessSample, p), "children_pids": tuple(p.get("children_pids") or ())}) \
        if isinstance(p, dict) and "pid" in p else None
    h = status.get("host") if isinstance(status.get("host"), dict) else {}
    warnings = tuple(MonitorWarning(**_known(MonitorWarning, w)) for w in status.get("warnings") or ()
                     if isinstance(w, dict))
    health, why = Health.parse(status.get("health"))
    return Snapshot(taken_at=taken_at, url=f"{profile} on {host}", health=health, health_detail=why,
                    slots=tuple(slot_rows_of(status)), slots_error=status.get("slots_error"), gpu=gpu, process=proc,
                    host=HostSample(h.get("ram_total"), h.get("ram_used"), h.get("ram_available")),
                    cache_ram_mib=status.get("cache_ram_mib"), warnings=warnings, error=status.get("error"))


def _known(cls, d: dict) -> dict:
    """``d``'s entries that are fields of dataclass ``cls``, the others absent: their defaults (or None)."""
    missing = dataclasses.MISSING
    return {f.name: d.get(f.name) for f in dataclasses.fields(cls)
            if f.name in d or (f.default is missing and f.default_factory is missing)}


async def park(host, profile: str, slot: int | None, name: str | None) -> str:
    """Park ``slot`` of the host's ``profile`` server through its own ``kv-valet park --json``:
    the outcome in one sentence; a refusal raises RemoteError with the host's reason."""
    argv = ["park", profile, "--json"] + (["--slot", str(slot)] if slot is not None else []) + \
        (["--name", name] if name else [])
    return park_text(host.name, await _json_of(host, argv))


async def resume(host, profile: str, name: str, slot: int | None) -> str:
    """Resume ``name`` into the host's ``profile`` server through its own ``kv-valet resume --json``."""
    argv = ["resume", profile, name, "--yes", "--json"] + (["--slot", str(slot)] if slot is not None else [])
    return resume_text(host.name, await _json_of(host, argv))


async def _json_of(host, argv: list[str]) -> dict:
    """What the host's ``kv-valet … --json`` answered; its refusal (``"ok": false``) as RemoteError."""
    from app.remote.host import RemoteError

    d = await host.run_cli(argv, timeout=600, ok_exits=(0, 1))
    if not isinstance(d, dict):
        raise RemoteError(f"`kv-valet {argv[0]} --json` on {host.name} answered no JSON object",
                          kind="output", host=host.name)
    if not d.get("ok", False):
        reasons = [str(x) for x in d.get("details") or ()]
        failed = [str(s.get("error")) for s in d.get("sessions") or () if s.get("error")]
        raise RemoteError(" ".join([str(d.get("error") or "; ".join(failed) or "failed"), *reasons]),
                          kind="command", host=host.name, exit_status=d.get("exit", 1), output=d)
    return d


def park_text(host_name: str, d: dict) -> str:
    """A host's ``park --json`` answer in one sentence (per slot parked), with its warnings."""
    from app.core.units import fmt_bytes

    parts = []
    for s in d.get("sessions") or ():
        if s.get("unchanged"):
            parts.append(f"Slot {s.get('slot')} on {host_name} is already parked as '{s.get('session')}' (unchanged).")
        else:
            parts.append(f"Parked slot {s.get('slot')} of '{s.get('profile')}' on {host_name} as '{s.get('session')}': "
                         f"{s.get('tokens', 0):,} tokens, {fmt_bytes(s.get('size') or 0)}.")
        parts += [f"Warning: {w}" for w in s.get("warnings") or ()]
    return " ".join(parts) or f"No slot of '{d.get('profile')}' on {host_name} holds tokens: nothing to park."


def resume_text(host_name: str, d: dict) -> str:
    """A host's ``resume --json`` answer in one sentence, with its warnings."""
    return " ".join([f"Resumed '{d.get('session')}' into slot {d.get('slot')} of '{d.get('profile')}' on {host_name}: "
                     f"{d.get('tokens', 0):,} tokens in {d.get('restore_ms', 0):,.1f} ms.",
                     *[f"Warning: {w}" for w in d.get("warnings") or ()]])


async def restore_and_judge(endpoint, name: str, slot: int | None = None, *, server_service=None,
                            target_id: str | None = None) -> dict[str, Any]:
    """Restore ``name`` at ``endpoint`` (app.move.move: a profile here, or a host's) and judge a
    first query: ``{"slot_id", "n_restored", "verdict": {"kind", "reason"}}``. Here, through the
    running server's session service (``server_service.sessions(target_id)``)."""
    from app.move.move import LocalEndpoint

    if isinstance(endpoint, LocalEndpoint):
        from app.sessions.check import report_dict

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
