"""The Sessions tab's slots: the server's one slot picture.

A server here is shown through its one sampler (:mod:`app.monitor.sampler`, the server
service's): the slot chooser gets the slots of every snapshot of that sampler, the ones the
Monitor tab, the server list and the status bar show, however it was taken (the Monitor's
ticks, the server list's refresh). A workflow's own read of ``/slots`` (a park's, a resume's)
becomes that picture (:meth:`app.monitor.sampler.Sampler.feed_slots`), not one more read: a
park from the window reads ``/slots`` once. A host's server is shown as its last status said
(no SSH call). A :class:`SlotPicture` is a helper object of the
:class:`~app.ui.sessions.controller.SessionsController`, through its public interface only.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class SlotPicture:
    def __init__(self, controller):
        self.controller = controller
        self.key: str | None = None  # the target id of the server the controller's service belongs to
        self._reading = False

    def attach(self, servers) -> None:
        """Follow the snapshots of every sampler of the window's server service."""
        servers.service.samplers.subscribe(self._on_picture)

    def detach(self, servers) -> None:
        servers.service.samplers.unsubscribe(self._on_picture)

    def bind(self, svc, first: bool) -> None:
        """``svc`` (a SessionService here) is the controller's service now; ``first``: hook its reads,
        which feed its own server's sampler from then on, shown or not (a proxy's park of another)."""
        c = self.controller
        self.key = next((tid for tid, h in list(c.servers.service.servers.items()) if h.sessions is svc),
                        None) if c.servers is not None else None
        if first:
            svc.on_slots(lambda rows, s=svc, key=self.key: self._feed(s, key, rows))

    def sampler(self, key: str | None = None):
        """The one sampler of the server here ``key`` names (default: the controller's service's), or None."""
        c, key = self.controller, key or self.key
        return c.servers.service.sampler(key) if c.servers is not None and key else None

    def _shown_here(self) -> bool:
        c = self.controller
        return not c.closed and c.service is not None and c.sessions is c.service

    def _on_picture(self, key: str, snap) -> None:
        """A snapshot of any server's sampler: its slots are the tab's when it is the server shown here."""
        if key == self.key and self._shown_here():
            self.controller.slots_changed.emit(list(snap.slots))

    def _feed(self, svc, key: str | None, rows) -> None:
        """A workflow of ``svc`` read /slots for its decision: that read is the picture, not one more."""
        c = self.controller
        sampler = self.sampler(key) if key is not None and not c.closed else None
        if sampler is not None:
            c.spawn(sampler.feed_slots(rows), "the slots a decision read, as the server's picture")
        elif svc is c.sessions and not c.closed:
            c.slots_changed.emit(list(rows))  # no sampler: a controller without a window's servers

    async def read(self) -> None:
        """The slots as they are now: a server here's through its one sampler (a tick now: everyone who
        shows them gets it, ``slots_changed`` too), a host's as its last status said them (no SSH);
        ``slots_changed`` empty, with a hint, when they cannot be read."""
        c = self.controller
        if not c.sessions or self._reading:
            return
        self._reading = True
        sampler = self.sampler() if c.sessions is c.service else None
        try:
            if sampler is not None:
                snap = await sampler.refresh()
                if snap.slots_error:
                    c.say(f"Slots unavailable: {snap.slots_error}", ok=False)
                return  # the chooser got them from _on_picture
            rows = await c.sessions.slot_rows()
        except Exception as e:  # report: said on the hint line; the slot chooser stays empty
            log.warning("sessions tab: reading the server's slots failed", exc_info=e)
            c.say(f"Slots unavailable: {e}", ok=False)
            rows = []
        finally:
            self._reading = False
        if not c.closed:
            c.slots_changed.emit(rows)
