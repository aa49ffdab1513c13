"""The app killed (SIGKILL) in the middle of a park, a resume and an A/B arm, on the real server.

The app side runs as its own process (tests/faults/driver.py, or the ``kv-valet`` CLI)
and is killed at an exact point of the workflow: the driver stops there and says so,
or a watcher freezes the CLI the moment the server creates the temporary state file.
The "next start" is a ``kv-valet resume`` in a new process, as a user would run it: it
finishes or undoes what the kill interrupted, says so on stderr, and the session it
resumes is the copy the journal says must survive.

There is no "move between save folders" in KV Valet (a session's files stay in the
folder they were parked in; a rename changes the catalog name only), so the re-park of
an existing session, which writes under a temporary name and swaps the files in, is
the move that is interrupted here.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.faults.helpers import MORE, SHORT, Freezer, Proc, Server, assert_consistent, cli, state_bytes

pytestmark = pytest.mark.real_server


async def _park_old_copy(srv: Server) -> tuple[int, bytes]:
    """Park slot 0 as "chat" (the copy that must survive), then give the slot a few more
    tokens, so the old and the new copy differ in their token count."""
    svc, cat = await srv.service()
    try:
        old = (await svc.park(0, "chat")).record
    finally:
        await svc.aclose()
        cat.close()
    await srv.fill(0, SHORT + MORE)
    return old.n_tokens, state_bytes(srv.save_dir, old.state_file)


async def _next_start_resumes(expected_tokens: int, note: str) -> str:
    """A new ``kv-valet resume``: recovery says what it did, the right copy resumes."""
    rc, out, err = await cli("resume", "real", "chat", "--slot", "1", "--yes")
    assert rc == 0, (out, err)
    assert note in err, err
    assert f"resumed 'chat' into slot 1: {expected_tokens:,} tokens" in out, out
    return err


def test_app_killed_mid_park_keeps_one_good_copy(stock_profile):
    """Killed after the server saved (journal: saving), killed with the new file swapped in
    but no catalog row (journal: commit), and a CLI killed the moment the save begins."""
    async def go():
        srv = await Server(stock_profile).start()
        try:
            await srv.fill(0)
            n_old, old_bytes = await _park_old_copy(srv)
            save_dir = srv.save_dir

            # 1. killed after the server wrote the temporary file: the park is undone
            d = await Proc.driver(op="park", profile="real", slot=0, name="chat", pause="saved")
            await d.expect("at saved")
            tmp = [f.name for f in save_dir.iterdir() if f.name.startswith("kvv-tmp-")]
            assert len(tmp) == 1 and tmp[0].endswith(".bin")
            await d.kill()
            await _next_start_resumes(n_old, "park of 'chat' was interrupted while saving: temporary files removed")
            listed = assert_consistent([save_dir])
            assert listed["chat"].n_tokens == n_old
            assert state_bytes(save_dir, listed["chat"].state_file) == old_bytes  # byte-identical

            # 2. killed between the file swap and the catalog row: the park is finished
            d = await Proc.driver(op="park", profile="real", slot=0, name="chat", pause="commit")
            await d.expect("at commit")
            names = sorted(f.name for f in save_dir.iterdir())
            assert "chat.bin" in names and any(n.endswith(".prev.bin") for n in names), names  # old copy aside
            await d.kill()
            n_new = await _tokens_in(save_dir / "chat.bin")  # the new copy is in place, not yet listed
            assert n_new > n_old
            await _next_start_resumes(n_new, "park of 'chat' was interrupted after the state file was moved: "
                                             "finished")
            listed = assert_consistent([save_dir])
            assert listed["chat"].n_tokens == n_new

            # 3. the CLI itself, killed the moment the server creates the temporary state file
            await srv.fill(0, SHORT + MORE + MORE)
            n_before = listed["chat"].n_tokens
            before = state_bytes(save_dir, "chat.bin")
            p = await Proc.start(*_cli_argv("park", "real", "--slot", "0", "--name", "chat"))
            freezer = await Freezer.watch(save_dir, r"kvv-tmp-[0-9a-f]+\.bin", "create", p.pid)
            try:
                await freezer.hit()
            finally:
                await freezer.stop()
            await p.kill()
            await _server_closed_files(srv, save_dir)  # the server finishes the save it was asked for
            await _next_start_resumes(n_before, "park of 'chat' was interrupted while saving: temporary files "
                                                "removed")
            assert_consistent([save_dir])
            assert state_bytes(save_dir, "chat.bin") == before
        finally:
            await srv.aclose()

    asyncio.run(go())


def test_app_killed_mid_resume_loses_nothing(stock_profile):
    """Killed after the server restored the slot, before the catalog notes the restore (its figures, its
    verdict, its history event: one commit, so never half of it)."""
    async def go():
        srv = await Server(stock_profile).start()
        try:
            await srv.fill(0)
            svc, cat = await srv.service()
            try:
                rec = (await svc.park(0, "chat")).record
            finally:
                await svc.aclose()
                cat.close()
            before = state_bytes(srv.save_dir, rec.state_file)

            d = await Proc.driver(op="resume", profile="real", name="chat", slot=1, pause="restored")
            await d.expect("at restored")
            await d.kill()
            # the server did restore; the catalog has nothing of it: neither its figures nor its event
            from app import paths
            from app.store.catalog import Catalog

            with Catalog(paths.catalog_path()) as cat:
                again = cat.get("real", "chat")
                assert (again.last_n_restored, again.last_restore_at) == (rec.last_n_restored, rec.last_restore_at)
                assert again.last_verdict == rec.last_verdict and cat.history(again.id) == []
            # the next start resumes it again, and the file never changed
            rc, out, err = await cli("resume", "real", "chat", "--slot", "0", "--yes")
            assert rc == 0 and f"{rec.n_tokens:,} tokens" in out, (out, err)
            assert_consistent([srv.save_dir])
            assert state_bytes(srv.save_dir, rec.state_file) == before
        finally:
            await srv.aclose()

    asyncio.run(go())


def test_app_killed_mid_ab_arm_puts_the_sidecar_back(sidecar_profile):
    """Killed with the checkpoint sidecar hidden for the A/B's second arm: the next start
    puts it back, byte-identical, and says so."""
    async def go():
        srv = await Server(sidecar_profile).start()
        try:
            await srv.fill(0)
            svc, cat = await srv.service()
            try:
                rec = (await svc.park(0, "chat")).record
            finally:
                await svc.aclose()
                cat.close()
            sidecar = srv.save_dir / (rec.state_file + ".ckpt")
            assert rec.sidecar_file == sidecar.name and sidecar.is_file(), rec
            sidecar_before = sidecar.read_bytes()

            d = await Proc.driver(op="ab", profile="real", name="chat", slot=1, pause="hidden")
            await d.expect("at hidden", timeout=120)
            hidden = sidecar.with_name(sidecar.name + ".kvv-hidden")
            assert hidden.is_file() and not sidecar.exists()
            await d.kill()
            assert hidden.is_file() and not sidecar.exists()  # nobody put it back yet

            await _next_start_resumes(rec.n_tokens, f"put back the sidecar {sidecar} that an interrupted A/B "
                                                    "check had hidden")
            assert sidecar.read_bytes() == sidecar_before and not hidden.exists()
            listed = assert_consistent([srv.save_dir])
            assert listed["chat"].sidecar_status == "present"
        finally:
            await srv.aclose()

    asyncio.run(go())


# -- helpers -----------------------------------------------------------------------------------------


def _cli_argv(*args: str) -> list[str]:
    import sys

    return [sys.executable, "-m", "app.cli", *args]


async def _tokens_in(path) -> int:
    from app.server.statefile import read_state_header

    return read_state_header(path).token_count


async def _server_closed_files(srv: Server, folder) -> None:
    """Wait until the server holds no file of ``folder`` open (its save is over)."""
    import os

    folder = os.path.realpath(folder)

    def open_files() -> list[str]:
        out = []
        for fd in os.listdir(f"/proc/{srv.pid}/fd"):
            try:
                target = os.readlink(f"/proc/{srv.pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(folder + "/"):
                out.append(target)
        return out

    loop = asyncio.get_running_loop()
    end = loop.time() + 30
    while open_files():
        assert loop.time() < end, open_files()
        await asyncio.sleep(0.01)  # polling a condition, not a timed wait
