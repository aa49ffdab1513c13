"""The fake llama-server must behave like the captured build 11434 where KV Valet depends on it."""

from __future__ import annotations

import json
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.fake_server import fake_llama_server as fake_mod

FAKE = Path(__file__).with_name("fake_llama_server.py")
FIXTURES = Path(__file__).parents[1] / "fixtures" / "llama-server-b11434"
RESPONSES = json.loads((FIXTURES / "responses.json").read_text())
LOG_LINE = re.compile(r"^\d+\.\d{2}\.\d{3}\.\d{3} [IWED] \S")
LONG_TEXT = " ".join(f"word{i}" for i in range(700))  # ~1,400 fake tokens: > 2 SWA windows


# Our own readers (the fake's tests must not lean on the app's format code).
def state_header(path: Path) -> dict:
    """magic 'ggsq' (LE 0x67677371), version, word count, then a packed payload
    (-1, payload version 1, token count, tokens, media count 0)."""
    data = Path(path).read_bytes()
    magic, version, n_words = struct.unpack_from("<III", data)
    first = struct.unpack_from("<iii", data, 12) if n_words >= 3 and len(data) >= 24 else (None, None, None)
    return {"magic": magic, "version": version, "n_words": n_words, "packed": first[0] == -1,
            "token_count": first[2] if first[0] == -1 else n_words, "file_size": len(data)}


def sidecar_checkpoints(path: Path) -> list[tuple[int, int, int]]:
    """(n_tokens, pos_min, pos_max) of a PKCL v1 sidecar whose sizes add up to the file size."""
    data = Path(path).read_bytes()
    magic, version, count = struct.unpack_from("<III", data)
    assert (data[:4], version) == (b"PKCL", 1) and magic == 0x4C434B50
    out, off = [], 12
    for _ in range(count):
        n_tokens, pos_min, pos_max, n_tgt, n_dft = struct.unpack_from("<qiiQQ", data, off)
        out.append((n_tokens, pos_min, pos_max))
        off += 32 + n_tgt + n_dft
    assert off == len(data)
    return out


def post(url: str, path: str, body: dict | None = None, **kw) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=10, **kw)


def complete(url: str, prompt, id_slot: int = 0, n_predict: int = 8) -> dict:
    r = post(url, "/completion", {"prompt": prompt, "n_predict": n_predict, "id_slot": id_slot, "cache_prompt": True})
    assert r.status_code == 200, r.text
    return r.json()


def log_text(proc) -> str:
    return Path(proc.log_path).read_text()


