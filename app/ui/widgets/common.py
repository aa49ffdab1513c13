"""Small widget helpers the panels share.

The ``set_*`` helpers touch a widget only when a value changes: most figures are
the same from one Monitor tick to the next, and an unchanged setText still
relayouts and repaints. (It also keeps the number of void Qt calls per tick low:
PySide6 6.12.0 on Python 3.11 drops a reference to None on every void call, see
the report.)
"""

from __future__ import annotations

from PySide6.QtWidgets import QGroupBox, QLabel, QProgressBar, QSizePolicy, QVBoxLayout, QWidget

from app.ui.widgets import theme


def set_text(label: QLabel, text: str) -> None:
    if label.text() != text:
        label.setText(text)


def set_visible(w: QWidget, on: bool) -> None:
    if w.isHidden() == on:
        w.setVisible(on)


def set_style(w: QWidget, template: str) -> None:
    """A style with theme roles in braces (app.ui.widgets.theme.tint), set only when it changes."""
    if w.property("kv_tint") != template:
        theme.tint(w, template)


def set_bar(bar: QProgressBar, value: int, fmt: str) -> None:
    if bar.value() != value:
        bar.setValue(value)
    if bar.format() != fmt:
        bar.setFormat(fmt)


def group(title: str) -> tuple[QGroupBox, QVBoxLayout]:
    """A titled box and its vertical layout."""
    box = QGroupBox(title)
    lay = QVBoxLayout(box)
    lay.setContentsMargins(8, 8, 8, 8)
    lay.setSpacing(6)
    return box, lay


def wrapping_label() -> QLabel:
    """A message label that wraps and never widens the window (long paths included)."""
    label = QLabel("")
    label.setWordWrap(True)
    label.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)
    label.setMinimumWidth(0)
    return label
