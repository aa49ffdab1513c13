"""``kv-valet resume --yes --unless-hazard --unless-useless chat --unless-files-changed --json``: what the
conversation proxy on another machine asks of a host's kv-valet. Each check that leaves the park parked
is said with its one-word ``refused`` (what app.servers.remote_sessions.RemoteSessions.resume raises
again as ResumeHazard, ResumeUseless, ResumeMismatch); the flags reach the session service's resume.
The files-changed case on a fake server: tests/fake_server/test_park_files_cli.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from app.cli import main as cli_main
from app.sessions.resume import ResumeHazard, ResumeUseless


class RefusingService:
    profile_name = "big"

    def __init__(self, error: Exception):
        self.error, self.asked = error, None

    async def resume(self, name, slot_id=None, **kw):
        self.asked = (name, slot_id, kw)
        raise self.error

    async def aclose(self):
        pass


@pytest.mark.parametrize("error, refused, said", [
    (ResumeHazard("onto chat B's checkpoints"), "hazard", "onto chat B's checkpoints"),
    (ResumeUseless(SimpleNamespace(sentence="Gemma 3 on build 11434 re-prefills", remedy="--swa-full")), "useless",
     "Gemma 3 on build 11434 re-prefills; to resume: --swa-full"),
])
def test_a_refusal_asked_for_is_said_with_its_word(monkeypatch, capsys, error, refused, said):
    svc = RefusingService(error)

    async def connect(catalog, target, **kw):
        return svc
    monkeypatch.setattr("app.cli.sessions.connect", connect)
    status = cli_main(["resume", "big", "proxy-c1", "--slot", "1", "--yes", "--unless-hazard",
                       "--unless-useless", "chat", "--unless-files-changed", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert status == 1 and out["ok"] is False and out["refused"] == refused, out
    assert out["error"] == f"'proxy-c1' was left parked: {said}" and out["details"] == [said]
    assert svc.asked == ("proxy-c1", 1, {"force": True, "avoid_mismatch": True, "avoid_hazard": True,
                                         "avoid_useless": "chat"})
