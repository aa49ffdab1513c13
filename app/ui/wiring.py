"""Attach the optional panels (monitor, sessions) to the main window."""

from __future__ import annotations


def attach_panels(window) -> None:
    return None
