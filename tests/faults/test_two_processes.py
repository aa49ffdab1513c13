"""Two KV Valet processes parking and deleting in one catalog and one save folder at once.

Each process (tests/faults/driver.py, the same SessionService the window and the CLI
use) parks its own slot of the same real server in a loop: a name both re-park
("shared", one state file and two writers), names of its own, two of which slug to one
file name ("a 1" and "a-1"), deletes of its older names and of "shared". At the end the
catalog and the folder must agree exactly: no row whose file is another session's save,
no file nobody lists, no journal entry left.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.faults.helpers import MORE, SHORT, Proc, Server, assert_consistent

pytestmark = pytest.mark.real_server

ROUNDS = 12


def test_two_processes_park_and_delete_at_once(stock_profile):
    async def go():
        srv = await Server(stock_profile).start()
        try:
            # different token counts in the two slots: a row paired with the other's file shows
            await asyncio.gather(srv.fill(0, SHORT), srv.fill(1, SHORT + MORE + MORE))
            a = await Proc.driver(op="loop", profile="real", slot=0, tag="a", n=ROUNDS)
            b = await Proc.driver(op="loop", profile="real", slot=1, tag="b", n=ROUNDS)
            await asyncio.gather(a.expect("connected"), b.expect("connected"))
            a.send("go")
            b.send("go")
            (rc_a, out_a, err_a), (rc_b, out_b, err_b) = await asyncio.gather(a.finish(300), b.finish(300))
            assert rc_a == 0 and rc_b == 0, (out_a, err_a, out_b, err_b)
            counts = [json.loads(out.split("done ", 1)[1].splitlines()[0]) for out in (out_a, out_b)]
            for c in counts:
                assert c["errors"] == [], counts
                assert c["parked"] == 3 * ROUNDS, counts
            listed = assert_consistent([srv.save_dir])
            # each process keeps its last two names; "shared" survives its last delete only if parked since
            assert {f"a {ROUNDS - 1}", f"a-{ROUNDS - 1}", f"b {ROUNDS - 1}", f"b-{ROUNDS - 1}"} <= set(listed)
            assert len({x.state_file for x in listed.values()}) == len(listed)  # one file per session
        finally:
            await srv.aclose()

    asyncio.run(go())


def test_a_re_park_or_delete_waits_for_another_process_commit(stock_profile):
    """The exact interleavings, forced: process A stops inside its commit of "shared" (the
    new file swapped in, the row not written); process B re-parks or deletes "shared"
    meanwhile and must wait for A (the catalog's files lock), whether A then goes on or is
    killed there. Without the wait, B's file ends under A's row, or A's row points at a file
    B unlinked."""
    async def go():
        srv = await Server(stock_profile).start()
        try:
            await asyncio.gather(srv.fill(0, SHORT), srv.fill(1, SHORT + MORE + MORE))
            svc, cat = await srv.service()
            try:
                n0 = (await svc.park(0, "shared")).record.n_tokens
                n1 = (await svc.park(1, "other")).record.n_tokens
                svc.delete("other")
            finally:
                await svc.aclose()
                cat.close()
            assert n1 > n0

            async def b_waits_for_a(**b_spec) -> tuple[Proc, Proc]:
                """B connected; A stopped in its commit; B told to go: B waits for A's lock."""
                b = await Proc.driver(profile="real", report_lock_waits=True, wait_go=True, **b_spec)
                await b.expect("connected")
                a = await Proc.driver(op="park", profile="real", slot=0, name="shared", pause="commit")
                await a.expect("at commit")
                b.send("go")
                await b.expect("waiting for the lock")
                return a, b

            # 1. B re-parks while A commits; A goes on: B's copy, parked last, is the one listed
            a, b = await b_waits_for_a(op="park", slot=1, name="shared")
            a.send("go on")
            (rc_a, out_a, _), (rc_b, out_b, err_b) = await asyncio.gather(a.finish(), b.finish())
            assert rc_a == 0 and rc_b == 0, (out_a, out_b, err_b)
            assert assert_consistent([srv.save_dir])["shared"].n_tokens == n1

            # 2. A killed in its commit: B finishes A's commit first (A's row), then its own
            a, b = await b_waits_for_a(op="park", slot=1, name="shared")
            await a.kill()
            rc_b, out_b, err_b = await b.finish()
            assert rc_b == 0, (out_b, err_b)
            assert "park of 'shared' was interrupted after the state file was moved: finished" in out_b, out_b
            assert assert_consistent([srv.save_dir])["shared"].n_tokens == n1

            # 3. B deletes while A commits: the delete waits, then removes A's row and A's file
            a, b = await b_waits_for_a(op="delete", name="shared")
            a.send("go on")
            (rc_a, out_a, _), (rc_b, out_b, err_b) = await asyncio.gather(a.finish(), b.finish())
            assert rc_a == 0 and rc_b == 0, (out_a, out_b, err_b)
            assert assert_consistent([srv.save_dir]) == {}
            assert list(srv.save_dir.iterdir()) == []
        finally:
            await srv.aclose()

    asyncio.run(go())
