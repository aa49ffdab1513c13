"""The fake llama-server must behave like the captured build 11434 where KV Valet depends on it."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from app.server.sidecar import SidecarStatus, inspect_sidecar
from app.server.statefile import StateFileError, read_state_header, read_state_tokens, write_state_file

FAKE = Path(__file__).with_name("fake_llama_server.py")
FIXTURES = Path(__file__).parents[1] / "fixtures" / "llama-server-b11434"
RESPONSES = json.loads((FIXTURES / "responses.json").read_text())
LOG_LINE = re.compile(r"^\d+\.\d{2}\.\d{3}\.\d{3} [IWED] \S")
LONG_TEXT = " ".join(f"word{i}" for i in range(700))  # ~1,400 fake tokens: > 2 SWA windows


def post(url: str, path: str, body: dict | None = None, **kw) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=10, **kw)


def complete(url: str, prompt, id_slot: int = 0, n_predict: int = 8) -> dict:
    r = post(url, "/completion", {"prompt": prompt, "n_predict": n_predict, "id_slot": id_slot, "cache_prompt": True})
    assert r.status_code == 200, r.text
    return r.json()


def log_text(proc) -> str:
    return Path(proc.log_path).read_text()


def test_help_and_version_print_the_fixtures():
    out = subprocess.run([sys.executable, str(FAKE), "--help"], capture_output=True, text=True, timeout=10)
    assert out.returncode == 0
    assert out.stdout == (FIXTURES / "help.txt").read_text()
    out = subprocess.run([sys.executable, str(FAKE), "--version"], capture_output=True, text=True, timeout=10)
    assert out.returncode == 0
    assert out.stderr == (FIXTURES / "version.txt").read_text()
    assert out.stdout == ""


def test_missing_model_exits_1_with_llama_cpp_errors(tmp_path):
    missing = tmp_path / "nope.gguf"
    out = subprocess.run([sys.executable, str(FAKE), "-m", str(missing), "--port", "0"],
                         capture_output=True, text=True, timeout=10)
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
                             capture_output=True, text=True, timeout=10)
    assert out.returncode == 1
    assert f"E srv  init_listene: couldn't bind HTTP server socket, hostname: 127.0.0.1, port: {port}" in out.stderr


def test_health_503_while_loading_then_200(fake_server):
    with fake_server(wait=False, FAKE_LOAD_SECONDS=1.0) as (url, proc):
        deadline = time.monotonic() + 10
        seen = []
        while time.monotonic() < deadline:
            try:
                r = httpx.get(url + "/health", timeout=1)
            except httpx.TransportError:
                time.sleep(0.02)
                continue
            if not seen or seen[-1][0] != r.status_code:
                seen.append((r.status_code, r.json()))
            if r.status_code == 200:
                break
            time.sleep(0.02)
        assert seen[0] == (503, {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}})
        assert seen[-1] == (200, RESPONSES["health"]["body"])
        log = log_text(proc)
        assert log.index("model loaded") < log.index("listening on http://127.0.0.1:") < log.index("all slots are idle")
        assert all(LOG_LINE.match(line) for line in log.splitlines())


def test_props_slots_tokenize_and_metrics_shapes(fake_server):
    with fake_server(FAKE_COMPLETION_DELAY=0.5) as (url, proc):
        props = httpx.get(url + "/props").json()
        assert props.keys() == RESPONSES["props"]["body"].keys()
        assert props["total_slots"] == 2 and props["default_generation_settings"]["n_ctx"] == 4096
        assert props["build_info"] == "b11434-fake"
        idle = httpx.get(url + "/slots").json()
        assert idle == [{"id": i, "n_ctx": 4096, "speculative": False, "is_processing": False} for i in (0, 1)]

        tokens = post(url, "/tokenize", {"content": "Hello world"}).json()["tokens"]
        assert len(tokens) == 3  # "Hello", " ", "world": deterministic fake pieces
        assert tokens == post(url, "/tokenize", {"content": "Hello world"}).json()["tokens"]
        assert post(url, "/detokenize", {"tokens": tokens}).json() == {"content": "Hello world"}

        with httpx.Client(timeout=10) as client:
            import threading

            result = {}
            t = threading.Thread(target=lambda: result.update(r=client.post(
                url + "/completion", json={"prompt": "Say hi.", "n_predict": 4, "id_slot": 1})))
            t.start()
            deadline = time.monotonic() + 5
            busy = False
            while time.monotonic() < deadline and not busy:
                busy = httpx.get(url + "/slots").json()[1]["is_processing"]
            t.join()
        assert busy
        body = result["r"].json()
        assert body.keys() == RESPONSES["completion"]["body"].keys()
        assert body["timings"].keys() == RESPONSES["completion"]["body"]["timings"].keys()
        assert body["tokens_predicted"] == 4 and body["id_slot"] == 1
        after = httpx.get(url + "/slots").json()[1]
        assert after.keys() == RESPONSES["slots_after_task"]["body"][1].keys()
        assert after["n_prompt_tokens"] == body["tokens_cached"]

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
    header = read_state_header(state)
    assert header.version == 4 and header.packed
    assert header.token_count == save["n_saved"] and header.file_size == save["n_written"]
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
    with fake_server(FAKE_SIDECAR=1) as (url, proc):
        complete(url, LONG_TEXT)
        save = post(url, "/slots/0?action=save", {"filename": "s1.bin"}).json()
        assert re.search(r"saved \d+ context checkpoints to sidecar", log_text(proc))
    state = tmp_path / "slots" / "s1.bin"
    report = inspect_sidecar(state, save["n_saved"], "sliding-window")
    assert report.status is SidecarStatus.PRESENT_VALID and report.kind == "PKCL v1"
    assert len(report.checkpoints) >= 2

    with fake_server(FAKE_SIDECAR=1) as (url, proc):
        post(url, "/slots/0?action=restore", {"filename": "s1.bin"})
        follow = complete(url, LONG_TEXT + " and more")
        log = log_text(proc)
    assert f"restored {len(report.checkpoints)} context checkpoints from sidecar" in log
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
    assert read_state_header(tmp_path / "slots" / "x.bin").token_count == first["tokens_cached"]


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


def test_restore_that_does_not_fit(fake_server, tmp_path):
    (tmp_path / "slots").mkdir(exist_ok=True)
    write_state_file(tmp_path / "slots" / "big.bin", list(range(300, 5300)), b"\0" * 64)
    with fake_server() as (url, proc):
        r = post(url, "/slots/0?action=restore", {"filename": "big.bin"})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "Unable to restore slot: Restored prompt does not fit in the slot context"


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
        assert proc.wait(timeout=10) == -signal.SIGKILL
    half = tmp_path / "slots" / "half.bin"
    # The header survives (it is tiny next to the state), so only the size the
    # save response reported (n_written) can reveal the damage.
    header = read_state_header(half)
    assert header.token_count == full["n_saved"]
    assert header.file_size == full["n_written"] // 2


def test_die_before_the_header_is_complete_is_detected(tmp_path):
    path = tmp_path / "cut.bin"
    write_state_file(path, list(range(300, 400)), b"x" * 64)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(StateFileError, match="truncated"):
        read_state_tokens(path)


def test_abort_on_save_prints_the_ggml_assert(fake_server):
    with fake_server(FAKE_ABORT_ON_SAVE=1) as (url, proc):
        with pytest.raises(httpx.TransportError):
            post(url, "/slots/0?action=save", {"filename": "a.bin"})
        assert proc.wait(timeout=10) == -signal.SIGABRT
        assert 'GGML_ASSERT(tensor->data != NULL && "tensor not allocated") failed' in log_text(proc)


def test_sigterm_exits_0_promptly(fake_server):
    with fake_server() as (url, proc):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
        assert "cleaning up before exit..." in log_text(proc)
