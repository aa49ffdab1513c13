"""The one launch path of the window and ``kv-valet serve``: a profile's server, adopted from a
killed KV Valet first when one left it running, and behind its front (the conversation proxy)
when the profile says ``proxy = true``.

The front is given to :class:`app.servers.service.ServerService` by the face that builds it
(``ServerService(front=ProxyFront())``): the proxy sits a floor above the server service, so the
service knows it only by this module's :class:`Front` protocol and never imports it.
"""

from __future__ import annotations

import logging
from typing import Protocol

from app.core.lifecycle import StopTrigger
from app.core.profile import LaunchProfile
from app.server.launcher import resolve_api_key
from app.server.targets import free_loopback_port, profile_target_id
from app.servers.events import LaunchRefused, Notice, ProxyChanged

log = logging.getLogger(__name__)


class FrontService(Protocol):
    """A running front: what the server service and the launch path use of it."""

    async def park_before_stop(self) -> None: ...

    def notice(self) -> str | None: ...

    @property
    def url(self) -> str: ...


class Front(Protocol):
    """What stands in front of a server whose profile asks for it (the conversation proxy)."""

    async def start(self, servers, handle, host: str, port: int, api_key: str | None, *,
                    slots_endpoint: bool = True) -> FrontService:
        """Start listening on ``host:port`` in front of ``handle``'s server (``slots_endpoint`` False: answer
        clients' ``GET /slots`` as a server started with ``--no-slots`` does)."""

    async def save_leftover(self, servers, handle, profile: LaunchProfile, rec) -> list[str]:
        """Save what the front kept in a leftover server's slots under its own names; what was saved."""


async def launch_profile(servers, profile: LaunchProfile):
    """Launch ``profile``'s server; (its handle or None, its front or None).

    Behind the front when the profile says so (``proxy = true``): the front takes the profile's
    host and port, the server a private loopback port, and the front's conversations are saved
    under their own names before any stop. A server of the profile that an earlier, killed KV Valet
    left running is adopted first (:func:`adopt_leftovers`), never duplicated."""
    await adopt_leftovers(servers, profile)
    if not profile.proxy:
        return await servers.launch(profile), None
    tid = profile_target_id(profile.name)
    if servers.front is None:
        servers.notify(LaunchRefused(tid, "this profile runs behind the conversation proxy (proxy = true), "
                                          "which this program does not start: use the window or 'kv-valet serve'"))
        return None, None
    # the proxy reads /slots itself: a --no-slots of the profile is kept for the clients, at the front
    extra = tuple(profile.extra_args or ())
    no_slots = profile.slots_endpoint is False or "--no-slots" in extra
    behind = profile.replace(host="127.0.0.1", port=free_loopback_port(),
                             slots_endpoint=None if no_slots else profile.slots_endpoint,
                             extra_args=tuple(a for a in extra if a != "--no-slots"))
    handle = await servers.launch(behind)
    if handle is None:
        return None, None
    # every address of the profile's --host (llama-server takes several, comma-separated)
    front = await servers.front.start(servers, handle, profile.host or "127.0.0.1", profile.port,
                                      resolve_api_key(profile), slots_endpoint=not no_slots)
    handle.before_park.append(front.park_before_stop)
    handle.proxy = front
    servers.notify(ProxyChanged(handle.id, front))
    servers.notify(Notice(handle.id, f"Conversation proxy at {front.url}: clients talk to it; the server "
                                     f"listens on {handle.url} (loopback only)."))
    notice = front.notice()
    if notice:
        servers.notify(Notice(handle.id, notice))
    return handle, front


async def adopt_leftovers(servers, profile: LaunchProfile) -> list[str]:
    """Adopt the servers of ``profile`` that an earlier KV Valet launched and left running (it was
    killed: its server, a child in its own session, runs on). Each is attached (its pid and start
    time match its record), its slots are parked, then it stops, so the launch that follows takes
    its place with nothing lost and never runs twice on one port. A server that was behind the
    conversation proxy has its conversations saved under their own park names first, by the front
    (:meth:`Front.save_leftover`): they come back from their parks into the new server. Any other
    slot that holds tokens is parked as a dated session (``kv-valet resume-all PROFILE`` puts it back).

    Restarting rather than keeping it: a leftover is not this app's child, so it could only be
    watched (``/health``), not supervised (no exit status, no log for Cache health or the
    verdicts, no auto-restart), and its flags and private port are the killed app's. The
    messages said to the user; the conversations saved."""
    said: list[str] = []
    tid = profile_target_id(profile.name)
    for rec in servers.leftovers([profile.name]):
        servers.notify(Notice(tid, f"Adopting the leftover server of '{profile.name}' (pid {rec.pid}, {rec.url}) "
                                   "that an earlier KV Valet left running: parking its slots, then restarting it."))
        try:
            handle = await servers.attach(rec.url, leftover=rec)
        except Exception as e:  # report: it cannot be reached: it is stopped as before (nothing to save)
            log.warning("cannot attach to the leftover server %s: %s", rec.url, e)
            await servers.stop_leftover(rec)
            said.append(f"stopped the unreachable leftover server pid {rec.pid}")
            continue
        try:
            saved = await servers.front.save_leftover(servers, handle, profile, rec) if servers.front else []
            report = await servers.park_then_stop(handle.id, StopTrigger.SERVE)
        except Exception as e:  # report: it went away while being adopted (it was stopping): stopped as before
            log.warning("the leftover server %s went away while being adopted: %s", rec.url, e)
            await servers.remove(handle.id)
            await servers.stop_leftover(rec)
            msg = f"Leftover server pid {rec.pid} went away while being adopted ({e}): nothing saved from it"
            servers.notify(Notice(tid, msg, ok=False))
            said.append(msg)
            continue
        await servers.remove(handle.id)
        if rec.is_alive():  # the park or the stop failed: it must not run on beside the new one
            await servers.stop_leftover(rec)
        parked = [r for r in report.results if r.ok and not r.unchanged]
        msg = (f"Leftover server pid {rec.pid} adopted: {len(saved)} conversation(s) saved to come back from "
               f"their parks, {len(parked)} other slot(s) parked"
               + (f" ('kv-valet resume-all {profile.name}' puts them back)" if parked else "")
               + (f"; {report.error or report.interrupted}" if report.error or report.interrupted else ""))
        servers.notify(Notice(tid, msg, ok=not (report.error or report.interrupted)))
        said.append(msg)
    return said
