"""packaging/screenshots.py takes the README's pictures from the running app on the real server."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from PySide6.QtGui import QImage

from tests.conftest import ROOT, free_port

pytestmark = [pytest.mark.real_server, pytest.mark.gui]


def test_the_screenshot_script_grabs_every_main_panel_of_the_live_window(real_binary, real_model, tmp_path):
    out = tmp_path / "shots"
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", LLAMA_SERVER=real_binary)
    r = subprocess.run([sys.executable, str(ROOT / "packaging" / "screenshots.py"), "--out", str(out),
                        "--port", str(free_port())], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    for name in ("monitor", "sessions", "cache-health", "log"):
        img = QImage(str(out / f"{name}.png"))
        assert not img.isNull() and img.width() >= 1200 and img.height() >= 700, name
        # a picture of something, not an empty grab: many distinct colours
        colours = {img.pixel(x, y) for x in range(0, img.width(), 23) for y in range(0, img.height(), 19)}
        assert len(colours) > 20, name
    assert str(out / "log.png") in r.stdout