def test_the_fake_imports_nothing_from_the_app():
    """A format mistake in the app must not be copied into the fake: it has its own code."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import fake_llama_server; "
            "print(sorted(m for m in sys.modules if m == 'app' or m.startswith('app.')))")
    out = subprocess.run([sys.executable, "-c", code, str(FAKE.parent)], capture_output=True, text=True, timeout=120,
                         cwd=FAKE.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_help_and_version_print_the_fixtures():
    out = subprocess.run([sys.executable, str(FAKE), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    assert out.stdout == (FIXTURES / "help.txt").read_text()
    out = subprocess.run([sys.executable, str(FAKE), "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    assert out.stderr == (FIXTURES / "version.txt").read_text()
    assert out.stdout == ""


def test_missing_model_exits_1_with_llama_cpp_errors(tmp_path):
    missing = tmp_path / "nope.gguf"
    out = subprocess.run([sys.executable, str(FAKE), "-m", str(missing), "--port", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert f"failed to open {missing}: No such file or directory" in out.stderr
    assert f"E srv    load_model: failed to load model, '{missing}'" in out.stderr
    assert "E srv  llama_server: exiting due to model loading error" in out.stderr


def test_port_in_use_exits_1(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run([sys.executable, str(FAKE), "-m", str(model), "--port", str(port)],
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert f"E srv  init_listene: couldn't bind HTTP server socket, hostname: 127.0.0.1, port: {port}" in out.stderr


def poll_health(url: str, until_status: int, timeout: float = 120.0) -> list[tuple[int, dict]]:
    """/health's answers, each new status once, up to the first ``until_status``; the timeout
    is only a failure guard."""
    deadline = time.monotonic() + timeout
    seen: list[tuple[int, dict]] = []
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url + "/health", timeout=5)
        except httpx.TransportError:  # not listening yet
            time.sleep(0.02)
            continue
        if not seen or seen[-1][0] != r.status_code:
            seen.append((r.status_code, r.json()))
        if r.status_code == until_status:
            return seen
        time.sleep(0.02)
    raise AssertionError(f"/health never answered {until_status}: {seen}")


def test_health_503_while_loading_then_200(fake_server):
    # the load lasts until the test has seen it (SIGUSR1 ends it): no timed window to catch
    with fake_server(wait=False, FAKE_LOAD_SECONDS=600) as (url, proc):
        seen = poll_health(url, 503)
        assert seen == [(503, {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}})]
        proc.send_signal(signal.SIGUSR1)
        seen = poll_health(url, 200)
        assert seen[-1] == (200, RESPONSES["health"]["body"])
        assert [status for status, _ in seen] in ([200], [503, 200])
        log = log_text(proc)
        assert log.index("model loaded") < log.index("listening on http://127.0.0.1:") < log.index("all slots are idle")
        # untimestamped lines only where llama.cpp prints a multi-line message (the chat template example)
        lines = log.splitlines()
        start = next(i for i, line in enumerate(lines) if "chat template, example_format: '" in line)
        end = next(i for i, line in enumerate(lines) if "chat template, thinking = 0" in line)
        assert lines[end - 1] == "'" and end - start > 2
        assert all(LOG_LINE.match(line) for i, line in enumerate(lines) if not start < i < end)


def test_props_slots_tokenize_and_metrics_shapes(fake_server):
    # a completion keeps its slot busy until the test has seen it (SIGUSR2 ends the delay)
    with fake_server(FAKE_COMPLETION_DELAY=600) as (url, proc):
        props = httpx.get(url + "/props").json()
        assert props.keys() == RESPONSES["props"]["body"].keys()
        assert props["total_slots"] == 2 and props["default_generation_settings"]["n_ctx"] == 4096
        assert props["build_info"] == "b11434-fake"
        assert props["default_generation_settings"].keys() == RESPONSES["props"]["body"]["default_generation_settings"].keys()
        idle = httpx.get(url + "/slots").json()
        assert idle == [{"id": i, "n_ctx": 4096, "speculative": False, "is_processing": False} for i in (0, 1)]

        tokens = post(url, "/tokenize", {"content": "Hello world"}).json()["tokens"]
        assert len(tokens) == 3  # "Hello", " ", "world": deterministic fake pieces
        assert tokens == post(url, "/tokenize", {"content": "Hello world"}).json()["tokens"]
        assert post(url, "/detokenize", {"tokens": tokens}).json() == {"content": "Hello world"}

        with httpx.Client(timeout=60) as client:
            import threading

            result = {}
            t = threading.Thread(target=lambda: result.update(r=client.post(
                url + "/completion", json={"prompt": "Say hi.", "n_predict": 4, "id_slot": 1})))
            t.start()
            deadline = time.monotonic() + 30  # a failure guard: the slot stays busy until SIGUSR2
            busy = False
            while time.monotonic() < deadline and not busy:
                busy = httpx.get(url + "/slots").json()[1]["is_processing"]
            proc.send_signal(signal.SIGUSR2)
            t.join()
        assert busy
        body = result["r"].json()
        assert body.keys() == RESPONSES["completion"]["body"].keys()
        assert body["timings"].keys() == RESPONSES["completion"]["body"]["timings"].keys()
        assert body["tokens_predicted"] == 4 and body["id_slot"] == 1
        after = httpx.get(url + "/slots").json()[1]
        assert after.keys() == RESPONSES["slots_after_task"]["body"][1].keys()
        assert after["n_prompt_tokens"] == body["tokens_cached"]
        assert after["next_token"] == RESPONSES["slots_after_task"]["body"][1]["next_token"]  # released

        metrics = httpx.get(url + "/metrics").text
        assert re.search(r"^llamacpp:prompt_tokens_total \d+$", metrics, re.M)
        assert "llamacpp:requests_processing 0" in metrics


def test_save_restore_round_trip_without_sidecar_reprefills(fake_server, tmp_path):
    with fake_server() as (url, proc):
        first = complete(url, LONG_TEXT)
        assert first["timings"]["cache_n"] == 0
        save = post(url, "/slots/0?action=save", {"filename": "s1.bin"}).json()
        assert save.keys() == RESPONSES["save_ok"]["body"].keys()
        assert save["n_saved"] == first["tokens_cached"]
    state = tmp_path / "slots" / "s1.bin"
    header = state_header(state)
    assert header["magic"] == 0x67677371 and state.read_bytes()[:4] == b"qsgg"
    assert header["version"] == 4 and header["packed"] and header["n_words"] == save["n_saved"] + 4
    assert header["token_count"] == save["n_saved"] and header["file_size"] == save["n_written"]
    assert not (tmp_path / "slots" / "s1.bin.ckpt").exists()

    with fake_server() as (url, proc):
        restore = post(url, "/slots/0?action=restore", {"filename": "s1.bin"}).json()
        assert restore.keys() == RESPONSES["restore_ok"]["body"].keys()
        assert restore["n_restored"] == save["n_saved"] and restore["n_read"] == save["n_written"]
        # like the real server: after a restore the slot shows no task
        assert httpx.get(url + "/slots").json()[0] == RESPONSES["slots_after_restore"]["body"][0]
        follow = complete(url, LONG_TEXT + " and more")
        assert follow["timings"]["cache_n"] == 0
        assert follow["timings"]["prompt_n"] == follow["tokens_evaluated"]
        assert "forcing full prompt re-processing due to lack of cache data" in log_text(proc)


def test_sidecar_is_written_and_loaded_and_the_follow_up_is_cheap(fake_server, tmp_path):
    with fake_server(FAKE_SIDECAR=1, KVV_SIDECAR_MODE="port") as (url, proc):  # PKCL v1
        complete(url, LONG_TEXT)
        save = post(url, "/slots/0?action=save", {"filename": "s1.bin"}).json()
        assert re.search(r"saved \d+ context checkpoints to sidecar", log_text(proc))
    checkpoints = sidecar_checkpoints(tmp_path / "slots" / "s1.bin.ckpt")
    assert len(checkpoints) >= 2 and all(n <= save["n_saved"] and lo <= hi < n for n, lo, hi in checkpoints)

    with fake_server(FAKE_SIDECAR=1, KVV_SIDECAR_MODE="port") as (url, proc):
        post(url, "/slots/0?action=restore", {"filename": "s1.bin"})
        follow = complete(url, LONG_TEXT + " and more")
        log = log_text(proc)
    assert f"restored {len(checkpoints)} context checkpoints from sidecar" in log
    assert "restored context checkpoint (pos_min = " in log
    assert "forcing full prompt re-processing" not in log
    assert 0 < follow["timings"]["prompt_n"] < 20
    assert follow["timings"]["cache_n"] + follow["timings"]["prompt_n"] == follow["tokens_evaluated"]

    # the same file on a stock build (no sidecar support) re-prefills
    with fake_server() as (url, proc):
        post(url, "/slots/0?action=restore", {"filename": "s1.bin"})
        follow = complete(url, LONG_TEXT + " and more")
    assert follow["timings"]["cache_n"] == 0


def test_same_process_follow_up_uses_live_cache(fake_server):
    with fake_server() as (url, proc):
        first = complete(url, LONG_TEXT)
        second = complete(url, LONG_TEXT + first["content"] + " next")
        assert second["timings"]["cache_n"] >= len(LONG_TEXT.split()) * 2
        assert second["timings"]["prompt_n"] < 10


def test_dense_model_resumes_after_restore(fake_server):
    with fake_server(FAKE_MODEL_KIND="dense") as (url, proc):
        complete(url, LONG_TEXT)
        post(url, "/slots/0?action=save", {"filename": "d.bin"})
    with fake_server(FAKE_MODEL_KIND="dense") as (url, proc):
        post(url, "/slots/1?action=restore", {"filename": "d.bin"})
        follow = complete(url, LONG_TEXT, id_slot=1)
        assert follow["timings"]["cache_n"] == follow["tokens_evaluated"] - 1
        assert follow["timings"]["prompt_n"] == 1


def test_slot_ids_wrap_around(fake_server, tmp_path):
    with fake_server() as (url, proc):
        first = complete(url, "only slot one has tokens", id_slot=1)
        r = post(url, "/slots/7?action=save", {"filename": "x.bin"})
        assert r.status_code == 200
        assert r.json()["id_slot"] == 7 and r.json()["n_saved"] == first["tokens_cached"]
    assert state_header(tmp_path / "slots" / "x.bin")["token_count"] == first["tokens_cached"]


@pytest.mark.parametrize("name", ["save_bad_filename", "restore_missing_file", "bad_action"])
def test_errors_match_the_captured_bodies(fake_server, name):
    fixture = RESPONSES[name]
    with fake_server() as (url, proc):
        r = post(url, fixture["request"]["path"], fixture["request"].get("json"))
        assert r.status_code == fixture["status"]
        assert r.json() == fixture["body"]


def test_failed_restore_clears_the_slot_and_erase_reports_zero(fake_server):
    with fake_server() as (url, proc):
        complete(url, "some tokens here")
        r = post(url, "/slots/0?action=restore", {"filename": "nope.bin"})
        assert r.status_code == 400
        assert post(url, "/slots/0?action=erase").json() == RESPONSES["erase"]["body"]
        assert "failed to open" in log_text(proc) and "clearing prompt with" in log_text(proc)


def write_fake_state(path: Path, tokens: list[int], n_cells: int | None = None, version: int = 4) -> None:
    """A state file as the fake writes it (its own writer; n_cells: KV cells its sequence state holds)."""
    n_cells = len(tokens) if n_cells is None else n_cells
    path.write_bytes(fake_mod.encode_state_file(fake_mod.pack_token_words(tokens),
                                                fake_mod.seq_state_bytes(n_cells, 1, 1, n_cells), version))


def test_restore_that_does_not_fit(fake_server, tmp_path):
    (tmp_path / "slots").mkdir(exist_ok=True)
    # a real state of 5,000 tokens holds 5,000 KV cells: the load itself fails (state_read_meta),
    # so the server answers the generic error, not "does not fit"
    write_fake_state(tmp_path / "slots" / "big.bin", list(range(300, 5300)))
    # "does not fit" is checked after the load: only reachable when the state holds fewer cells
    write_fake_state(tmp_path / "slots" / "odd.bin", list(range(300, 5300)), n_cells=100)
    with fake_server() as (url, proc):
        r = post(url, "/slots/0?action=restore", {"filename": "big.bin"})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == ("Unable to restore slot: No available space in KV cache or invalid "
                                                "slot save file")
        assert "E state_read_meta: not enough cells in kv cache" in log_text(proc)
        r = post(url, "/slots/0?action=restore", {"filename": "odd.bin"})
        assert r.json()["error"]["message"] == "Unable to restore slot: Restored prompt does not fit in the slot context"


def test_restore_refuses_another_version_or_kv_type(fake_server, tmp_path):
    (tmp_path / "slots").mkdir(exist_ok=True)
    write_fake_state(tmp_path / "slots" / "v3.bin", list(range(300, 400)), version=3)
    with fake_server() as (url, proc):
        complete(url, "some tokens here")
        r = post(url, "/slots/0?action=restore", {"filename": "v3.bin"})
        assert r.status_code == 400 and "invalid slot save file" in r.json()["error"]["message"]
        assert "unknown (magic, version) for sequence state file: 67677371, 00000003" in log_text(proc)
        complete(url, LONG_TEXT)
        post(url, "/slots/0?action=save", {"filename": "f16.bin"})
    with fake_server(extra_args=["-ctk", "q8_0"]) as (url, proc):
        r = post(url, "/slots/0?action=restore", {"filename": "f16.bin"})
        assert r.status_code == 400
        assert "E state_read_data: mismatched key type (1 != 8, layer 0)" in log_text(proc)


def test_restore_into_a_slot_that_ran_a_task_keeps_the_task_and_shows_the_restored_count(fake_server):
    """server_slot::to_json (server-context.cpp ~724): the previous task stays, n_prompt_tokens
    is the slot's current token count."""
    with fake_server() as (url, proc):
        complete(url, LONG_TEXT, id_slot=0)
        save = post(url, "/slots/0?action=save", {"filename": "a.bin"}).json()
        short = complete(url, "a short chat", id_slot=1)
        before = httpx.get(url + "/slots").json()[1]
        assert before["n_prompt_tokens"] == short["tokens_cached"]
        post(url, "/slots/1?action=restore", {"filename": "a.bin"})
        after = httpx.get(url + "/slots").json()[1]
        assert after["id_task"] == before["id_task"] and after["n_prompt_tokens"] == save["n_saved"]
        assert after["n_prompt_tokens_processed"] == after["n_prompt_tokens_cache"] == 0
        post(url, "/slots/1?action=erase")
        assert httpx.get(url + "/slots").json()[1]["n_prompt_tokens"] == 0


