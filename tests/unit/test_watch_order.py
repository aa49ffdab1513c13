"""The verdict watcher ignores an earlier task's lines that arrive after the restore was registered.

The server's log reaches the app in batches from a reader thread: the last lines of a task that
ran before the restore (an A/B baseline, say) can be delivered just after the restore."""

import time

from app.sessions.watch import ResumeWatcher
from app.server.logparse import parse_line
from app.server.supervisor import LogLine

EARLIER = [
    "0.10.000.000 I slot operator(): id  1 | task 50 | new prompt, n_ctx_slot = 4096, n_keep = 0, task.n_tokens = 2736",
    "0.14.000.000 I slot print_timing: id  1 | task 50 | prompt eval time =    4513.00 ms /  2736 tokens",
    "0.14.000.100 I slot      release: id  1 | task 50 | stop processing: n_tokens = 2737, truncated = 0",
]
NEXT = [
    "0.20.000.000 I slot operator(): id  1 | task 60 | new prompt, n_ctx_slot = 4096, n_keep = 0, task.n_tokens = 2750",
    "0.20.000.100 I slot operator(): id  1 | task 60 | restored context checkpoint (pos_min = 1182, pos_max = 2205, "
    "n_tokens = 2206, n_past = 2205, size = 7.506 MiB)",
    "0.20.500.000 I slot print_timing: id  1 | task 60 | prompt eval time =     500.00 ms /   545 tokens",
]


def test_late_lines_of_an_earlier_task_are_not_judged():
    w = ResumeWatcher()
    read_before = time.time() - 1.0  # read by the reader thread before the restore
    w.expect(1, 2729, "long chat", "present", build_persists=True, sidecar_count=2)
    for i, line in enumerate(EARLIER):
        assert w.feed(LogLine(i, read_before, parse_line(line))) is None
    v = None
    for i, line in enumerate(NEXT):
        v = w.feed(LogLine(10 + i, time.time(), parse_line(line))) or v
    assert v is not None and v.kind == "PARTIAL" and v.cache_n == 2205


def test_a_restore_armed_after_its_query_was_sent_takes_the_lines_read_since_it_ended():
    """The proxy arms the watch once the request the restore was for is sent (issue #38): on a busy machine the
    reader thread has read that query's first lines by then. ``since`` (the restore's end) takes them; lines read
    before it are still an earlier task's."""
    w = ResumeWatcher()
    ended = time.time() - 1.0
    w.expect(1, 2729, "long chat", "present", build_persists=True, sidecar_count=2, since=ended)
    for i, line in enumerate(EARLIER):
        assert w.feed(LogLine(i, ended - 0.5, parse_line(line))) is None  # read before the restore ended
    v = None
    for i, line in enumerate(NEXT):
        v = w.feed(LogLine(10 + i, ended + 0.1, parse_line(line))) or v  # read before the watch was armed
    assert v is not None and v.kind == "PARTIAL" and v.cache_n == 2205
