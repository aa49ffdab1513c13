import dataclasses

import pytest

from app.core.checkpoints import CheckpointFigures
from app.server.logparse import (EVENT_CLASSES, BindFailed, CheckpointCreated, CheckpointRestored, Eval,
                                 FullReprocess, GgmlAssert, Kind, Listening, LogEvent, ModelLoadFailed, NewPrompt,
                                 PromptCacheUpdate, PromptEval, PromptProgress, Release, SidecarIgnored, SidecarMode,
                                 SidecarRestored, SidecarSaved, SidecarWriteFailed, SlotContext, SlotSelected, Total,
                                 parse_line)
from app.server.outcome import Cause, classify
from tests.conftest import B11434, FIXTURES, SIDECAR_BUILD


def events(path):
    return [parse_line(line) for line in path.read_text().splitlines()]


def test_real_capture_restart_restore_reprefill():
    evs = events(B11434 / "02-restart-restore-reprefill.log")
    kinds = [e.kind for e in evs]
    assert Kind.MODEL_LOADED in kinds and Kind.LISTENING in kinds
    listening = next(e for e in evs if e.kind == Kind.LISTENING)
    assert listening.url == "http://127.0.0.1:18080"
    full = [e for e in evs if e.kind == Kind.FULL_REPROCESS]
    assert len(full) == 1 and full[0].slot == 0 and full[0].task == 2
    assert "SWA or hybrid/recurrent memory" in full[0].reason
    pe = next(e for e in evs if e.kind == Kind.PROMPT_EVAL)
    assert (pe.slot, pe.n_tokens, pe.ms) == (0, 2885, 11052.83)
    created = [e for e in evs if e.kind == Kind.CHECKPOINT_CREATED]
    assert [c.checkpoint.n_tokens for c in created] == [2369, 2881]
    rel = next(e for e in evs if e.kind == Kind.RELEASE)
    assert rel.n_tokens == 2892
    assert next(e for e in evs if e.kind == Kind.NEW_PROMPT).n_tokens == 2885


def test_sidecar_build_capture():
    evs = events(SIDECAR_BUILD / "02-restart-restore-sidecar-hit.log")
    side = next(e for e in evs if e.kind == Kind.SIDECAR_RESTORED)
    assert side.count == 4 and side.slot == 0
    cp = next(e for e in evs if e.kind == Kind.CHECKPOINT_RESTORED)
    assert cp.checkpoint.n_past == 2880 and cp.checkpoint.pos_max == 2880
    saved = next(e for e in events(SIDECAR_BUILD / "01-fill-save-with-sidecar.log") if e.kind == Kind.SIDECAR_SAVED)
    assert saved.count == 4


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
    assert a.kind == Kind.GGML_ASSERT and "tensor not allocated" in a.assertion
    idle = parse_line("20.410333 I slot process_sing: id  2 | task -1 | saving idle slot to prompt cache")
    assert idle.kind == Kind.IDLE_SLOT_SAVE and idle.slot == 2 and idle.task == -1
    upd = parse_line("0.30.721.686 I srv  get_availabl: prompt cache update took 569.17 ms")
    assert upd.kind == Kind.PROMPT_CACHE_UPDATE and upd.ms == 569.17
    bind = parse_line("0.00.010.000 E srv  init_listene: couldn't bind HTTP server socket, hostname: 127.0.0.1, "
                      "port: 8080")
    assert bind.kind == Kind.BIND_FAILED and (bind.host, bind.port) == ("127.0.0.1", 8080)


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


# -- one frozen dataclass per kind that carries figures --------------------------------------------------

def captured(path, needle: str) -> str:
    """The first line of a real capture that holds ``needle``."""
    return next(line for line in (FIXTURES / path).read_text().splitlines() if needle in line)


