"""The shared enums live in app.core.states, and are taken from there."""

from __future__ import annotations

from app.core import states


def test_the_shared_enums_are_imported_from_core_only():
    """No module takes them from the server modules that used to define them (no old import path)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    old = re.compile(r"from app\.server\.(supervisor|sidecar|gguf_info) import (\([^)]*|[^\n]*)"
                     r"\b(ServerState|SidecarStatus|MemoryKind)\b")
    offenders = [str(p.relative_to(root)) for d in ("app", "tests") for p in (root / d).rglob("*.py")
                 if old.search(p.read_text(encoding="utf-8"))]
    assert offenders == []


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
