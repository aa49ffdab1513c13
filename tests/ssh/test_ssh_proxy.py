"""Issue #29 item 7: a chat client here talks to a host's server through the conversation proxy here
(``kv-valet serve HOST:PROFILE --proxy``), over a real sshd (tests/ssh/conftest.py), and its
conversation comes back warm on the host after the host's server restarts.

The host runs KV Valet's sidecar build (PKCL v2, tests/sidecar-server/build) with Gemma 3 270M, a
sliding-window model: a park there brings its context checkpoints back, so the restored conversation
is a HIT. What is asserted is what the user sees: the lines ``serve`` prints here, the answers the
``openai`` client gets, the parks the host lists (``kv-valet hosts sessions``), and the conversation
kept here (``kv-valet conversations list``)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading

import openai
import pytest

from app.core.profile import LaunchProfile
from tests.conftest import free_port
from tests.real.sidecar_bin import sidecar_server_bin  # noqa: F401  (fixture)
from tests.real.test_real_proxy import SYSTEMS, turn
from tests.ssh.test_ssh_end_to_end import cli, cli_json, user_ssh  # noqa: F401  (fixture)

pytestmark = pytest.mark.real_server

#: bounds for a failing test, never a measure: the host's server start, a park or restore over SSH
START_S = 300.0
LINE_S = 300.0


class Serve:
    """``kv-valet serve box:PROFILE --proxy --port PORT`` as a user runs it, its stderr read line by line."""

    def __init__(self, target: str, port: int):
        self.port = port
        self.proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", target, "--proxy", "--port", str(port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env=os.environ.copy())
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, text: str, bound: float = LINE_S) -> str:
        """The next line holding ``text`` (every line read is kept in ``seen``)."""
        while True:
            try:
                line = self.lines.get(timeout=bound)
            except queue.Empty:
                raise AssertionError(f"no line with {text!r} in {bound:g} s; seen:\n" + "\n".join(self.seen)) from None
            if line is None:
                raise AssertionError(f"serve ended (exit {self.proc.wait()}) before {text!r}; seen:\n"
                                     + "\n".join(self.seen))
            self.seen.append(line)
            if text in line:
                return line

    def stop(self) -> int:
        """Ctrl-C, as the user stops it: its conversations parked on the host; its exit status."""
        self.proc.send_signal(signal.SIGINT)
        self.wait_for("proxy stopped")
        return self.proc.wait(timeout=LINE_S)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def ask(port: int, messages: list[dict]) -> str:
    with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="not-needed", max_retries=0,
                       timeout=LINE_S) as client:
        reply = client.chat.completions.create(model="gemma", messages=messages, max_tokens=4, temperature=0)
    return reply.choices[0].message.content or ""


def test_a_chat_here_through_the_proxy_comes_back_warm_on_the_host_after_its_server_restarts(
        user_ssh, real_model, sidecar_server_bin):  # noqa: F811
    sshd = user_ssh
    there = LaunchProfile(name="there", model=real_model, server_binary=str(sidecar_server_bin), port=free_port(),
                          ctx_size=4096, parallel=1, slot_save_path=str(sshd.remote_home / "slots") + "/")
    sshd.save_profile(there)
    port = free_port()
    serve = Serve("box:there", port)
    try:
        # the host's server is down: serve starts it there, then listens here
        serve.wait_for("is not running: starting it there", START_S)
        ready = serve.wait_for("ready at", START_S)
        assert f"http://127.0.0.1:{port}" in ready
        first_q = turn(SYSTEMS["A"], question="What is the first word?")
        reply = ask(port, first_q)
        new = serve.wait_for("request ")
        assert "request NEW conversation " in new, new
        conv = new.split("conversation ", 1)[1].split()[0]
        assert serve.stop() == 0
        assert f"parked on box: conversation {conv} as 'proxy-{conv}'" in serve.seen[-2], serve.seen
    finally:
        serve.kill()
    # parked on the host, under the conversation's own name; the host's server still runs
    parks = cli_json("hosts", "sessions", "box", "--profile", "there", "--json")
    assert [s["name"] for s in parks] == [f"proxy-{conv}"] and parks[0]["n_tokens"] > 0, parks
    assert cli_json("hosts", "status", "box", "there", "--json")["health"] == "ok"

    # the host's server restarts (stopped, then started again by the next serve): its slots are empty
    assert cli_json("hosts", "stop", "box", "there", "--json")["active"] is False
    serve = Serve("box:there", port)
    try:
        serve.wait_for("is not running: starting it there", START_S)
        serve.wait_for("ready at", START_S)
        ask(port, turn(SYSTEMS["A"], ("What is the first word?", reply), question="And the second?"))
        back = serve.wait_for("request ")
        # the same conversation, restored from its park on the host, and warm: HIT
        assert f"request HIT conversation {conv} " in back and f"restored from 'proxy-{conv}'" in back, back
        assert serve.stop() == 0
    finally:
        serve.kill()
        cli("hosts", "stop", "box", "there", "--json")
    # kept here: the conversation and its last verdict
    [mine] = cli_json("conversations", "list", "box:there", "--json")
    assert mine["id"] == conv and mine["requests"] == 2 and mine["last_verdict"] == "HIT", mine
