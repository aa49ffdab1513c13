"""A ``kv-valet`` start is cheap: building the parser (every command's options and help) imports no
HTTP client. Each of a host's commands over SSH (a move's facts, receive and commit; a remote view's
status) is a new Python start, and aiohttp and httpx together cost about a third of a second of it."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("aiohttp", "httpx", "PySide6")


def test_building_the_parser_imports_no_http_client_and_no_qt():
    code = ("import json, sys; from app.cli import build_parser; build_parser(); "
            f"print(json.dumps([m for m in {list(HEAVY)!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout) == []
