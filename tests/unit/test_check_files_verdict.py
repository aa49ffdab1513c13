"""A check forced (--yes) past a park whose files are not the ones it wrote is never a pass
(app.sessions.check.not_its_own_files): UNKNOWN with the park's words, unless its output already differs."""

from __future__ import annotations

from app.core.verdict import Verdict, VerdictKind
from app.sessions.check import not_its_own_files
from app.sessions.check_report import CheckReport

SAID = "not the sidecar this session parked (Y.bin.ckpt): last checkpoint at 1,923, parked with 2,185"


def report(kind: VerdictKind) -> CheckReport:
    v = Verdict(kind, "re-processed 285 of 2,210 prompt tokens", n_restored=2197, prompt_n=285, cache_n=1923)
    return CheckReport(session="Y", profile="p", build="b", slot_id=1, n_restored=2197, sidecar_status="present",
                       sidecar_count=3, question="q", probes=[], verdict=v, warnings=[])


def test_a_warm_check_of_another_chats_files_is_unknown_and_names_them():
    for kind in (VerdictKind.HIT, VerdictKind.PARTIAL, VerdictKind.DISCARDED):
        r = not_its_own_files(report(kind), [SAID])
        assert r.verdict.kind is VerdictKind.UNKNOWN and not r.verdict.ok
        assert r.verdict.reason.startswith(f"not a correct resume that can be shown: {SAID}. The check ran on these "
                                           f"files because it was told to (--yes); what it measured: {kind.value}")
        assert r.verdict.figures["measured_kind"] == kind.value and r.warnings == [SAID]
        assert (r.verdict.cache_n, r.verdict.prompt_n) == (1923, 285)


def test_a_differing_output_stays_differs():
    r = not_its_own_files(report(VerdictKind.DIFFERS), [SAID])
    assert r.verdict.kind is VerdictKind.DIFFERS and r.warnings == [SAID]
