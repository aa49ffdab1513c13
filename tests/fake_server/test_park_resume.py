"""Park / resume against the fake llama-server (a real subprocess)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from app import paths
from app.cli import main as cli_main
from app.sessions import park as park_mod
from app.sessions.journal import Recovery
from app.sessions.park import ParkError, default_name, park_all, park_slot, slugify
from app.sessions.park_commit import recover_parks
from app.sessions.resume_plan import PlanEntry, clear_resume_plan, load_resume_plan
from app.sessions.service import SessionService
from app.core.confirmation import NeedsConfirmation
from app.sessions.resume import (ResumeRefused, follow_up, preflight,
                             resume_session)
from app.sessions.records import delete_session, list_sessions, rename_session
from app.sessions.target import ServerTarget
from app.server.client import LlamaClient
from app.server.statefile import read_state_header
from app.store.catalog import Catalog

gguf = pytest.importorskip("gguf")

PROMPT = "the quiet valet parks the cache " * 60  # ~ 360 fake tokens


def write_model(tmp_path: Path, dense: bool = False) -> Path:
    """A tiny real GGUF so the app can read the memory kind (gemma3 SWA, or llama dense)."""
    path = tmp_path / "model.gguf"
    arch = "llama" if dense else "gemma3"
    w = gguf.GGUFWriter(str(path), arch)
    if not dense:
        w.add_uint32("gemma3.attention.sliding_window", 512)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run(coro):
    return asyncio.run(coro)


async def connect(url: str, tmp_path: Path, **kw) -> ServerTarget:
    catalog = Catalog(paths.catalog_path())
    t = await ServerTarget.connect(LlamaClient(url), catalog, save_dir=tmp_path / "slots")
    t.profile_name = "fake"  # like a profile: the same across server restarts (ports differ)
    for k, v in kw.items():
        setattr(t, k, v)
    return t


async def close(t: ServerTarget) -> None:
    await t.client.aclose()
    t.catalog.close()


async def fill_and_park(url, tmp_path, slot=0, name="chat", prompt=PROMPT, **kw):
    t = await connect(url, tmp_path, **kw)
    try:
        await t.client.completion(prompt, slot_id=slot, n_predict=4)
        return await park_slot(t, slot, name)
    finally:
        await close(t)


def tmp_files(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "slots").glob("kvv-tmp-*"))


# --------------------------------------------------------------------------- park


def test_park_writes_files_and_catalog_row(fake_server, tmp_path):
    write_model(tmp_path)
    with fake_server() as (url, _):
        res = run(fill_and_park(url, tmp_path, name="chat one"))
    rec = res.record
    state = tmp_path / "slots" / "chat-one.bin"
    assert rec.state_file == "chat-one.bin" and state.is_file()
    assert rec.n_tokens == read_state_header(state).token_count > 300
    assert rec.state_size == state.stat().st_size
    # a park never waits for the whole-model hash: size + first 16 MiB now, the SHA-256 in the background
    assert rec.memory_kind == "sliding-window" and rec.model_quick_id.startswith("q1:") and rec.model_size > 0
    assert rec.sidecar_status == "missing" and rec.sidecar_file is None
    assert rec.n_ctx_slot == 4096 and rec.server_build == "b11434-fake" and rec.save_ms >= 0
    assert any("re-prefill" in w for w in res.warnings)
    assert tmp_files(tmp_path) == []
    with Catalog(paths.catalog_path()) as cat:
        assert cat.get(rec.profile, "chat one").state_size == rec.state_size
        assert cat.list_pending() == []
        assert cat.build_persists_checkpoints("b11434-fake") is False
    assert not (paths.data_dir() / "model-hashes.json").exists()  # the park did not hash the whole model


def test_default_name_and_slug():
    assert default_name(0, time.mktime((2026, 11, 29, 16, 40, 0, 0, 0, -1))) == "2026-11-29 16-40 slot 0"
    for bad in ("a/b", "../x", "..", "x\x01y", ".hidden", "kvv-tmp-1"):
        s = slugify(bad)
        assert "/" not in s and ".." not in s and not s.startswith(".") and s.isprintable()
        assert not s.startswith("kvv-tmp-")
    assert slugify("会话 一") == "会话-一"


def test_out_of_range_and_empty_slot_refused(fake_server, tmp_path):
    write_model(tmp_path)
    with fake_server() as (url, _):
        async def go():
            t = await connect(url, tmp_path)
            try:
                with pytest.raises(ParkError, match="slot 7 does not exist: this server has slots 0-1"):
                    await park_slot(t, 7, "x")
                with pytest.raises(ParkError, match="slot 1 is empty"):
                    await park_slot(t, 1, "x")
            finally:
                await close(t)
        run(go())
    assert list((tmp_path / "slots").iterdir()) == []


def test_repark_replaces_and_removes_stale_sidecar(fake_server, tmp_path):
    write_model(tmp_path)
    with fake_server(FAKE_SIDECAR=1) as (url, _):
        first = run(fill_and_park(url, tmp_path, name="chat"))
    ckpt = tmp_path / "slots" / "chat.bin.ckpt"
    assert first.record.sidecar_status == "present" and ckpt.is_file()
    with fake_server() as (url, _):  # a stock build: writes no sidecar
        second = run(fill_and_park(url, tmp_path, name="chat", prompt=PROMPT + " more words here"))
    assert not ckpt.exists(), "a stale sidecar must never be paired with a new state file"
    assert second.record.id == first.record.id and second.record.sidecar_status == "missing"
    assert second.record.n_tokens > first.record.n_tokens
    assert sorted(p.name for p in (tmp_path / "slots").iterdir()) == ["chat.bin"]


def test_sidecar_valid_hidden_invalid_missing(fake_server, tmp_path):
    write_model(tmp_path)
    with fake_server(FAKE_SIDECAR=1) as (url, _):
        res = run(fill_and_park(url, tmp_path, name="sc"))
        rec = res.record
        assert rec.sidecar_status == "present" and rec.sidecar_count >= 1
        assert rec.sidecar_file == "sc.bin.ckpt" and rec.sidecar_size > 0
        assert "checkpoint" in rec.sidecar_reason and res.warnings == []
        ckpt = tmp_path / "slots" / "sc.bin.ckpt"

        async def pf():
            t = await connect(url, tmp_path)
            try:
                return await preflight(t, t.catalog.get(rec.profile, "sc"), 1)
            finally:
                await close(t)

        ok = run(pf())
        assert ok.refusals == [] and ok.warnings == [] and ok.reprefill_tokens is None
        hidden = tmp_path / "hidden.ckpt"
        shutil.move(ckpt, hidden)  # hidden = missing
        p = run(pf())
        assert p.reprefill_tokens == rec.n_tokens
        assert any("sidecar missing" in w and f"re-prefill about {rec.n_tokens:,} tokens" in w for w in p.warnings)
        ckpt.write_bytes(hidden.read_bytes()[:40])  # truncated = invalid
        p = run(pf())
        assert any("sidecar invalid" in w for w in p.warnings) and p.reprefill_tokens == rec.n_tokens


def test_reprefill_estimate_uses_measured_rate(fake_server, tmp_path):
    write_model(tmp_path)
    with fake_server() as (url, _):
        rec = run(fill_and_park(url, tmp_path, name="r")).record

        async def go():
            t = await connect(url, tmp_path)
            try:
                t.catalog.record_prefill(t.profile_name, 1000, 4000.0)  # 250 tok/s
                return await preflight(t, t.catalog.get(rec.profile, "r"), 1)
            finally:
                await close(t)
        p = run(go())
    assert p.reprefill_seconds == pytest.approx(rec.n_tokens / 250)
    assert any("250 tokens/s" in w and "about" in w for w in p.warnings)
    # the build parked an SWA slot and wrote no sidecar: said so
    assert any("never wrote a checkpoint sidecar" in w or "sidecar missing" in w for w in p.warnings)


# --------------------------------------------------------------------------- failures keep the old copy


def _snapshot(tmp_path):
    slots = tmp_path / "slots"
    with Catalog(paths.catalog_path()) as cat:
        rows = [asdict(r) for r in cat.list()]
        pending = cat.list_pending()
    return {p.name: sha(p) for p in slots.iterdir()}, rows, pending


@pytest.mark.parametrize("knob,mode", [("FAKE_SAVE_ERROR", "v2"), ("FAKE_DIE_DURING_SAVE", "v2"),
                                       ("FAKE_SAVE_ERROR", "fork")])
def test_failed_park_keeps_previous_copy(fake_server, tmp_path, knob, mode):
    """A save that fails keeps the previous copy. The fork answers a failed state write with success and
    0 bytes, and writes the sidecar anyway: the park still fails, and that sidecar goes."""
    write_model(tmp_path)
    with fake_server(FAKE_SIDECAR=1, KVV_SIDECAR_MODE=mode) as (url, _):
        run(fill_and_park(url, tmp_path, name="keep"))
    before = _snapshot(tmp_path)
    assert set(before[0]) == {"keep.bin", "keep.bin.ckpt"}
    with fake_server(FAKE_SIDECAR=1, KVV_SIDECAR_MODE=mode, **{knob: 1}) as (url, _):
        with pytest.raises(ParkError) as failed:
            run(fill_and_park(url, tmp_path, name="keep", prompt=PROMPT + " changed"))
    if mode == "fork":
        assert "wrote 0 bytes" in str(failed.value)
    assert _snapshot(tmp_path) == before
    assert tmp_files(tmp_path) == []


def test_commit_failure_rolls_back(fake_server, tmp_path):
    """Disk/catalog failure after the new state file was moved in: all back as it was."""
    write_model(tmp_path)
    with fake_server(FAKE_SIDECAR=1) as (url, _):
        run(fill_and_park(url, tmp_path, name="keep"))
        before = _snapshot(tmp_path)

        def boom(self, rec):
            raise OSError(28, "No space left on device")
        real = Catalog.add_or_replace
        Catalog.add_or_replace = boom
        try:
            with pytest.raises(ParkError, match="No space left"):
                run(fill_and_park(url, tmp_path, name="keep", prompt=PROMPT + " changed"))
        finally:
            Catalog.add_or_replace = real
    assert _snapshot(tmp_path) == before
    assert tmp_files(tmp_path) == []


# --------------------------------------------------------------------------- recovery


def _journal(cat, slots, **extra):
    payload = {"phase": "commit", "save_dir": str(slots), "tmp": "kvv-tmp-abc.bin", "final": "j.bin",
               "backup": "kvv-tmp-abc.prev.bin", "name": "j", "profile": "p", "pid": 999999999,
               "pid_ctime": 0.0}
    payload.update(extra)
    return cat.add_pending("park", payload)


def test_recover_rolls_back_when_temp_state_still_exists(tmp_path):
    slots = tmp_path / "slots"
    slots.mkdir()
    (slots / "j.bin").write_bytes(b"old state")
    (slots / "kvv-tmp-abc.prev.bin.ckpt").write_bytes(b"old sidecar")  # renamed aside before the crash
    (slots / "kvv-tmp-abc.bin").write_bytes(b"new state")
    (slots / "kvv-tmp-abc.bin.ckpt").write_bytes(b"new sidecar")
    with Catalog(paths.catalog_path()) as cat:
        _journal(cat, slots, record={"name": "j", "profile": "p"}, ino=1)
        msgs = recover_parks(Recovery(cat, (slots,)))
        assert cat.list_pending() == [] and cat.list() == []
    assert any("rolled back" in m for m in msgs)
    assert sorted(p.name for p in slots.iterdir()) == ["j.bin", "j.bin.ckpt"]
    assert (slots / "j.bin.ckpt").read_bytes() == b"old sidecar"
    assert (slots / "j.bin").read_bytes() == b"old state"


def test_recover_finishes_when_state_was_moved(tmp_path):
    slots = tmp_path / "slots"
    slots.mkdir()
    (slots / "j.bin").write_bytes(b"new state")
    (slots / "kvv-tmp-abc.prev.bin").write_bytes(b"old state")
    (slots / "kvv-tmp-abc.bin.ckpt").write_bytes(b"new sidecar")
    with Catalog(paths.catalog_path()) as cat:
        rec = {"name": "j", "profile": "p", "state_file": "j.bin", "save_dir": str(slots), "n_tokens": 5,
               "updated_at": 123.0}
        _journal(cat, slots, record=rec, ino=(slots / "j.bin").stat().st_ino)
        msgs = recover_parks(Recovery(cat, (slots,)))
        assert cat.list_pending() == []
        assert cat.get("p", "j").n_tokens == 5
    assert any("finished" in m for m in msgs)
    assert sorted(p.name for p in slots.iterdir()) == ["j.bin", "j.bin.ckpt"]
    assert (slots / "j.bin.ckpt").read_bytes() == b"new sidecar"


def test_recover_saving_phase_and_orphans(tmp_path):
    slots = tmp_path / "slots"
    slots.mkdir()
    (slots / "kvv-tmp-abc.bin").write_bytes(b"half")
    (slots / "kvv-tmp-orphan.bin").write_bytes(b"x")
    (slots / "keep.bin").write_bytes(b"keep")
    with Catalog(paths.catalog_path()) as cat:
        _journal(cat, slots, phase="saving")
        # an entry of a live process (this test's parent pid differs from ours) is left alone
        live = cat.add_pending("park", {"phase": "saving", "save_dir": str(slots), "tmp": "kvv-tmp-live.bin",
                                        "final": "l.bin", "backup": "kvv-tmp-live.prev.bin", "pid": os.getppid(),
                                        "pid_ctime": __import__("psutil").Process(os.getppid()).create_time()})
        (slots / "kvv-tmp-live.bin").write_bytes(b"in progress")
        msgs = recover_parks(Recovery(cat, (slots,)))
        assert [e[0] for e in cat.list_pending()] == [live]
    assert sorted(p.name for p in slots.iterdir()) == ["keep.bin", "kvv-tmp-live.bin"]
    assert len(msgs) == 2


# --------------------------------------------------------------------------- resume refusals


def _park_then(fake_server, tmp_path, name="s", **env):
    with fake_server(**env) as (url, _):
        return run(fill_and_park(url, tmp_path, name=name)).record


def _refusal(url, tmp_path, name="s", slot=1, **target_kw) -> list[str]:
    async def go():
        t = await connect(url, tmp_path, **target_kw)
        try:
            with pytest.raises(ResumeRefused) as ei:
                await resume_session(t, name, slot, force=True)
            return ei.value.reasons
        finally:
            await close(t)
    return run(go())


def test_refuse_other_kv_types(fake_server, tmp_path):
    write_model(tmp_path)
    with fake_server() as (url, _):
        run(fill_and_park(url, tmp_path, name="s"))
        reasons = _refusal(url, tmp_path, cache_type_k="q8_0")
    assert any("different K cache type" in r and "f16" in r and "q8_0" in r for r in reasons)


def test_refuse_truncated_state_file(fake_server, tmp_path):
    write_model(tmp_path)
    with fake_server() as (url, _):
        rec = run(fill_and_park(url, tmp_path, name="s"))
        state = tmp_path / "slots" / "s.bin"
        state.write_bytes(state.read_bytes()[: rec.record.state_size // 2])
        reasons = _refusal(url, tmp_path)
    assert any("truncated" in r for r in reasons)


def test_refuse_foreign_state_file(fake_server, tmp_path):
    write_model(tmp_path)
    with fake_server() as (url, _):
        run(fill_and_park(url, tmp_path, name="s"))
        state = tmp_path / "slots" / "s.bin"
        state.write_bytes(b"JUNK" + state.read_bytes()[4:])
        reasons = _refusal(url, tmp_path)
    assert any("not a llama.cpp slot state file" in r for r in reasons)


def test_refuse_other_model(fake_server, tmp_path):
    write_model(tmp_path)
    with fake_server() as (url, _):
        rec = run(fill_and_park(url, tmp_path, name="s")).record
        with Catalog(paths.catalog_path()) as cat:
            cat.add_or_replace(rec.__class__(**{**asdict(rec), "id": None, "model_path": "/models/other.gguf",
                                                "model_sha256": "ab" * 32, "model_quick_id": "q1:" + "cd" * 32}))
        reasons = _refusal(url, tmp_path)
        # same bytes under another path is fine
        other = tmp_path / "copy.gguf"
        shutil.copy(tmp_path / "model.gguf", other)
        with Catalog(paths.catalog_path()) as cat:
            cat.add_or_replace(rec.__class__(**{**asdict(rec), "id": None, "model_path": str(other)}))

        async def ok():
            t = await connect(url, tmp_path)
            try:
                return await preflight(t, t.catalog.get(rec.profile, "s"), 1)
            finally:
                await close(t)
        assert run(ok()).refusals == []
    assert any("a different model file" in r and "other.gguf" in r for r in reasons)
    # said how it was compared: the whole-file hash is not known yet
    assert any("first 16 MiB" in r for r in reasons)


def test_a_park_this_server_process_made_is_restored_without_a_look_at_the_model_file(fake_server, tmp_path):
    """The server runs the model it loaded whatever the file became since: a park the same process made is of
    that model, so the file on disk (here rewritten since) is not compared (issue #38: the look is on a returning
    request's path). A park of an earlier process, or any park once the process is not known, is compared."""
    write_model(tmp_path, dense=True)
    with fake_server(FAKE_MODEL_KIND="dense") as (url, _):
        async def go():
            t = await connect(url, tmp_path, model_path=str(tmp_path / "model.gguf"), started_at=time.time())
            try:
                await t.client.completion(PROMPT, slot_id=0, n_predict=4)
                parked = (await park_slot(t, 0, "s")).record
                assert t.parked_here["s"] == (parked.id, parked.updated_at)
                model = tmp_path / "model.gguf"
                model.write_bytes(model.read_bytes() + b"\0" * 64)  # another file at the same path
                rec = t.catalog.get("fake", "s")
                here = await preflight(t, rec, 1)
                t.parked_here.clear()  # what a new server process starts from
                new_process = await preflight(t, rec, 1)
                t.parked_here["s"] = (parked.id, parked.updated_at)
                t.started_at = rec.updated_at + 1  # parked before this process started
                earlier = await preflight(t, rec, 1)
                t.started_at = None  # an attached server: its process is not known
                unknown = await preflight(t, rec, 1)
                return here, new_process, earlier, unknown
            finally:
                await close(t)
        here, new_process, earlier, unknown = run(go())
    assert here.refusals == []
    for pf in (new_process, earlier, unknown):
        assert any("changed" in r for r in pf.refusals), pf.refusals


def test_background_model_hash_fills_sessions_without_changing_compatibility(fake_server, tmp_path):
    write_model(tmp_path)
    with fake_server() as (url, _):
        rec = run(fill_and_park(url, tmp_path, name="h")).record
        assert rec.model_sha256 == ""

        async def go():
            t = await connect(url, tmp_path, model_path=str(tmp_path / "model.gguf"))
            svc = SessionService(t)
            try:
                before = await preflight(t, t.catalog.get(rec.profile, "h"), 1)
                await svc.warm_model_identity()  # what the window runs after the server starts
                stored = t.catalog.get(rec.profile, "h")
                after = await preflight(t, stored, 1)
                return before, stored, after
            finally:
                await close(t)
        before, stored, after = run(go())
    assert stored.model_sha256 == sha(tmp_path / "model.gguf")
    assert before.refusals == after.refusals == []


def test_refuse_missing_file_and_bad_slot(fake_server, tmp_path):
    write_model(tmp_path)
    with fake_server() as (url, _):
        run(fill_and_park(url, tmp_path, name="s"))
        (tmp_path / "slots" / "s.bin").unlink()
        reasons = _refusal(url, tmp_path)
        assert any("state file is missing" in r for r in reasons)
        reasons = _refusal(url, tmp_path, slot=7)
        assert any("slot 7 does not exist: this server has slots 0-1" in r for r in reasons)


def test_refuse_slot_too_small(fake_server, tmp_path):
    write_model(tmp_path)
    with fake_server() as (url, _):
        run(fill_and_park(url, tmp_path, name="s", prompt=PROMPT * 2))
    with fake_server(extra_args=("-c", "1000")) as (url, _):  # 500 per slot
        reasons = _refusal(url, tmp_path)
    assert any("slot 1 holds at most 500 tokens" in r for r in reasons)


def test_a_leased_resume_takes_the_slot_from_an_earlier_read(fake_server, tmp_path):
    """The proxy's resume into a slot it holds (``leased``) does not read /slots first when an earlier read
    of this server process showed the slot with a task id: its size still refuses a park too long for it,
    and the task id kept is that read's. A slot that had run no task then is read now."""
    write_model(tmp_path, dense=True)
    for name, prompt in (("long", PROMPT), ("short", PROMPT[:len(PROMPT) // 3])):
        with fake_server(FAKE_MODEL_KIND="dense") as (url, _):
            run(fill_and_park(url, tmp_path, name=name, prompt=prompt))
    with fake_server(FAKE_MODEL_KIND="dense", extra_args=("-c", "1000")) as (url, _):  # 500 per slot
        async def go():
            t = await connect(url, tmp_path)
            try:
                reads = []
                read = t.client.slots

                async def counted():
                    reads.append(1)
                    return await read()
                t.client.slots = counted
                assert {r.id: r for r in await t.slot_rows()}[1].id_task is None  # a slot that ran no task yet
                reads.clear()
                await resume_session(t, "short", 1, force=True, leased=True)
                assert reads == [1]  # no task id to keep from that read: read now
                await t.client.completion("another chat in slot one", slot_id=1, n_predict=4)
                earlier = {r.id: r for r in await t.slot_rows()}[1]
                assert earlier.id_task is not None
                reads.clear()
                res = await resume_session(t, "short", 1, force=True, leased=True)
                assert reads == [] and res.n_restored > 0
                assert t.restored[1].id_task == earlier.id_task
                with pytest.raises(ResumeRefused, match="slot 1 holds at most 500 tokens"):
                    await resume_session(t, "long", 1, force=True, leased=True)
                assert reads == []
                await resume_session(t, "short", 1, force=True)  # not leased: read
                assert reads == [1]
            finally:
                await close(t)
        run(go())


def test_an_unchanged_parks_state_file_is_not_read_again_before_its_restore(fake_server, tmp_path, monkeypatch):
    """The state file the park verified (its header: this build's version, the parked token count), not written
    since (its stamps), is not read before a restore (issue #38: that is a returning request's path); written
    since, it is, and a foreign one is refused."""
    from app.sessions import resume as resume_mod

    write_model(tmp_path, dense=True)
    with fake_server(FAKE_MODEL_KIND="dense") as (url, _):
        run(fill_and_park(url, tmp_path, name="s"))
        real = resume_mod.read_state_header
        reads = []

        def counted(path):
            reads.append(path)
            return real(path)
        monkeypatch.setattr(resume_mod, "read_state_header", counted)

        async def go():
            t = await connect(url, tmp_path)
            try:
                return await resume_session(t, "s", 1, force=True)
            finally:
                await close(t)
        assert run(go()).n_restored > 0 and reads == []
        state = tmp_path / "slots" / "s.bin"
        state.write_bytes(b"JUNK" + state.read_bytes()[4:])  # the same size, written since
        reasons = _refusal(url, tmp_path)
    assert reads == [state] and any("not a llama.cpp slot state file" in r for r in reasons)


def test_a_restores_note_handed_to_later_is_written_when_that_runs(fake_server, tmp_path):
    """``later`` (the proxy: run once the request is sent) takes the restore's catalog note: nothing of the
    restore is in the catalog until it runs, then all of it (its event, the verdict UNKNOWN, the pending
    verdict) and ``ResumeResult.noted``."""
    write_model(tmp_path, dense=True)
    with fake_server(FAKE_MODEL_KIND="dense") as (url, _):
        run(fill_and_park(url, tmp_path, name="s"))

        async def go():
            t = await connect(url, tmp_path)
            try:
                held = []
                res = await resume_session(t, "s", 1, force=True, leased=True, later=held.append)
                rec = t.catalog.get("fake", "s")
                before = ([e.kind for e in t.catalog.history(rec.id)], t.catalog.pending_verdicts("fake", 1),
                          res.noted)
                assert len(held) == 1 and res.n_restored > 0
                held[0]()
                after = ([e.kind for e in t.catalog.history(rec.id)], t.catalog.pending_verdicts("fake", 1),
                         res.noted, t.catalog.get("fake", "s").last_verdict)
                return before, after
            finally:
                await close(t)
        before, after = run(go())
    assert "resume" not in before[0] and before[1] == [] and before[2] is None
    assert after[0].count("resume") == 1 and [n.slot_id for n in after[1]] == [1]
    assert after[2] is not None and after[2].pending == after[1][0] and str(after[3]) == "UNKNOWN"


# --------------------------------------------------------------------------- resume


def test_resume_over_non_empty_slot_needs_confirmation(fake_server, tmp_path):
    write_model(tmp_path, dense=True)
    with fake_server(FAKE_MODEL_KIND="dense") as (url, _):
        rec = run(fill_and_park(url, tmp_path, name="d")).record
        assert rec.memory_kind == "dense" and rec.sidecar_status == "not needed"

        async def go():
            t = await connect(url, tmp_path)
            try:
                await t.client.completion("something else entirely here", slot_id=1, n_predict=4)
                with pytest.raises(NeedsConfirmation) as ei:
                    await resume_session(t, "d", 1)
                assert ei.value.warnings == [f"slot 1 holds {ei.value.warnings[0].split()[3]} tokens; "
                                             "resuming replaces them"]
                res = await resume_session(t, "d", 1, force=True)
                assert res.n_restored == rec.n_tokens and res.slot_id == 1
                assert (t.restored[1].n_tokens, t.restored[1].session) == (rec.n_tokens, "d")
                # slot 1 now holds the restored tokens: the default slot is the first empty one (none left)
                with pytest.raises(ResumeRefused, match="no empty slot"):
                    await resume_session(t, "d")
                # a dense model resumes from the cache
                fu = await follow_up(t, 1, PROMPT + " and one more question")
                assert fu.cache_n > 300 and fu.prompt_n < 20
                stored = t.catalog.get(rec.profile, "d")
                assert stored.last_n_restored == rec.n_tokens and stored.last_restore_ms is not None
                assert [e.kind for e in t.catalog.history(stored.id)] == ["resume"]
            finally:
                await close(t)
        run(go())


@pytest.mark.parametrize("sidecar", [True, False])
def test_resume_after_restart_swa(fake_server, tmp_path, sidecar):
    """Stock build: the first query re-prefills; with a PR #206 sidecar it does not."""
    write_model(tmp_path)
    env = {"FAKE_SIDECAR": 1} if sidecar else {}
    with fake_server(**env) as (url, _):
        rec = run(fill_and_park(url, tmp_path, name="swa")).record
    with fake_server(**env) as (url, _):
        async def go():
            t = await connect(url, tmp_path)
            try:
                if not sidecar:
                    with pytest.raises(NeedsConfirmation, match="re-prefill"):
                        await resume_session(t, "swa", 0)
                res = await resume_session(t, "swa", force=not sidecar)
                assert res.slot_id == 0 and res.n_restored == rec.n_tokens
                return await follow_up(t, 0, PROMPT + " next")
            finally:
                await close(t)
        fu = run(go())
    if sidecar:
        assert fu.cache_n > 300 and fu.prompt_n < 20
    else:
        assert fu.cache_n == 0 and fu.prompt_n > 300
    with Catalog(paths.catalog_path()) as cat:
        assert (cat.prefill_rate("fake") is not None) == (not sidecar)


def test_park_all_and_resume_plan(fake_server, tmp_path):
    write_model(tmp_path, dense=True)
    with fake_server(FAKE_MODEL_KIND="dense") as (url, _):
        async def go():
            t = await connect(url, tmp_path, profile_name="prof")
            svc = SessionService(t)
            try:
                await t.client.completion(PROMPT, slot_id=1, n_predict=4)
                results = await svc.park_all(prefix="eod", remember=True)
                assert [r.record.name for r in results] == ["eod slot 1"]
                assert load_resume_plan("prof") == [PlanEntry(1, "eod slot 1")]
                await t.client.erase_slot(1)
                t.restored.clear()
                t.held_as.clear()
                out = await svc.resume_all()
                assert out[0].ok and out[0].result.slot_id == 1
                assert load_resume_plan("prof") == []  # every entry came back: the plan is done
                # a failing slot is reported, the others go on
                await t.client.completion("x y z w " * 20, slot_id=0, n_predict=4)

                async def bad_park(*a, **k):
                    raise ParkError("disk on fire")
                orig = park_mod.park_slot
                park_mod.park_slot = bad_park
                try:
                    results = await svc.park_all(prefix="eod2")
                finally:
                    park_mod.park_slot = orig
                # slot 1 holds what was just resumed into it: not parked again (app.sessions.park_choice.choose_parks)
                assert {r.slot_id: (r.error, r.unchanged) for r in results} == {0: ("disk on fire", False),
                                                                                  1: (None, True)}
                res = await park_all(t, prefix="all")
                assert sorted(r.record.name for r in res) == ["all slot 0", "eod slot 1"]
                clear_resume_plan("prof")
            finally:
                await close(t)
        run(go())


def test_sessions_rename_delete(fake_server, tmp_path):
    write_model(tmp_path)
    with fake_server(FAKE_SIDECAR=1) as (url, _):
        rec = run(fill_and_park(url, tmp_path, name="a")).record
    with Catalog(paths.catalog_path()) as cat:
        assert [r.name for r in list_sessions(cat)] == ["a"]
        rename_session(cat, "a", "b")
        assert cat.get(rec.profile, "b").state_file == "a.bin"
        removed = delete_session(cat, "b")
        assert sorted(p.name for p in removed) == ["a.bin", "a.bin.ckpt"]
        assert list_sessions(cat) == []
    assert list((tmp_path / "slots").iterdir()) == []


# --------------------------------------------------------------------------- CLI


def test_cli_park_resume_sessions(fake_server, tmp_path, capsys):
    write_model(tmp_path, dense=True)
    slots = str(tmp_path / "slots")
    with fake_server(FAKE_MODEL_KIND="dense") as (url, _):
        run(_fill(url, 0))
        assert cli_main(["park", url, "--slot", "0", "--name", "cli one", "--save-dir", slots]) == 0
        out = capsys.readouterr().out
        assert "parked slot 0 as 'cli one'" in out and "tokens" in out and "sidecar not needed" in out
        assert cli_main(["park", url, "--slot", "7", "--save-dir", slots]) == 1
        assert "slot 7 does not exist" in capsys.readouterr().out
        assert cli_main(["park", url, "--slot", "0"]) == 2  # URL without --save-dir
        capsys.readouterr()
        run(_fill(url, 1))
        assert cli_main(["resume", url, "cli one", "--slot", "1", "--save-dir", slots]) == 1
        err = capsys.readouterr().err
        assert "slot 1 holds" in err and "--yes" in err
        assert cli_main(["resume", url, "cli one", "--slot", "1", "--yes", "--save-dir", slots]) == 0
        assert "resumed 'cli one' into slot 1" in capsys.readouterr().out
        assert cli_main(["resume", url, "nope", "--save-dir", slots]) == 1
        assert "no parked session named 'nope'" in capsys.readouterr().err
    assert cli_main(["sessions", "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["name"] == "cli one" and rows[0]["last_n_restored"] == rows[0]["n_tokens"]
    assert cli_main(["sessions", "show", "cli one"]) == 0
    assert "cli-one.bin" in capsys.readouterr().out
    assert cli_main(["sessions", "rename", "cli one", "cli two"]) == 0
    assert cli_main(["sessions", "list"]) == 0
    assert "cli two" in capsys.readouterr().out
    assert cli_main(["sessions", "rm", "cli two"]) == 0
    assert not (tmp_path / "slots" / "cli-one.bin").exists()
    assert cli_main(["sessions", "rm", "cli two"]) == 1


async def _fill(url, slot):
    async with LlamaClient(url) as c:
        await c.completion(PROMPT + f" slot {slot}", slot_id=slot, n_predict=4)


def test_cli_park_by_profile_and_resume_all(fake_server, tmp_path, capsys):
    from urllib.parse import urlparse

    from app.core.profile import LaunchProfile
    from app.sessions.resume_plan import write_resume_plan
    from app.store.profiles import ProfileStore

    model = write_model(tmp_path, dense=True)
    with fake_server(FAKE_MODEL_KIND="dense") as (url, _):
        ProfileStore().save(LaunchProfile(name="fk", model=str(model), port=urlparse(url).port,
                                          slot_save_path=str(tmp_path / "slots") + "/"))
        run(_fill(url, 0))
        run(_fill(url, 1))
        # no pid record: this server was not launched by KV Valet, so it cannot be stopped by it
        assert cli_main(["park", "fk", "--all", "--name", "x", "--and-stop"]) == 1
        assert "only a server that KV Valet launched" in capsys.readouterr().err
        assert cli_main(["park", "fk", "--all", "--name", "eod"]) == 0
        out = capsys.readouterr().out
        assert "as 'eod slot 0'" in out and "as 'eod slot 1'" in out
        with Catalog(paths.catalog_path()) as cat:
            recs = cat.list("fk")
            assert {r.name for r in recs} == {"eod slot 0", "eod slot 1"}
        write_resume_plan("fk", [park_mod.ParkResult(r, None, [], r.slot_id) for r in recs])
        assert cli_main(["resume-all", "fk"]) == 0
        out = capsys.readouterr().out
        assert "resumed 'eod slot 0' into slot 0" in out and "resumed 'eod slot 1' into slot 1" in out
        assert load_resume_plan("fk") == []
    assert cli_main(["park", "fk", "--slot", "0"]) == 1
    assert "not running" in capsys.readouterr().err


def test_cli_resume_resets_the_verdict_and_uses_the_one_slot_rule(fake_server, tmp_path, capsys):
    """Regression: `kv-valet resume` left the session's last verdict in the catalog
    (only the window reset it), and the CLI chose its default slot by its own rule."""
    from app.core.verdict import VerdictKind

    write_model(tmp_path, dense=True)
    slots = str(tmp_path / "slots")
    with fake_server(FAKE_MODEL_KIND="dense") as (url, _):
        run(_fill(url, 1))
        assert cli_main(["park", url, "--name", "v", "--save-dir", slots]) == 0  # default: the slot with tokens
        assert "parked slot 1 as 'v'" in capsys.readouterr().out
        with Catalog(paths.catalog_path()) as cat:
            rec = cat.list()[0]
            cat.update_verdict(rec.id, VerdictKind.HIT, "an earlier resume")
        run(_fill(url, 0))
        # slot 1 (where it was parked) holds tokens: the default is the first empty slot; none is empty
        assert cli_main(["resume", url, "v", "--save-dir", slots]) == 1
        assert "no empty slot" in capsys.readouterr().err
        async def erase():
            async with LlamaClient(url) as c:
                await c.erase_slot(1)
        run(erase())
        assert cli_main(["resume", url, "v", "--save-dir", slots]) == 0
        assert "into slot 1" in capsys.readouterr().out  # back where it was parked
        with Catalog(paths.catalog_path()) as cat:
            after = cat.get(rec.profile, "v")
        assert after.last_verdict is VerdictKind.UNKNOWN
        assert after.last_verdict_reason == "no query on this slot since the restore yet"


def test_cli_park_resume_json(fake_server, tmp_path, capsys):
    """``park|resume --json``: one JSON object each, errors included, exit status unchanged."""
    write_model(tmp_path, dense=True)
    slots = str(tmp_path / "slots")
    with fake_server(FAKE_MODEL_KIND="dense") as (url, _):
        run(_fill(url, 0))
        assert cli_main(["park", url, "--slot", "0", "--name", "j one", "--save-dir", slots, "--json"]) == 0
        p = json.loads(capsys.readouterr().out)
        assert p["ok"] and p["session"] == "j one" and p["slot"] == 0 and p["tokens"] > 300
        assert p["size"] == p["state_size"] + p["sidecar_size"]
        assert p["state_size"] == Path(p["files"][0]).stat().st_size
        assert p["sidecar"]["status"] == "not needed" and [s["session"] for s in p["sessions"]] == ["j one"]
        assert cli_main(["park", url, "--slot", "7", "--save-dir", slots, "--json"]) == 1
        bad = json.loads(capsys.readouterr().out)
        assert not bad["ok"] and "slot 7 does not exist" in bad["error"] and bad["slot"] == 7
        run(_fill(url, 1))
        assert cli_main(["resume", url, "j one", "--slot", "1", "--save-dir", slots, "--json"]) == 1
        out = capsys.readouterr()
        e = json.loads(out.out)
        assert not e["ok"] and e["exit"] == 1 and "--yes" in e["error"]
        assert any("slot 1 holds" in d for d in e["details"])
        assert out.err == ""
        assert cli_main(["resume", url, "j one", "--slot", "1", "--yes", "--save-dir", slots, "--json"]) == 0
        r = json.loads(capsys.readouterr().out)
        assert r["ok"] and r["session"] == "j one" and r["slot"] == 1 and r["tokens"] == p["tokens"]
        assert r["restore_ms"] >= 0 and r["files"] == p["files"] and isinstance(r["warnings"], list)
        assert cli_main(["resume", url, "nope", "--save-dir", slots, "--json"]) == 1
        nope = json.loads(capsys.readouterr().out)
        assert "cannot resume 'nope'" in nope["error"] and "no parked session named 'nope'" in nope["details"][0]
    assert cli_main(["resume", "no-such-profile", "x", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["ok"] is False
