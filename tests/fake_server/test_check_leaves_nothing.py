"""A check and an A/B leave nothing behind: the stop's park of every slot (the one park-then-stop)
finds the slots they restored into empty, and no new session lands in the catalog or the save folder."""

from __future__ import annotations

from pathlib import Path

from app import paths
from app.core.lifecycle import StopTrigger
from app.server.launcher import slot_save_path_for
from app.sessions.check_report import PROTOCOL_ONE_PROCESS
from app.store.catalog import Catalog
from tests.fake_server.test_server_service import PROMPT, _launched, complete


async def test_a_check_and_an_ab_leave_nothing_for_the_stop_to_park(tmp_path, monkeypatch):
    servers, handle, profile = await _launched(tmp_path, monkeypatch)
    try:
        await complete(profile, PROMPT, 0)
        svc = await servers.sessions(handle.id)
        parked = (await svc.park(0, "chat")).record
        files = sorted(p.name for p in Path(slot_save_path_for(profile)).iterdir())
        await svc.check("chat", 1, protocol=PROTOCOL_ONE_PROCESS, output_check=False)
        await svc.ab("chat", 1, protocol=PROTOCOL_ONE_PROCESS, output_check=False)
        assert [(r.id, r.tokens_held or 0) for r in await svc.slot_rows()][1] == (1, 0)
        report = await servers.park_then_stop(handle.id, StopTrigger.SERVE)
    finally:
        await servers.aclose()
    assert report.stopped and report.complete
    assert [(r.slot_id, r.unchanged, r.record.name) for r in report.results] == [(0, True, "chat")]
    with Catalog(paths.catalog_path()) as cat:
        assert [(r.name, r.n_tokens) for r in cat.list("fake")] == [("chat", parked.n_tokens)]
    assert sorted(p.name for p in Path(slot_save_path_for(profile)).iterdir()) == files
