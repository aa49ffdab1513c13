"""Benchmark: a click on a remote server's row in the window to its Sessions list filled.

Not a test. Runs the SSH tests' host (tests/ssh/conftest.py ``running_sshd``: another user with its
own home in its own network and mount namespace, this checkout's real ``kv-valet`` there; root) with a
profile ``there`` whose catalog holds ``--sessions`` parked sessions (rows only), and the real
window offscreen (MainWindow + its panels, a qasync loop) with that host listed. Times, from the
click on the row (``RemoteView.sig_loaded``'s seconds: the click's handler to the list shown):

* **cold**: the host's SSH connection closed before the click (connect, verify the host key, log
  in, then ``kv-valet sessions list --json`` and ``status --json`` there, at once);
* **warm**: the connection kept (the list's refresh made it), the two commands only;
* and, for each, the click to its server's state shown too (``status --json``'s answer: the list is
  shown as soon as the host lists it, the state when the status comes);

``--runs`` of each (default 10), interleaved (a click on this machine's row between two), medians,
and the cold/warm ratio. Prints one line, then one JSON object of every figure. Compiles the
checkout's bytecode first (tests/bench/bench_move.py ``bytecode_for_the_host``: the host cannot).

``--ci`` is the quick mode CI runs (.ci/run): 5 runs; ``--json PATH`` also writes the figures there.

    QT_QPA_PLATFORM=offscreen .venv/bin/python tests/bench/bench_remote_click.py [--runs 10] [--sessions 50]
                                                                           [--ci] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SEED = """
import sys, time
from app import paths
from app.store.catalog import Catalog, SessionRecord
n, save_dir = int(sys.argv[1]), sys.argv[2]
with Catalog(paths.catalog_path()) as c:
    for i in range(n):
        t = time.time() - i * 60
        c.add_or_replace(SessionRecord(name=f"chat {i}", profile="there", state_file=f"chat-{i}.bin",
                                       save_dir=save_dir, state_size=9_000_000, n_tokens=700 + i, created_at=t,
                                       updated_at=t))
"""


def seed(sshd, n: int) -> None:
    """The host's profile and catalog, written there through SSH (the host's own python and app)."""
    from app.core.profile import LaunchProfile

    save_dir = sshd.remote_home / "slots"
    sshd.save_profile(LaunchProfile(name="there", model="/models/m.gguf", port=18999,
                                    slot_save_path=str(save_dir) + "/"))
    sshd.run("python", "-c", SEED, str(n), str(save_dir), timeout=120)


async def clicks(window, source, runs: int, sessions: int) -> dict:
    from app.servers.server_list import COL_NAME
    from tests.conftest import signal_future

    panel = window.server_list

    hooked: set[str] = set()
    read: dict[str, asyncio.Event] = {}

    async def click(target_id: str) -> tuple[float, float]:
        """Seconds from the click to the list shown, and to its server's status shown too."""
        loaded = signal_future(window.remote_view.sig_loaded, lambda tid, _s: tid == target_id)
        row = panel.model.row_of(target_id)
        t0 = time.perf_counter()
        panel.table.setCurrentIndex(panel.model.index(row, COL_NAME))  # the click's selection change
        remote = window.remote_view.shown.sessions  # the click's handler ran: its load is asked, not answered
        n0, status_read = statuses(remote), asyncio.Event()
        read[target_id] = status_read
        if target_id not in hooked:
            hooked.add(target_id)
            remote.on_change(lambda: read[target_id].set() if statuses(remote) > read_from[target_id] else None)
        read_from[target_id] = n0
        _tid, seconds = await asyncio.wait_for(loaded, 120)
        assert len(window.sessions_panel.source_model.records) == sessions
        await asyncio.wait_for(status_read.wait(), 120)
        return seconds, time.perf_counter() - t0

    read_from: dict[str, int] = {}

    def statuses(remote) -> int:
        """The statuses read so far; a tree from before 2026-12-04 read one with each listing only."""
        return getattr(remote, "statuses", remote.listings)

    def away() -> None:
        panel.table.clearSelection()
        window.controller.select(None)

    cold, warm, cold_state, warm_state = [], [], [], []
    for _ in range(runs):
        await source.host.close()
        away()
        listed, stated = await click("box:there")
        cold.append(listed)
        cold_state.append(stated)
        away()
        listed, stated = await click("box:there")
        warm.append(listed)
        warm_state.append(stated)
    med = {"cold_ms": statistics.median(cold) * 1000, "warm_ms": statistics.median(warm) * 1000,
           "cold_state_ms": statistics.median(cold_state) * 1000, "warm_state_ms": statistics.median(warm_state) * 1000}
    med["cold_vs_warm"] = med["cold_ms"] / med["warm_ms"]
    print(f"click on a remote row to its Sessions list ({sessions} sessions, median of {runs}): cold "
          f"{med['cold_ms']:.0f} ms, warm {med['warm_ms']:.0f} ms ({med['cold_vs_warm']:.1f}x); to its server's "
          f"state too: cold {med['cold_state_ms']:.0f} ms, warm {med['warm_state_ms']:.0f} ms")
    return {"runs": runs, "sessions": sessions, "median": med,
            "all_s": {"cold": cold, "warm": warm, "cold_state": cold_state, "warm_state": warm_state}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=None, help="clicks of each kind (default 10; 5 with --ci)")
    ap.add_argument("--sessions", type=int, default=50)
    ap.add_argument("--ci", action="store_true", help="the quick mode CI runs: 5 runs")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures there")
    args = ap.parse_args()
    if args.runs is None:
        args.runs = 5 if args.ci else 10
    if args.runs < 5:
        ap.error("--runs must be at least 5")
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from tests.bench.bench_move import bytecode_for_the_host

    bytecode_for_the_host()  # else the host compiles what was edited since, at every click
    with tempfile.TemporaryDirectory(prefix="kvv-bench-") as d:
        for k, sub in (("KV_VALET_CONFIG_DIR", "config"), ("KV_VALET_DATA_DIR", "data"),
                       ("KV_VALET_STATE_DIR", "state")):
            os.environ[k] = os.path.join(d, sub)
        import qasync
        from PySide6.QtWidgets import QApplication

        from app.servers.server_list import RemoteServerSource
        from app.ui.panels import build_window
        from tests.ssh.conftest import running_sshd

        base = Path(d) / "sshd"
        base.mkdir()
        app = QApplication.instance() or QApplication([])
        loop = qasync.QEventLoop(app)
        asyncio.set_event_loop(loop)
        # ``with loop``: closing it joins its executor's QThreads (left running, Qt aborts the process at exit)
        with loop, running_sshd(base) as sshd:
            seed(sshd, args.sessions)
            window = build_window()
            window.confirm_quit = False
            window.show()
            source = RemoteServerSource(sshd.remote_host())

            async def go():
                window.server_list.add_source(source)
                await window.server_list.refresh()
                try:
                    return await clicks(window, source, args.runs, args.sessions)
                finally:
                    await window.shutdown()

            figures = loop.run_until_complete(go())
    text = json.dumps(figures, indent=1)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
