"""A stand-in for systemd-logind on a private D-Bus bus, for the shutdown-parking tests.

    python tests/doubles/fake_logind.py BUS_ADDRESS

It owns ``org.freedesktop.login1`` and serves ``/org/freedesktop/login1``:
``Inhibit(what, who, why, mode)`` returns the write end of a pipe, like logind's
inhibitor lock, and prints ``INHIBIT <what> <mode>``; when the caller closes its
copy (the lock is released) it prints ``RELEASED <seconds since the last
PrepareFor… signal>``. ``Emit(name, start)`` sends the signal ``PrepareForShutdown``
or ``PrepareForSleep``. Nothing from app/ is imported.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from PySide6.QtCore import ClassInfo, QCoreApplication, QObject, Slot
from PySide6.QtDBus import QDBusConnection, QDBusMessage, QDBusUnixFileDescriptor

IFACE = "org.freedesktop.login1.Manager"
PATH = "/org/freedesktop/login1"


@ClassInfo({"D-Bus Interface": IFACE})
class Manager(QObject):
    def __init__(self, bus: QDBusConnection):
        super().__init__()
        self.bus = bus
        self.signalled_at = time.monotonic()

    @Slot(str, str, str, str, result=QDBusUnixFileDescriptor)
    def Inhibit(self, what, who, why, mode):  # noqa: N802 (the D-Bus method's name)
        read_fd, write_fd = os.pipe()
        print(f"INHIBIT {what} {mode} {who}", flush=True)
        threading.Thread(target=self._watch, args=(read_fd,), daemon=True).start()
        fd = QDBusUnixFileDescriptor(write_fd)  # dup'ed into the reply
        os.close(write_fd)
        return fd

    def _watch(self, read_fd: int) -> None:
        while os.read(read_fd, 1):
            pass
        os.close(read_fd)
        print(f"RELEASED {time.monotonic() - self.signalled_at:.3f}", flush=True)

    @Slot(str, bool)
    def Emit(self, name, start):  # noqa: N802
        msg = QDBusMessage.createSignal(PATH, IFACE, name)
        msg.setArguments([start])
        self.signalled_at = time.monotonic()
        self.bus.send(msg)
        print(f"EMITTED {name} {start}", flush=True)


def main() -> int:
    app = QCoreApplication([])
    bus = QDBusConnection.connectToBus(sys.argv[1], "fake-logind")
    manager = Manager(bus)
    ok = (bus.isConnected() and bus.registerObject(PATH, manager, QDBusConnection.ExportAllSlots)
          and bus.registerService("org.freedesktop.login1"))
    print("READY" if ok else "FAILED", flush=True)
    return app.exec() if ok else 1


if __name__ == "__main__":
    sys.exit(main())
