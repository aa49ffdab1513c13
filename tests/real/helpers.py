"""Helpers shared by the real-server tests (start a server, connect a job target)."""

from __future__ import annotations

import asyncio

from app import paths
from app.jobs.target import ServerTarget
from app.server.client import LlamaClient
from app.server.launcher import make_supervisor, plan_launch
from app.store.catalog import Catalog

# About 35 tokens per repeat: 20 repeats park ~700 tokens, above the 512-token SWA window.
TEXT = ("The valet parks each car in a numbered bay and writes the bay on a ticket. "
        "When the owner returns, the valet reads the ticket and fetches the car without searching. ") * 20


async def start_server(profile):
    plan = await asyncio.to_thread(plan_launch, profile)
    sup = make_supervisor(plan)
    await sup.start()
    return plan, sup


async def connect_target(plan, sup, profile) -> ServerTarget:
    """A job target on a *new* Catalog object each time: like an app restart."""
    return await ServerTarget.connect(LlamaClient(plan.url), Catalog(paths.catalog_path()), profile=profile,
                                      log=sup.log, build=plan.build)
