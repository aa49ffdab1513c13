"""Benchmark: a thousand parked sessions — listing them in the CLI and the Sessions tab.

Generates ``--sessions`` sessions (default 1,000) over three profiles in a
temporary data folder (``KV_VALET_DATA_DIR``): real state files (``qsgg``
header, the token words, a few KiB of stand-in sequence state) and a realistic
mix of sidecars (none for dense models, PKCL v1, PKCL v2 with the state hash
cached as a park leaves it, missing, damaged), parked over the last ~4 months.
Then it times, and prints the median of each:

* ``Catalog.list()`` (SQLite read + records);
* ``list_sessions()`` cold (first look at every sidecar) and warm (the next ones);
* ``kv-valet sessions list`` as a subprocess, next to ``kv-valet --version``
  (interpreter start + imports) for scale;
* the Sessions tab, offscreen: constructing the panel (its first refresh
  included), showing and painting it, a second refresh with nothing changed, a
  refresh after one session changed, typing a filter, clicking a header to sort.

Every GUI figure is GUI-thread time (the panel's work plus the event
processing that follows it: layout and paint).

    QT_QPA_PLATFORM=offscreen .venv/bin/python tests/bench/bench_sessions_scale.py [--sessions 1000] [--repeat 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

PROFILES = ("gemma3-27b", "qwen3-30b", "llama3-8b")
DAY = 86400.0


def _write_v2(path: Path, state_hash: int, n_tokens: int) -> None:
    """A PKCL v2 sidecar with two small checkpoints below ``n_tokens``."""
    cps = [(n_tokens - 600, n_tokens - 1600, n_tokens - 601), (n_tokens - 10, n_tokens - 1010, n_tokens - 11)]
    out = struct.pack("<IIQI", 0x4C434B50, 2, state_hash, len(cps))
    for n, lo, hi in cps:
        out += struct.pack("<qii", n, lo, hi)
        for block in (b"t" * 256, b"", b"s" * 16):
            out += struct.pack("<Q", len(block)) + block
    path.write_bytes(out)


def generate(n: int, *, now: float | None = None) -> list:
    """``n`` sessions in the catalog of ``KV_VALET_DATA_DIR`` with their files; returns the records.

    Session ``i`` was parked ``i * 3`` hours before ``now`` (files' mtimes too),
    so 1,000 sessions span 125 days.
    """
    from app import paths
    from app.sessions.sidecar_check import inspect, state_hash
    from app.server.sidecar import Checkpoint, write_pkcl
    from app.server.statefile import write_state_file
    from app.store.catalog import Catalog, SessionRecord

    now = time.time() if now is None else now
    out = []
    with Catalog(paths.catalog_path()) as cat:
        for i in range(n):
            profile = PROFILES[i % len(PROFILES)]
            folder = paths.sessions_dir(profile)
            folder.mkdir(parents=True, exist_ok=True)
            name = f"chat {i:04d}"
            state = folder / f"chat-{i:04d}.bin"
            n_tokens = 2000 + (i * 37) % 3000
            write_state_file(state, [(i + t) % 32000 for t in range(n_tokens)], bytes(4096 + (i % 7) * 512))
            mix = i % 20
            kind = "dense" if mix < 8 else "sliding-window"
            ckpt = state.with_name(state.name + ".ckpt")
            if 8 <= mix < 14:
                write_pkcl(ckpt, [(Checkpoint(n_tokens - 512 * k - 1, n_tokens - 512 * k - 1024,
                                              n_tokens - 512 * k - 2, 256, 0), b"t" * 256, b"")
                                  for k in range(1 + mix % 3)])
            elif 14 <= mix < 17:
                _write_v2(ckpt, state_hash(state, compute=True), n_tokens)  # a park hashes it while fresh
            elif mix == 19:
                ckpt.write_bytes(b"PKCL" + b"\x01\x00\x00\x00" + b"garbage")
            parked = now - i * 3 * 3600.0 - 60.0
            for p in (state, ckpt):
                if p.exists():
                    os.utime(p, (parked, parked))
            report = inspect(state, n_tokens, kind, verify_hash=True)
            out.append(cat.add_or_replace(SessionRecord(
                name=name, profile=profile, state_file=state.name, save_dir=str(folder),
                state_size=state.stat().st_size, n_tokens=n_tokens, save_ms=120.0 + i % 50,
                server_build="b11434", model_path=f"/models/{profile}-Q4_K_M.gguf", model_size=16 << 30,
                cache_type_k="q8_0", cache_type_v="q8_0", n_ctx_slot=32768, flash_attn="on",
                memory_kind=kind, sidecar_status=report.status, sidecar_reason=report.reason,
                sidecar_count=len(report.checkpoints), sidecar_size=report.size,
                sidecar_file=report.path.name if report.path else None, slot_id=i % 4,
                created_at=parked, updated_at=parked,
                last_verdict=("HIT", "PARTIAL", "DISCARDED", None)[i % 4])))
    return out


def _median_ms(fn, repeat: int, before=None) -> float:
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


def _forget_sidecar_checks() -> None:
    """Drop what sidecar_check remembers in memory (a no-op before it remembered anything)."""
    from app.sessions import sidecar_check

    getattr(sidecar_check, "forget", lambda: None)()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()

    tmp = tempfile.TemporaryDirectory(prefix="kv-valet-bench-")
    base = Path(tmp.name)
    for var, sub in (("KV_VALET_DATA_DIR", "data"), ("KV_VALET_CONFIG_DIR", "config"),
                     ("KV_VALET_STATE_DIR", "state")):
        os.environ[var] = str(base / sub)

    from app import paths
    from app.sessions.records import list_sessions
    from app.store.catalog import Catalog

    t0 = time.perf_counter()
    generate(args.sessions)
    print(f"generated {args.sessions:,} sessions in {time.perf_counter() - t0:.1f} s under {base}")
    rows: list[tuple[str, float]] = []

    with Catalog(paths.catalog_path()) as cat:
        assert len(cat.list()) == args.sessions
        rows.append(("Catalog.list()", _median_ms(cat.list, args.repeat)))
        rows.append(("list_sessions() cold", _median_ms(lambda: list_sessions(cat), args.repeat,
                                                         before=_forget_sidecar_checks)))
        list_sessions(cat)
        rows.append(("list_sessions() warm", _median_ms(lambda: list_sessions(cat), args.repeat)))

    def cli(*argv: str) -> None:
        res = subprocess.run([sys.executable, "-m", "app.cli", *argv], cwd=ROOT, env=dict(os.environ),
                             capture_output=True, text=True, check=True)
        if argv[:2] == ("sessions", "list"):
            assert len(res.stdout.splitlines()) == args.sessions, res.stdout[-500:]

    rows.append(("kv-valet --version (process start)", _median_ms(lambda: cli("--version"), args.repeat)))
    rows.append(("kv-valet sessions list (subprocess)", _median_ms(lambda: cli("sessions", "list"), args.repeat)))

    rows += bench_gui(args)
    print(f"\nmedians of {args.repeat} runs, {args.sessions:,} sessions:")
    for label, ms in rows:
        print(f"  {label:<52} {ms:9.1f} ms")
    tmp.cleanup()
    return 0


def bench_gui(args) -> list[tuple[str, float]]:
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QApplication

    from app import paths
    from app.store.catalog import Catalog
    from app.store.profiles import ProfileStore
    from app.ui.panels import sessions_panel
    from app.ui.sessions.panel import SessionsPanel

    app = QApplication.instance() or QApplication([])
    store = ProfileStore()
    rows = []

    def open_panel(first_refresh_cold: bool) -> tuple[SessionsPanel, float, float]:
        if first_refresh_cold:
            _forget_sidecar_checks()
        t0 = time.perf_counter()
        panel = sessions_panel(catalog=Catalog(paths.catalog_path()), store=store)
        t1 = time.perf_counter()
        panel.resize(1200, 700)
        panel.show()
        app.processEvents()
        t2 = time.perf_counter()
        return panel, (t1 - t0) * 1000.0, (t2 - t0) * 1000.0

    def close(panel: SessionsPanel) -> None:
        panel.hide()
        panel.controller.catalog.close()
        panel.deleteLater()
        app.processEvents()

    panel, construct, shown = open_panel(True)
    rows.append(("Sessions tab: first open, cold: construct", construct))
    rows.append(("Sessions tab: first open, cold: construct + paint", shown))
    close(panel)
    opens = [open_panel(False) for _ in range(args.repeat)]
    for p, _c, _s in opens[:-1]:
        close(p)
    panel = opens[-1][0]
    assert panel.model.rowCount() == args.sessions
    rows.append(("Sessions tab: open again: construct", statistics.median(o[1] for o in opens)))
    rows.append(("Sessions tab: open again: construct + paint", statistics.median(o[2] for o in opens)))

    def refresh_and_paint() -> None:
        panel.refresh()
        app.processEvents()

    rows.append(("Sessions tab: refresh, nothing changed", _median_ms(panel.refresh, args.repeat)))
    rows.append(("Sessions tab: refresh + paint, nothing changed", _median_ms(refresh_and_paint, args.repeat)))

    counter = [0]

    def touch_one() -> None:  # another session was judged: one row changes
        counter[0] += 1
        rec = panel.model.records[5]
        panel.controller.catalog.update_verdict(rec.id, ("HIT", "PARTIAL")[counter[0] % 2], f"bench {counter[0]}")

    rows.append(("Sessions tab: refresh + paint, one session changed",
                 _median_ms(refresh_and_paint, args.repeat, before=touch_one)))

    filter_box = getattr(panel, "filter", None)
    if filter_box is not None:
        def type_filter() -> None:
            filter_box.setText("qwen3")
            app.processEvents()

        rows.append(("Sessions tab: filter 'qwen3' + paint",
                     _median_ms(type_filter, args.repeat, before=lambda: (filter_box.clear(), app.processEvents()))))
        filter_box.clear()
        app.processEvents()
        shown_rows = panel.table.model().rowCount()
        assert shown_rows == args.sessions, shown_rows
    if panel.table.isSortingEnabled():
        header = panel.table.horizontalHeader()
        order = [Qt.AscendingOrder]

        def sort_tokens() -> None:
            order[0] = Qt.DescendingOrder if order[0] == Qt.AscendingOrder else Qt.AscendingOrder
            header.setSortIndicator(2, order[0])  # what a click on the "Tokens" header does
            app.processEvents()

        rows.append(("Sessions tab: sort by Tokens + paint", _median_ms(sort_tokens, args.repeat)))
    close(panel)
    return rows


if __name__ == "__main__":
    sys.exit(main())