def test_live_short_session_follow_up_rolls_back_to_its_checkpoint(fake_server):
    """Shorter than the SWA window, yet pos_min (0) >= pos_min_thold (0): the checkpoint
    with pos_min == 0 is used, as build 11434 does ([TAG_CHECKPOINTS_FIX_POS_MIN])."""
    with fake_server() as (url, proc):
        first = complete(url, "the quiet valet parks the cache " * 20, n_predict=4)
        second = complete(url, "the quiet valet parks the cache " * 20 + first["content"] + " more words")
        log = log_text(proc)
    assert "restored context checkpoint (pos_min = 0, pos_max = " in log
    cp = int(re.search(r"restored context checkpoint \(pos_min = 0, pos_max = (\d+)", log).group(1))
    assert second["timings"]["cache_n"] == cp and second["timings"]["cache_n"] < first["tokens_cached"]


def test_checkpoint_chosen_by_the_real_rule(fake_server):
    """A continuation that leaves the tokens after a checkpoint resumes there; one that leaves
    them before the end of every checkpoint re-processes all (the reference's "checking
    checkpoint with [1389, 2412] against 1889"); one the live SWA window still covers needs none."""
    tokens = fake_mod.tokenize(" ".join([LONG_TEXT] * 3), add_bos=True)[:2900]
    assert len(tokens) == 2900
    with fake_server() as (url, proc):
        for slot in (0, 1):
            complete(url, tokens, id_slot=slot, n_predict=4)  # checkpoints [1360, 2383] and [1872, 2895]
        before = complete(url, tokens[:2000] + [7, 8, 9], id_slot=0)
        after = complete(url, tokens[:2390] + [7, 8, 9], id_slot=1)
        log = log_text(proc)
    assert before["timings"]["cache_n"] == 0 and before["timings"]["prompt_n"] == 2003
    assert log.count("against 1488...") == 2 and "forcing full prompt re-processing" in log
    assert after["timings"]["cache_n"] == 2383 and after["timings"]["prompt_n"] == 2393 - 2383
    assert "checking checkpoint with [1360, 2383] against 1878..." in log
    assert "restored context checkpoint (pos_min = 1360, pos_max = 2383, n_tokens = 2384, n_past = 2383" in log
    with fake_server() as (url, proc):
        complete(url, tokens, n_predict=4)  # memory: positions 1879-2902 of the SWA ring
        live = complete(url, tokens[:2400] + [7, 8, 9])
    assert live["timings"]["cache_n"] == 2400 and "checking checkpoint" not in log_text(proc)


