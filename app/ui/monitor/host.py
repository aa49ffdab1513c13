"""The Monitor's "Server process" and "Host RAM" boxes, each fed its part of a snapshot."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QGridLayout, QGroupBox, QLabel, QProgressBar, QWidget

from app.monitor.process import HostSample, ProcessSample
from app.core.units import MiB, fmt_bytes, fmt_uptime
from app.ui.widgets import theme
from app.ui.sessions.slots_model import _num
from app.ui.widgets.common import set_bar, set_text, set_visible

__all__ = ["ProcessBox", "HostBox"]


def _uptime(s: float | None) -> str:
    return fmt_uptime(s)


def _cache_ram_text(budget_mib: int | None) -> str:
    if budget_mib is None:
        return "-"
    if budget_mib < 0:
        return "unlimited"
    if budget_mib == 0:
        return "disabled"
    return fmt_bytes(budget_mib * MiB)


class ProcessBox(QGroupBox):
    """pid, CPU, RSS, threads and uptime of the server process (``labels`` by key)."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Server process", parent)
        self.labels: dict[str, QLabel] = {}
        pgrid = QGridLayout(self)
        for row, (key, title) in enumerate((("pid", "pid"), ("cpu", "CPU"), ("rss", "RSS"),
                                            ("threads", "threads"), ("uptime", "uptime"))):
            pgrid.addWidget(QLabel(title), row, 0)
            self.labels[key] = QLabel("-")
            self.labels[key].setAlignment(Qt.AlignRight | Qt.AlignVCenter)
            pgrid.addWidget(self.labels[key], row, 1)
        self.note = QLabel("no server process known")
        theme.tint(self.note, "color: {muted}")
        pgrid.addWidget(self.note, 5, 0, 1, 2)
        pgrid.setColumnStretch(1, 1)

    def apply(self, p: ProcessSample | None) -> None:
        L = self.labels
        alive = p is not None and p.alive
        set_text(L["pid"], "-" if p is None else str(p.pid))
        set_text(L["cpu"], "-" if not alive or p.cpu_pct is None else f"{p.cpu_pct:.1f} %")
        set_text(L["rss"], fmt_bytes(p.rss) if alive and p.rss is not None else "-")
        set_text(L["threads"], _num(p.threads) if alive else "-")
        set_text(L["uptime"], _uptime(p.uptime_s) if alive else "-")
        if p is None:
            note = "no server process known"
        elif not p.alive:
            note = f"pid {p.pid}: not running"
        else:
            note = "RSS, threads and CPU include child processes" if p.children_pids else ""
        set_text(self.note, note)
        set_visible(self.note, bool(note))


class HostBox(QGroupBox):
    """RAM of the machine, the server's RSS and the profile's --cache-ram budget
    (``labels`` by key, ``bar`` the share used)."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Host RAM", parent)
        self.labels: dict[str, QLabel] = {}
        hgrid = QGridLayout(self)
        self.bar = QProgressBar()
        self.bar.setRange(0, 1000)
        self.bar.setMaximumHeight(18)
        hgrid.addWidget(self.bar, 0, 0, 1, 2)
        for row, (key, title, tip) in enumerate((
                ("used", "used", "RAM used on this machine"),
                ("available", "available", "RAM the kernel can hand out without swapping"),
                ("total", "total", ""),
                ("server_rss", "server RSS", "Resident memory of the server (prompt cache included)"),
                ("cache_ram", "--cache-ram", "The profile's prompt-cache budget in host RAM")), start=1):
            t = QLabel(title)
            t.setToolTip(tip)
            hgrid.addWidget(t, row, 0)
            self.labels[key] = QLabel("-")
            self.labels[key].setAlignment(Qt.AlignRight | Qt.AlignVCenter)
            self.labels[key].setToolTip(tip)
            hgrid.addWidget(self.labels[key], row, 1)
        hgrid.setColumnStretch(1, 1)

    def apply(self, h: HostSample, server_rss: str, cache_ram_mib: int | None) -> None:
        H = self.labels
        set_text(H["used"], fmt_bytes(h.ram_used))
        set_text(H["available"], fmt_bytes(h.ram_available))
        set_text(H["total"], fmt_bytes(h.ram_total))
        set_text(H["server_rss"], server_rss)
        set_text(H["cache_ram"], _cache_ram_text(cache_ram_mib))
        if h.ram_used is not None and h.ram_total:
            frac = h.ram_used / h.ram_total
            set_bar(self.bar, int(round(frac * 1000)), f"{frac:.0%} used")
        else:
            set_bar(self.bar, 0, "N/A")
