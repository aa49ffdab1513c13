from app.server.logparse import Kind, parse_line
from app.server.outcome import Cause, classify
from tests.conftest import B11434, SIDECAR_BUILD


def events(path):
    return [parse_line(line) for line in path.read_text().splitlines()]


def test_real_capture_restart_restore_reprefill():
    evs = events(B11434 / "02-restart-restore-reprefill.log")
    kinds = [e.kind for e in evs]
    assert Kind.MODEL_LOADED in kinds and Kind.LISTENING in kinds
    listening = next(e for e in evs if e.kind == Kind.LISTENING)
    assert listening.fields["url"] == "http://127.0.0.1:18080"
    full = [e for e in evs if e.kind == Kind.FULL_REPROCESS]
    assert len(full) == 1 and full[0].slot == 0 and full[0].task == 2
    assert "SWA or hybrid/recurrent memory" in full[0].fields["reason"]
    pe = next(e for e in evs if e.kind == Kind.PROMPT_EVAL)
    assert (pe.slot, pe.fields["n_tokens"], pe.fields["ms"]) == (0, 2885, 11052.83)
    created = [e for e in evs if e.kind == Kind.CHECKPOINT_CREATED]
    assert [c.fields["n_tokens"] for c in created] == [2369, 2881]
    rel = next(e for e in evs if e.kind == Kind.RELEASE)
    assert rel.fields["n_tokens"] == 2892
    assert next(e for e in evs if e.kind == Kind.NEW_PROMPT).fields["n_tokens"] == 2885


def test_sidecar_build_capture():
    evs = events(SIDECAR_BUILD / "02-restart-restore-sidecar-hit.log")
    side = next(e for e in evs if e.kind == Kind.SIDECAR_RESTORED)
    assert side.fields["count"] == 4 and side.slot == 0
    cp = next(e for e in evs if e.kind == Kind.CHECKPOINT_RESTORED)
    assert cp.fields["n_past"] == 2880 and cp.fields["pos_max"] == 2880
    saved = next(e for e in events(SIDECAR_BUILD / "01-fill-save-with-sidecar.log") if e.kind == Kind.SIDECAR_SAVED)
    assert saved.fields["count"] == 4


def test_every_captured_line_parses_and_unknown_lines_stay_raw():
    for path in [*B11434.glob("*.log"), *SIDECAR_BUILD.glob("*.log")]:
        for line in path.read_text().splitlines():
            ev = parse_line(line)
            assert ev.line == line
    raw = parse_line("something a future build prints")
    assert raw.kind == Kind.RAW and raw.text == "something a future build prints"
    assert parse_line("").kind == Kind.RAW


def test_seed_lines():
    a = parse_line('D:/a/llama.cpp/llama.cpp/ggml/src/ggml-backend.cpp:359: GGML_ASSERT(tensor->data != NULL '
                   '&& "tensor not allocated") failed')
    assert a.kind == Kind.GGML_ASSERT and "tensor not allocated" in a.fields["assert"]
    idle = parse_line("20.410333 I slot process_sing: id  2 | task -1 | saving idle slot to prompt cache")
    assert idle.kind == Kind.IDLE_SLOT_SAVE and idle.slot == 2 and idle.task == -1
    upd = parse_line("0.30.721.686 I srv  get_availabl: prompt cache update took 569.17 ms")
    assert upd.kind == Kind.PROMPT_CACHE_UPDATE and upd.fields["ms"] == 569.17
    bind = parse_line("0.00.010.000 E srv  init_listene: couldn't bind HTTP server socket, hostname: 127.0.0.1, "
                      "port: 8080")
    assert bind.kind == Kind.BIND_FAILED and bind.fields == {"host": "127.0.0.1", "port": 8080}


def test_outcome_classification():
    assert classify(-6, ["x.cpp:359: GGML_ASSERT(tensor->data != NULL) failed"], False).cause == Cause.ASSERT
    assert "tensor->data" in classify(-6, ["x.cpp:359: GGML_ASSERT(tensor->data != NULL) failed"], False).detail
    assert classify(-4, [], False).cause == Cause.ILLEGAL_INSTRUCTION
    assert classify(-9, [], False).cause == Cause.KILLED
    assert classify(-15, [], True).cause == Cause.STOPPED_BY_USER
    port = classify(1, ["0.00.01.000 E srv  init_listene: couldn't bind HTTP server socket, hostname: 127.0.0.1, "
                        "port: 8080"], False)
    assert port.cause == Cause.PORT_IN_USE and "8080" in port.detail
    oom = classify(1, ["ggml_backend_cuda_buffer_type_alloc_buffer: allocating 1024.00 MiB on device 0: "
                       "cudaMalloc failed: out of memory"], False)
    assert oom.cause == Cause.OUT_OF_MEMORY
    assert "signal 9" in classify(-9, [], False).summary()
