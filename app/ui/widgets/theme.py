"""Light and dark, following the system.

Qt's own widgets take the desktop's palette (a dark GNOME or KDE gives a dark
Fusion palette, and a switch while KV Valet runs changes it at once). The
colours KV Valet adds — state, verdicts, warnings, charts — are *roles* here,
each with a light and a dark value, so they stay readable on either:

- painted things (charts, bars, table foregrounds) ask :func:`colour` when they
  paint, so a repaint after the switch is enough;
- styled labels are set with :func:`tint`, which remembers the style with role
  names in it and re-applies it when the scheme changes;
- anything else listens to :func:`watcher`'s ``sig_changed``.

Dark is what the system says (``QStyleHints.colorScheme``); where it says
nothing (an older desktop, a custom palette), a dark window colour means dark.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication, QWidget

# role: (light, dark). Light values are the ones the app always had.
ROLES: dict[str, tuple[str, str]] = {
    "ok": ("#1a7f37", "#3fb950"),
    "warn": ("#8a5a00", "#d29922"),
    "crit": ("#b00020", "#f85149"),
    "muted": ("#6e7781", "#8b949e"),
    "accent": ("#1f6feb", "#58a6ff"),
    "text": ("#1f2328", "#e6edf3"),
    "background": ("#ffffff", "#0d1117"),
    "grid": ("#d0d7de", "#30363d"),
    "track": ("#e8ebef", "#2d333b"),
    "bar": ("#54aeff", "#388bfd"),
    "faint": ("#9e9e9e", "#6e7681"),
    "restore": ("#90caf9", "#316dca"),
    "prompt": ("#1565c0", "#79c0ff"),
    "note_bg": ("#fff8c5", "#3b2f0b"),
    "note_border": ("#d4a72c", "#9e6a03"),
    "on_crit": ("#ffffff", "#ffffff"),
}
STREAMS: tuple[tuple[str, str], ...] = (
    ("#1565c0", "#58a6ff"), ("#2e7d32", "#3fb950"), ("#ef6c00", "#f0883e"), ("#6a1b9a", "#bc8cff"),
    ("#00838f", "#39c5cf"), ("#ad1457", "#ff7bb5"), ("#4e342e", "#c8a27a"), ("#9e9d24", "#d4d44a"),
)
#: a verdict's colour (app.core.verdict.VerdictKind); NEW and UNKNOWN are muted; DIFFERS (the output
#: differs from a cold prefill: warm but wrong) is an error
VERDICT_ROLES = {"HIT": "ok", "PARTIAL": "warn", "DISCARDED": "crit", "MISS": "crit", "DIFFERS": "crit"}

_TINT = "kv_tint"  # the dynamic property holding a widget's style template


def is_dark() -> bool:
    app = QGuiApplication.instance()
    if app is None:
        return False
    scheme = app.styleHints().colorScheme()
    if scheme == Qt.ColorScheme.Dark:
        return True
    if scheme == Qt.ColorScheme.Light:
        return False
    return app.palette().color(QPalette.Window).lightness() < 128


def colours(dark: bool | None = None) -> dict[str, str]:
    """Every role's colour (``#rrggbb``) for the current scheme (or the one asked for)."""
    i = int(is_dark() if dark is None else dark)
    return {role: pair[i] for role, pair in ROLES.items()}


def hex_of(role: str) -> str:
    return ROLES[role][int(is_dark())]


def colour(role: str) -> QColor:
    return QColor(hex_of(role))


def verdict_colour(kind) -> QColor:
    """HIT green, PARTIAL amber, DISCARDED, MISS and DIFFERS red, anything else muted."""
    return colour(VERDICT_ROLES.get(str(getattr(kind, "value", kind) or ""), "muted"))


def stream_colour(i: int) -> QColor:
    return QColor(STREAMS[i % len(STREAMS)][int(is_dark())])


def tint(widget: QWidget, template: str) -> None:
    """Style ``widget`` with role names in braces (``"color: {muted}; font-weight: bold"``),
    again whenever the scheme changes. An empty template clears the style."""
    watcher()  # make sure someone re-tints
    widget.setProperty(_TINT, template)
    widget.setStyleSheet(template.format_map(colours()) if template else "")


class ThemeWatcher(QObject):
    """Notices the switch (the system's colour scheme or the application palette) and
    re-tints; ``sig_changed(dark)`` tells whoever draws HTML or caches colours."""

    sig_changed = Signal(bool)

    def __init__(self, app: QGuiApplication):
        super().__init__(app)
        self.dark = is_dark()
        app.styleHints().colorSchemeChanged.connect(self._check)
        app.paletteChanged.connect(self._check)

    def _check(self, *_args) -> None:
        dark = is_dark()
        if dark == self.dark:
            return
        self.dark = dark
        values = colours(dark)
        for w in QApplication.allWidgets():
            template = w.property(_TINT)
            if isinstance(template, str):
                w.setStyleSheet(template.format_map(values) if template else "")
            else:
                w.update()
        self.sig_changed.emit(dark)


def watcher() -> ThemeWatcher:
    app = QGuiApplication.instance()
    found = app.findChild(ThemeWatcher, options=Qt.FindDirectChildrenOnly)
    return found if found is not None else ThemeWatcher(app)
