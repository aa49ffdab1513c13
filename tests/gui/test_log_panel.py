"""The log panel: follows the tail, filters by level and text, copies what it shows."""

import pytest

from app.server.supervisor import LogBuffer
from app.ui.servers.log_panel import LogPanel
from tests.conftest import B11434

pytestmark = pytest.mark.gui


@pytest.fixture
def panel(qtbot):
    p = LogPanel(interval_ms=10_000)  # pulled by hand: deterministic
    qtbot.addWidget(p)
    buf = LogBuffer(1000)
    for line in (B11434 / "02-restart-restore-reprefill.log").read_text().splitlines():
        buf.append(line)
    p.set_buffer(buf)
    return p, buf


def test_shows_everything_then_new_lines(panel):
    p, buf = panel
    assert p.shown_text().count("\n") + 1 == len(buf)
    buf.append("0.20.000.000 E srv  boom: something broke")
    assert p.pull() == 1
    assert p.shown_text().endswith("something broke")
    assert p.view.verticalScrollBar().value() == p.view.verticalScrollBar().maximum()


def test_level_and_text_filters(panel, qtbot):
    p, buf = panel
    p.level.setCurrentText("Cache events")
    text = p.shown_text()
    assert "forcing full prompt re-processing" in text and "prompt eval time" in text
    assert "llama_model_loader" not in text
    p.level.setCurrentText("Warnings and errors")
    assert all(" W " in line or " E " in line for line in p.shown_text().splitlines())
    p.level.setCurrentText("All lines")
    qtbot.keyClicks(p.search, "create_check")
    lines = p.shown_text().splitlines()
    assert len(lines) == 2 and all("created context checkpoint" in line for line in lines)


def test_copy(panel, qtbot):
    from PySide6.QtGui import QGuiApplication

    p, _ = panel
    qtbot.keyClicks(p.search, "listening on")
    p.copy_button.click()
    assert "listening on http://127.0.0.1:18080" in QGuiApplication.clipboard().text()


def test_a_flood_far_beyond_the_caps_stays_bounded_and_shows_the_newest(qtbot):
    """200,000 lines (40x the panel's cap, 10x the buffer's): memory stops growing
    once the caps are reached, and the newest line is the one on screen."""
    import tracemalloc

    from app.ui.servers.log_panel import MAX_LINES_SHOWN

    p = LogPanel(interval_ms=10_000)
    qtbot.addWidget(p)
    buf = LogBuffer(20_000)
    p.set_buffer(buf)
    line = "0.{i:08d} I slot update_slots: id  0 | task 7 | prompt processing progress, n_tokens = {i}"

    def flood(start: int, n: int) -> None:
        for i in range(start, start + n, 2_500):
            for j in range(i, i + 2_500):
                buf.append(line.format(i=j))
            p.pull()

    tracemalloc.start()
    flood(0, 50_000)  # past every cap: the buffer and the view are full
    first = tracemalloc.get_traced_memory()[0]
    flood(50_000, 150_000)
    grown = tracemalloc.get_traced_memory()[0] - first
    tracemalloc.stop()
    assert len(buf) == 20_000
    assert p.view.document().blockCount() <= MAX_LINES_SHOWN
    assert p.shown_text().splitlines()[-1] == line.format(i=199_999)
    assert p.view.verticalScrollBar().value() == p.view.verticalScrollBar().maximum()
    assert grown < 1_000_000, f"memory grew by {grown:,} bytes over 150,000 more lines"
