"""Headless verdicts: `kv-valet serve` judges a resume that `kv-valet resume` did in another process,
for a query any client sends (here httpx straight to /completion), and `sessions list` shows it."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from app.store.profiles import ProfileStore

pytestmark = pytest.mark.real_server

GUARD_S = 600  # failure guards only: every wait below ends on an event, not on the clock


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True,
                          timeout=GUARD_S, env=os.environ.copy())


class Serve:
    """`kv-valet serve PROFILE --quiet` in the background; its stderr read line by line."""

    def __init__(self, profile: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", profile, "--quiet"],
                                     stderr=subprocess.PIPE, text=True, env=os.environ.copy())
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stderr:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, text: str) -> str:
        """The next stderr line that holds ``text`` (blocks on serve's own output)."""
        while True:
            line = self.lines.get(timeout=GUARD_S)
            if line is None:
                raise AssertionError(f"serve ended before '{text}':\n" + "".join(self.seen))
            self.seen.append(line)
            if text in line:
                return line

    def stop(self) -> tuple[int, str]:
        """SIGTERM (a logout), then its exit code and the rest of its output."""
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=GUARD_S)
        rest = []
        while (line := self.lines.get(timeout=GUARD_S)) is not None:
            rest.append(line)
        self.seen += rest
        return code, "".join(rest)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def headless_resume(profile, prompt: str, follow_up: str) -> tuple[str, dict, Serve, str]:
    """serve; fill slot 0 from a client; park and resume it (separate `kv-valet` processes);
    the client's next query on slot 0. Returns serve's verdict line, the session as
    `sessions list --json` shows it, the stopped Serve and its output after SIGTERM."""
    ProfileStore().save(profile)
    serve = Serve(profile.name)
    try:
        serve.wait_for("ready at")
        with httpx.Client(base_url=profile.url, timeout=GUARD_S, trust_env=False) as client:
            client.post("/completion", json={"prompt": prompt, "id_slot": 0, "n_predict": 2,
                                             "cache_prompt": True}).raise_for_status()
            parked = cli("park", profile.name, "--slot", "0", "--name", "chat")
            assert parked.returncode == 0, parked.stdout + parked.stderr
            resumed = cli("resume", profile.name, "chat", "--slot", "0", "--yes")
            assert resumed.returncode == 0, resumed.stdout + resumed.stderr
            assert "resumed 'chat' into slot 0" in resumed.stdout
            [waiting] = json.loads(cli("sessions", "list", "--json").stdout)
            assert waiting["last_verdict"] == "UNKNOWN"
            client.post("/completion", json={"prompt": prompt + follow_up, "id_slot": 0, "n_predict": 2,
                                             "cache_prompt": True}).raise_for_status()
        line = serve.wait_for("[kv-valet] verdict")
        [rec] = json.loads(cli("sessions", "list", "--json").stdout)
        code, rest = serve.stop()
    finally:
        serve.kill()
    assert code == 0, "".join(serve.seen)
    return line, rec, serve, rest


def test_serve_judges_a_resume_done_by_another_process(real_profile):
    from app import paths
    from app.store.catalog import Catalog
    from tests.real.helpers import TEXT

    line, rec, serve, rest = headless_resume(real_profile, TEXT, " Where is the car?")
    # Stock build, Gemma 3 (sliding window): no sidecar, so the restored cache is discarded.
    assert "verdict DISCARDED for 'chat' (slot 0)" in line, line
    assert rec["last_verdict"] == "DISCARDED" and "discarded" in rec["last_verdict_reason"]
    assert "sidecar" in rec["last_verdict_reason"] or "checkpoints" in rec["last_verdict_reason"]
    assert rec["last_time_saved_s"] == 0.0  # the ledger: a re-prefill saved nothing
    assert "parked slot 0 as '" in rest and "server stopped" in rest
    with Catalog(paths.catalog_path()) as cat:
        assert cat.pending_verdicts("real") == []  # judged and settled
        assert cat.prefill_rate("real")  # serve sampled the prefill rate through the same wiring
