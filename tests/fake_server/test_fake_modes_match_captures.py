"""Replay tests/fixtures/sidecar-modes-b11434 (the sidecar server in KVV_SIDECAR_MODE fork and v2)
against the fake in that mode: the same sidecar and checkpoint events, in the same order.

The captures were made by tests/sidecar-server/capture-modes (Gemma 3 270M, -c 8192 -np 2 -lv 4
--ctx-checkpoints 32, a fresh process per numbered log). The fake is driven through the same
steps with prompts of the captured token counts (a 2,531-token text, 8 generated; the follow-up
re-renders the saved tokens as text and adds 11 tokens), so its checkpoint positions are the
real ones. Both logs go through the app's parser (:func:`app.server.logparse.parse_line`) and
are compared event by event: kind, level, the slot's task being -1 or not, and the key figures
(counts, positions, n_tokens, n_past), never timings or sizes. The fake may print only line
shapes some capture shows. The sidecars it writes are read with the app's reader and hashed
with the app's FNV-1a (the fake has its own code for both).
"""

from __future__ import annotations

import dataclasses
import os
import re
import struct
from pathlib import Path

import httpx
import pytest

from app.server.logparse import (CheckpointCreated, CheckpointRestored, Kind, NewPrompt, Release, SidecarIgnored,
                                 SidecarMode, SidecarRestored, SidecarSaved, parse_line)
from app.server.sidecar import fnv1a64_file, read_facts
from tests.fake_server.conftest import run_fake_server
from tests.fake_server.test_fake_matches_captures import text_prompt

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MODES = FIXTURES / "sidecar-modes-b11434"
TEXT = text_prompt(2531)  # the capture's TEXT is 2,531 Gemma tokens (BOS included)
# the capture's QUESTION adds 11 Gemma tokens to the 2,538 saved ones; these are 11 fake tokens
# that do not merge with the saved text's last token
QUESTION = "In one short sentence, what?"
ARGS = ("--ctx-checkpoints", "32")

STAMP = re.compile(r"^\d+\.\d{2}\.\d{3}\.\d{3} ")
CHECKING = re.compile(r"checking checkpoint with \[(-?\d+), (-?\d+)\] against (-?\d+)")
ERASED = re.compile(r"erased invalidated context checkpoint \((.*)\)")
CACHED = re.compile(r"cached n_tokens = (\d+), memory_seq_rm \[(\d+), end\)")
KV = re.compile(r"(\w+) = (-?\d+)")
KEEP = {Kind.SIDECAR_MODE, Kind.SIDECAR_SAVED, Kind.SIDECAR_RESTORED, Kind.SIDECAR_IGNORED,
        Kind.SIDECAR_WRITE_FAILED, Kind.CHECKPOINT_CREATED, Kind.CHECKPOINT_RESTORED, Kind.FULL_REPROCESS,
        Kind.NEW_PROMPT, Kind.RELEASE}
FIGURES = ("index", "max", "pos_min", "pos_max", "n_tokens", "n_past", "n_swa", "pos_next", "count", "mode")


def event_figures(ev) -> dict:
    """The key figures of a kept event by name: counts, positions, n_tokens, n_past, the mode."""
    if isinstance(ev, SidecarIgnored):
        return {"reason": ev.reason, "file": os.path.basename(ev.path)}
    if isinstance(ev, (CheckpointCreated, CheckpointRestored)):
        out = {k: v for k, v in dataclasses.asdict(ev.checkpoint).items() if k in FIGURES and v is not None}
        return out | ({"index": ev.index, "max": ev.limit} if isinstance(ev, CheckpointCreated) else {})
    if isinstance(ev, (SidecarSaved, SidecarRestored)):
        return {"count": ev.count}
    if isinstance(ev, SidecarMode):
        return {"mode": ev.mode}
    if isinstance(ev, (NewPrompt, Release)):
        return {"n_tokens": ev.n_tokens}
    return {}  # a full re-processing, a failed sidecar write: the kind alone


