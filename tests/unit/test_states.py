"""The shared enums live in app.core.states; their old modules hand out the same classes."""

from __future__ import annotations

from app.core import states


def test_the_old_places_re_export_the_core_enums():
    from app.server.gguf_info import MemoryKind
    from app.server.sidecar import SidecarStatus
    from app.server.supervisor import ServerState

    assert MemoryKind is states.MemoryKind
    assert SidecarStatus is states.SidecarStatus
    assert ServerState is states.ServerState


def test_values_are_unchanged():
    """The catalog stores memory kinds and sidecar statuses by value; the window shows states by value."""
    assert [m.value for m in states.MemoryKind] == ["dense", "sliding-window", "recurrent-hybrid", "unknown"]
    assert [s.value for s in states.SidecarStatus] == ["present", "present, unverified", "missing", "invalid",
                                                      "not needed"]
    assert [s.value for s in states.ServerState] == ["Stopped", "Starting", "Loading", "Ready", "Stopping",
                                                    "Crashed"]


def test_power_events():
    assert states.PowerEvent("shutdown") is states.PowerEvent.SHUTDOWN
    assert states.PowerEvent.SHUTDOWN.doing == "shut down" and states.PowerEvent.SLEEP.doing == "sleep"
    assert f"parking before {states.PowerEvent.SLEEP}" == "parking before sleep"
