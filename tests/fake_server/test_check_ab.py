"""Check resume and the sidecar A/B against the fake server (sidecar build behaviour)."""

from __future__ import annotations

import csv
import hashlib
import io
import json
from pathlib import Path

import pytest
from app.sessions.ab import ab_check
from app.sessions.check import check_resume
from app.sessions.check_export import to_csv, to_json, to_markdown
from app.sessions.check_report import (ARM_BASELINE, ARM_HIDDEN, ARM_HIDDEN_EXACT, ARM_WITH, ARM_WITH_EXACT, PROBE_EXACT,
                                       PROBE_TEXT, CheckError)
from app.sessions.sidecar_hide import HIDDEN_SUFFIX, hide_sidecar, recover_hidden_sidecars
from app.sessions import journal
from app.sessions.journal import Recovery
from app.sessions.target import ServerTarget
from app.core.output_check import OUTPUT_TOKENS
from app.core.verdict import VerdictKind
from app.sessions.watch import FileLogBuffer
from app.server.client import LlamaClient, ServerUnreachable
from app.server.sidecar import inspect_sidecar
from app.store.catalog import Catalog, SessionRecord

LONG_TEXT = " ".join(f"word{i}" for i in range(700))  # ~1,400 fake tokens: > 2 SWA windows
WARM_TEXT = LONG_TEXT + " the cache slot park resume token model quiet valet disk"
BUILD = "b11434-fake"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_target(url: str, tmp_path: Path, catalog: Catalog, proc) -> ServerTarget:
    return ServerTarget(client=LlamaClient(url), url=url, save_dir=tmp_path / "slots", catalog=catalog,
                        profile_name="fake", build=BUILD, model_path=str(tmp_path / "model.gguf"),
                        log=FileLogBuffer(proc.log_path, from_start=True))


async def warm_tokenizer(client: LlamaClient) -> None:
    """The fake tokenizer learns pieces as it sees them (a real vocabulary is fixed):
    teach a fresh fake process the saved text, so /detokenize can spell it."""
    await client.tokenize(WARM_TEXT)


async def park(fake_server, tmp_path: Path, catalog: Catalog, sidecar: bool = True) -> SessionRecord:
    env = {"FAKE_SIDECAR": 1} if sidecar else {}
    with fake_server(**env) as (url, proc):
        async with LlamaClient(url) as c:
            await c.completion(LONG_TEXT, slot_id=0, n_predict=8)
            save = await c.save_slot(0, "s1.bin")
    state = tmp_path / "slots" / "s1.bin"
    rep = inspect_sidecar(state, save["n_saved"], "sliding-window")
    catalog.record_sidecar_observation(BUILD, rep.path is not None, "sliding-window")
    return catalog.add_or_replace(SessionRecord(
        name="s1", profile="fake", state_file="s1.bin", save_dir=str(tmp_path / "slots"),
        sidecar_file="s1.bin.ckpt" if rep.path else None, state_size=state.stat().st_size,
        sidecar_size=rep.size, n_tokens=save["n_saved"], server_build=BUILD, memory_kind="sliding-window",
        sidecar_status=rep.status.value, sidecar_count=len(rep.checkpoints), slot_id=0))


@pytest.fixture
def catalog(tmp_path):
    c = Catalog(tmp_path / "catalog.sqlite3")
    yield c
    c.close()


