"""Park before the computer shuts down or sleeps: a systemd-logind delay inhibitor.

While a server KV Valet started is running, the window holds a *delay* lock
(``org.freedesktop.login1.Manager.Inhibit("shutdown:sleep", …, "delay")``).
logind then announces a shutdown or a suspend with ``PrepareForShutdown(true)``
/ ``PrepareForSleep(true)`` and waits (up to its ``InhibitDelayMaxSec``) until
the lock is released: the window parks every filled slot in that time, then
releases it. Without logind (no system bus, another init system) nothing
happens here and the SIGTERM path still parks at logout.
"""

from __future__ import annotations

import logging
import os

from PySide6.QtCore import SLOT, QObject, Signal, Slot
from PySide6.QtDBus import QDBusConnection, QDBusMessage

from app.core.states import PowerEvent

log = logging.getLogger(__name__)

LOGIN1 = "org.freedesktop.login1"
PATH = "/org/freedesktop/login1"
IFACE = "org.freedesktop.login1.Manager"
#: the logind signals the guard hears, and its slots for them
SIGNALS = (("PrepareForShutdown", "_on_shutdown(bool)"), ("PrepareForSleep", "_on_sleep(bool)"))


def logind_bus_name() -> str | None:
    """The name of the private connection to ``$KV_VALET_LOGIND_BUS`` (None: the system bus)."""
    address = os.environ.get("KV_VALET_LOGIND_BUS")
    return f"kv-valet-logind {address}" if address else None


def logind_bus() -> QDBusConnection:
    """The system bus, or the bus at ``$KV_VALET_LOGIND_BUS`` (tests: a private bus with a fake logind)."""
    name = logind_bus_name()
    if name:
        # Qt keeps named connections for the process: one name per address, never a stale bus
        return QDBusConnection.connectToBus(os.environ["KV_VALET_LOGIND_BUS"], name)
    return QDBusConnection.systemBus()


class ShutdownGuard(QObject):
    sig_prepare = Signal(object, bool)  # PowerEvent.SHUTDOWN or .SLEEP, True when it is about to happen

    def __init__(self, bus: QDBusConnection | None = None, parent=None):
        super().__init__(parent)
        self._own_name = logind_bus_name() if bus is None else None  # a private connection made here
        self.bus = bus if bus is not None else logind_bus()
        self._fd: int | None = None
        self.connected = False
        if self.bus.isConnected():
            self.connected = all(
                self.bus.connect(LOGIN1, PATH, IFACE, name, self, SLOT(slot)) for name, slot in SIGNALS)

    def close(self) -> None:
        """Let go of everything: the lock, the two signals, and a private bus connection made here (Qt
        keeps a named connection for the life of the process otherwise, its socket and its thread's
        hooks with it). The window's shutdown does this, before this object goes."""
        self.release()
        if self.connected:
            for name, slot in SIGNALS:
                self.bus.disconnect(LOGIN1, PATH, IFACE, name, self, SLOT(slot))
            self.connected = False
        if self._own_name is not None:
            QDBusConnection.disconnectFromBus(self._own_name)
            self._own_name = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def take(self) -> bool:
        """Hold the delay lock (idempotent); False when logind is not there."""
        if self._fd is not None:
            return True
        if not self.bus.isConnected():
            return False
        msg = QDBusMessage.createMethodCall(LOGIN1, PATH, IFACE, "Inhibit")
        msg.setArguments(["shutdown:sleep", "KV Valet", "Parking llama-server chats before the computer "
                          "shuts down or sleeps", "delay"])
        reply = self.bus.call(msg)
        args = reply.arguments() if reply.type() == QDBusMessage.ReplyMessage else []
        if not args or not hasattr(args[0], "fileDescriptor") or args[0].fileDescriptor() < 0:
            log.info("no logind inhibitor lock: %s", reply.errorMessage() or "no reply")
            return False
        self._fd = os.dup(args[0].fileDescriptor())  # ours to close; the message's copy goes with it
        return True

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @Slot(bool)
    def _on_shutdown(self, start: bool) -> None:
        self.sig_prepare.emit(PowerEvent.SHUTDOWN, start)

    @Slot(bool)
    def _on_sleep(self, start: bool) -> None:
        self.sig_prepare.emit(PowerEvent.SLEEP, start)
