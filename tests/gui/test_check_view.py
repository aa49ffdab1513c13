"""The check dialog shows the report's figures; exports are written and parse."""

from __future__ import annotations

import csv
import io
import json

import pytest
from PySide6.QtGui import QImage

from app.sessions.check_report import ABReport, CheckReport, ProbeRow
from app.core.verdict import Reuse, VerdictKind, judge
from app.store.catalog import HistoryEvent
from app.ui.dialogs.check import CheckDialog, export_png
from app.ui.dialogs.check_charts import ABChart, HistoryChart

pytestmark = pytest.mark.gui


def row(name, restore_ms, prompt_ms, prompt_n, cache_n, total, loaded, status="present"):
    v = judge(Reuse(2892, cache_n, prompt_n, prompt_total=total, restored=True, sidecar_status=status, sidecar_loaded_count=loaded, build_persists=True, prompt_ms=prompt_ms))
    return ProbeRow(name, restore_ms, prompt_ms, prompt_n, cache_n, prompt_ms + 27.3, 2892, loaded, v, total)


@pytest.fixture
def report():
    probes = [row("exact tokens", 30.2, 169.72, 18, 2880, 2898, 4), row("text", 29.8, 78.42, 5, 2880, 2885, 4)]
    with_, hidden = row("with sidecar", 30.0, 78.42, 5, 2880, 2885, 4), row("sidecar hidden", 5.9, 11344.23, 2885, 0,
                                                                           2885, 0, "missing")
    ab = ABReport("long chat", "default", "b11434", 0, 2892, "present", 4, [with_, hidden],
                  delta_prefill_speedup=11344.23 / 78.42, end_to_end_speedup=(5.9 + 11344.23) / (30.0 + 78.42),
                  note="sidecar with 4 checkpoints hidden for the second arm and put back")
    return CheckReport("long chat", "default", "b11434", 0, 2892, "present", 4, "q?", probes, probes[0].verdict,
                       ab=ab)


def test_dialog_shows_figures(qtbot, report):
    d = CheckDialog(report)
    qtbot.addWidget(d)
    assert "HIT" in d.verdict_label.text()
    t = d.table
    assert t.rowCount() == 4
    cells = [[t.item(i, j).text() for j in range(t.columnCount())] for i in range(t.rowCount())]
    assert cells[0][:5] == ["exact tokens", "30.2", "169.7", "18", "2,880"]
    assert cells[3][0] == "sidecar hidden" and cells[3][3] == "2,885" and cells[3][7] == "DISCARDED"
    assert "4 context checkpoints loaded from the sidecar" in d.reasons_label.text()
    assert "144.7×" in d.ratio_label.text() and "delta prefill" in d.ratio_label.text()
    assert "2,892 tokens restored" in d.summary_label.text()


def test_exports_written_and_parse(qtbot, report, tmp_path):
    d = CheckDialog(report)
    qtbot.addWidget(d)
    md = d.export("md", tmp_path / "r.md")
    cs = d.export("csv", tmp_path / "r.csv")
    js = d.export("json", tmp_path / "r.json")
    png = d.export("png", tmp_path / "r.png")
    data = json.loads(js.read_text())
    assert [p["prompt_n"] for p in data["probes"]] == [18, 5]
    assert data["ab"]["ratios"]["delta_prefill_speedup"] == pytest.approx(144.66, abs=0.01)
    rows = list(csv.DictReader(io.StringIO(cs.read_text())))
    assert [r["prompt_n"] for r in rows if r["section"] == "probe"] == ["18", "5"]
    assert "| sidecar hidden | 5.9 | 11,344.2 | 2,885 | 0 |" in md.read_text()
    img = QImage(str(png))
    assert not img.isNull() and img.width() > 100
    assert "saved r.png" in d.status_label.text()


def test_export_png_offscreen(qtbot, report, tmp_path):
    assert export_png(report.ab, tmp_path / "ab.png")
    img = QImage(str(tmp_path / "ab.png"))
    assert img.width() == 760 and img.height() >= 200


def test_charts_paint_without_data(qtbot):
    c, h = ABChart(), HistoryChart()
    qtbot.addWidget(c)
    qtbot.addWidget(h)
    c.set_report(None)
    h.set_events([])
    assert not c.grab().isNull() and not h.grab().isNull()


def test_history_chart_points(qtbot):
    h = HistoryChart()
    qtbot.addWidget(h)
    evs = [HistoryEvent(kind="check", at=1000.0 + i, restore_ms=6.0, prompt_ms=p, ttft_ms=None, verdict=v)
           for i, (p, v) in enumerate([(11052.8, "DISCARDED"), (78.4, "HIT"), (None, None)])]
    h.set_events(evs)
    pts = h.points()
    assert [p[3] for p in pts] == ["DISCARDED", "HIT", "UNKNOWN"]
    assert pts[0][2] == 11052.8
    h.resize(500, 220)
    assert not h.grab().isNull()


def test_dialog_with_history_and_plain_ab(qtbot, report):
    d = CheckDialog(report.ab, history=[HistoryEvent(kind="ab", at=1.0, restore_ms=30.0, prompt_ms=78.0,
                                                     verdict=VerdictKind.HIT.value)])
    qtbot.addWidget(d)
    assert d.history_chart is not None and d.table.rowCount() == 2
    assert "with sidecar" in d.verdict_label.text()


def test_a_probe_whose_output_differs_shows_differs_in_red_with_the_first_differing_token(qtbot, report):
    """The decision is the core's (app.core.output_check); the dialog only shows it."""
    from app.core.output_check import Alt, Continuation, Step, compare, with_output
    from app.core.output_drift import Bound
    from app.ui.dialogs.check import OUTPUT_ROLE
    from app.ui.widgets import theme

    def steps(*ids, runner=3):
        return Continuation(tuple(Step(i, f"<{i}>", -0.5, (Alt(i, f"<{i}>", -0.5), Alt(runner if i != runner else 7,
                                                                                          "<r>", -3.0)))
                                  for i in ids), cache_n=0)

    bound = Bound(0.3, "gemma3", 60, 0.2, 1.5, "reduced")
    # position 2: the resumed side sure of 7, the cold side of 3 (2.5 nats apart), past the measured bound
    checked = compare(steps(1, 2, 7, 4), [steps(1, 2, 3)], k=4, bound=bound)
    text = report.probes[1]
    text.output = checked
    text.verdict = with_output(text.verdict, checked)
    report.probes[0].output = compare(steps(1, 2), steps(1, 2), k=2, bound=bound)
    report.verdict = text.verdict
    d = CheckDialog(report)
    qtbot.addWidget(d)
    assert "DIFFERS" in d.verdict_label.text() and "output differs from a cold prefill" in d.verdict_label.text()
    assert theme.verdict_colour("DIFFERS") == theme.colour("crit")
    t = d.table
    assert t.horizontalHeaderItem(8).text() == "output"
    assert [t.item(i, 8).text() for i in range(t.rowCount())] == ["same 2/2", "DIFFERS at 2", "off", "off"]
    assert t.item(1, 7).text() == "DIFFERS" and t.item(1, 8).data(OUTPUT_ROLE) == "DIFFERS"
    assert "the resume took '<7>', the cold prefill '<3>'" in t.item(1, 8).toolTip()
