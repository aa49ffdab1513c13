"""Freeze a process the moment a file event happens: the fault matrix's "mid-save" and "mid-restore".

A save of a small slot takes a millisecond or two, so no poll or sleep can land inside
it. This script blocks in ``read()`` on an inotify descriptor (run as its own process,
at real-time priority when allowed, so no GIL and no busy CPU delays it); on the first
event on a file whose name matches, it SIGSTOPs the process, and when ``--open-by``
is given, checks that process still holds the file open (its ``/proc/PID/fd``): the
operation is then provably still in flight. An event of the wrong process (the app
reading a state file's header before a restore) is let go (SIGCONT) and the watch
goes on. On a hit it prints one JSON line and exits 0; the test SIGKILLs the frozen
process and inspects what the kill left.

    python freeze.py DIR REGEX EVENTS PID [--open-by PID]

EVENTS: comma-separated of create, modify, open, access. Prints ``ready`` once the
watch is in place.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import re
import signal
import struct
import sys

IN_ACCESS, IN_MODIFY, IN_OPEN, IN_CREATE = 0x1, 0x2, 0x20, 0x100
EVENTS = {"access": IN_ACCESS, "modify": IN_MODIFY, "open": IN_OPEN, "create": IN_CREATE}
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len


def open_fd_of(pid: int, path: str) -> int | None:
    """The fd number under which ``pid`` holds ``path`` open, or None."""
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == path:
                    return int(fd)
            except OSError:
                continue
    except OSError:
        return None
    return None


def fd_pos(pid: int, fd: int) -> int | None:
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}") as f:
            for line in f:
                if line.startswith("pos:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def main(argv: list[str]) -> int:
    folder, pattern, events, pid = os.path.realpath(argv[0]), re.compile(argv[1]), argv[2], int(argv[3])
    open_by = int(argv[argv.index("--open-by") + 1]) if "--open-by" in argv else None
    mask = 0
    for e in events.split(","):
        mask |= EVENTS[e]
    try:  # be first on a CPU when the event comes (root only; harmless elsewhere)
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(50))
    except (OSError, AttributeError):
        pass
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    ifd = libc.inotify_init1(0)
    if ifd < 0 or libc.inotify_add_watch(ifd, os.fsencode(folder), mask) < 0:
        print(json.dumps({"error": os.strerror(ctypes.get_errno())}), flush=True)
        return 2
    print("ready", flush=True)
    while True:
        buf = os.read(ifd, 64 * 1024)
        off = 0
        while off < len(buf):
            _wd, ev_mask, _cookie, n = _EVENT.unpack_from(buf, off)
            name = buf[off + _EVENT.size: off + _EVENT.size + n].rstrip(b"\0").decode(errors="replace")
            off += _EVENT.size + n
            if not (ev_mask & mask) or not pattern.fullmatch(name):
                continue
            os.kill(pid, signal.SIGSTOP)
            path = os.path.join(folder, name)
            if open_by is not None:
                fd = open_fd_of(open_by, path)
                if fd is None:  # not the process we wait for, or already done: let it go on
                    os.kill(pid, signal.SIGCONT)
                    continue
                pos = fd_pos(open_by, fd)
            else:
                pos = None
            try:
                size = os.stat(path).st_size
            except OSError:
                size = None
            print(json.dumps({"name": name, "mask": ev_mask, "pos": pos, "size": size}), flush=True)
            return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
