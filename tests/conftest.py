"""Shared test set-up: every test gets its own config and data folders."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
B11434 = FIXTURES / "llama-server-b11434"
SIDECAR_BUILD = FIXTURES / "sidecar-build-b11434"

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# -- under CI nothing skips -----------------------------------------------------------------
# With CI set (.ci/run sets it), a test that would skip fails instead, with the reason: a
# missing tool, package or build (pytest.skip, skipif, importorskip, a fixture's skip, a
# module's skip at collection) is a CI machine set up wrong, not a pass. An xfail and a
# non-strict XPASS fail too. The exceptions are listed here, each with why, and only here.

#: node id (or its start, e.g. a whole file) -> why CI may skip it. Empty: CI runs everything.
CI_ALLOWED_SKIPS: dict[str, str] = {}


def _ci_allows(nodeid: str) -> bool:
    return any(nodeid == k or nodeid.startswith(k + "::") or nodeid.startswith(k + "[") for k in CI_ALLOWED_SKIPS)


def _skip_reason(report) -> str:
    if getattr(report, "wasxfail", None) is not None:
        kind = "xfail" if report.skipped else "XPASS of a non-strict xfail"
        return f"{kind}: {report.wasxfail or 'no reason given'}"
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, lineno, "Skipped: reason")
        return f"skip at {longrepr[0]}:{longrepr[1]}: {longrepr[2]}"
    return f"skip: {longrepr}"


def _fail_under_ci(report) -> None:
    reason = _skip_reason(report)
    report.outcome = "failed"
    if hasattr(report, "wasxfail"):
        del report.wasxfail
    report.longrepr = (f"[CI] {reason}\nUnder CI (CI={os.environ.get('CI')}) a skip fails: give the CI machine "
                       "what the test needs (.ci/run), or allow it in tests/conftest.py CI_ALLOWED_SKIPS "
                       "with the reason.")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if (os.environ.get("CI") and (report.skipped or getattr(report, "wasxfail", None) is not None)
            and not _ci_allows(report.nodeid)):
        _fail_under_ci(report)
    return report


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_make_collect_report(collector):
    report = yield
    if os.environ.get("CI") and report.skipped and not _ci_allows(report.nodeid):
        _fail_under_ci(report)
    return report


# -- under CI the whole suite runs -------------------------------------------------------------
# A run that ran far fewer tests than the suite has (a -k or a -m from PYTEST_ADDOPTS, a plugin,
# a collection that silently lost a folder) fails under CI. The floor is tests/min_tests.txt: a
# little below today's count; raise it when the suite grows. With KVV_SUITE_FLOOR set (.ci/run sets
# it for the README's test command) the floor holds whatever pytest was given: paths, -k, --co. With
# CI alone it is judged only when pytest was given no paths: a run of chosen files is not the suite.
# The variable is this pytest's alone: taken out of the environment when this file loads, so a test's
# own pytest subprocess (tests/unit/test_ci_skips.py) is not judged as the suite. Under pytest-xdist
# the controller counts (it sees every worker's reports) and judges; a worker (PYTEST_XDIST_WORKER in
# its environment, config.workerinput) does neither.

MIN_TESTS_FILE = ROOT / "tests" / "min_tests.txt"
SUITE_FLOOR_VAR = "KVV_SUITE_FLOOR"
_SUITE_FLOOR = bool(os.environ.pop(SUITE_FLOOR_VAR, ""))
_ran: set[str] = set()


def min_tests() -> int:
    lines = [ln.split("#")[0].strip() for ln in MIN_TESTS_FILE.read_text().splitlines()]
    return int(next(ln for ln in lines if ln).replace(",", "").replace("_", ""))


def pytest_runtest_logreport(report):
    if report.when == "setup" and not os.environ.get("PYTEST_XDIST_WORKER"):
        _ran.add(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if hasattr(config, "workerinput"):
        return
    if not _SUITE_FLOOR:
        if (not os.environ.get("CI") or config.option.collectonly
                or config.args_source == pytest.Config.ArgsSource.ARGS):
            return
    floor = min_tests()
    if len(_ran) < floor:
        tr = config.pluginmanager.get_plugin("terminalreporter")
        where = MIN_TESTS_FILE.relative_to(ROOT) if MIN_TESTS_FILE.is_relative_to(ROOT) else MIN_TESTS_FILE
        if tr is not None:
            tr.write_line(f"[CI] only {len(_ran)} tests ran; the suite has at least {floor} "
                          f"({where}): a filter or a lost folder cut the run", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# -- worker processes (pytest-xdist) --------------------------------------------------------------
# pyproject's addopts run the suite on three worker processes (``-n 3 --dist loadgroup``) on the two cores
# of the machines it is written for: two workers left the cores idle a third of the time, waiting on SSH,
# server starts and subprocesses. What must not overlap shares a group and so a worker:
#
#: folder (or file) -> xdist group. tests/ssh: one sshd host per session (its account, its network
#: namespace and its /30 addresses are made and removed by the session fixture).
XDIST_GROUPS = {"tests/ssh/": "ssh"}
#: llama.cpp's CPU threads per server while several workers run: two servers of two threads each on two cores
#: spin against each other (a decode of 20 ms per token took 0.6 to 1.6 s); one thread each shares them.
XDIST_SERVER_THREADS = "1"


def xdist_worker_count(config) -> int:
    """How many workers this run has (0 without xdist; read on the controller or a worker)."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        return int(workerinput.get("workercount", 1))
    n = getattr(config.option, "numprocesses", None)
    return int(n or 0) if not isinstance(n, str) else 0


