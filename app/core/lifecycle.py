"""What may stop a server, and what each does to its chats first: one table.

Every trigger ends in :meth:`app.servers.service.ServerService.park_then_stop`
with the one timeout of the preferences (``park_timeout_s``); this table says
whether the server stops afterwards and whether a slot that failed to park holds
the stop up.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

#: How long the park before a stop may take, when the preferences say nothing.
DEFAULT_PARK_TIMEOUT_S = 120.0


class StopTrigger(enum.StrEnum):
    QUIT = "quit"  # the quit dialog's "Park all & quit"
    SIGNAL = "signal"  # SIGTERM / SIGHUP to the window (a logout, a reboot)
    SESSION_END = "session end"  # the desktop session ends (Qt's commitDataRequest)
    SHUTDOWN = "shutdown"  # logind: the computer is about to shut down
    SLEEP = "sleep"  # logind: the computer is about to sleep (the server stays)
    SERVE = "serve"  # Ctrl-C, SIGTERM or SIGHUP to `kv-valet serve`
    UNIT_STOP = "unit stop"  # systemd stops the user unit that runs `kv-valet serve`
    USER = "park all & stop"  # the button, or `kv-valet park --all --and-stop`


class TargetKind(enum.StrEnum):
    PROFILE = "profile"  # a profile's server (launched here, or to be reached at its URL)
    LEFTOVER = "leftover"  # a profile's server an earlier KV Valet launched (its pid record)
    URL = "url"  # any server at a URL (attach mode): never stopped by KV Valet


@dataclass(frozen=True)
class StopPolicy:
    stop: bool  # the server stops after the parks
    stop_if_failed: bool  # ... even when a slot could not be parked (the app or the computer is going)
    doing: str  # for the status line: "… parking every slot"


POLICY: dict[StopTrigger, StopPolicy] = {
    StopTrigger.QUIT: StopPolicy(True, True, "Parking every slot before quitting"),
    StopTrigger.SIGNAL: StopPolicy(True, True, "Asked to quit: parking every slot"),
    StopTrigger.SESSION_END: StopPolicy(True, True, "The desktop session ends: parking every slot"),
    StopTrigger.SHUTDOWN: StopPolicy(True, True, "The computer is about to shut down: parking every slot"),
    StopTrigger.SLEEP: StopPolicy(False, False, "The computer is about to sleep: parking every slot"),
    StopTrigger.SERVE: StopPolicy(True, True, "parking the slots before stopping"),
    StopTrigger.UNIT_STOP: StopPolicy(True, True, "the service is stopping: parking the slots first"),
    # the user asked for it with the server staying useful otherwise: a chat that could not
    # be parked keeps the server running (its tokens would be lost)
    StopTrigger.USER: StopPolicy(True, False, "Parking every slot, then stopping the server"),
}
