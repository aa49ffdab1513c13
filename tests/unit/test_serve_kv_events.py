"""``kv-valet serve … --kv-events ENDPOINT``: only with the proxy here (it is what knows each slot's
tokens), refused before anything starts otherwise (app/cli/serve.py; the events: app/proxy/kv_events.py)."""

from __future__ import annotations

from app.cli import main
from app.cli.errors import Exit
from app.store.profiles import ProfileStore


def test_kv_events_without_the_proxy_are_refused_before_anything_starts(capsys):
    line = "llama-server -m /nonexistent/m.gguf -c 4096 -np 2"
    assert main(["profiles", "import", "--name", "plain", line]) == 0
    assert main(["serve", "plain", "--kv-events", "tcp://127.0.0.1:5557"]) == Exit.USAGE
    assert "--kv-events needs the proxy" in capsys.readouterr().err
    assert ProfileStore().load("plain").proxy is False  # nothing changed, nothing launched


def test_kv_events_for_a_hosts_server_are_refused(capsys):
    assert main(["serve", "box:default", "--proxy", "--kv-events", "tcp://127.0.0.1:5557"]) == Exit.USAGE
    assert "--kv-events is for a server here" in capsys.readouterr().err
