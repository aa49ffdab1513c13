"""A logout or a reboot sends the window process SIGTERM or SIGHUP: the real signal, sent to a real
window process (``kv-valet --start PROFILE``, offscreen) running the real llama-server, parks the
filled slot before the process goes. The park is checked where a user finds it: the catalog and the
state file on disk (issue #28, item 5: the handler used to be tested by calling it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

import psutil
import pytest

from app import paths
from app.server.statefile import read_state_header
from app.store.catalog import Catalog
from app.store.profiles import ProfileStore
from tests.real.helpers import TEXT

pytestmark = pytest.mark.real_server


def complete(url: str, prompt: str, slot: int) -> dict:
    body = json.dumps({"prompt": prompt, "n_predict": 2, "id_slot": slot, "cache_prompt": True}).encode()
    req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_real_signal_to_the_window_parks_the_chat_then_quits(real_profile, sig):
    ProfileStore().save(real_profile)
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen"}
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "--start", real_profile.name],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()  # blocks until the window says its server is Ready (or exits)
        assert "server Ready at " in line, line
        url = line.strip().rsplit(" ", 1)[-1]
        done = complete(url, TEXT, 0)
        held = done["tokens_evaluated"]
        [server] = [c for c in psutil.Process(proc.pid).children(recursive=True) if "llama-server" in c.name()]

        proc.send_signal(sig)
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with Catalog(paths.catalog_path()) as cat:
        rows = cat.list(real_profile.name)
    assert [r.slot_id for r in rows] == [0], err
    assert rows[0].n_tokens >= held and read_state_header(rows[0].state_path).token_count == rows[0].n_tokens
    assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE
