"""Benchmark: the log parser and the log panel under a flood.

Feeds 20,000 lines/s (real captured llama-server lines, cycled) for 10 s into
the same path the app uses — LogBuffer.append (parse) on the GUI thread, the
LogPanel pulling every 100 ms — and prints lines/s ingested and the longest
event-loop stall, measured by a 5 ms heartbeat timer.

    QT_QPA_PLATFORM=offscreen .venv/bin/python tests/bench/bench_log_ingest.py [--rate 20000] [--seconds 10]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=int, default=20000, help="lines per second")
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()

    from PySide6.QtCore import QElapsedTimer, QTimer
    from PySide6.QtWidgets import QApplication

    from app.server.supervisor import LogBuffer
    from app.ui.log_panel import LogPanel

    app = QApplication([])
    lines = []
    for p in sorted((ROOT / "tests" / "fixtures").glob("*/*.log")):
        lines += p.read_text().splitlines()
    source = itertools.cycle(lines)
    buf = LogBuffer(20000)
    panel = LogPanel()
    panel.resize(1000, 600)
    panel.show()
    panel.set_buffer(buf)

    clock = QElapsedTimer()
    clock.start()
    fed = 0
    gaps: list[float] = []
    last_beat = [time.perf_counter()]
    feed_interval_ms = 10

    def feed() -> None:
        nonlocal fed
        target = int(clock.elapsed() / 1000.0 * args.rate)
        n = target - fed
        for _ in range(max(0, n)):
            buf.append(next(source))
        fed += max(0, n)
        if clock.elapsed() >= args.seconds * 1000:
            app.quit()

    def beat() -> None:
        now = time.perf_counter()
        gaps.append((now - last_beat[0]) * 1000.0)
        last_beat[0] = now

    feeder = QTimer(interval=feed_interval_ms, timeout=feed)
    heart = QTimer(interval=5, timeout=beat)
    feeder.start()
    heart.start()
    t0 = time.perf_counter()
    app.exec()
    elapsed = time.perf_counter() - t0
    panel.pull()
    stalls = [g - 5 for g in gaps]
    print(f"fed {fed:,} lines in {elapsed:.2f} s → {fed / elapsed:,.0f} lines/s ingested "
          f"(target {args.rate:,}/s)")
    print(f"log panel: {panel.lines_shown:,} lines appended, {panel.view.document().blockCount():,} kept "
          f"(bounded at {panel.view.maximumBlockCount():,})")
    print(f"event-loop stall: longest {max(stalls):.1f} ms, median {statistics.median(stalls):.2f} ms, "
          f"p99 {sorted(stalls)[int(len(stalls) * 0.99)]:.1f} ms over {len(stalls):,} heartbeats")
    return 0


if __name__ == "__main__":
    sys.exit(main())
