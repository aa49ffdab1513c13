"""What a check or an A/B found (app.sessions.check, app.sessions.ab): the probes' rows, the
reports, and the names of probes, arms and protocols. Values only, so the faces (the window's check
dialog, the CLI) and the exporters (app.sessions.check_export) read them without the steps."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from app.core import output_check as oc
from app.core.verdict import Verdict

DEFAULT_QUESTION = "\nIn one short sentence, what was this about?"

ARM_WITH = "with sidecar"
ARM_HIDDEN = "sidecar hidden"
ARM_WITH_EXACT = "with sidecar, exact tokens"
ARM_HIDDEN_EXACT = "sidecar hidden, exact tokens"
ARM_BASELINE = "baseline (empty slot)"
PROBE_EXACT = "exact tokens"
PROBE_TEXT = "text"

PROTOCOL_RESTARTS = "across restarts"  # each probe in a fresh server process (the seed's A/B)
PROTOCOL_ONE_PROCESS = "one process"  # every probe in the running server (arms can confound)
PROTOCOLS = (PROTOCOL_RESTARTS, PROTOCOL_ONE_PROCESS)


class CheckError(Exception):
    """The check cannot run (message is user-facing)."""


@dataclass
class ProbeRow:
    """One restore + first query (or the baseline prefill)."""

    name: str
    restore_ms: float | None
    prompt_ms: float | None
    prompt_n: int | None
    cache_n: int | None
    ttft_ms: float | None
    n_restored: int | None
    checkpoints_loaded: int | None
    verdict: Verdict
    prompt_tokens: int | None = None
    fresh_process: bool = False  # the server was restarted right before this probe
    confounded: str = ""  # why an earlier probe's leftovers decided this one ("" = clean)
    output: oc.OutputCheck | None = None  # the output check's result (None: not run, the baseline)
    pending: Any = field(default=None, repr=False, compare=False)  # (prompt, answer) until the output check

    @property
    def total_ms(self) -> float | None:
        if self.prompt_ms is None:
            return None
        return (self.restore_ms or 0.0) + self.prompt_ms


@dataclass
class RestoredSession:
    """What a check and an A/B both say first: the session, where it was restored and what it brought."""

    session: str
    profile: str
    build: str
    slot_id: int
    n_restored: int
    sidecar_status: str
    sidecar_count: int


@dataclass
class ABReport(RestoredSession):
    rows: list[ProbeRow]
    delta_prefill_speedup: float | None  # prompt_ms hidden / prompt_ms with sidecar
    end_to_end_speedup: float | None  # (restore + prompt) hidden / (restore + prompt) with
    baseline_speedup: float | None = None  # baseline prompt_ms / (restore + prompt) with sidecar
    note: str = ""
    had_sidecar: bool = True
    at: float = field(default_factory=time.time)
    protocol: str = PROTOCOL_RESTARTS
    behaviour: str = "unknown"  # the build's sidecar behaviour (app.core.sidecar_behaviour)
    output_check: bool = True  # each arm's output compared with a cold prefill's
    question_sent: str = ""  # how the chat probe sent the question ("" when no chat probe ran as text)

    def row(self, name: str) -> ProbeRow | None:
        return next((r for r in self.rows if r.name == name), None)

    @property
    def confounded(self) -> list[ProbeRow]:
        return [r for r in self.rows if r.confounded]


@dataclass
class CheckReport(RestoredSession):
    question: str
    probes: list[ProbeRow]
    verdict: Verdict  # the worst of the probes
    warnings: list[str] = field(default_factory=list)
    ab: ABReport | None = None
    at: float = field(default_factory=time.time)
    protocol: str = PROTOCOL_ONE_PROCESS
    behaviour: str = "unknown"
    output_check: bool = True  # each probe's output compared with a cold prefill's
    question_sent: str = ""  # how the text probe sent the question ("" when it did not run)

    def probe(self, name: str) -> ProbeRow | None:
        return next((r for r in self.probes if r.name == name), None)