def pytest_configure(config):
    if xdist_worker_count(config) > 1:
        # every llama-server a test starts (through KV Valet's launcher or the tests' own helper) reads it
        os.environ.setdefault("LLAMA_ARG_THREADS", XDIST_SERVER_THREADS)


def pytest_collection_modifyitems(config, items):
    for item in items:
        try:
            path = Path(str(item.fspath)).resolve().relative_to(ROOT).as_posix()
        except ValueError:  # a test's own pytest run on files it wrote elsewhere
            continue
        group = next((g for prefix, g in XDIST_GROUPS.items() if path.startswith(prefix)), None)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
    if getattr(config, "workerinput", None) is not None and config.getvalue("loadgroup"):
        _group_node_ids(items)


def _xdist_group(item) -> str | None:
    names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                    for m in item.iter_markers("xdist_group")})
    return "_".join(names) or None


def _group_node_ids(items) -> None:
    """On a worker under ``--dist loadgroup``: each grouped test's node id ends in ``@GROUP`` (what the
    scheduler groups by), and the grouped tests come first. pytest-xdist (3.8) appends the suffix by
    writing ``item._nodeid``, which pytest 9.2 no longer reads (the id is ``item._id``, a NodeId): no
    test was grouped, tests/ssh ran on both workers and each built the standalone bundle. First, because
    the scheduler hands out work in collection order: a group of minutes taken last would be the run's
    tail; taken first, one worker runs it while the other works through the rest."""
    from _pytest import nodes

    grouped = []
    for item in items:
        group = _xdist_group(item)
        if group is None:
            continue
        grouped.append(item)
        suffix = "@" + group
        if not item.nodeid.endswith(suffix) and isinstance(getattr(item, "_id", None), getattr(nodes, "NodeId", ())):
            item._id = nodes.NodeId.parse(item.nodeid + suffix)
    first = set(map(id, grouped))
    items[:] = grouped + [item for item in items if id(item) not in first]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, below the ephemeral range: a
    port from bind(0) can be taken as a connection's source port before the test binds it (CI
    once failed so, the proxy's front meeting a /health poll of the other worker's server)."""
    from app.server.targets import free_loopback_port

    return free_loopback_port()


@pytest.fixture(autouse=True)
def isolated_dirs(tmp_path, monkeypatch):
    """Profiles, catalog and parked sessions of a test never touch the user's."""
    monkeypatch.setenv("KV_VALET_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("KV_VALET_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("KV_VALET_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("LLAMA_API_KEY", raising=False)
    yield


QT_FIXTURES = {"qapp", "qtbot", "qloop"}


def _uses_qt(item) -> bool:
    return bool(QT_FIXTURES & set(getattr(item, "fixturenames", ()))) or item.get_closest_marker("gui") is not None


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """pytest-qt processes the application's events around every test once a QApplication exists, a
    Qt-free test too (a real server driven by asyncio.run, a subprocess): there nothing of Qt has work
    to do, and an event for an object an earlier test left behind would be dispatched in the middle of
    another test's sockets and threads. Its event processing runs for the tests that use Qt only."""
    import pytestqt.plugin as qt_plugin

    qt_plugin.kvv_qt_test = _uses_qt(item)  # on pytest-qt's module: this file is imported twice
    try:
        return (yield)
    finally:
        qt_plugin.kvv_qt_test = False


def _patch_pytest_qt() -> None:
    try:
        import pytestqt.plugin as qt_plugin
    except ImportError:  # pytest-qt is a test dependency: without it no Qt test runs at all
        return
    if getattr(qt_plugin, "kvv_patched", False):
        return
    original = qt_plugin._process_events

    def process() -> None:
        if getattr(qt_plugin, "kvv_qt_test", True):
            original()

    qt_plugin._process_events = process
    qt_plugin.kvv_patched = True


_patch_pytest_qt()


@pytest.fixture(autouse=True)
def no_collection_off_the_main_thread(request):
    """Once Qt is loaded, a Qt-free test runs with automatic garbage collection off and collects on the
    main thread when it ends. Its worker threads (``asyncio.to_thread``, a log reader, an SSH client's)
    would otherwise run a collection whenever their allocations cross the threshold, freeing a Qt
    object an earlier test left in a reference cycle off the GUI thread; the next Qt test's
    ``processEvents`` then dispatches to it and crashes (a segfault in pytest-qt's ``_process_events``,
    seen in CI at the first Qt test after the Qt-free real-server tests)."""
    import gc
    import sys

    if QT_FIXTURES & set(request.fixturenames) or request.node.get_closest_marker("gui") is not None \
            or "PySide6.QtCore" not in sys.modules:
        yield
        return
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        # The youngest generation only: with collection off, everything this test allocated is still in
        # it. A full collection here cost 0.13 to 0.2 s per test once Qt and the app were loaded (a
        # third of tests/unit's time); the Qt objects of earlier tests are collected by those tests
        # themselves, on this thread (qt_garbage_on_the_main_thread, qloop).
        gc.collect(0)
        if was_enabled:
            gc.enable()


@pytest.fixture(autouse=True)
def qt_garbage_on_the_main_thread(request):
    """A test with Qt objects collects its garbage on the GUI thread, as the app does
    (:class:`app.ui.collector.MainThreadCollector`), and leaves none behind: a Qt object in a reference
    cycle freed later by a worker thread of another test (the log reader, ``asyncio.to_thread``) would
    leave the event dispatcher holding it, and pytest-qt's next ``processEvents`` would crash."""
    if not QT_FIXTURES & set(request.fixturenames):
        yield
        return
    import gc

    request.getfixturevalue("qapp")
    from app.ui.collector import MainThreadCollector

    collector = MainThreadCollector()
    collector.start()
    try:
        yield
    finally:
        collector.stop()
        del collector
        gc.collect()


@pytest.fixture
def server_asked(monkeypatch) -> list[str]:
    """What the app asked its llama-server, in order, of what a restore's token check and the restore do:
    each chat it had rendered (``/apply-template``, named by the chat's last message) and each restore
    (``"restore"``). The calls still reach the server."""
    from app.server.client import LlamaClient

    asked: list[str] = []
    render, restore = LlamaClient.apply_template, LlamaClient.restore_slot

    async def rendering(self, body):
        asked.append(body["messages"][-1]["content"])
        return await render(self, body)

    async def restoring(self, slot, filename):
        asked.append("restore")
        return await restore(self, slot, filename)
    monkeypatch.setattr(LlamaClient, "apply_template", rendering)
    monkeypatch.setattr(LlamaClient, "restore_slot", restoring)
    return asked


@pytest.fixture
def qloop(qapp):
    """A qasync event loop on the test's QApplication (as the app runs)."""
    import asyncio
    import gc

    import qasync

    loop = qasync.QEventLoop(qapp, already_running=False)
    asyncio.set_event_loop(loop)
    # In the app the loop runs for the whole session. A test runs it in bursts
    # (run_until_complete), and qasync dispatches pending Qt events once more
    # after each burst, and pytest-qt does at teardown: keep the loop marked as
    # running in between so a task step dispatched then still finds it.
    original_run_forever = loop.run_forever

    def run_forever():
        try:
            return original_run_forever()
        finally:
            asyncio.events._set_running_loop(loop)

    loop.run_forever = run_forever
    asyncio.events._set_running_loop(loop)
    leaks: list[str] = []
    try:
        yield loop
    finally:
        try:
            # Let the tasks the test's own last step started (closing clients) finish.
            loop.run_until_complete(asyncio.sleep(0))
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            leaks += [f"asyncio task left running: {t.get_coro()!r}" for t in pending]
            leaks += [f"Qt timer left running: {name}" for name in _active_timers(qapp)]
            for t in pending:
                t.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            # Transports and socket notifiers of finished work are collected now,
            # while the loop that owns them is open, not in the middle of a later test.
            gc.collect()
            loop.run_until_complete(asyncio.sleep(0))
        finally:
            asyncio.events._set_running_loop(None)
            loop.close()  # also shuts down its QThread executor
            asyncio.set_event_loop(None)
            # Deferred deletions of this test's widgets happen here, too.
            from PySide6.QtCore import QCoreApplication, QEvent

            QCoreApplication.sendPostedEvents(None, QEvent.DeferredDelete)
            qapp.processEvents()
            gc.collect()
    if leaks:
        # napari does the same: a leak here is a bug in the code under test (or the test).
        pytest.fail("the test left work running:\n  " + "\n  ".join(leaks), pytrace=False)


def _active_timers(qapp) -> list[str]:
    """Active QTimers owned by the visible or hidden top-level widgets still alive."""
    from PySide6.QtCore import QTimer

    out = []
    for w in qapp.topLevelWidgets():
        for timer in w.findChildren(QTimer):
            if timer.isActive() and timer.objectName() != "qt_scrollarea_timer":
                owner = timer.parent()
                out.append(f"{type(owner).__name__}.{timer.objectName() or 'QTimer'} "
                           f"(every {timer.interval()} ms, window {type(w).__name__})")
    return out


@pytest.fixture(autouse=True)
def no_thread_leaks():
    """A test may not leave a thread of its own running (a server reader, an executor)."""
    import threading
    import time

    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5
    while True:
        extra = [t for t in threading.enumerate() if t not in before and t.is_alive() and not t.daemon]
        if not extra or time.monotonic() > deadline:
            break
        time.sleep(0.05)  # threads end asynchronously; this bounded wait is the check itself
    if extra:
        pytest.fail("the test left threads running: " + ", ".join(t.name for t in extra), pytrace=False)


def signal_future(signal, predicate=lambda *args: True):
    """An asyncio future resolved with the first emission that matches: its one
    argument, or the tuple of its arguments."""
    import asyncio

    fut = asyncio.get_event_loop().create_future()

    def handler(*args):
        if not fut.done() and predicate(*args):
            fut.set_result(args[0] if len(args) == 1 else args)

    signal.connect(handler)
    fut.add_done_callback(lambda _f: signal.disconnect(handler))
    return fut


def run(loop, coro_or_future, timeout=120):  # a guard against a hang, not a speed claim
    import asyncio

    return loop.run_until_complete(asyncio.wait_for(coro_or_future, timeout))
