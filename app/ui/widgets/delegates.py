"""Item delegates: how a table paints a cell that is more than its text.

* :class:`FillBarDelegate`: a slot's fill (tokens held / n_ctx) as a bar with the
  percentage on it (the Monitor's slot table).
* :class:`VerdictDelegate`: a verdict in its colour (HIT green, PARTIAL amber,
  DISCARDED, MISS and DIFFERS red, NEW and UNKNOWN muted): the Sessions table's last verdict and the
  Conversations tab's, one word per event in both (:class:`app.core.verdict.VerdictKind`).

Both ask :mod:`app.ui.widgets.theme` for their colours when they paint, so a switch
between light and dark needs only a repaint.
"""

from __future__ import annotations

from PySide6.QtCore import QModelIndex, QRectF, QSize, Qt
from PySide6.QtGui import QPainter, QPalette
from PySide6.QtWidgets import QStyledItemDelegate, QStyleOptionViewItem

from app.ui.widgets import theme
from app.ui.widgets.theme import colour

#: the role a model gives a cell's fill in (float 0..1, or None): the delegate's input, so it lives here and
#: the models that feed it (app.ui.sessions.slots_model) take it from here, never the other way up
FILL_ROLE = Qt.UserRole + 1


class FillBarDelegate(QStyledItemDelegate):
    """Paints the Fill column as a bar with the percentage on it.

    ``role`` gives the fill as a float 0..1 (None: plain text, e.g. no n_ctx).
    """

    def __init__(self, parent=None, role: int = FILL_ROLE) -> None:
        super().__init__(parent)
        self.role = role

    def paint(self, painter: QPainter, option: QStyleOptionViewItem, index: QModelIndex) -> None:
        frac = index.data(self.role)
        if frac is None:
            super().paint(painter, option, index)
            return
        painter.save()
        painter.setRenderHint(QPainter.Antialiasing)
        rect = QRectF(option.rect).adjusted(4, 4, -4, -4)
        painter.setPen(Qt.NoPen)
        painter.setBrush(colour("track"))
        painter.drawRoundedRect(rect, 3, 3)
        colour_ = colour("crit" if frac >= 1.0 else "warn" if frac >= 0.9 else "bar")
        filled = QRectF(rect)
        filled.setWidth(rect.width() * max(0.0, min(1.0, frac)))
        painter.setBrush(colour_)
        painter.drawRoundedRect(filled, 3, 3)
        painter.setPen(colour("text"))
        painter.drawText(rect, Qt.AlignCenter, index.data(Qt.DisplayRole) or "")
        painter.restore()

    def sizeHint(self, option: QStyleOptionViewItem, index: QModelIndex) -> QSize:  # noqa: N802
        s = super().sizeHint(option, index)
        return QSize(max(s.width(), 90), s.height())


class VerdictDelegate(QStyledItemDelegate):
    """Draws a verdict's text in the verdict's colour (:func:`app.ui.widgets.theme.verdict_colour`).

    ``role`` gives the verdict (a :class:`~app.core.verdict.VerdictKind` or its text);
    an empty one keeps the table's own text colour.
    """

    def __init__(self, parent=None, role: int = Qt.DisplayRole) -> None:
        super().__init__(parent)
        self.role = int(role)

    def verdict_brush(self, index: QModelIndex):
        """The colour the verdict of ``index`` is drawn in; None: the table's own."""
        verdict = index.data(self.role)
        return theme.verdict_colour(verdict) if verdict else None

    def initStyleOption(self, option: QStyleOptionViewItem, index: QModelIndex) -> None:  # noqa: N802
        super().initStyleOption(option, index)
        c = self.verdict_brush(index)  # asked when painted: light or dark
        if c is not None:
            option.palette.setColor(QPalette.Text, c)
