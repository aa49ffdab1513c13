"""An API key reaches the real server and nothing else: not argv, not a log, not the pid record.

The key is typed where users type it by mistake (Extra arguments) and in the key
field; it must end up in the server's environment only, and every front end must
still get through with it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.jobs.service import SessionService
from app.server.launcher import make_supervisor, plan_launch, pid_record_path
from app.store.catalog import Catalog
from app import paths
from app.store.profiles import ProfileStore

pytestmark = pytest.mark.real_server

KEY = "kvv-secret-4f9d2c71"


def test_a_key_typed_into_extra_arguments_stays_out_of_argv_logs_and_records(real_profile, caplog):
    caplog.set_level(logging.DEBUG)
    profile = real_profile.replace(name="keyed", extra_args=("--api-key", KEY, "--metrics"))
    ProfileStore().save(profile)

    async def go():
        plan = await asyncio.to_thread(plan_launch, profile)
        sup = make_supervisor(plan)
        await sup.start()
        try:
            pid = sup.pid
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert KEY.encode() not in b" ".join(cmdline) and b"--metrics" in cmdline
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            assert f"LLAMA_API_KEY={KEY}".encode() in environ.split(b"\0")

            # the key works (the server demands it) and the service finds it in the profile
            with Catalog(paths.catalog_path()) as cat:
                svc = await SessionService.for_profile(cat, ProfileStore().load("keyed"))
                rows = await svc.slot_rows()
                assert len(rows) == 2
                await svc.aclose()
            # the CLI gets it from the environment, never from an argument
            env = dict(os.environ, LLAMA_API_KEY=KEY)
            r = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "app.cli", "status", plan.url,
                                                         "--json"], capture_output=True, text=True, env=env,
                                        timeout=60)
            assert r.returncode == 0 and json.loads(r.stdout)["health"] == "ok", r.stderr
            r = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "app.cli", "status", plan.url,
                                                         "--json"], capture_output=True, text=True,
                                        env={k: v for k, v in os.environ.items() if k != "LLAMA_API_KEY"},
                                        timeout=60)
            assert json.loads(r.stdout)["slots_error"]  # without the key: refused
            log_text = "\n".join(item.event.line for item in sup.log.since(0))
            record = pid_record_path("keyed").read_text()
        finally:
            await sup.aclose()
        return log_text, record

    log_text, record = asyncio.run(go())
    assert "listening on" in log_text and KEY not in log_text
    assert KEY not in record
    assert KEY not in caplog.text
    from app.store.profiles import profile_path

    saved = profile_path("keyed", ProfileStore().folder)
    assert "--api-key" not in saved.read_text() and saved.stat().st_mode & 0o077 == 0