async def test_check_resume_hit_then_hidden_discarded(fake_server, tmp_path, catalog):
    rec = await park(fake_server, tmp_path, catalog)
    assert rec.sidecar_status == "present" and rec.sidecar_count >= 2
    with fake_server(FAKE_SIDECAR=1) as (url, proc):
        target = make_target(url, tmp_path, catalog, proc)
        await warm_tokenizer(target.client)
        report = await check_resume(target, rec, 0)
        assert report.verdict.kind is VerdictKind.HIT, report.verdict.reason
        assert [p.name for p in report.probes] == [PROBE_EXACT, PROBE_TEXT]
        for p in report.probes:
            assert p.verdict.kind is VerdictKind.HIT, p.verdict.reason
            assert p.checkpoints_loaded == rec.sidecar_count
            assert f"{rec.sidecar_count} context checkpoints loaded from the sidecar" in p.verdict.reason
            assert p.n_restored == rec.n_tokens
            assert 0 < p.prompt_n < 40 and p.cache_n >= rec.n_tokens - 32
            assert p.restore_ms is not None and p.ttft_ms >= p.prompt_ms
            assert p.output is not None and p.output.status == "match" and p.output.compared == OUTPUT_TOKENS
        # history and last verdict
        hist = catalog.history(rec.id)
        assert [h.kind for h in hist] == ["check", "check"]
        assert hist[0].details["probe"] == PROBE_EXACT and hist[0].verdict == "HIT"
        stored = catalog.get_by_id(rec.id)
        assert stored.last_verdict == "HIT" and stored.last_n_restored == rec.n_tokens

        # the same session with its sidecar moved away: the restore is discarded
        sidecar = tmp_path / "slots" / "s1.bin.ckpt"
        sidecar.rename(tmp_path / "aside.ckpt")
        try:
            report = await check_resume(target, rec, 1)
        finally:
            (tmp_path / "aside.ckpt").rename(sidecar)
        assert report.verdict.kind is VerdictKind.DISCARDED
        for p in report.probes:
            assert p.cache_n == 0 and p.prompt_n == p.prompt_tokens
            assert "no checkpoint sidecar next to the state file" in p.verdict.reason
            assert p.checkpoints_loaded == 0
        assert catalog.get_by_id(rec.id).last_verdict == "DISCARDED"
        await target.client.aclose()


async def test_ab_puts_sidecar_back_and_exports_agree(fake_server, tmp_path, catalog):
    rec = await park(fake_server, tmp_path, catalog)
    sidecar = tmp_path / "slots" / "s1.bin.ckpt"
    digest = sha256(sidecar)
    with fake_server(FAKE_SIDECAR=1) as (url, proc):
        target = make_target(url, tmp_path, catalog, proc)
        await target.client.tokenize(WARM_TEXT)  # a chat client taught the fake tokenizer its text
        ab = await ab_check(target, rec, 0, baseline=True)
        await target.client.aclose()
    assert sha256(sidecar) == digest
    assert not (tmp_path / "slots" / ("s1.bin.ckpt" + HIDDEN_SUFFIX)).exists()
    assert catalog.list_pending() == []
    with_, hidden, base = ab.row(ARM_WITH), ab.row(ARM_HIDDEN), ab.row(ARM_BASELINE)
    assert with_.verdict.kind is VerdictKind.HIT and with_.checkpoints_loaded == rec.sidecar_count
    assert hidden.verdict.kind is VerdictKind.DISCARDED and hidden.cache_n == 0
    assert base.prompt_n == base.prompt_tokens and base.restore_ms is None
    assert ab.delta_prefill_speedup == pytest.approx(hidden.prompt_ms / with_.prompt_ms)
    assert ab.delta_prefill_speedup > 20
    assert ab.end_to_end_speedup == pytest.approx(hidden.total_ms / with_.total_ms)
    assert ab.had_sidecar and "put back" in ab.note
    kinds = [h.kind for h in catalog.history(rec.id)]
    assert kinds == ["ab", "ab", "ab", "ab", "baseline"]
    assert ab.protocol == "one process" and "all probes ran in one server process" in ab.note
    assert not ab.confounded  # the fake keeps no checkpoints across restores

    # exports hold the same figures
    data = json.loads(to_json(ab))
    assert data["type"] == "ab"
    assert [r["name"] for r in data["rows"]] == [ARM_WITH, ARM_WITH_EXACT, ARM_HIDDEN, ARM_HIDDEN_EXACT,
                                                 ARM_BASELINE]
    assert data["protocol"] == "one process"
    assert data["rows"][2]["prompt_n"] == hidden.prompt_n
    assert data["rows"][0]["prompt_ms"] == pytest.approx(with_.prompt_ms, abs=0.01)
    assert data["ratios"]["delta_prefill_speedup"] == pytest.approx(ab.delta_prefill_speedup, abs=0.01)
    rows = list(csv.DictReader(io.StringIO(to_csv(ab))))
    ab_rows = [r for r in rows if r["section"] == "ab"]
    ratio_rows = {r["name"]: r["value"] for r in rows if r["section"] == "ratio"}
    assert [r["name"] for r in ab_rows] == [r["name"] for r in data["rows"]]
    for r, j in zip(ab_rows, data["rows"]):
        assert int(r["prompt_n"]) == j["prompt_n"] and r["verdict"] == j["verdict"]
        assert float(r["prompt_ms"]) == pytest.approx(j["prompt_ms"])
    assert float(ratio_rows["delta_prefill_speedup"]) == pytest.approx(data["ratios"]["delta_prefill_speedup"])
    md = to_markdown(ab)
    for j in data["rows"]:
        assert f"| {j['name']} |" in md and f"{j['prompt_n']:,}" in md
    assert f"{data['ratios']['delta_prefill_speedup']:,.2f}×" in md


