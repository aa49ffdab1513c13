"""The CLI's declared seam to the Qt layer: the two commands that need a window.

Every other command runs without importing PySide6 (a test checks it). Only
these functions import ``app.ui``, and only when called.
"""

from __future__ import annotations

from pathlib import Path


def open_window(start: str | None = None) -> int:
    """``kv-valet`` with no command: the desktop window (``start``: a profile whose server it starts)."""
    from app.ui.app import run_gui

    return run_gui(start=start)


def export_png(report, path: Path) -> bool:
    """The check report's chart, drawn offscreen by the window's own code."""
    from app.ui.dialogs.check import export_png as draw

    return draw(report, path)