def test_slot_actions_need_slot_save_path(fake_server):
    with fake_server(slot_save=False) as (url, proc):
        r = post(url, "/slots/0?action=save", {"filename": "a.bin"})
        assert r.status_code == 501
        assert r.json()["error"]["message"] == (
            "This server does not support slots action. Start it with `--slot-save-path`")


def test_api_key(fake_server):
    with fake_server(extra_args=["--api-key", "sekrit"]) as (url, proc):
        assert httpx.get(url + "/health").status_code == 200
        r = httpx.get(url + "/slots")
        assert r.status_code == 401
        assert r.json() == {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}}
        assert httpx.get(url + "/slots", headers={"Authorization": "Bearer sekrit"}).status_code == 200


def test_save_error_writes_nothing(fake_server, tmp_path):
    with fake_server(FAKE_SAVE_ERROR=1) as (url, proc):
        complete(url, "hello")
        r = post(url, "/slots/0?action=save", {"filename": "e.bin"})
        assert r.status_code == 500
        assert r.json() == {"error": {"code": 500, "message": "Unable to save slot", "type": "server_error"}}
    assert not (tmp_path / "slots" / "e.bin").exists()


def test_die_during_save_leaves_a_truncated_file(fake_server, tmp_path):
    with fake_server() as (url, proc):
        complete(url, LONG_TEXT)
        full = post(url, "/slots/0?action=save", {"filename": "full.bin"}).json()
    with fake_server(FAKE_DIE_DURING_SAVE=1) as (url, proc):
        complete(url, LONG_TEXT)
        with pytest.raises(httpx.TransportError):
            post(url, "/slots/0?action=save", {"filename": "half.bin"})
        assert proc.wait(timeout=120) == -signal.SIGKILL
    half = tmp_path / "slots" / "half.bin"
    # The header survives (it is tiny next to the state), so only the size the
    # save response reported (n_written) can reveal the damage.
    header = state_header(half)
    assert header["token_count"] == full["n_saved"]
    assert header["file_size"] == full["n_written"] // 2
    with fake_server() as (url, proc):  # and the server refuses it
        r = post(url, "/slots/0?action=restore", {"filename": "half.bin"})
        assert r.status_code == 400
        assert "error loading sequence state file: unexpectedly reached end of file" in log_text(proc)


def test_abort_on_save_prints_the_ggml_assert(fake_server):
    with fake_server(FAKE_ABORT_ON_SAVE=1) as (url, proc):
        with pytest.raises(httpx.TransportError):
            post(url, "/slots/0?action=save", {"filename": "a.bin"})
        assert proc.wait(timeout=120) == -signal.SIGABRT
        assert 'GGML_ASSERT(tensor->data != NULL && "tensor not allocated") failed' in log_text(proc)


def test_sigterm_exits_0_promptly(fake_server):
    with fake_server() as (url, proc):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        assert "cleaning up before exit..." in log_text(proc)
