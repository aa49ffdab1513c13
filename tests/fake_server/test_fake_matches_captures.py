"""Replay the real llama-server captures against the fake: same figures, same log lines, same order.

The expectations come from the fixture files, parsed here:
* tests/fixtures/llama-server-b11434: the stock build 11434 (01 fill + save, 02 restart + restore
  + text follow-up, 03 a short session + the error responses of responses.json);
* tests/fixtures/sidecar-build-b11434: the same sources with turboquant PR #206 sidecars (01 fill
  + save, 02 restore + text follow-up, 03 restore + exact tokens, 04 sidecar hidden).

The fake is driven with prompts that have the captured token counts (2,861 tokens, a 21-token
follow-up, a 318-token session...), so its log, once timings, sizes and task ids are masked, must
be the captured log line for line. Nothing here imports the app.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import httpx
import pytest

from tests.fake_server.conftest import run_fake_server

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
STOCK = FIXTURES / "llama-server-b11434"
SIDECAR = FIXTURES / "sidecar-build-b11434"
RESPONSES = json.loads((STOCK / "responses.json").read_text())
# sidecar-build-b11434 was captured from KV Valet's first port (PKCL v1, strict, no tip): the
# sidecar server's KVV_SIDECAR_MODE=port (the other modes: test_fake_modes_match_captures.py)
PORT = {"FAKE_SIDECAR": 1, "KVV_SIDECAR_MODE": "port"}

STAMP = re.compile(r"^\d+\.\d{2}\.\d{3}\.\d{3} ")
# llama.cpp's format: <elapsed> <L> <component> <func>: <text>, func right-aligned in 12 columns
LOG_LINE = re.compile(r"^\d+\.\d{2}\.\d{3}\.\d{3} [IWED] (srv  |slot )[ \w()]{12}: ")
MASKS = [
    (re.compile(r"\| task \d+ \|"), "| task T |"),
    (re.compile(r"task id = \d+"), "task id = T"),
    (re.compile(r"id_task = \d+"), "id_task = T"),
    (re.compile(r"size = [\d.]+ MiB"), "size = _ MiB"),
    (re.compile(r"(prompt processing, n_tokens = +\d+, progress = [\d.]+), t = .*"), r"\1"),
    (re.compile(r"(prompt eval time|eval time|total time) = +[\d.]+ ms / +(\d+) tokens.*"), r"\1 = _ ms / \2 tokens"),
    (re.compile(r"graphs reused = +\d+"), "graphs reused = _"),
    (re.compile(r"took [\d.]+ ms"), "took _ ms"),
    (re.compile(r"total state size = [\d.]+ MiB \(draft: [\d.]+ MiB\)"), "total state size = _"),
    (re.compile(r"cache state: (\d+) prompts, [\d.]+ MiB \(limits: ([\d.]+ MiB, \d+ tokens), \d+ est\)"),
     r"cache state: \1 prompts, _ MiB (limits: \2, _ est)"),
    (re.compile(r"prompt 0x[0-9a-f]+: +(\d+) tokens, checkpoints: +(\d+), +[\d.]+ MiB"),
     r"prompt _: \1 tokens, checkpoints: \2, _ MiB"),
    (re.compile(r"failed to open \S*/([^/\s:]+):"), r"failed to open \1:"),
]


def key_lines(log: str) -> list[str]:
    """The lines after "listening on" that say what the server did, masked where a fake
    cannot match a real machine (timings, byte sizes, task ids, paths). Untimestamped
    continuation lines are kept after the line they continue."""
    out, keep, started = [], False, False
    for line in log.splitlines():
        if not started:
            started = "listening on http://" in line
            continue
        if not STAMP.match(line):
            if keep:
                out.append(line)
            continue
        rest = STAMP.sub("", line)
        level, component = rest[0], rest[2:].split(" ", 1)[0]
        keep = (component in ("srv", "slot") or level in "EW") and "all slots are idle" not in rest
        if keep:
            for rx, repl in MASKS:
                rest = rx.sub(repl, rest)
            out.append(rest)
    return out


def fixture_lines(path: Path) -> list[str]:
    return key_lines(path.read_text())


def assert_same_lines(fake_log: str, capture: Path) -> None:
    ours, theirs = key_lines(fake_log), fixture_lines(capture)
    if ours and "cleaning up before exit" in ours[-1] and not any("cleaning up" in t for t in theirs):
        ours = ours[:-1]  # the capture stops before the server did
    assert ours == theirs


def text_prompt(n_tokens: int) -> str:
    """A text the fake tokenizes into exactly ``n_tokens`` tokens (BOS included):
    <start_of_turn>, "user", "\\n", then words and single spaces."""
    n_words = (n_tokens - 4 + 1) // 2
    assert 4 + 2 * n_words - 1 == n_tokens
    return "<start_of_turn>user\n" + " ".join(f"w{i}" for i in range(n_words))


def more(n_pairs: int) -> str:
    return "".join(f" x{i}" for i in range(n_pairs))  # two tokens each


def complete(url: str, prompt, n_predict: int, id_slot: int = 0) -> dict:
    r = httpx.post(url + "/completion", json={"prompt": prompt, "n_predict": n_predict, "id_slot": id_slot,
                                              "cache_prompt": True}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def post(url: str, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=30)


def figures(resp: dict) -> tuple[int, int, int, int]:
    t = resp["timings"]
    return t["cache_n"], t["prompt_n"], resp["tokens_evaluated"], resp["tokens_cached"]


def read_state(path: Path) -> tuple[bytes, list[int]]:
    """Our own reading of a state file: u32 magic, u32 version, u32 n words, the words."""
    data = path.read_bytes()
    _magic, _version, n_words = struct.unpack_from("<III", data)
    words = list(struct.unpack_from(f"<{n_words}i", data, 12))
    assert words[0] == -1 and words[1] == 1  # packed payload, version 1
    return data, words[3:3 + words[2]]


def read_pkcl(path: Path) -> list[tuple[int, int, int, int, int, int]]:
    """(offset, n_tokens, pos_min, pos_max, n_tgt, n_dft) of each checkpoint, checking the sizes add up."""
    data = path.read_bytes()
    magic, version, count = struct.unpack_from("<III", data)
    assert (magic, version) == (0x4C434B50, 1) and data[:4] == b"PKCL"
    out, off = [], 12
    for _ in range(count):
        n_tokens, pos_min, pos_max, n_tgt, n_dft = struct.unpack_from("<qiiQQ", data, off)
        out.append((off, n_tokens, pos_min, pos_max, n_tgt, n_dft))
        off += 32 + n_tgt + n_dft
    assert off == len(data)
    return out


def hex_dump_bytes(path: Path) -> bytes:
    """The bytes of an ``xxd`` dump."""
    out = b""
    for line in path.read_text().splitlines():
        hexpart = line.split(":", 1)[1].strip()[:39]
        out += bytes.fromhex(hexpart.replace(" ", ""))
    return out


LONG = text_prompt(2861)  # the captured 2,861-token prompt


def fill_and_save(tmp: Path, **env) -> dict:
    """01: a 2,861-token prompt, a text follow-up of 21 new tokens, save slot 0 as s1.bin."""
    with run_fake_server(tmp, **env) as (url, proc):
        assert httpx.get(url + "/slots").json() == [RESPONSES["slots_after_task"]["body"][0],
                                                    {**RESPONSES["slots_after_task"]["body"][0], "id": 1}]
        first = complete(url, LONG, 4)
        follow = LONG + first["content"] + more(10)
        second = complete(url, follow, 8)
        save = post(url, "/slots/0?action=save", {"filename": "s1.bin"}).json()
    return {"first": first, "second": second, "follow": follow, "save": save,
            "log": Path(proc.log_path).read_text()}


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stock")
    return tmp, fill_and_save(tmp)


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sidecar")
    return tmp, fill_and_save(tmp, **PORT)


# ---------------------------------------------------------------- stock build 11434


def test_01_fill_and_save(stock):
    tmp, s = stock
    assert figures(s["first"]) == (0, 2861, 2861, 2864)
    assert figures(s["second"]) == (2864, 21, 2885, 2892)  # same process: the live cache serves it
    assert s["save"].keys() == RESPONSES["save_ok"]["body"].keys()
    assert s["save"]["n_saved"] == 2892 and s["save"]["n_written"] == (tmp / "slots" / "s1.bin").stat().st_size
    assert_same_lines(s["log"], STOCK / "01-start-fill-save.log")
    assert not (tmp / "slots" / "s1.bin.ckpt").exists()  # a stock build writes no sidecar


def test_state_file_header_is_laid_out_like_the_real_one(stock):
    tmp, s = stock
    real = hex_dump_bytes(STOCK / "state-file-header.hex")
    data, tokens = read_state(tmp / "slots" / "s1.bin")
    # magic 'qsgg', version 4, 2,896 words = marker, payload version, count, 2,892 tokens, media count;
    # the first token is BOS (2) in both. The other tokens differ: the fake has no real tokenizer.
    assert data[:28] == real[:28]
    assert len(tokens) == 2892 and struct.unpack_from("<i", data, 12 + 4 * 2895)[0] == 0


def test_02_restart_restore_text_follow_up_reprefills(stock):
    tmp, s = stock
    with run_fake_server(tmp) as (url, proc):
        restore = post(url, "/slots/0?action=restore", {"filename": "s1.bin"}).json()
        assert restore.keys() == RESPONSES["restore_ok"]["body"].keys()
        assert restore["n_restored"] == 2892 and restore["n_read"] == s["save"]["n_written"]
        # a slot that never ran a task shows no task, even with 2,892 restored tokens
        assert httpx.get(url + "/slots").json()[0] == RESPONSES["slots_after_restore"]["body"][0]
        follow = complete(url, s["follow"], 8)
    assert figures(follow) == (0, 2885, 2885, 2892)
    assert_same_lines(Path(proc.log_path).read_text(), STOCK / "02-restart-restore-reprefill.log")


SHORT = text_prompt(315)  # 315 + 3 decoded = the captured 318-token session


def test_03_short_session_and_the_captured_responses(tmp_path):
    with run_fake_server(tmp_path) as (url, proc):  # the session the capture restores (not captured)
        short = complete(url, SHORT, 4, id_slot=1)
        assert post(url, "/slots/1?action=save", {"filename": "short.bin"}).json()["n_saved"] == 318
    with run_fake_server(tmp_path) as (url, proc):
        assert post(url, "/slots/1?action=restore", {"filename": "short.bin"}).json()["n_restored"] == 318
        first = complete(url, SHORT + short["content"] + more(7), 4, id_slot=1)
        assert figures(first) == (0, 333, 333, 336)  # shorter than the SWA window, re-prefilled all the same

        def replay(name: str) -> httpx.Response:
            req = RESPONSES[name]["request"]
            if req["method"] == "GET":
                return httpx.get(url + req["path"], timeout=10)
            return post(url, req["path"], req.get("json"))

        slots = replay("slots_after_task").json()
        want = RESPONSES["slots_after_task"]["body"]
        assert slots[0] == want[0]
        assert slots[1].keys() == want[1].keys() and slots[1]["params"].keys() == want[1]["params"].keys()
        for k in ("id_task", "n_prompt_tokens", "n_prompt_tokens_processed", "n_prompt_tokens_cache", "next_token"):
            assert slots[1][k] == want[1][k], k
        assert slots[1]["params"]["n_predict"] == want[1]["params"]["n_predict"] == 4

        save = replay("save_ok")
        assert save.status_code == 200
        assert {k: v for k, v in save.json().items() if k not in ("n_written", "timings")} == \
            {k: v for k, v in RESPONSES["save_ok"]["body"].items() if k not in ("n_written", "timings")}
        restore = replay("restore_ok")
        assert {k: v for k, v in restore.json().items() if k not in ("n_read", "timings")} == \
            {k: v for k, v in RESPONSES["restore_ok"]["body"].items() if k not in ("n_read", "timings")}
        assert restore.json()["n_read"] == save.json()["n_written"] == (tmp_path / "slots" / "fixture.bin").stat().st_size
        slots = replay("slots_after_restore").json()
        want = RESPONSES["slots_after_restore"]["body"]
        assert slots[0] == want[0]  # 336 restored tokens, but no task: nothing to show
        assert slots[1]["id_task"] == want[1]["id_task"] and slots[1]["n_prompt_tokens"] == want[1]["n_prompt_tokens"]

        for name in ("save_bad_filename", "restore_missing_file", "bad_action"):
            r = replay(name)
            assert (r.status_code, r.json()) == (RESPONSES[name]["status"], RESPONSES[name]["body"]), name
        r = replay("bad_slot")  # slot 7 of 2 is slot 1: saved, and the answer keeps the id asked for
        assert r.status_code == RESPONSES["bad_slot"]["status"]
        assert {k: r.json()[k] for k in ("id_slot", "filename", "n_saved")} == \
            {k: RESPONSES["bad_slot"]["body"][k] for k in ("id_slot", "filename", "n_saved")}
        r = replay("erase")  # the failed restore cleared slot 0
        assert (r.status_code, r.json()) == (RESPONSES["erase"]["status"], RESPONSES["erase"]["body"])

        req = RESPONSES["completion"]["request"]["json"]
        # "Say hi." is 13 fake tokens, "Say hi" 12 like the real tokenizer's "Say hi."
        said = complete(url, req["prompt"].replace("hi.", "hi"), req["n_predict"], req["id_slot"])
        want = RESPONSES["completion"]["body"]
        assert said.keys() == want.keys() and said["timings"].keys() == want["timings"].keys()
        assert said["generation_settings"].keys() == want["generation_settings"].keys()
        assert figures(said) == figures(want) == (0, 12, 12, 19)
        for k in ("id_slot", "tokens_predicted", "stop", "truncated", "stop_type", "tokens"):
            assert said[k] == want[k], k

        tok = replay("tokenize")
        assert tok.status_code == 200 and list(tok.json()) == ["tokens"]
        metrics = replay("metrics").text
    real = dict(re.findall(r"^llamacpp:(\w+) (\S+)$", RESPONSES["metrics"]["body"], re.M))
    fake = dict(re.findall(r"^llamacpp:(\w+) (\S+)$", metrics, re.M))
    # the captured body is cut short after prompt_tokens_seconds: compare what it holds
    assert list(fake)[:len(real)] == list(real)
    for k in ("prompt_tokens_total", "prompt_tokens_cached_total", "tokens_predicted_total", "n_decode_total",
              "n_tokens_max"):
        assert fake[k] == real[k], k
    assert re.search(r"^llamacpp:requests_processing 0$", metrics, re.M)
    assert_same_lines(Path(proc.log_path).read_text(), STOCK / "03-short-session-restore-reprefill.log")


# ---------------------------------------------------------------- sidecar build (turboquant PR #206)


def test_sidecar_01_fill_and_save(sidecar):
    tmp, s = sidecar
    assert figures(s["first"]) == (0, 2861, 2861, 2864)
    assert figures(s["second"]) == (2864, 21, 2885, 2892)
    assert s["save"]["n_saved"] == 2892
    assert_same_lines(s["log"], SIDECAR / "01-fill-save-with-sidecar.log")


def test_sidecar_layout_is_the_real_one(sidecar):
    tmp, _ = sidecar
    layout = (SIDECAR / "sidecar-layout.txt").read_text()
    real = [tuple(map(int, m)) for m in re.findall(
        r"n_tokens (\d+), pos_min (\d+), pos_max (\d+), n_tgt \d+, n_dft (\d+)", layout)]
    assert len(real) == int(re.search(r"count (\d+)", layout).group(1)) == 4
    ours = read_pkcl(tmp / "slots" / "s1.bin.ckpt")
    assert [(n, lo, hi, dft) for _, n, lo, hi, _, dft in ours] == real
    first = bytes.fromhex("".join(layout.split("first 76 bytes:", 1)[1].split()))
    assert len(first) == 76
    data = (tmp / "slots" / "s1.bin.ckpt").read_bytes()
    assert data[:28] == first[:28]  # magic, version, count, then n_tokens, pos_min, pos_max of the first
    assert ours[0][0] == 12 and ours[1][0] == 12 + 32 + ours[0][4]  # like "header at offset 12", "offset 7870904"


def test_sidecar_02_restore_hit(sidecar):
    tmp, s = sidecar
    with run_fake_server(tmp, **PORT) as (url, proc):
        restore = post(url, "/slots/0?action=restore", {"filename": "s1.bin"}).json()
        assert restore["n_restored"] == 2892
        follow = complete(url, s["follow"], 8)
    assert figures(follow) == (2880, 5, 2885, 2892)  # rolled back to the checkpoint at 2,880
    assert_same_lines(Path(proc.log_path).read_text(), SIDECAR / "02-restart-restore-sidecar-hit.log")


def test_sidecar_03_restore_exact_tokens(sidecar):
    tmp, s = sidecar
    _, saved = read_state(tmp / "slots" / "s1.bin")
    with run_fake_server(tmp, **PORT) as (url, proc):
        post(url, "/slots/0?action=restore", {"filename": "s1.bin"})
        new = httpx.post(url + "/tokenize", json={"content": " and one more"}).json()["tokens"]
        assert len(new) == 6
        follow = complete(url, saved + new, 8)
    assert figures(follow) == (2880, 18, 2898, 2905)
    assert_same_lines(Path(proc.log_path).read_text(), SIDECAR / "03-restart-restore-sidecar-exact-tokens.log")


def test_sidecar_04_hidden_sidecar_reprefills(sidecar):
    tmp, s = sidecar
    ckpt = tmp / "slots" / "s1.bin.ckpt"
    aside = tmp / "aside.ckpt"
    shutil.move(ckpt, aside)
    try:
        with run_fake_server(tmp, **PORT) as (url, proc):
            post(url, "/slots/0?action=restore", {"filename": "s1.bin"})
            follow = complete(url, s["follow"], 8)
    finally:
        shutil.move(aside, ckpt)
    assert figures(follow) == (0, 2885, 2885, 2892)
    assert_same_lines(Path(proc.log_path).read_text(), SIDECAR / "04-restart-restore-sidecar-hidden.log")


# ---------------------------------------------------------------- the log format


@pytest.mark.parametrize("path", sorted(STOCK.glob("*.log")) + sorted(SIDECAR.glob("*.log")), ids=lambda p: p.name)
def test_fixture_key_lines_are_in_the_format_the_fake_writes(path):
    """Guard for the comparison itself: the key lines are found, and every timestamped
    server line of a capture has the shape the fake's lines have."""
    lines = path.read_text().splitlines()
    assert len(fixture_lines(path)) > 10
    for line in lines:
        if STAMP.match(line) and re.match(r"^\S+ [IWED] (srv |slot)", line):
            assert LOG_LINE.match(line), line


def test_the_fake_writes_only_well_formed_lines(stock):
    _, s = stock
    lines = s["log"].splitlines()
    prev_ok = False
    for line in lines:
        if STAMP.match(line):
            assert LOG_LINE.match(line) or re.match(r"^\S+ E \w+: ", line), line
            prev_ok = True
        else:  # continuation lines only after a timestamped line (sampler params, chat template)
            assert prev_ok, line
