"""A check's or an A/B's report written out (app.sessions.check_report): JSON (:func:`to_json`, the
CLI's ``--json`` and :func:`report_dict`), CSV (:func:`to_csv`), Markdown (:func:`to_markdown`) and
plain text (:func:`to_text`), from the same figures."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from app.core import output_check as oc
from app.sessions.check_report import ABReport, CheckReport, ProbeRow

ROW_FIELDS = ["name", "restore_ms", "prompt_ms", "prompt_n", "cache_n", "ttft_ms", "n_restored",
              "checkpoints_loaded", "verdict", "reason", "fresh_process", "confounded", "output",
              "output_first_diff"]


def _r(x: float | None) -> float | None:
    return None if x is None else round(float(x), 2)


def row_dict(row: ProbeRow) -> dict[str, Any]:
    return {"name": row.name, "restore_ms": _r(row.restore_ms), "prompt_ms": _r(row.prompt_ms),
            "prompt_n": row.prompt_n, "cache_n": row.cache_n, "ttft_ms": _r(row.ttft_ms),
            "n_restored": row.n_restored, "checkpoints_loaded": row.checkpoints_loaded,
            "verdict": row.verdict.kind.value, "reason": row.verdict.reason,
            "fresh_process": row.fresh_process, "confounded": row.confounded or None,
            "output": row.output.status.value if row.output is not None else None,
            "output_first_diff": (row.output.first_diff.index if row.output is not None
                                  and row.output.first_diff is not None else None)}


def row_json(row: ProbeRow) -> dict[str, Any]:
    """A row for the JSON export: :func:`row_dict` and the output check in full."""
    return {**row_dict(row), "output_check": row.output.to_dict() if row.output is not None else None}


def ratios(ab: ABReport) -> dict[str, float | None]:
    return {"delta_prefill_speedup": _r(ab.delta_prefill_speedup), "end_to_end_speedup": _r(ab.end_to_end_speedup),
            "baseline_speedup": _r(ab.baseline_speedup)}


def _ab_dict(ab: ABReport) -> dict[str, Any]:
    return {"type": "ab", "session": ab.session, "profile": ab.profile, "build": ab.build, "slot_id": ab.slot_id,
            "n_restored": ab.n_restored, "sidecar_status": ab.sidecar_status, "sidecar_count": ab.sidecar_count,
            "had_sidecar": ab.had_sidecar, "note": ab.note, "at": ab.at, "protocol": ab.protocol,
            "behaviour": ab.behaviour, "output_check": ab.output_check, "question_sent": ab.question_sent or None,
            "rows": [row_json(r) for r in ab.rows], "ratios": ratios(ab)}


def report_dict(report: CheckReport | ABReport) -> dict[str, Any]:
    if isinstance(report, ABReport):
        return _ab_dict(report)
    return {"type": "check", "session": report.session, "profile": report.profile, "build": report.build,
            "slot_id": report.slot_id, "n_restored": report.n_restored, "sidecar_status": report.sidecar_status,
            "sidecar_count": report.sidecar_count, "question": report.question, "at": report.at,
            "protocol": report.protocol, "behaviour": report.behaviour, "output_check": report.output_check,
            "question_sent": report.question_sent or None,
            "verdict": {"kind": report.verdict.kind.value, "reason": report.verdict.reason},
            "warnings": list(report.warnings), "probes": [row_json(r) for r in report.probes],
            "ab": _ab_dict(report.ab) if report.ab else None}


def to_json(report: CheckReport | ABReport) -> str:
    return json.dumps(report_dict(report), indent=2)


def to_csv(report: CheckReport | ABReport) -> str:
    """One row per probe / arm (section "probe" / "ab"), then one per ratio (section "ratio")."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["section", *ROW_FIELDS, "value"])

    def rows(section: str, items: list[ProbeRow]) -> None:
        for r in items:
            d = row_dict(r)
            w.writerow([section, *("" if d[k] is None else d[k] for k in ROW_FIELDS), ""])

    ab = report if isinstance(report, ABReport) else report.ab
    if isinstance(report, CheckReport):
        rows("probe", report.probes)
    if ab is not None:
        rows("ab", ab.rows)
        for k, v in ratios(ab).items():
            w.writerow(["ratio", k, *([""] * (len(ROW_FIELDS) - 1)), "" if v is None else v])
    return buf.getvalue()


def _fmt(x, unit: str = "", digits: int = 1) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:,.{digits}f}{unit}"
    return f"{x:,}{unit}"