def events(log: str) -> list[tuple]:
    """The sidecar and checkpoint events of a log, as comparable tuples."""
    out = []
    for line in log.splitlines():
        if not STAMP.match(line):
            continue
        ev = parse_line(line)
        key: tuple
        if ev.kind in KEEP:
            key = (ev.kind.value, tuple(sorted(event_figures(ev).items())))
        elif m := CHECKING.search(ev.text):
            key = ("checking_checkpoint", tuple(map(int, m.groups())))
        elif m := ERASED.search(ev.text):
            key = ("erased_checkpoint", tuple(sorted((k, int(v)) for k, v in KV.findall(m.group(1)) if k in FIGURES)))
        elif m := CACHED.search(ev.text):
            key = ("cached", tuple(map(int, m.groups())))
        else:
            continue
        out.append((*key, ev.level, ev.func, ev.task == -1 if ev.task is not None else None))
    return out


def shape(line: str) -> str:
    """A line without its timestamp, numbers, paths and column padding."""
    rest = STAMP.sub("", line)
    rest = re.sub(r"(/[^\s()']+)+", "PATH", rest)
    rest = re.sub(r"\d+", "N", rest)
    return re.sub(r"\s+", " ", rest).strip()


def capture_shapes() -> set[str]:
    shapes = set()
    for path in FIXTURES.glob("**/*.log"):
        shapes |= {shape(line) for line in path.read_text().splitlines() if STAMP.match(line)}
    return shapes


SHAPES = capture_shapes()


def assert_only_captured_shapes(log: str) -> None:
    unknown = [line for line in log.splitlines()
               if STAMP.match(line) and re.match(r"^\S+ [IWED] (srv |slot)", line) and shape(line) not in SHAPES]
    assert unknown == []


def assert_like_capture(log: str, capture: Path) -> None:
    assert events(log) == events(capture.read_text()), capture.name
    assert_only_captured_shapes(log)


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def chat_text(url: str, tokens: list[int]) -> str:
    """capture-modes' chat_text: the saved tokens as text (without <bos>), then the question."""
    text = post(url, "/detokenize", {"tokens": tokens})["content"]
    return (text[len("<bos>"):] if text.startswith("<bos>") else text) + QUESTION


def saved_tokens(path: Path) -> list[int]:
    data = path.read_bytes()
    n_words = struct.unpack_from("<I", data, 8)[0]
    words = struct.unpack_from(f"<{n_words}i", data, 12)
    assert words[:2] == (-1, 1)
    return list(words[3:3 + words[2]])


def ask(url: str, tokens: list[int]) -> dict:
    return post(url, "/completion", {"prompt": chat_text(url, tokens), "n_predict": 1, "id_slot": 0,
                                     "cache_prompt": True})


def log_of(proc) -> str:
    return Path(proc.log_path).read_text()


