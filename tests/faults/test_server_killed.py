"""The real llama-server SIGKILLed idle, mid-prefill, mid-save and mid-restore.

"Mid-save" and "mid-restore" are exact: tests/faults/freeze.py freezes the server on the
first write to the temporary state file (or sidecar), or on its read of the state file,
and checks that the server still holds that file open (the HTTP call is provably in
flight) before the test kills it. A save or restore that slipped through before the
freeze is simply done again.
"""

from __future__ import annotations

import asyncio

import pytest

from app.sessions.resume import ResumeFailed
from app.sessions.service import ServiceError
from app.server.client import ServerUnreachable
from app.server.logparse import Kind
from tests.faults.helpers import MORE, SHORT, Freezer, Server, assert_consistent, state_bytes

pytestmark = pytest.mark.real_server

KILLED = "killed by a signal — signal 9 (SIGKILL)"


async def _resumes_after_restart(srv: Server, name: str, n_tokens: int, slot: int = 1) -> None:
    """Restart what died; the session is listed, its files agree, and it resumes whole."""
    await srv.start()
    svc, cat = await srv.service()
    try:
        assert [r.name for r in svc.sessions()] == [name]
        res = await svc.resume(name, slot, force=True)
        assert res.n_restored == n_tokens
    finally:
        await svc.aclose()
        cat.close()
    assert_consistent([srv.save_dir])


def test_server_killed_idle_and_mid_prefill(stock_profile):
    async def go():
        srv = await Server(stock_profile).start()
        try:
            await srv.fill(0)
            rec = await srv.park(0, "chat")
            before = state_bytes(srv.save_dir, rec.state_file)

            outcome = await srv.kill()  # idle
            assert outcome.summary().startswith(KILLED), outcome.summary()
            await _resumes_after_restart(srv, "chat", rec.n_tokens)

            # mid-prefill: killed when the log says the new prompt goes into the slot (its decode,
            # a second or two here, comes next)
            prefilling = asyncio.get_running_loop().create_future()
            srv.sup.on_line(lambda item: item.event.kind is Kind.NEW_PROMPT and not prefilling.done()
                            and prefilling.set_result(item.event.line))
            query = asyncio.ensure_future(srv.fill(0, SHORT * 2 + MORE, n_predict=8))
            await asyncio.wait_for(prefilling, 120)
            outcome = await srv.kill()
            with pytest.raises(ServerUnreachable):
                await query
            tail = "\n".join(outcome.last_lines)
            assert outcome.summary().startswith(KILLED) and "new prompt" in tail, outcome
            assert "prompt eval time" not in tail[tail.rindex("new prompt"):], tail  # the prefill never ended
            assert state_bytes(srv.save_dir, rec.state_file) == before
            await _resumes_after_restart(srv, "chat", rec.n_tokens)
        finally:
            await srv.aclose()

    asyncio.run(go())


async def _kill_mid_save(srv: Server, regex: str, events: str) -> tuple[dict, str, dict[str, bytes]]:
    """Re-park slot 0 as "chat" and SIGKILL the server while it writes ``regex``. Returns the
    freeze, the park's error and the files of the save folder as they were before that park."""
    svc, cat = await srv.service()
    try:
        for _attempt in range(5):
            files = {f.name: f.read_bytes() for f in srv.save_dir.iterdir()}
            pid = srv.pid  # gone from the supervisor once the server is killed
            freezer = await Freezer.watch(srv.save_dir, regex, events, pid, open_by=pid)
            park = asyncio.ensure_future(svc.park(0, "chat"))
            hit = freezer.hit_task()
            try:
                done, _ = await asyncio.wait({park, hit}, return_when=asyncio.FIRST_COMPLETED, timeout=120)
                if park in done:  # the save slipped through before the freeze: again
                    park.result()
                    continue
                outcome = await srv.kill()
                with pytest.raises(ServiceError) as e:
                    await park
                assert outcome.summary().startswith(KILLED), outcome.summary()
                return hit.result(), str(e.value), files
            finally:
                await freezer.stop(frozen_pid=pid)
        raise AssertionError("five saves in a row finished before the freeze")
    finally:
        await svc.aclose()
        cat.close()


@pytest.mark.parametrize("build", ["stock", "sidecar"])
def test_server_killed_mid_save_keeps_the_previous_copy(build, request):
    """Stock: killed while it writes the state file. Sidecar build (v2): killed while it
    writes the checkpoint sidecar, after the state file (a half sidecar next to a whole
    state file)."""
    profile = request.getfixturevalue(f"{build}_profile")
    regex, events = {"stock": (r"kvv-tmp-[0-9a-f]+\.bin", "modify"),
                     "sidecar": (r"kvv-tmp-[0-9a-f]+\.bin\.ckpt(\.tmp)?", "modify")}[build]

    async def go():
        srv = await Server(profile).start()
        try:
            await srv.fill(0)
            await srv.park(0, "chat")
            await srv.fill(0, SHORT + MORE)

            hit, message, before = await _kill_mid_save(srv, regex, events)
            assert "the server stopped answering during the save" in message, message
            assert hit["pos"] is not None  # the server held the file open: the save was in flight
            # the failed park cleaned up after itself at once: no temporary file, the previous copy
            # (state file and sidecar) byte-identical
            after = {f.name: f.read_bytes() for f in srv.save_dir.iterdir()}
            assert sorted(after) == sorted(before) and after == before, sorted(after)
            assert sorted(before) == (["chat.bin", "chat.bin.ckpt"] if build == "sidecar" else ["chat.bin"])
            from app.server.statefile import read_state_header

            await _resumes_after_restart(srv, "chat", read_state_header(srv.save_dir / "chat.bin").token_count)
        finally:
            await srv.aclose()

    asyncio.run(go())


def test_server_killed_mid_restore(stock_profile):
    async def go():
        srv = await Server(stock_profile).start()
        try:
            await srv.fill(0)
            rec = await srv.park(0, "chat")
            before = state_bytes(srv.save_dir, rec.state_file)
            svc, cat = await srv.service()
            try:
                for _attempt in range(5):
                    pid = srv.pid  # gone from the supervisor once the server is killed
                    freezer = await Freezer.watch(srv.save_dir, rf"{rec.state_file}", "open,access", pid,
                                                  open_by=pid)
                    resume = asyncio.ensure_future(svc.resume("chat", 1, force=True))
                    try:
                        hit = freezer.hit_task()
                        done, _ = await asyncio.wait({resume, hit}, return_when=asyncio.FIRST_COMPLETED,
                                                     timeout=60)
                        if resume in done:  # finished before the freeze: again
                            resume.result()
                            continue
                        outcome = await srv.kill()
                        with pytest.raises(ResumeFailed) as e:
                            await resume
                        break
                    finally:
                        await freezer.stop(frozen_pid=pid)
                else:
                    raise AssertionError("five restores in a row finished before the freeze")
            finally:
                await svc.aclose()
                cat.close()
            assert "the server stopped answering during the restore" in str(e.value), e.value
            assert outcome.summary().startswith(KILLED)
            assert state_bytes(srv.save_dir, rec.state_file) == before
            await _resumes_after_restart(srv, "chat", rec.n_tokens)
        finally:
            await srv.aclose()

    asyncio.run(go())