FILL = "llama-server-b11434/01-start-fill-save.log"
HIT = "sidecar-build-b11434/02-restart-restore-sidecar-hit.log"
# (where the line comes from, a piece of it, its class, the figures it must carry)
TYPED = [
    (FILL, "prompt eval time", PromptEval, {"ms": 10008.41, "n_tokens": 2861, "slot": 0, "task": 1}),
    (FILL, "       eval time", Eval, {"ms": 69.23, "n_tokens": 4}),
    (FILL, "total time", Total, {"ms": 10077.65, "n_tokens": 2865}),
    (FILL, "prompt processing, n_tokens", PromptProgress, {"n_tokens": 2048, "progress": 0.72}),
    ("llama-server-b11434/02-restart-restore-reprefill.log", "forcing full prompt", FullReprocess, {"task": 2}),
    (HIT, "restored context checkpoint (", CheckpointRestored,
     {"checkpoint": CheckpointFigures(pos_min=1857, pos_max=2880, n_tokens=2881, n_past=2880, size_mib=7.506)}),
    (FILL, "created context checkpoint 1 of", CheckpointCreated,
     {"index": 1, "limit": 32, "checkpoint": CheckpointFigures(pos_min=1321, pos_max=2344, n_tokens=2345,
                                                              size_mib=7.506)}),
    ("sidecar-build-b11434/01-fill-save-with-sidecar.log", "to sidecar", SidecarSaved, {"count": 4, "task": -1}),
    (HIT, "from sidecar", SidecarRestored, {"count": 4}),
    ("sidecar-modes-b11434/v2/04-stale-hash-refused.log", "ignoring checkpoint sidecar", SidecarIgnored,
     {"path": "/home/user/slots/a.bin.ckpt"}),
    ("sidecar-modes-b11434/fork/01-fill-save.log", "checkpoint sidecars:", SidecarMode, {"mode": "fork"}),
    (FILL, "stop processing", Release, {"n_tokens": 2864}),
    (FILL, "selected slot by", SlotSelected, {"how": "id (0)"}),
    (FILL, "new prompt,", NewPrompt, {"n_ctx_slot": 4096, "n_keep": 0, "n_tokens": 2861}),
    (FILL, "new slot, n_ctx", SlotContext, {"n_ctx": 4096}),
    (FILL, "listening on", Listening, {"url": "http://127.0.0.1:18080"}),
]


@pytest.mark.parametrize("path, needle, cls, figures", TYPED, ids=[t[2].__name__ for t in TYPED])
def test_each_kind_is_its_own_frozen_dataclass_from_a_real_line(path, needle, cls, figures):
    line = captured(path, needle)
    ev = parse_line(line)
    assert type(ev) is cls and EVENT_CLASSES[ev.kind] is cls and isinstance(ev, LogEvent)
    assert {k: getattr(ev, k) for k in figures} == figures
    assert ev.line == line and ev.text and ev.slot == (0 if "| task" in line else None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ev.slot = 3
    assert parse_line(line) == ev and hash(parse_line(line)) == hash(ev)


def test_the_other_typed_kinds_from_seed_lines():
    failed = parse_line("0.15.813.149 E slot process_sing: id  0 | task -1 | failed to write checkpoint sidecar "
                        "/s/a.bin.ckpt")
    assert isinstance(failed, SidecarWriteFailed) and failed.path == "/s/a.bin.ckpt"
    upd = parse_line("0.30.721.686 I srv  get_availabl: prompt cache update took 569.17 ms")
    assert isinstance(upd, PromptCacheUpdate) and upd.ms == 569.17
    bind = parse_line("0.00.010.000 E srv  init_listene: couldn't bind HTTP server socket, hostname: 127.0.0.1, "
                      "port: 8080")
    assert isinstance(bind, BindFailed) and (bind.host, bind.port) == ("127.0.0.1", 8080)
    load = parse_line("0.00.010.000 E srv    load_model: failed to load model, '/m/x.gguf'")
    assert isinstance(load, ModelLoadFailed) and load.detail == "failed to load model, '/m/x.gguf'"
    a = parse_line("x.cpp:359: GGML_ASSERT(tensor->data != NULL) failed")
    assert isinstance(a, GgmlAssert) and a.assertion == "GGML_ASSERT(tensor->data != NULL) failed"


def test_timing_lines_carry_a_rate_and_kinds_without_figures_stay_plain():
    pe = parse_line(captured(FILL, "prompt eval time"))
    assert pe.tokens_per_s == pytest.approx(2861 / 10008.41 * 1000)
    assert parse_line("prompt eval time = 0.00 ms / 3 tokens").tokens_per_s is None
    for line in ["0.02.201.000 I srv  load_model: model loaded", "all slots are idle", "something else"]:
        assert type(parse_line(line)) is LogEvent
    assert not any(f.name == "fields" for f in dataclasses.fields(LogEvent))


def test_checkpoint_figures_take_only_whole_numbers_for_counts():
    restored = parse_line("restored context checkpoint (pos_min = 1.5, pos_max = 9, n_swa = 512, pos_next = 10, "
                          "size = 7 MiB, colour = 3)")
    assert restored.checkpoint == CheckpointFigures(pos_max=9, n_swa=512, pos_next=10, size_mib=7.0)
    assert parse_line("restored context checkpoint (nothing here)").checkpoint == CheckpointFigures()