class Run:
    """One mode's scenario, run once per module: the logs of each numbered step."""

    def __init__(self, tmp: Path, mode: str):
        self.tmp, self.mode = tmp, mode
        self.logs: dict[str, str] = {}
        self.answers: dict[str, dict] = {}
        self.state = tmp / "slots" / "a.bin"
        self.ckpt = tmp / "slots" / "a.bin.ckpt"

    def server(self, extra=ARGS):
        return run_fake_server(self.tmp, extra_args=extra, FAKE_SIDECAR=1, KVV_SIDECAR_MODE=self.mode)

    def hidden(self):
        os.rename(self.ckpt, str(self.ckpt) + ".hidden")

    def unhide(self):
        os.rename(str(self.ckpt) + ".hidden", self.ckpt)

    def run(self) -> Run:
        with self.server() as (url, proc):
            post(url, "/completion", {"prompt": TEXT, "n_predict": 8, "id_slot": 0, "cache_prompt": True})
            self.answers["save"] = post(url, "/slots/0?action=save", {"filename": "a.bin"})
        self.logs["01"] = log_of(proc)
        self.facts = read_facts(self.state)
        tokens = saved_tokens(self.state)

        with self.server() as (url, proc):
            self.answers["restore"] = post(url, "/slots/0?action=restore", {"filename": "a.bin"})
            self.answers["02"] = ask(url, tokens)
        self.logs["02"] = log_of(proc)

        self.hidden()
        with self.server() as (url, proc):
            post(url, "/slots/0?action=restore", {"filename": "a.bin"})
            self.answers["03"] = ask(url, tokens)
        self.logs["03"] = log_of(proc)
        self.unhide()

        if self.mode == "fork":
            with self.server() as (url, proc):
                post(url, "/slots/0?action=restore", {"filename": "a.bin"})
                self.answers["04a"] = ask(url, tokens)
                self.hidden()
                post(url, "/slots/0?action=restore", {"filename": "a.bin"})
                self.answers["04b"] = ask(url, tokens)
                self.unhide()
            self.logs["04"] = log_of(proc)
            with open(self.ckpt, "ab") as f:
                f.write(b"\0" * 7)
            with self.server() as (url, proc):
                post(url, "/slots/0?action=restore", {"filename": "a.bin"})
            self.logs["05"] = log_of(proc)
        else:
            raw = bytearray(self.ckpt.read_bytes())
            raw[8:16] = struct.pack("<Q", struct.unpack("<Q", bytes(raw[8:16]))[0] ^ 1)
            self.ckpt.write_bytes(raw)
            with self.server() as (url, proc):
                post(url, "/slots/0?action=restore", {"filename": "a.bin"})
                self.answers["04"] = ask(url, tokens)
            self.logs["04"] = log_of(proc)
            raw[8:16] = struct.pack("<Q", struct.unpack("<Q", bytes(raw[8:16]))[0] ^ 1)
            self.ckpt.write_bytes(raw)
            with self.server(("--ctx-checkpoints", "1")) as (url, proc):
                post(url, "/slots/0?action=restore", {"filename": "a.bin"})
            self.logs["05"] = log_of(proc)
        return self


@pytest.fixture(scope="module")
def fork(tmp_path_factory):
    return Run(tmp_path_factory.mktemp("fork"), "fork").run()


@pytest.fixture(scope="module")
def v2(tmp_path_factory):
    return Run(tmp_path_factory.mktemp("v2"), "v2").run()


def capture(mode: str, step: str) -> Path:
    (path,) = (MODES / mode).glob(f"{step}-*.log")
    return path


def figures(answer: dict) -> tuple[int, int]:
    return answer["timings"]["cache_n"], answer["timings"]["prompt_n"]


# ---------------------------------------------------------------- the comparison itself


