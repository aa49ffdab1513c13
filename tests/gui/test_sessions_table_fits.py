"""The Sessions table in the window as it opens (1,280 px wide): every column, the Verdict
included, is on screen without a horizontal scroll bar, with long names, a long model file
name and a long verdict reason (issue #37 item 7); what left the table (the model file, the
size on disk, the time saved) is in the row's tooltip and in the details line under it."""

from __future__ import annotations

import time

import pytest
from PySide6.QtCore import QEvent, QPoint, Qt
from PySide6.QtGui import QHelpEvent
from PySide6.QtWidgets import QApplication, QToolTip

from app import paths
from app.core.units import fmt_bytes, fmt_duration
from app.store.catalog import Catalog, SessionRecord
from app.store.profiles import ProfileStore
from app.ui.panels import build_window
from app.ui.sessions.model import COL_NAME, COL_VERDICT, COLUMNS
from app.ui.sessions.table import NO_DETAILS
from tests.conftest import run

pytestmark = pytest.mark.gui

MODEL = "/home/user/models/Qwen3-Coder-30B-A3B-Instruct-UD-Q4_K_XL-00001-of-00002.gguf"
LONG_NAME = "Refactoring the billing service's retry logic, with the whole repository pasted in first"
REASON = ("re-processed 131,000 of 131,072 prompt tokens in 734,012 ms: this build does not persist context "
          "checkpoints (no sidecar), so the restored cache was discarded and the whole chat was prefilled again")
GiB = 1 << 30


def _record(i: int, name: str, verdict: str, now: float) -> SessionRecord:
    folder = paths.sessions_dir("qwen3-coder-30b")
    return SessionRecord(
        name=name, profile="qwen3-coder-30b", state_file=f"s{i}.bin", save_dir=str(folder),
        state_size=3 * GiB + i, sidecar_size=120 << 20, n_tokens=131_072 - i, model_path=MODEL,
        cache_type_k="q8_0", cache_type_v="q8_0", memory_kind="sliding-window",
        sidecar_status="missing", created_at=now - 40 * 86400, updated_at=now - (30 + i) * 86400,
        last_restore_ms=123_456.0, last_restore_at=now - 1800, last_verdict=verdict,
        last_verdict_reason=REASON, time_saved_s=7384.0 + i, last_time_saved_s=0.0 if i else 95.0)


@pytest.fixture
def window(qtbot, qloop):
    """The real window at 1,280 × 800 on its Sessions tab, over three sessions with long texts."""
    now = time.time()
    with Catalog(paths.catalog_path()) as cat:
        for i, (name, verdict) in enumerate(((LONG_NAME, "DISCARDED"), ("short", "PARTIAL"), ("chat 3", "HIT"))):
            cat.add_or_replace(_record(i, name, verdict, now))
    w = build_window(ProfileStore())
    w.confirm_quit = False
    qtbot.addWidget(w)
    w.resize(1280, 800)
    w.show()
    qtbot.waitExposed(w)
    w.tabs.setCurrentWidget(w.sessions_panel)
    QApplication.sendPostedEvents(None, QEvent.LayoutRequest)
    QApplication.processEvents()
    yield w
    QToolTip.hideText()
    run(qloop, w.shutdown(), 120)


def row_of(panel, name: str) -> int:
    return [r.name for r in panel.model.records].index(name)


def tooltip_at(view, index) -> str:
    """The tooltip a user gets by resting the mouse on a cell."""
    pos = view.visualRect(index).center()
    QApplication.sendEvent(view.viewport(), QHelpEvent(QEvent.ToolTip, pos, view.viewport().mapToGlobal(pos)))
    return QToolTip.text() if QToolTip.isVisible() else ""


def test_every_column_and_the_verdict_fit_a_1280_px_window_without_a_horizontal_scroll(window):
    assert window.width() == 1280
    panel = window.sessions_panel
    view, header = panel.table, panel.table.horizontalHeader()
    assert view.isVisible() and panel.model.rowCount() == 3
    assert view.horizontalScrollBar().maximum() == 0 and not view.horizontalScrollBar().isVisible()
    last = len(COLUMNS) - 1
    assert header.sectionViewportPosition(last) + header.sectionSize(last) <= view.viewport().width()
    metrics = view.fontMetrics()
    for name, verdict in ((LONG_NAME, "DISCARDED"), ("short", "PARTIAL"), ("chat 3", "HIT")):
        cell = view.visualRect(panel.model.index(row_of(panel, name), COL_VERDICT))
        # the whole word is on screen, in the viewport, not elided
        assert 0 <= cell.left() and cell.right() <= view.viewport().width()
        assert cell.width() > metrics.horizontalAdvance(verdict)
        assert panel.model.index(row_of(panel, name), COL_VERDICT).data() == verdict
    # the long name gives way (elided in its column), it does not push the table wider
    name_cell = view.visualRect(panel.model.index(row_of(panel, LONG_NAME), COL_NAME))
    assert name_cell.width() < metrics.horizontalAdvance(LONG_NAME)
    assert panel.model.index(row_of(panel, LONG_NAME), COL_NAME).data() == LONG_NAME


def test_the_model_file_size_and_time_saved_are_in_the_rows_tooltip_and_the_details_line(window, qtbot):
    panel = window.sessions_panel
    view, details = panel.table, panel.list.details
    assert "Model" not in COLUMNS and "Size" not in COLUMNS and "Time saved" not in COLUMNS
    assert details.isVisible() and details.text() == NO_DETAILS

    row = row_of(panel, LONG_NAME)
    rec = panel.model.records[row]
    size, saved = fmt_bytes(rec.state_size + rec.sidecar_size), fmt_duration(rec.time_saved_s)
    tip = tooltip_at(view, panel.model.index(row, COL_NAME))
    assert tip.startswith(LONG_NAME + "\n")  # the whole name, elided in its cell
    for fact in (f"Model: {MODEL} (KV cache K q8_0, V q8_0; sliding-window)",
                 f"Size: {size} (state file {fmt_bytes(rec.state_size)}, sidecar {fmt_bytes(rec.sidecar_size)})",
                 f"Time saved: {saved} (the last resume saved {fmt_duration(95.0)})",
                 f"State file: {rec.state_path}, profile qwen3-coder-30b"):
        assert fact in tip.splitlines()
    assert tooltip_at(view, panel.model.index(row, COL_VERDICT)) == REASON  # the long reason, whole

    qtbot.mouseClick(view.viewport(), Qt.LeftButton, pos=view.visualRect(panel.model.index(row, COL_NAME)).center())
    assert panel.selected().name == LONG_NAME
    shown = details.text()
    assert "Model: Qwen3-Coder-30B-A3B-Instruct-UD-Q4_K_XL-00001-of-00002.gguf" in shown
    assert f"Size: {size} " in shown and f"Time saved: {saved} (" in shown
    assert MODEL in details.toolTip() and "Prefill time the resumes avoided" in details.toolTip()
    # the details line wraps inside the tab: none of it is off the right edge of the window
    right = window.mapToGlobal(window.rect().topRight()).x()
    assert details.mapToGlobal(QPoint(details.width(), 0)).x() <= right

    other = row_of(panel, "short")
    qtbot.mouseClick(view.viewport(), Qt.LeftButton, pos=view.visualRect(panel.model.index(other, COL_NAME)).center())
    assert "the last resume re-prefilled: it saved nothing" in details.text()
    assert fmt_duration(panel.model.records[other].time_saved_s) in details.text()
