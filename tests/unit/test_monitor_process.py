"""ProcessMonitor against the test process and a real child process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from app.monitor.process import HostSample, ProcessMonitor, ProcessSample, sample_host


def _spawn_sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])


def _wait_for_child(mon: ProcessMonitor, pid: int, timeout: float = 10.0) -> ProcessSample:
    deadline = time.monotonic() + timeout
    while True:
        s = mon.sample()
        if pid in s.children_pids or time.monotonic() > deadline:
            return s
        time.sleep(0.02)  # polling a real OS process, not synchronising tasks


def test_sample_self_with_child_counts_children():
    own = ProcessMonitor(os.getpid())
    alone = own.sample()
    child = _spawn_sleeper()
    try:
        s = _wait_for_child(own, child.pid)
        assert s.alive and s.pid == os.getpid()
        assert child.pid in s.children_pids
        assert s.rss is not None and s.rss > 0
        child_rss = psutil.Process(child.pid).memory_info().rss
        own_rss = psutil.Process().memory_info().rss
        # totals include the child (RSS moves a little between reads)
        assert s.rss >= own_rss + child_rss // 2
        assert s.threads >= alone.threads + 1
        assert s.cpu_pct is not None and s.cpu_pct >= 0.0
        assert s.uptime_s is not None and s.uptime_s >= 0.0

        kid = ProcessMonitor(child.pid)
        ks = kid.sample()
        assert ks.alive and ks.rss > 0 and ks.children_pids == ()
    finally:
        child.kill()
        child.wait(10)
    assert kid.sample().alive is False
    after = own.sample()
    assert child.pid not in after.children_pids


def test_dead_pid_is_not_alive():
    child = _spawn_sleeper()
    mon = ProcessMonitor(child.pid)
    assert mon.sample().alive
    child.kill()
    child.wait(10)
    s = mon.sample()
    assert s == ProcessSample(pid=child.pid, alive=False)
    assert mon.sample().alive is False  # stays gone


def test_nonexistent_pid_never_raises():
    # a pid beyond pid_max cannot exist
    s = ProcessMonitor(2**31 - 2).sample()
    assert s.alive is False


def test_recycled_pid_is_not_our_server():
    # Same pid, another create_time: what a recycled pid looks like.
    ct = psutil.Process().create_time()
    s = ProcessMonitor(os.getpid(), create_time=ct - 100.0).sample()
    assert s.alive is False
    assert ProcessMonitor(os.getpid(), create_time=ct).sample().alive


def test_host_sample():
    h = sample_host()
    assert isinstance(h, HostSample)
    assert h.ram_total > 0 and 0 < h.ram_available <= h.ram_total and h.ram_used > 0
    assert ProcessMonitor.sample_host().ram_total == h.ram_total
