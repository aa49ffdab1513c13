"""Check resume / A-B results: a table, two small QPainter charts and exports.

* :class:`CheckDialog`: the report's table, verdict and chart, with Export
  buttons (Markdown, CSV, JSON, PNG).
* :func:`export_png`: the chart of a report rendered offscreen to a PNG file.
* The charts, :class:`ABChart` and :class:`HistoryChart`, are drawn in
  :mod:`app.ui.dialogs.check_charts`.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (QApplication, QDialog, QFileDialog, QHBoxLayout, QHeaderView, QLabel, QPushButton,
                               QTableWidget, QTableWidgetItem, QVBoxLayout)

from app.sessions.check_export import output_cell, to_csv, to_json, to_markdown
from app.sessions.check_report import ABReport, CheckReport
from app.ui.widgets import theme
from app.ui.widgets.delegates import VerdictDelegate
from app.ui.dialogs.check_charts import ABChart, HistoryChart, _ab_of, _rows_of, verdict_color


COLUMNS = ["run", "restore ms", "prompt ms", "prompt_n", "cache_n", "TTFT ms", "checkpoints", "verdict", "output"]
#: the output column's colour, as a verdict word: DIFFERS red, a passed output check green, else the table's
OUTPUT_ROLE = Qt.UserRole + 1


def _output_word(r) -> str:
    if r.output is None:
        return ""
    return "DIFFERS" if r.output.differs else "HIT" if r.output.passed else ""


# --------------------------------------------------------------------------- dialog

def _cell(text: str, align=Qt.AlignRight | Qt.AlignVCenter) -> QTableWidgetItem:
    item = QTableWidgetItem(text)
    item.setTextAlignment(align)
    item.setFlags(item.flags() & ~Qt.ItemIsEditable)
    return item


def _num(x) -> str:
    if x is None:
        return "–"
    return f"{x:,.1f}" if isinstance(x, float) else f"{x:,}"


class CheckDialog(QDialog):
    """The result of a check (and A/B): table, verdict, chart, exports."""

    def __init__(self, report: CheckReport | ABReport, parent=None, *, history=None):
        super().__init__(parent)
        self.report = report
        self.setWindowTitle(f"Check resume: {report.session}")
        self.resize(860, 620)
        lay = QVBoxLayout(self)

        self.verdict_label = QLabel()
        self.verdict_label.setWordWrap(True)
        self.verdict_label.setTextFormat(Qt.RichText)
        self._show_verdict()
        theme.watcher().sig_changed.connect(self._show_verdict)  # light ↔ dark
        lay.addWidget(self.verdict_label)

        self.summary_label = QLabel(self._summary())
        self.summary_label.setWordWrap(True)
        theme.tint(self.summary_label, "color: {muted}")
        lay.addWidget(self.summary_label)

        rows = _rows_of(report)
        self.table = QTableWidget(len(rows), len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.verticalHeader().setVisible(False)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeToContents)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.setItemDelegateForColumn(7, VerdictDelegate(self.table))  # the verdict in its colour
        # the output check: DIFFERS in the error colour ("output differs from a cold prefill")
        self.table.setItemDelegateForColumn(8, VerdictDelegate(self.table, role=OUTPUT_ROLE))
        for i, r in enumerate(rows):
            vals = [r.name, _num(r.restore_ms), _num(r.prompt_ms), _num(r.prompt_n), _num(r.cache_n),
                    _num(r.ttft_ms), _num(r.checkpoints_loaded), r.verdict.kind.value, output_cell(r)]
            for j, v in enumerate(vals):
                item = _cell(v, Qt.AlignLeft | Qt.AlignVCenter if j in (0, 7, 8) else Qt.AlignRight | Qt.AlignVCenter)
                item.setToolTip(r.output.reason if j == 8 and r.output is not None else r.verdict.reason)
                if j == 8:
                    item.setData(OUTPUT_ROLE, _output_word(r))
                self.table.setItem(i, j, item)
        self.table.resizeRowsToContents()
        height = self.table.horizontalHeader().sizeHint().height() + 4
        height += sum(self.table.rowHeight(i) for i in range(len(rows)))
        self.table.setFixedHeight(height)
        lay.addWidget(self.table)

        self.reasons_label = QLabel("<br>".join(f"<b>{_escape(r.name)}</b>: {_escape(r.verdict.reason)}"
                                                for r in rows))
        self.reasons_label.setWordWrap(True)
        self.reasons_label.setTextFormat(Qt.RichText)
        lay.addWidget(self.reasons_label)

        self.chart = ABChart()
        self.chart.show_ratios = False
        self.chart.set_report(report)
        lay.addWidget(self.chart, 1)
        self.ratio_label = QLabel(self.chart.ratio_text())
        self.ratio_label.setStyleSheet("font-weight:600")
        self.ratio_label.setWordWrap(True)
        lay.addWidget(self.ratio_label)

        self.history_chart = None
        if history:
            self.history_chart = HistoryChart()
            self.history_chart.set_events(history)
            lay.addWidget(self.history_chart, 1)

        buttons = QHBoxLayout()
        self.status_label = QLabel("")
        theme.tint(self.status_label, "color: {muted}")
        buttons.addWidget(self.status_label, 1)
        self.buttons = {}
        for key, text in (("md", "Export Markdown…"), ("csv", "Export CSV…"), ("json", "Export JSON…"),
                          ("png", "Export PNG…")):
            b = QPushButton(text)
            b.clicked.connect(lambda _=False, k=key: self.export(k))
            buttons.addWidget(b)
            self.buttons[key] = b
        close = QPushButton("Close")
        close.clicked.connect(self.accept)
        buttons.addWidget(close)
        lay.addLayout(buttons)

    def _show_verdict(self, *_dark) -> None:
        kind, reason = self._verdict()
        color = verdict_color(kind).name()
        self.verdict_label.setText(f"<span style='font-size:15pt;font-weight:600;color:{color}'>{kind}</span>"
                                   f"<br>{_escape(reason)}")

    def _verdict(self) -> tuple[str, str]:
        if isinstance(self.report, CheckReport):
            return self.report.verdict.kind.value, self.report.verdict.reason
        # an arm whose output differed from a cold prefill says more than the first arm's reuse
        first = next((r for r in self.report.rows if r.output is not None and r.output.differs),
                     self.report.rows[0] if self.report.rows else None)
        if first is None:
            return "UNKNOWN", "no runs"
        return first.verdict.kind.value, f"{first.name}: {first.verdict.reason}"

    def _summary(self) -> str:
        r = self.report
        text = (f"{r.session} · profile {r.profile} · build {r.build} · slot {r.slot_id} · "
                f"{r.n_restored:,} tokens restored · sidecar {r.sidecar_status} ({r.sidecar_count} checkpoints) · "
                f"protocol: {r.protocol} · sidecar behaviour: {r.behaviour}")
        ab = _ab_of(r)
        if ab is not None and ab.note:
            text += f" · {ab.note}"
        return text

    # -- exports
    def export(self, kind: str, path: str | Path | None = None) -> Path | None:
        """Write the report (or the chart, for "png") to ``path``; asks when None."""
        suffix = {"md": ".md", "csv": ".csv", "json": ".json", "png": ".png"}[kind]
        if path is None:
            default = f"kv-valet-check-{_safe(self.report.session)}{suffix}"
            chosen, _ = QFileDialog.getSaveFileName(self, "Export", default, f"*{suffix}")
            if not chosen:
                return None
            path = chosen
        path = Path(path)
        if kind == "png":
            self.chart.show_ratios = True
            try:
                ok = self.chart.grab().save(str(path), "PNG")
            finally:
                self.chart.show_ratios = False
            if not ok:
                self.status_label.setText(f"could not write {path}")
                return None
        else:
            writer = {"md": to_markdown, "csv": to_csv, "json": to_json}[kind]
            path.write_text(writer(self.report), encoding="utf-8")
        self.status_label.setText(f"saved {path.name}")
        return path


def export_png(report: CheckReport | ABReport, path: str | Path, size: tuple[int, int] = (760, 0)) -> bool:
    """Render the report's chart offscreen to ``path`` (the CLI has no window:
    an offscreen QApplication is made for it)."""
    if QApplication.instance() is None:
        import os

        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
        export_png._app = QApplication(["kv-valet"])  # kept alive for the process
    chart = ABChart()
    chart.set_report(report)
    height = size[1] or max(chart.minimumHeight(), 220)
    chart.resize(size[0], height)
    return chart.grab().save(str(path), "PNG")


def _escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in name) or "session"
