"""Issue #36's case through the CLI, on the fake sidecar build in fork mode: two chats parked, X's ``.ckpt``
copied over Y's; ``sessions show Y`` names the file, ``check`` and ``resume`` of Y refuse without ``--yes``
(exit 1, never 0) and name the sidecar with both last checkpoint positions, ``--yes`` goes on; X still
checks as before. The same case on the real sidecar build: tests/real/test_real_park_files.py."""

from __future__ import annotations

import asyncio
import json
import re
import shutil

import httpx

from app.cli import main as cli_main
from app.server.client import LlamaClient
from tests.fake_server.test_park_resume import write_model

FORK = {"FAKE_SIDECAR": 1, "KVV_SIDECAR_MODE": "fork"}
TEXTS = {0: " ".join(f"word{i}" for i in range(700)), 1: " ".join(f"word{i}" for i in range(900))}


async def _fill(url: str, slot: int) -> None:
    async with LlamaClient(url) as c:
        await c.completion(TEXTS[slot], slot_id=slot, n_predict=4)


def _last(state_json: dict) -> int:
    return max(json.loads(state_json["parked_files"])[".ckpt"]["checkpoints"], key=lambda p: p[2])[2]


def test_another_chats_sidecar_is_refused_until_yes_and_the_right_one_checks(fake_server, tmp_path, capsys):
    write_model(tmp_path)
    slots = tmp_path / "slots"
    with fake_server(**FORK) as (url, _):
        for slot, name in ((0, "X"), (1, "Y")):
            asyncio.run(_fill(url, slot))
            assert cli_main(["park", url, "--slot", str(slot), "--name", name, "--save-dir", str(slots)]) == 0
    capsys.readouterr()
    assert cli_main(["sessions", "show", "X", "--json"]) == 0
    x = json.loads(capsys.readouterr().out)
    assert cli_main(["sessions", "show", "Y", "--json"]) == 0
    y = json.loads(capsys.readouterr().out)
    assert y["files_check"]["status"] == "as parked" and _last(x) != _last(y)
    shutil.copyfile(slots / "X.bin.ckpt", slots / "Y.bin.ckpt")  # the server stopped; X's sidecar over Y's

    named = f"not the sidecar this session parked (Y.bin.ckpt): last checkpoint at {_last(x):,}, parked with " \
            f"{_last(y):,}"
    assert cli_main(["sessions", "show", "Y"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"sidecar: +invalid \(\d+ checkpoints\): " + re.escape(named), out), out
    assert f"files:       {named} (a resume, check or move asks for --yes)" in out

    with fake_server(**FORK) as (url, proc):
        httpx.post(url + "/tokenize", json={"content": TEXTS[1]}, timeout=30)
        common = ["--save-dir", str(slots), "--log-file", str(proc.log_path), "--no-output-check"]
        assert cli_main(["check", url, "Y", *common]) == 1
        err = capsys.readouterr().err
        assert "not checked (pass --yes to go on)" in err and f"{named}: the check would use it" in err
        assert cli_main(["resume", url, "Y", "--slot", "1", "--save-dir", str(slots)]) == 1
        err = capsys.readouterr().err
        assert "--yes" in err and named in err
        assert cli_main(["check", url, "X", *common, "--json"]) == 0, capsys.readouterr().err
        assert json.loads(capsys.readouterr().out)["verdict"]["kind"] == "HIT"
        cli_main(["check", url, "Y", *common, "--yes", "--json"])  # --yes: checked, whatever it finds
        out = capsys.readouterr()
        assert "not checked" not in out.err and json.loads(out.out)["probes"]
        # what the conversation proxy on another machine asks the host's kv-valet: --yes for the slot's
        # warnings, but a park whose files are not its own stays parked, said in words the proxy reads
        before = httpx.get(url + "/slots", timeout=30).json()[1]
        assert cli_main(["resume", url, "Y", "--slot", "1", "--save-dir", str(slots), "--yes",
                         "--unless-files-changed", "--json"]) == 1
        refused = json.loads(capsys.readouterr().out)
        assert refused["ok"] is False and refused["error"] == "its files are not the ones parked: 'Y' was left parked"
        assert refused["refused"] == "files-changed"  # what RemoteSessions.resume reads (ResumeMismatch)
        assert any(named in d for d in refused["details"]), refused
        assert httpx.get(url + "/slots", timeout=30).json()[1] == before  # nothing was restored
        assert cli_main(["resume", url, "X", "--slot", "0", "--save-dir", str(slots), "--yes",
                         "--unless-files-changed", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["ok"] is True