@pytest.mark.parametrize("path", sorted(MODES.glob("*/*.log")), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_each_capture_has_the_events_compared(path):
    """Guard: the parser finds the events in every capture (a format drift would empty both sides)."""
    evs = events(path.read_text())
    kinds = {e[0] for e in evs}
    assert ("sidecar_mode", (("mode", path.parent.name),), "I", "load_model", None) in evs
    assert kinds & {"sidecar_saved", "sidecar_restored", "sidecar_ignored", "checkpoint_created"}


# ---------------------------------------------------------------- fork (the turboquant fork at #206)


def test_fork_01_fill_and_save_writes_pkcl_v1(fork):
    assert_like_capture(fork.logs["01"], capture("fork", "01"))
    f = fork.facts
    assert (f.kind, f.version, f.count, f.trailing, f.short) == ("PKCL", 1, 2, 0, None)
    assert [(c.n_tokens, c.pos_min, c.pos_max) for c in f.checkpoints] == [(2015, 991, 2014), (2527, 1503, 2526)]
    assert fork.answers["save"]["n_saved"] == 2538


def test_fork_02_restart_restore_sidecar_hit(fork):
    assert_like_capture(fork.logs["02"], capture("fork", "02"))
    assert fork.answers["restore"]["n_restored"] == 2538
    assert figures(fork.answers["02"]) == (2526, 23)


def test_fork_03_hidden_sidecar_silent_tip_reprefills(fork):
    assert_like_capture(fork.logs["03"], capture("fork", "03"))
    assert "sidecar" not in fork.logs["03"].split("checkpoint sidecars: fork", 1)[1]  # silent
    assert figures(fork.answers["03"]) == (0, 2549)


def test_fork_04_one_process_confound(fork):
    """The second restore keeps the first arm's checkpoints: the sidecar-less arm is a HIT."""
    assert_like_capture(fork.logs["04"], capture("fork", "04"))
    assert figures(fork.answers["04a"]) == (2526, 23)
    assert figures(fork.answers["04b"]) == (2525, 24)


def test_fork_05_lax_loader_accepts_trailing_bytes(fork):
    assert_like_capture(fork.logs["05"], capture("fork", "05"))
    assert read_facts(fork.state).trailing == 7


# ---------------------------------------------------------------- v2 (KV Valet's default)


def test_v2_01_fill_and_save_writes_pkcl_v2_with_the_state_hash(v2):
    assert_like_capture(v2.logs["01"], capture("v2", "01"))
    f = v2.facts
    assert (f.kind, f.version, f.count, f.trailing, f.short) == ("PKCL", 2, 2, 0, None)
    assert f.state_hash == fnv1a64_file(v2.state)
    assert [(c.n_tokens, c.pos_min, c.pos_max) for c in f.checkpoints] == [(2015, 991, 2014), (2527, 1503, 2526)]
    assert not Path(str(v2.ckpt) + ".tmp").exists()  # written through a temp file and a rename


def test_v2_02_restart_restore_sidecar_hit(v2):
    assert_like_capture(v2.logs["02"], capture("v2", "02"))
    assert figures(v2.answers["02"]) == (2526, 23)


def test_v2_03_hidden_sidecar_tip_reprefills(v2):
    assert_like_capture(v2.logs["03"], capture("v2", "03"))
    assert figures(v2.answers["03"]) == (0, 2549)


def test_v2_04_stale_hash_refused(v2):
    assert_like_capture(v2.logs["04"], capture("v2", "04"))
    assert figures(v2.answers["04"]) == (0, 2549)


def test_v2_05_count_above_ctx_checkpoints_refused(v2):
    assert_like_capture(v2.logs["05"], capture("v2", "05"))


# ---------------------------------------------------------------- what the captures do not show


def fill_save(tmp: Path, mode: str, name: str = "a.bin", erase_first: bool = False, **env) -> str:
    with run_fake_server(tmp, extra_args=ARGS, FAKE_SIDECAR=1, KVV_SIDECAR_MODE=mode, **env) as (url, proc):
        post(url, "/completion", {"prompt": TEXT, "n_predict": 8, "id_slot": 0, "cache_prompt": True})
        if erase_first:
            assert post(url, "/slots/0?action=erase", {})["n_erased"] == 2538
        post(url, "/slots/0?action=save", {"filename": name})
    return log_of(proc)


def restore(tmp: Path, mode: str, name: str = "a.bin", **env) -> str:
    with run_fake_server(tmp, extra_args=ARGS, FAKE_SIDECAR=1, KVV_SIDECAR_MODE=mode, **env) as (url, proc):
        post(url, "/slots/0?action=restore", {"filename": name})
    return log_of(proc)


def kinds(log: str) -> list[tuple]:
    return [e[:2] for e in events(log) if e[0] not in ("new_prompt", "release", "cached", "checking_checkpoint")]


def test_port_writes_pkcl_v1_and_its_strict_loader_warns_without_a_tip(tmp_path):
    log = fill_save(tmp_path, "port")
    assert "I srv    load_model: checkpoint sidecars: port" in log
    state = tmp_path / "slots" / "a.bin"
    f = read_facts(state)
    assert (f.kind, f.version, f.count) == ("PKCL", 1, 2)
    assert ("sidecar_restored", (("count", 2),)) in kinds(restore(tmp_path, "port"))
    with open(str(state) + ".ckpt", "ab") as fh:
        fh.write(b"\0")
    log = restore(tmp_path, "port")
    assert kinds(log)[1:] == [("sidecar_ignored", (("file", "a.bin.ckpt"), ("reason", "1 trailing bytes")))]
    assert re.search(r" W slot process_sing: id  0 \| task -1 \| ignoring checkpoint sidecar: 1 trailing bytes "
                     r"\(\S+/slots/a\.bin\.ckpt\)$", log, re.M)


def test_erase_keeps_the_checkpoints_on_the_fork_only(tmp_path):
    """Saved after an erase: the fork still holds (and writes) the erased chat's checkpoints;
    v2 writes an empty list (it writes on every save); port writes nothing."""
    saved = {}
    for mode in ("fork", "v2", "port"):
        (tmp_path / mode).mkdir()
        saved[mode] = fill_save(tmp_path / mode, mode, erase_first=True)
    assert ("sidecar_saved", (("count", 2),)) in kinds(saved["fork"])
    assert ("sidecar_saved", (("count", 0),)) in kinds(saved["v2"])
    assert "sidecar_saved" not in {k for k, _ in kinds(saved["port"])}
    assert read_facts(tmp_path / "fork" / "slots" / "a.bin").count == 2
    assert read_facts(tmp_path / "v2" / "slots" / "a.bin").count == 0
    assert not (tmp_path / "port" / "slots" / "a.bin.ckpt").exists()


def test_v2_refuses_an_empty_list_and_makes_a_tip_instead(tmp_path):
    """A dense model makes no checkpoints: v2 still writes a sidecar (count 0), which its own
    loader refuses ("no checkpoints"); the tip spans every restored position."""
    log = fill_save(tmp_path, "v2", FAKE_MODEL_KIND="dense")
    assert ("sidecar_saved", (("count", 0),)) in kinds(log)
    state = tmp_path / "slots" / "a.bin"
    assert read_facts(state).state_hash == fnv1a64_file(state)
    assert kinds(restore(tmp_path, "v2", FAKE_MODEL_KIND="dense"))[1:] == [
        ("sidecar_ignored", (("file", "a.bin.ckpt"), ("reason", "no checkpoints"))),
        ("checkpoint_created", (("index", 1), ("max", 32), ("n_tokens", 2538), ("pos_max", 2537), ("pos_min", 0))),
    ]


def test_the_fork_refuses_other_formats_silently_and_makes_a_tip(tmp_path):
    fill_save(tmp_path, "v2")  # a PKCL v2 sidecar: the fork reads version 1 only
    assert kinds(restore(tmp_path, "fork"))[1:] == [
        ("checkpoint_created", (("index", 1), ("max", 32), ("n_tokens", 2538), ("pos_max", 2537), ("pos_min", 2026))),
    ]


def test_mode_line_only_on_the_sidecar_build_and_unknown_modes_run_v2(tmp_path):
    with run_fake_server(tmp_path, KVV_SIDECAR_MODE="fork") as (url, proc):  # a stock build: no sidecars
        pass
    assert "checkpoint sidecars" not in log_of(proc)
    log = fill_save(tmp_path, "bogus")
    assert re.search(r" W srv    load_model: checkpoint sidecars: v2 \(KVV_SIDECAR_MODE 'bogus' is not one of "
                     r"v2, fork, port\)$", log, re.M)
    assert parse_line(next(line for line in log.splitlines() if "checkpoint sidecars" in line)).mode == "v2"
    assert read_facts(tmp_path / "slots" / "a.bin").version == 2
    with run_fake_server(tmp_path, FAKE_SIDECAR=1) as (url, proc):  # unset: v2, the real binary's default
        pass
    assert "I srv    load_model: checkpoint sidecars: v2" in log_of(proc)


def test_ctx_checkpoints_0_writes_and_reads_no_sidecar(tmp_path):
    for mode in ("v2", "fork", "port"):
        d = tmp_path / mode
        d.mkdir()
        with run_fake_server(d, extra_args=("--ctx-checkpoints", "0"), FAKE_SIDECAR=1,
                             KVV_SIDECAR_MODE=mode) as (url, proc):
            post(url, "/completion", {"prompt": TEXT, "n_predict": 8, "id_slot": 0, "cache_prompt": True})
            post(url, "/slots/0?action=save", {"filename": "a.bin"})
            post(url, "/slots/0?action=restore", {"filename": "a.bin"})
        log = log_of(proc)
        assert "context checkpoints disabled" in log
        assert "sidecar" not in log.split(f"checkpoint sidecars: {mode}", 1)[1], mode
        assert not (d / "slots" / "a.bin.ckpt").exists()