def _md_table(items: list[ProbeRow]) -> list[str]:
    out = ["| run | restore ms | prompt ms | prompt_n | cache_n | TTFT ms | checkpoints | verdict | output |",
           "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in items:
        d = row_dict(r)
        verdict = "reference" if r.verdict.figures.get("baseline") else d["verdict"]
        if r.confounded:
            verdict += " (confounded)"
        out.append(f"| {r.name} | {_fmt(d['restore_ms'])} | {_fmt(d['prompt_ms'])} | {_fmt(d['prompt_n'])} | "
                   f"{_fmt(d['cache_n'])} | {_fmt(d['ttft_ms'])} | {_fmt(d['checkpoints_loaded'])} | {verdict} | "
                   f"{output_cell(r)} |")
    return out


def output_cell(r: ProbeRow) -> str:
    """The output check in a table cell ("same 8/8", "DIFFERS at 3", "off", "–" for the baseline)."""
    if r.output is None:
        return "–" if r.verdict.figures.get("baseline") else "off"
    return r.output.short()


def _output_lines(items: list[ProbeRow], enabled: bool) -> list[str]:
    if not enabled:
        return ["- output check: off (--no-output-check)"]
    out = []
    for r in items:
        if r.output is None:
            continue
        line = f"- {r.name}, output check: {r.output.reason}"
        if r.output.status is not oc.Status.MATCH and (r.output.warm_text or r.output.cold_text):
            line += f" (resumed: {r.output.warm_text!r}; cold: {r.output.cold_text!r})"
        out.append(line)
    return out


def _question_lines(question: str, sent: str) -> list[str]:
    """How the chat probe asked its question ("as a user turn through the model's chat template")."""
    if not sent:
        return []
    return [f"- the chat probe's question{f' {question.strip()!r}' if question.strip() else ''}: sent {sent}"]


def _ratio_text(x: float | None) -> str:
    return "–" if x is None else f"{x:,.2f}×"


def _md_ab(ab: ABReport) -> list[str]:
    out = [f"### A/B: sidecar vs hidden ({ab.n_restored:,} tokens restored; protocol: {ab.protocol}; "
           f"build's sidecar behaviour: {ab.behaviour})", ""]
    out += _md_table(ab.rows)
    rt = ratios(ab)
    out += ["", f"- delta-prefill speed-up (prompt ms hidden / with sidecar, chat-client query): "
                f"{_ratio_text(rt['delta_prefill_speedup'])}",
            f"- end-to-end resume speed-up ((restore + prompt) hidden / with): {_ratio_text(rt['end_to_end_speedup'])}"]
    if rt["baseline_speedup"] is not None:
        out.append(f"- baseline full prefill / resume with sidecar: {_ratio_text(rt['baseline_speedup'])}")
    if ab.note:
        out.append(f"- {ab.note}")
    out += _question_lines("", ab.question_sent)
    out += _output_lines(ab.rows, ab.output_check)
    return out


def to_markdown(report: CheckReport | ABReport) -> str:
    if isinstance(report, ABReport):
        head = [f"## KV Valet A/B: {report.session}", "",
                f"Profile {report.profile}, build {report.build}, slot {report.slot_id}; "
                f"sidecar {report.sidecar_status} ({report.sidecar_count} checkpoints).", ""]
        return "\n".join(head + _md_ab(report)) + "\n"
    out = [f"## KV Valet check: {report.session}", "",
           f"Profile {report.profile}, build {report.build}, slot {report.slot_id}; {report.n_restored:,} tokens "
           f"restored; sidecar {report.sidecar_status} ({report.sidecar_count} checkpoints); protocol: "
           f"{report.protocol}; build's sidecar behaviour: {report.behaviour}.", ""]
    out += _md_table(report.probes)
    out += ["", f"**Verdict: {report.verdict.kind.value}**: {report.verdict.reason}"]
    for r in report.probes:
        out.append(f"- {r.name}: {r.verdict.reason}")
    out += _question_lines(report.question, report.question_sent)
    out += _output_lines(report.probes, report.output_check)
    for w in report.warnings:
        out.append(f"- warning: {w}")
    if report.ab:
        out += [""] + _md_ab(report.ab)
    return "\n".join(out) + "\n"


def to_text(report: CheckReport | ABReport) -> str:
    """The table for a terminal (the markdown reads fine as plain text)."""
    return to_markdown(report)
