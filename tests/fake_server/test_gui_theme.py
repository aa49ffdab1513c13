"""Light and dark follow the system: when the desktop switches the palette, KV Valet's own colours follow."""

from __future__ import annotations

import pytest
from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import QApplication

from app.ui.widgets import theme
from app.ui.dialogs.check_charts import HistoryChart
from tests.fake_server.gui_helpers import make_window

pytestmark = pytest.mark.gui


def dark_palette() -> QPalette:
    """What a dark desktop hands Qt (GNOME's or KDE's dark scheme, roughly)."""
    pal = QPalette(QColor("#2b2b2b"))  # window colour: Qt derives the rest
    for role, colour in ((QPalette.Window, "#2b2b2b"), (QPalette.WindowText, "#eeeeee"), (QPalette.Base, "#1e1e1e"),
                         (QPalette.Text, "#eeeeee"), (QPalette.Button, "#353535"), (QPalette.ButtonText, "#eeeeee")):
        pal.setColor(role, QColor(colour))
    return pal


@pytest.fixture
def system_palette(qapp):
    saved = QPalette(qapp.palette())
    yield
    qapp.setPalette(saved)


def test_switching_the_desktop_to_dark_recolours_what_kv_valet_paints(qtbot, tmp_path, system_palette):
    w, _profile = make_window(qtbot, tmp_path)
    light, dark = theme.colours(dark=False), theme.colours(dark=True)
    assert not theme.is_dark()
    assert light["muted"] in w.state_label.text()  # "● Server Stopped"
    w.profiles.errors.setText("a problem")
    assert light["crit"] in w.profiles.errors.styleSheet()
    chart = HistoryChart()
    qtbot.addWidget(chart)
    chart.resize(300, 200)
    assert chart.grab().toImage().pixelColor(3, 3).name() == light["background"]

    QApplication.setPalette(dark_palette())  # the desktop switches to dark while KV Valet runs

    assert theme.is_dark()
    assert dark["muted"] in w.state_label.text() and light["muted"] not in w.state_label.text()
    assert dark["crit"] in w.profiles.errors.styleSheet()
    assert dark["note_bg"] in w.monitor_panel.warnings_box.styleSheet()
    assert dark["crit"] in w.monitor_panel.health_badge.styleSheet()
    assert chart.grab().toImage().pixelColor(3, 3).name() == dark["background"]
    # every colour KV Valet adds has a dark value that reads on a dark background
    for role in ("ok", "warn", "crit", "muted", "accent", "text"):
        assert QColor(dark[role]).lightness() > QColor(dark["background"]).lightness() + 80, role

    QApplication.setPalette(QPalette(QColor("#efefef")))  # and back to light
    assert not theme.is_dark() and light["muted"] in w.state_label.text()
    assert light["crit"] in w.profiles.errors.styleSheet()
