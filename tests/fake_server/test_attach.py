"""Attach mode and leftover servers, against the fake llama-server."""

from __future__ import annotations

import os

import pytest

from app.core.profile import LaunchProfile
from app.server.attach import AttachedServer
from app.server.launcher import make_supervisor, pid_record_path, plan_launch
from app.core.states import ServerState
from app.server.supervisor import find_leftover_server, read_pid_record
from tests.fake_server.test_supervisor_fake import FAKE, free_port


@pytest.fixture
def profile(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    return LaunchProfile(name="fake", model=str(model), server_binary=FAKE, port=free_port())


async def test_attach_watches_without_owning(profile):
    sup = make_supervisor(plan_launch(profile))
    await sup.start()
    try:
        att = AttachedServer(sup.url, interval_s=0.05)
        assert await att.start() == ServerState.READY
        with pytest.raises(PermissionError, match="not started by KV Valet"):
            await att.stop_server()
        import asyncio

        crashed = []
        reported = asyncio.Event()
        att.on_state(lambda s, o: (crashed.append((s, o)), reported.set()))
        await sup.stop()
        await asyncio.wait_for(reported.wait(), 120)  # the watcher reports on its next poll
        assert crashed[0][0] == ServerState.CRASHED and "does not answer" in crashed[0][1].detail
        await att.aclose()
    finally:
        await sup.aclose()


async def test_leftover_server_is_found_by_pid_and_start_time(profile, tmp_path):
    sup = make_supervisor(plan_launch(profile))
    await sup.start()
    try:
        rec = find_leftover_server(pid_record_path("fake"))
        assert rec is not None and rec.pid == sup.pid and rec.url == profile.url
        # A record whose start time does not match (a recycled pid) is not ours, and is cleaned.
        fake = pid_record_path("other")
        fake.write_text(pid_record_path("fake").read_text().replace(str(rec.create_time), str(rec.create_time - 100)))
        assert read_pid_record(fake) is not None
        assert find_leftover_server(fake) is None and not fake.exists()
        # Our own leftover can be stopped from an attachment.
        att = AttachedServer(profile.url, leftover=rec)
        await att.stop_server()
        await att.aclose()
        await sup.wait_state(ServerState.CRASHED, ServerState.STOPPED, timeout=120)
        assert not rec.is_alive()
    finally:
        await sup.aclose()
    assert find_leftover_server(pid_record_path("fake")) is None
    assert os.path.exists(str(pid_record_path("fake"))) is False


@pytest.mark.gui
def test_window_attaches_and_never_stops_a_foreign_server(qtbot, qloop, profile):
    from app.store.profiles import ProfileStore
    from app.ui.panels import build_window
    from tests.conftest import run, signal_future

    sup = make_supervisor(plan_launch(profile))
    run(qloop, sup.start(), 120)
    try:
        w = build_window(ProfileStore(), tabs=False)
        qtbot.addWidget(w)
        ready = signal_future(w.controller.sig_state, lambda s, d: s == "Ready")
        run(qloop, w.controller.attach_async(profile.url), 120)
        run(qloop, ready, 120) if not ready.done() else None
        assert "Server Ready" in w.state_label.text() and "(attached)" in w.url_label.text()
        assert not w.controller.owned and w.controller.pid is None
        run(qloop, w.shutdown(), 120)
        assert sup.running  # closing the window left the foreign server alone
    finally:
        run(qloop, sup.aclose(), 120)


@pytest.mark.gui
def test_window_finds_a_server_left_by_an_earlier_app(qtbot, qloop, profile):
    from app.store.profiles import ProfileStore
    from app.ui.dialogs.leftovers import check_leftover_servers
    from app.ui.panels import build_window
    from tests.conftest import run

    store = ProfileStore()
    store.save(profile)
    sup = make_supervisor(plan_launch(profile))  # "the earlier app" launched it
    run(qloop, sup.start(), 120)
    try:
        w = build_window(store, tabs=False)
        qtbot.addWidget(w)
        found = check_leftover_servers(w, ask=False)
        assert [(r.pid, r.url, r.profile) for r in found] == [(sup.pid, profile.url, "fake")]
        run(qloop, w.controller.attach_async(found[0].url, leftover=found[0]), 120)
        assert w.controller.pid == sup.pid  # ours: it may be stopped from here
        run(qloop, w.controller.stop_async(), 120)
        run(qloop, sup.wait_state(ServerState.CRASHED, ServerState.STOPPED, timeout=120), 120)
        assert not found[0].is_alive()
        run(qloop, w.shutdown(), 120)
    finally:
        run(qloop, sup.aclose(), 120)
