"""The restore-case harness's pure parts (tests/real/restore_cases.py, tests/real/error_rates.py): the ground
truth read from a check's log, the counts, the sidecar edits and the README table of error rates."""

from __future__ import annotations

import json
import struct

from app.server.logparse import parse_line
from tests.conftest import ROOT
from tests.real import error_rates as er
from tests.real import restore_cases as rc

LINES = {
    "loaded": "0.03.345.037 I slot process_sing: id  0 | task -1 | restored 4 context checkpoints from sidecar",
    "used": "0.03.613.613 I slot   operator(): id  0 | task 1 | restored context checkpoint (pos_min = 1857, "
            "pos_max = 2880, n_tokens = 2881, n_past = 2880, size = 7.506 MiB)",
    "full": "0.03.591.141 I slot   operator(): id  0 | task 1 | forcing full prompt re-processing due to lack of "
            "cache data (likely due to SWA or hybrid/recurrent memory, see https://github.com/x)",
    "eval": "0.15.433.618 I slot print_timing: id  0 | task 8 | prompt eval time =     180.59 ms /    21 tokens "
            "(    8.60 ms per token,   116.29 tokens per second)",
}


def ev(*names):
    return [parse_line(LINES[n]) for n in names]


def test_a_checks_log_splits_into_its_probes_at_each_querys_timing_line():
    logs = rc.probe_logs(ev("loaded", "used", "eval", "full", "eval", "loaded", "used", "eval"), 2)
    assert (logs[0].sidecar_loaded, logs[0].checkpoints_used, logs[0].full_reprocess) == (4, [2881], False)
    assert (logs[1].sidecar_loaded, logs[1].checkpoints_used, logs[1].full_reprocess) == (None, [], True)
    assert len(rc.probe_logs([], 2)) == 2  # a log that says nothing: two empty probes


def test_wrong_data_counts_only_where_the_log_shows_it_took_part():
    took, = rc.probe_logs(ev("loaded", "used", "eval"), 1)
    none, = rc.probe_logs(ev("eval"), 1)
    assert rc.judge_truth(rc.OTHER_SIDECAR, took, 2000, 2900)[0] == rc.WRONG
    assert rc.judge_truth(rc.OTHER_SIDECAR, none, 0, 2900)[0] == rc.NOT_WRONG  # refused: the tip, or a full prefill
    assert rc.judge_truth(rc.BLOB_CHANGED, took, 2880, 2900, changed_at=2881)[0] == rc.WRONG
    assert rc.judge_truth(rc.BLOB_CHANGED, took, 2880, 2900, changed_at=1500)[0] == rc.NOT_WRONG  # another one used
    assert rc.judge_truth(rc.OTHER_QUANT, none, 2880, 2900)[0] == rc.WRONG
    assert rc.judge_truth(rc.OTHER_QUANT, none, 0, 2900)[0] == rc.NOT_WRONG
    assert rc.judge_truth(rc.SWA_PAST_WINDOW, none, 2880, 2900)[0] == rc.NOT_WRONG  # 11434 does not show #25297
    assert rc.judge_truth(rc.SWA_PAST_WINDOW, none, 2880, 2900, swa_wrong=True)[0] == rc.WRONG
    assert "n_tokens [2881]" in rc.judge_truth(rc.OTHER_SIDECAR, took, 1, 1)[1]


def _rec(case, kind, verdict, check=None, refusal="", probe="text", wrong=""):
    return rc.CaseRecord(case, "dense", "llama", "tiny", "stock", 1, kind, wrong=wrong, probe=probe, verdict=verdict,
                         check_verdict=check or verdict, refusal=refusal)


def test_counts_by_check_false_differs_and_misses():
    records = [_rec("a", rc.CORRECT, "HIT"), _rec("a", rc.CORRECT, "DIFFERS", "DIFFERS", probe="exact"),
               _rec("b", rc.CORRECT, "DISCARDED"),  # not a pass, and no false DIFFERS either
               _rec("c", rc.WRONG, "HIT", wrong="other-sidecar"),  # missed
               _rec("d", rc.WRONG, "HIT", "DIFFERS", wrong="other-sidecar"),  # caught by the other probe
               _rec("e", rc.WRONG, "", "", refusal="not the sidecar this session parked", wrong="other-sidecar"),
               _rec("f", rc.NOT_WRONG, "DISCARDED", wrong="truncated")]
    c = rc.counts(records)
    assert (c["correct"], c["false_differs"], c["false_differs_cases"]) == (2, 1, ["a"])
    assert (c["wrong"], c["missed"], c["missed_cases"], c["refused_wrong"]) == (3, 1, ["c"], 1)
    assert c["not_wrong_in_effect"] == 1
    assert (c["missed_with_yes"], c["missed_with_yes_cases"]) == (1, ["c"])
    assert (c["probes_wrong"], c["probes_missed"], c["probes_missed_with_yes"]) == (3, 2, 2)


def _pkcl_v1(blobs):
    out = struct.pack("<III", 0x4C434B50, 1, len(blobs))
    for n, data in blobs:
        out += struct.pack("<qiiQQ", n, 0, n - 1, len(data), 0) + data
    return out


def _pkcl_v2(blobs):
    out = struct.pack("<IIQI", 0x4C434B50, 2, 7, len(blobs))
    for n, data in blobs:
        out += struct.pack("<qii", n, 0, n - 1) + struct.pack("<Q", len(data)) + data + struct.pack("<QQ", 0, 0)
    return out


def test_a_blob_changed_and_a_truncated_sidecar(tmp_path):
    for make in (_pkcl_v1, _pkcl_v2):
        p = tmp_path / "s.bin.ckpt"
        p.write_bytes(make([(100, b"\x01" * 64), (300, b"\x02" * 64)]))
        blobs = rc._blobs(p)
        assert [(n, size) for n, _off, size in blobs] == [(100, 64), (300, 64)]
        assert rc.change_blob(p) == 300
        data = p.read_bytes()
        off = blobs[1][1]
        assert data[off:off + 60] == b"\x02" * 60 and data[off + 60:off + 64] == bytes(4)  # the tail, 1/16
        assert data[blobs[0][1]:blobs[0][1] + 64] == b"\x01" * 64  # the other checkpoint untouched
        assert rc.truncate(p) == off + 32 and p.stat().st_size == off + 32  # inside the last checkpoint


def test_the_readme_table_is_the_render_of_the_measured_counts():
    data = json.loads(er.DATA_FILE.read_text(encoding="utf-8"))
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert er.readme_with_table(readme, er.render_table(data)) == readme
    assert data["tiny"]["correct"] >= 100 and data["tiny"]["wrong"] >= 30
    assert data["tiny"]["false_differs"] == 0 and data["tiny"]["missed"] == 0
