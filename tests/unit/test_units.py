"""The one byte formatter and the one duration formatter (app.core.units): a table of values,
and the same text for the same session in the window and the CLI."""

from __future__ import annotations

import pytest

from app.core.units import GiB, KiB, MiB, NA, TiB, fmt_bytes, fmt_duration


@pytest.mark.parametrize("n, text", [
    (None, "N/A"), (NA, "N/A"), ("x", "N/A"), (float("nan"), "N/A"),
    (0, "0 B"), (1, "1 B"), (512, "512 B"), (1023, "1023 B"),
    (KiB, "1.0 KiB"), (1536, "1.5 KiB"), (MiB - 1, "1.0 MiB"),  # never "1024.0 KiB"
    (40 * MiB, "40.0 MiB"), (int(1.2 * GiB), "1.2 GiB"), (16 * GiB, "16.0 GiB"),
    (3 * TiB, "3.0 TiB"), (5000 * TiB, "5,000.0 TiB"),
    (-2048, "-2.0 KiB"),
])
def test_fmt_bytes(n, text):
    assert fmt_bytes(n) == text


@pytest.mark.parametrize("seconds, text", [
    (None, "-"), (NA, "-"), ("x", "-"), (float("nan"), "-"), (float("inf"), "-"),
    (0, "0 ms"), (0.0004, "0 ms"), (0.85, "850 ms"), (0.9994, "999 ms"), (0.9996, "1.0 s"),
    (1, "1.0 s"), (12.34, "12.3 s"), (59.94, "59.9 s"), (59.96, "1 min"),
    (60, "1 min"), (61, "1 min 1 s"), (725, "12 min 5 s"), (3599.4, "59 min 59 s"), (3599.6, "1 h"),
    (3600, "1 h"), (3720, "1 h 2 min"), (7190, "2 h"), (86399, "1 d"), (183600, "2 d 3 h"),
    (-3, "-3.0 s"),
])
def test_fmt_duration(seconds, text):
    assert fmt_duration(seconds) == text


def test_one_formatter_under_one_name():
    """No second name for the formatters (the old ``human_bytes``, ``format_duration``, app.monitor.units)."""
    import importlib.util

    from app.core import rules, verdict

    assert not hasattr(rules, "human_bytes") and not hasattr(verdict, "format_duration")
    assert importlib.util.find_spec("app.monitor.units") is None and importlib.util.find_spec("app.proxy.model") is None


def test_a_sessions_size_and_time_saved_read_the_same_in_the_window_and_the_cli(qapp):
    from PySide6.QtCore import Qt

    from app.cli.sessions import list_line
    from app.store.catalog import SessionRecord
    from app.ui.sessions.model import COL_NAME, SessionsModel

    rec = SessionRecord(id=1, name="chat", profile="p", state_file="chat.bin", save_dir="/x",
                        state_size=41 * MiB + 123_456, sidecar_size=7 * MiB, n_tokens=4096,
                        time_saved_s=725.0, last_time_saved_s=12.0)
    model = SessionsModel()
    model.set_records([rec])
    # the window shows them in the row's tooltip (and the details line under the table)
    facts = dict(line.split(": ", 1) for line in model.data(model.index(0, COL_NAME), Qt.ToolTipRole).splitlines()
                 if ": " in line)
    size, saved = facts["Size"].split(" (")[0], facts["Time saved"].split(" (")[0]
    assert size == fmt_bytes(rec.state_size + rec.sidecar_size) == "48.1 MiB"
    assert saved == fmt_duration(rec.time_saved_s) == "12 min 5 s"
    line = list_line(rec)
    assert f" {size}  " in line and f"saved {saved} " in line
