"""The park size prediction (app.core.park_size) and the GGUF layout it reads (shape_from_metadata).

The byte figures are what the real server wrote (tests/real/test_real_park_sizes.py measures them
again on every run); the seed's figure is its 27B Qwen3.6's context checkpoint, about 150 MiB."""

from __future__ import annotations

import pytest

from app.core import park_size as ps
from app.server.gguf_info import shape_from_metadata


def meta(arch: str, **kv):
    values = {f"{arch}.{k.replace('__', '.')}": v for k, v in kv.items()}
    return shape_from_metadata(arch, values.get)


TINY = dict(block_count=2, embedding_length=256, attention__head_count=2, attention__head_count_kv=2,
            attention__key_length=128, attention__value_length=128)


def test_the_measured_tiny_families():
    dense = meta("llama", **TINY)
    swa = meta("gemma3", **TINY, attention__sliding_window=32, attention__sliding_window_pattern=[1, 0])
    hybrid = meta("qwen35", **TINY, attention__recurrent_layers=[1, 0], ssm__conv_kernel=4, ssm__inner_size=256,
                  ssm__state_size=128, ssm__group_count=2)
    conv = meta("lfm2", **{**TINY, "attention__head_count": [2, 0], "attention__head_count_kv": [2, 0]},
                attention__sliding_window=32, shortconv__l_cache=3)
    rec = meta("mamba2", **TINY, ssm__conv_kernel=4, ssm__inner_size=512, ssm__state_size=128, ssm__group_count=2)
    measured = {  # n -> (state file, sidecar v2) on the real b11434 server and the sidecar build
        "dense": (dense, {300: (619_300, 20), 3000: (6_192_100, 20)}),
        "sliding-window": (swa, {300: (345_276, 33_268), 1000: (1_073_276, 66_516), 3000: (3_153_276, 66_516)}),
        "hybrid": (hybrid, {300: (456_008, 140_400), 3000: (3_296_408, 280_780)}),
        "hybrid-conv": (conv, {300: (40_144, 35_360), 3000: (83_344, 70_700)}),
        "recurrent": (rec, {300: (550_160, 549_000), 3000: (560_960, 1_097_980)}),
    }
    for family, (shape, rows) in measured.items():
        for n, (state, sidecar) in rows.items():
            size = ps.predict(shape, n)
            assert (size.state, size.sidecar) == (state, sidecar), family
            assert ps.predict(shape, n, writes_sidecar=False).sidecar == 0


def test_quantised_kv_types_and_a_fork_type():
    dense = meta("llama", **TINY)
    assert ps.state_bytes(dense, 301, "q8_0", "q8_0") == 332_404  # measured, -ctk/-ctv q8_0 -fa on
    assert ps.state_bytes(dense, 301, "turbo3", "turbo3") is None  # a fork's type: not known here
    assert ps.predict(dense, 301, ctk="turbo3") is None


def test_the_seeds_qwen36_checkpoint_is_about_150_mib_and_does_not_grow():
    q = meta("qwen35", block_count=64, embedding_length=5120, attention__head_count=24, attention__head_count_kv=4,
             attention__key_length=256, attention__value_length=256, full_attention_interval=4,
             ssm__conv_kernel=4, ssm__inner_size=6144, ssm__state_size=128, ssm__group_count=16)
    assert len(q.recurrent) == 48 and len(q.kv) == 16 and q.cell_ext
    per = ps.checkpoint_bytes(q, 100_000)
    assert per == ps.checkpoint_bytes(q, 1_000) and 149 << 20 < per < 151 << 20
    size = ps.predict(q, 100_000)
    assert size.n_checkpoints == 2 and size.sidecar_max == ps.sidecar_bytes(32, per)


def test_how_many_checkpoints_one_prompt_makes():
    assert [ps.checkpoints_per_prompt(n) for n in (3, 300, 516, 517, 100_000)] == [0, 1, 1, 2, 2]
    assert ps.checkpoints_per_prompt(3000, cap=1) == 1 and ps.checkpoints_per_prompt(3000, cap=0) == 0


def test_the_sliding_window_checkpoint_stops_growing_past_the_window():
    swa = meta("gemma3", **TINY, attention__sliding_window=32, attention__sliding_window_pattern=[1, 0])
    assert ps.checkpoint_bytes(swa, 10) < ps.checkpoint_bytes(swa, 32) == ps.checkpoint_bytes(swa, 5000) == 33_208


def test_gemma3_without_a_pattern_key_slides_five_layers_in_six():
    g = meta("gemma3", block_count=18, embedding_length=640, attention__head_count=4, attention__head_count_kv=1,
             attention__key_length=256, attention__value_length=256, attention__sliding_window=512)
    assert (len(g.kv), len(g.kv_swa)) == (3, 15)
    assert ps.predict(g, 1500).state == 12_502_972  # the real Gemma 3 270M, measured


def test_an_unknown_layout_gives_no_shape():
    assert meta("jamba") is None  # no block count
    assert meta("plamo2", **TINY) is None  # a hybrid laid out otherwise
    assert meta("llama4", **TINY, attention__sliding_window=8192) is None  # chunked attention: not laid out here


def test_calibration_from_earlier_parks():
    rows = [ps.ParkSample(300, 550_160, 549_000, 1), ps.ParkSample(3000, 560_960, 1_097_980, 2)]
    size = ps.calibrate(rows, 1000)
    assert size.source == ps.SOURCE_PARKS and size.state == pytest.approx(552_960, abs=2)
    assert size.per_checkpoint == 548_940 and size.n_checkpoints == 2 and size.sidecar == 1_097_980
    one = ps.calibrate([ps.ParkSample(1000, 2_064_100)], 2000, source=ps.SOURCE_PREVIOUS)
    assert one.state == 4_128_200 and one.sidecar == 0 and one.source == ps.SOURCE_PREVIOUS
    assert ps.calibrate([], 10) is None


def test_the_previous_copy_raises_the_checkpoint_count_up_to_the_cap():
    rec = meta("mamba2", **TINY, ssm__conv_kernel=4, ssm__inner_size=512, ssm__state_size=128, ssm__group_count=2)
    size = ps.predict(rec, 3000, ctx_checkpoints=8)
    assert ps.with_previous(size, 6).n_checkpoints == 6
    assert ps.with_previous(size, 50).n_checkpoints == 8
    assert ps.with_previous(size, 1) == size


def test_tolerance():
    assert ps.within_tolerance(1000, 1200) and not ps.within_tolerance(1000, 1300)
    assert ps.within_tolerance(10_050_000, 10_000_000) and not ps.within_tolerance(10_060_000, 10_000_000)
