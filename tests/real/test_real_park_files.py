"""Issue #36's case on the real sidecar build in fork mode (Gemma 3 270M, -np 2): chats X and Y parked, the
server stopped, X's ``.ckpt`` copied over Y's, the server started again. ``kv-valet check`` of Y refuses
(exit 1, never 0) and names the sidecar with both last checkpoint positions; a resume of Y asks first and
the proxy's resume leaves it parked; X, whose sidecar is its own, still checks warm (exit 0).

Kept cheap: two chats of about 700 and 1,400 tokens (their last checkpoints differ), no output check."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from app.cli import main as cli_main
from app.core.confirmation import NeedsConfirmation
from app.core.park_files import ParkedFiles
from app.sessions.resume import ResumeMismatch
from tests.real.helpers import TEXT
from tests.real.sidecar_bin import sidecar_server_bin  # noqa: F401  (fixture)
from tests.real.test_real_sidecar_modes import CHAT, mode, mode_profile, park_chat  # noqa: F401
from tests.real.test_real_sidecar_verdicts import Running

pytestmark = pytest.mark.real_server


def _last(rec) -> int:
    return max(p[2] for p in ParkedFiles.from_json(rec.parked_files).positions())


def test_another_chats_sidecar_is_refused_by_name_and_the_right_one_still_checks(mode_profile, monkeypatch,
                                                                                  capsys):
    mode(monkeypatch, "fork")

    async def go():
        async with Running(mode_profile) as srv:
            x = await park_chat(srv, "X", 0, TEXT)
            y = await park_chat(srv, "Y", 1, CHAT)
        assert x.sidecar_file and y.sidecar_file and _last(x) != _last(y)
        shutil.copyfile(x.state_path.with_name(x.sidecar_file), y.state_path.with_name(y.sidecar_file))
        named = (f"not the sidecar this session parked ({y.sidecar_file}): last checkpoint at {_last(x):,}, "
                 f"parked with {_last(y):,}")

        async with Running(mode_profile) as srv:
            target = srv.svc.target
            common = [target.url, "--save-dir", str(target.save_dir), "--log-file", str(srv.sup.log_file_path),
                      "--no-output-check", "--json"]
            capsys.readouterr()
            # the CLI, as a user runs it next to the running server (its own loop: a thread here)
            assert await asyncio.to_thread(cli_main, ["check", *common[:1], "Y", *common[1:], "--slot", "1"]) == 1
            err = capsys.readouterr().err
            assert "not checked (pass --yes to go on)" in err and named in err, err
            with pytest.raises(NeedsConfirmation) as asked:
                await srv.svc.resume("Y", 1)
            assert named in asked.value.warnings[0]
            with pytest.raises(ResumeMismatch):  # the proxy's resume: the park stays parked
                await srv.svc.resume("Y", 1, force=True, avoid_mismatch=True)
            assert target.restored == {}

            assert await asyncio.to_thread(cli_main, ["check", *common[:1], "X", *common[1:], "--slot", "0"]) == 0
            report = json.loads(capsys.readouterr().out)
            assert report["verdict"]["kind"] in ("HIT", "PARTIAL"), report["verdict"]["reason"]

    asyncio.run(go())