async def test_ab_server_killed_between_arms_puts_sidecar_back(fake_server, tmp_path, catalog):
    rec = await park(fake_server, tmp_path, catalog)
    sidecar = tmp_path / "slots" / "s1.bin.ckpt"
    digest = sha256(sidecar)
    with fake_server(FAKE_SIDECAR=1) as (url, proc):
        target = make_target(url, tmp_path, catalog, proc)

        def kill():
            proc.kill()
            proc.wait()

        with pytest.raises((ServerUnreachable, CheckError)):
            await ab_check(target, rec, 0, between_arms=kill)
        await target.client.aclose()
    assert sha256(sidecar) == digest
    assert catalog.list_pending() == []
    assert recover_hidden_sidecars(Recovery(catalog)) == []


def test_recover_after_app_death(tmp_path, catalog):
    """The app died with the sidecar hidden: the journal puts it back at the next start."""
    sidecar = tmp_path / "s.bin.ckpt"
    sidecar.write_bytes(b"PKCL" + bytes(range(256)) * 10)
    digest = sha256(sidecar)
    jid, hidden = hide_sidecar(catalog, sidecar)
    assert hidden.exists() and not sidecar.exists()
    # While the A/B runs (in flight here), recovery leaves it alone: a second A/B or
    # a CLI started now must not put the sidecar back in the middle of the hidden arm.
    assert recover_hidden_sidecars(Recovery(catalog)) == [] and hidden.exists()
    journal._IN_FLIGHT.discard(jid)  # the app died: a new process has nothing in flight
    assert recover_hidden_sidecars(Recovery(catalog)) == [
        f"put back the sidecar {sidecar} that an interrupted A/B check had hidden"]
    assert sha256(sidecar) == digest and not hidden.exists()
    assert catalog.list_pending() == []


async def test_stock_build_both_arms_reprefill(fake_server, tmp_path, catalog):
    rec = await park(fake_server, tmp_path, catalog, sidecar=False)
    assert rec.sidecar_status == "missing"
    with fake_server() as (url, proc):
        target = make_target(url, tmp_path, catalog, proc)
        await warm_tokenizer(target.client)
        report = await check_resume(target, rec, 0)
        ab = await ab_check(target, rec, 0)
        await target.client.aclose()
    assert report.verdict.kind is VerdictKind.DISCARDED
    for p in report.probes:
        assert "this build does not persist context checkpoints" in p.verdict.reason
    assert not ab.had_sidecar
    assert ab.note.startswith("both arms re-prefill: this build wrote no sidecar")
    assert all(r.verdict.kind is VerdictKind.DISCARDED for r in ab.rows)
    md = to_markdown(report)
    assert "DISCARDED" in md and "this build does not persist" in md


async def test_check_refuses_bad_slot(fake_server, tmp_path, catalog):
    rec = await park(fake_server, tmp_path, catalog)
    with fake_server(FAKE_SIDECAR=1) as (url, proc):
        target = make_target(url, tmp_path, catalog, proc)
        with pytest.raises(CheckError, match="slot 7 does not exist"):
            await check_resume(target, rec, 7)
        await target.client.aclose()


# -- the CLI ---------------------------------------------------------------------

def _cli(argv: list[str]) -> int:
    from app.cli import main

    return main(argv)


