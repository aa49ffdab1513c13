"""The conversation proxy on the turboquant fork's behaviour (KV Valet's sidecar build run with
KVV_SIDECAR_MODE=fork), driven by the real `openai` client: three conversations over two slots,
server restarts, each returning conversation judged from the server's own ``cache_n``/``prompt_n``.

What the fork at #206 does (``shared/reference/llama-server.md``, "The turboquant fork itself"):
it writes PKCL v1 sidecars and loads them on a restore (the park comes back with its checkpoints:
HIT); with no usable sidecar it silently makes a tip checkpoint over the restored tokens, which a
chat client's re-rendered tail cannot use (a full re-prefill: DISCARDED); and a restore KEEPS the slot's
earlier checkpoints, so a park without a sidecar restored into a slot another chat used in the same
process would roll back onto that chat's checkpoint (a reuse of the wrong sliding-window state): the
proxy does not restore it there, the prompt is processed anew, and the park is kept for a safe restore.

A missing sidecar is made by deleting a park's ``.ckpt`` (as after "failed to write checkpoint
sidecar"); everything else is the real server's own doing.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from app.core.conversation import Cause

from app.core.verdict import VerdictKind, tolerance
from app.server.sidecar import read_facts
from tests.conftest import free_port
from tests.real.test_real_proxy import SYSTEMS, Proxied, rotate, turn
from tests.real.sidecar_bin import sidecar_server_bin  # noqa: F401  (fixture)

pytestmark = pytest.mark.real_server


@pytest.fixture
def fork_profile(real_profile, sidecar_server_bin, monkeypatch):
    monkeypatch.setenv("KVV_SIDECAR_MODE", "fork")
    return real_profile.replace(name="fork", server_binary=str(sidecar_server_bin), proxy=True)


def park_of(profile, conv_id: str) -> Path:
    return Path(profile.slot_save_path) / f"proxy-{conv_id}.bin"


def hide_sidecar(profile, conv_id: str) -> None:
    """The park loses its sidecar (a write that failed): the state file alone is restored."""
    ckpt = park_of(profile, conv_id).with_name(park_of(profile, conv_id).name + ".ckpt")
    assert ckpt.is_file(), ckpt
    ckpt.unlink()


def log_since(p: Proxied, seq: int) -> list[str]:
    return [line.event.line for line in p.handle.supervisor.log.since(seq)]


def last_seq(p: Proxied) -> int:
    lines = p.handle.supervisor.log.since(0)
    return lines[-1].seq if lines else 0


def test_fork_conversations_after_restarts_are_judged_as_the_fork_behaves(fork_profile):
    async def go():
        # -- server 1: A, B, C over two slots; A comes back from its park (PKCL v1 sidecar loaded)
        async with Proxied(fork_profile) as p:
            first, back_a, _ = await rotate(p)
            assert back_a.verdict is VerdictKind.HIT, back_a
            assert p.proxy._backend.checkpoints_loaded[back_a.slot] is True  # predicted: the fork loads it
            report = await p.stop()  # park every conversation before the restart
            assert report.stopped and report.complete
        convs = {name: rec.conversation for name, (_, rec) in first.items()}
        for name, conv in convs.items():
            facts = read_facts(park_of(fork_profile, conv))
            assert (facts.kind, facts.version) == ("PKCL", 1) and facts.count, (name, facts)  # the fork's v1
        msgs = {name: turn(SYSTEMS[name], ("What is the first word?", first[name][0]), ("And the second?", "x"),
                           question="And then?") for name in "ABC"}
        hide_sidecar(fork_profile, convs["A"])

        # -- server 2 (a new process, a new app): B and C come back warm; A, without its sidecar, goes
        # into B's slot, whose checkpoints the fork kept across the restore
        async with Proxied(fork_profile.replace(port=free_port())) as p2:
            _, rb = await p2.ask(msgs["B"])
            _, rc = await p2.ask(msgs["C"])
            for rec, name in ((rb, "B"), (rc, "C")):
                assert rec.conversation == convs[name] and rec.restored_from == f"proxy-{convs[name]}", rec
                assert rec.verdict is VerdictKind.HIT, rec
                assert rec.cache_n >= rec.expected_reuse - tolerance(rec.expected_reuse) and rec.prompt_n < 100, rec  # a small delta
                assert p2.proxy._backend.checkpoints_loaded[rec.slot] is True
            assert any("restored" in line and "context checkpoints from sidecar" in line for line in log_since(p2, 0))
            seq = last_seq(p2)
            _, ra = await p2.ask(msgs["A"])
            # B's slot (the least recently used) holds B's checkpoints, which the fork would keep across a
            # restore of A's sidecar-less park: the proxy does not restore it, A is processed anew
            assert ra.conversation == convs["A"] and ra.slot == rb.slot, ra
            assert ra.restored_from is None, ra
            assert not any("restored context checkpoint" in line for line in log_since(p2, seq)), log_since(p2, seq)
            assert ra.verdict is VerdictKind.MISS, ra  # not restored: no restore to discard
            assert ra.prompt_n >= ra.expected_reuse - tolerance(ra.expected_reuse), ra
            assert ra.explanation is not None and ra.explanation.cause is Cause.RESTORE_WITHOUT_CHECKPOINTS, ra
            assert "did not restore it" in ra.explanation.detail, ra.explanation
            assert f"session 'proxy-{convs['B']}'" in ra.explanation.detail, ra.explanation
            kept = {c.id: c for c in p2.proxy.list()}[convs["A"]]
            assert kept.parked_as == f"proxy-{convs['A']}", kept  # the park stays, for a restore that is safe
            report = await p2.stop()
            assert report.stopped and report.complete
        hide_sidecar(fork_profile, convs["A"])  # A's new park holds checkpoints again: hidden once more

        # -- server 3: A alone, into a slot no chat used in this process. Without its sidecar the fork
        # would restore the tokens and fall back to its silent tip: a full re-prefill (the resume matrix's
        # "hidden" cell), so the proxy does not restore it and says so
        async with Proxied(fork_profile.replace(port=free_port())) as p3:
            seq = last_seq(p3)
            a_msgs = turn(SYSTEMS["A"], ("What is the first word?", first["A"][0]), ("And the second?", "x"),
                          ("And then?", "y"), question="And after that?")
            _, ra3 = await p3.ask(a_msgs)
            assert ra3.conversation == convs["A"] and ra3.restored_from is None, ra3
            assert ra3.slot not in p3.proxy._backend.checkpoints_loaded  # no restore was made
            assert ra3.verdict is VerdictKind.MISS and ra3.cache_n <= tolerance(ra3.expected_reuse), ra3
            assert ra3.prompt_n >= ra3.expected_reuse - tolerance(ra3.expected_reuse), ra3  # everything processed again
            assert ra3.explanation.cause is Cause.RESTORE_WITHOUT_CHECKPOINTS, ra3.explanation
            assert "did not restore" in ra3.explanation.detail and "no usable sidecar" in ra3.explanation.detail
            assert "kept from another chat" not in ra3.explanation.detail

    asyncio.run(go())
