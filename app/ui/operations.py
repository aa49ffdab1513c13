"""What the Sessions tab does, by name: the :class:`Operation` its controller's typed signals carry
(app.ui.sessions.controller), never the text of a message.

A value module of app/ui, importing nothing of it: the Sessions tab, the tray and the first-run guide
(app.ui.dialogs.first_run, which waits on the controller's signals) all name an operation, and a
dialog taking it from app/ui/sessions closed a circle of app/ui's subfolders (sessions opens
dialogs)."""

from __future__ import annotations

import enum


class Operation(enum.Enum):
    """What the Sessions tab did (its value is how the message line names it)."""
    PARK = "Park"
    PARK_ALL = "Park all"
    PARK_ALL_AND_STOP = "Park all & stop"
    RESUME = "Resume"
    RESUME_ALL = "Resume all"
    CHECK = "Check resume"
    AB_CHECK = "A/B check"
    VERDICT = "Verdict"
    RENAME = "Rename"
    DELETE = "Delete"
    DELETE_OLDER = "Delete older"
    MOVE = "Move"
    WAKE = "Back from sleep"
    CONNECT = "Connect"


#: the operations that park or resume (the tray tells them when the window is hidden)
PARKS_AND_RESUMES = frozenset({Operation.PARK, Operation.PARK_ALL, Operation.PARK_ALL_AND_STOP, Operation.RESUME,
                               Operation.RESUME_ALL})