@pytest.mark.parametrize("sidecar, code", [(True, 0), (False, 3)])
def test_cli_check_exit_codes(fake_server, tmp_path, capsys, sidecar, code):
    import asyncio

    from app import paths

    cat = Catalog(paths.catalog_path())
    try:
        rec = asyncio.run(park(fake_server, tmp_path, cat, sidecar=sidecar))
    finally:
        cat.close()
    env = {"FAKE_SIDECAR": 1} if sidecar else {}
    with fake_server(**env) as (url, proc):
        # stand-in for a chat client that taught the fake tokenizer its text
        import httpx
        httpx.post(url + "/tokenize", json={"content": WARM_TEXT}, timeout=10)
        out_json = tmp_path / "report.json"
        rc = _cli(["check", url, rec.name, "--save-dir", str(tmp_path / "slots"), "--log-file", str(proc.log_path),
                   "--ab", "--json", "--export", str(out_json), "--export", str(tmp_path / "report.csv"),
                   "--export", str(tmp_path / "report.png")])
    captured = capsys.readouterr()
    assert rc == code, captured.err
    data = json.loads(captured.out)
    assert data == json.loads(out_json.read_text())
    assert data["verdict"]["kind"] == ("HIT" if sidecar else "DISCARDED")
    assert len(data["probes"]) == 2 and len(data["ab"]["rows"]) == 4
    assert data["ab"]["protocol"] == "one process"  # a server KV Valet does not run: one process, labelled
    if not sidecar:
        assert data["ab"]["note"].startswith("both arms re-prefill: this build wrote no sidecar")
    rows = list(csv.DictReader(io.StringIO((tmp_path / "report.csv").read_text())))
    assert [r["section"] for r in rows] == ["probe", "probe", "ab", "ab", "ab", "ab", "ratio", "ratio", "ratio"]
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("flag", [[], ["--no-output-check"]])
def test_cli_check_output_check_on_by_default_and_no_output_check_turns_it_off(fake_server, tmp_path, capsys, flag):
    """By default each probe and each A/B arm shows its output check (the fake's greedy
    continuation is the same warm and cold); --no-output-check runs none and says so."""
    import asyncio

    import httpx

    from app import paths

    cat = Catalog(paths.catalog_path())
    try:
        rec = asyncio.run(park(fake_server, tmp_path, cat))
    finally:
        cat.close()
    with fake_server(FAKE_SIDECAR=1) as (url, proc):
        httpx.post(url + "/tokenize", json={"content": WARM_TEXT}, timeout=10)
        base = ["check", url, rec.name, "--save-dir", str(tmp_path / "slots"), "--log-file", str(proc.log_path),
                "--ab", *flag]
        rc = _cli([*base, "--json", "--export", str(tmp_path / "report.csv")])
        data = json.loads(capsys.readouterr().out)
        assert _cli(base) == rc == 0
        text = capsys.readouterr().out
    rows = [*data["probes"], *data["ab"]["rows"]]
    csv_rows = list(csv.DictReader(io.StringIO((tmp_path / "report.csv").read_text())))
    if flag:
        assert data["output_check"] is False and data["ab"]["output_check"] is False
        assert all(r["output"] is None and r["output_check"] is None for r in rows)
        assert "output check: off (--no-output-check)" in text and "| off |" in text
        assert {r["output"] for r in csv_rows if r["section"] != "ratio"} == {""}
    else:
        assert data["output_check"] is True and data["verdict"]["kind"] == "HIT"
        assert [r["output"] for r in rows] == ["match"] * 6
        assert all(r["output_check"]["compared"] == OUTPUT_TOKENS for r in rows)
        assert f"same {OUTPUT_TOKENS}/{OUTPUT_TOKENS}" in text and "output check: the first 8 tokens match" in text
        assert {r["output"] for r in csv_rows if r["section"] != "ratio"} == {"match"}


def test_cli_errors_exit_1(tmp_path, capsys):
    assert _cli(["check", "http://127.0.0.1:9", "s1"]) == 2  # usage: a URL needs --save-dir
    assert "--save-dir" in capsys.readouterr().err
    assert _cli(["check", "http://127.0.0.1:9", "s1", "--save-dir", str(tmp_path)]) == 1
    assert "is not running" in capsys.readouterr().err
