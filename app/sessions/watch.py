"""Judge the first query after a restore, whoever sends it.

A chat client usually sends the follow-up, not KV Valet, so the app learns how
the resume went from the server log (``-lv 4``, trace level, in build 11434):

    restored 4 context checkpoints from sidecar              (at the restore)
    new prompt, ..., task.n_tokens = 2885                    (the prompt length)
    forcing full prompt re-processing due to lack of ...     (discarded), or
    restored context checkpoint (... n_past = 2880 ...)      (rolled back to a checkpoint)
    cached n_tokens = 2880, memory_seq_rm [2880, end)        (first one = reused tokens)
    prompt eval time = 78.42 ms / 5 tokens                   (the figures; verdict here)
    release: ... stop processing: n_tokens = 2892            (end of task)

:class:`ResumeWatcher` is fed parsed events (hook :meth:`feed` to
``Supervisor.on_line``) and calls ``on_verdict(slot_id, session_name, verdict)``
once per registered restore. :func:`judge_from_completion` does the same from a
``/completion`` response when the app sent the query itself.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from app.core.observers import Observers
from app.core.checkpoints import CheckpointFigures
from app.core.timings import Timings
from app.core.verdict import Reuse, Verdict, judge
from app.server.logparse import (CheckpointRestored, FullReprocess, Kind, LogEvent, NewPrompt, PromptEval,
                                 SidecarRestored, parse_line)
from app.server.supervisor import LogBuffer, LogLine

log = logging.getLogger(__name__)

VerdictCallback = Callable[[int, "str | None", Verdict], None]

_CACHED = re.compile(r"cached n_tokens =\s*(\d+)")


@dataclass
class Expectation:
    slot_id: int
    n_restored: int
    session_name: str | None
    sidecar_status: object = None
    build_persists: bool | None = None
    ctx_checkpoints: int | None = 32
    saved_tokens: list[int] | None = None
    sidecar_count: int | None = None
    behaviour: object = None  # the build's sidecar behaviour, and what its loader was predicted to do
    prediction: object = None
    note: str | None = None  # said with the verdict (e.g. it went on into another chat's checkpoints)
    parked_positions: tuple | None = None  # the park's own checkpoint positions (app.core.park_files)
    # what the log said so far
    sidecar_loaded: int | None = None
    task: int | None = None
    n_tokens: int | None = None
    full_reprocess: bool = False
    checkpoint: CheckpointFigures | None = None
    cached_first: int | None = None
    # when the restore was registered: the server's log reaches us in batches from a
    # reader thread, so lines of an earlier task can arrive after it; they are not this one's
    since: float = field(default_factory=time.time)
    prompt_ms: float | None = None
    prompt_n: int | None = None
    events: list[str] = field(default_factory=list)


class ResumeWatcher:
    """Watches the server log for the first task on each slot with a pending restore."""

    def __init__(self, on_verdict: VerdictCallback | None = None, *, log_has_sidecar_lines: bool = True):
        self._verdicts: Observers[[int, str | None, Verdict]] = Observers("a resume's verdict")
        if on_verdict:
            self._verdicts.add(on_verdict)
        self._pending: dict[int, Expectation] = {}
        # "restored N context checkpoints from sidecar" seen on a slot before its
        # expectation was registered (the line comes during the restore request).
        self._recent_sidecar: dict[int, int] = {}
        self.log_has_sidecar_lines = log_has_sidecar_lines
        self.verdicts: list[tuple[int, str | None, Verdict]] = []

    # -- registration ------------------------------------------------------
    def on_verdict(self, cb: VerdictCallback) -> None:
        self._verdicts.add(cb)

    def expect(self, slot_id: int, n_restored: int, session_name: str | None, sidecar_status=None, *,
               build_persists: bool | None = None, ctx_checkpoints: int | None = 32,
               saved_tokens: list[int] | None = None, sidecar_count: int | None = None,
               sidecar_loaded: int | None = None, behaviour=None, prediction=None,
               note: str | None = None, parked_positions: tuple | None = None,
               since: float | None = None) -> Expectation:
        """Register a restore of ``n_restored`` tokens into ``slot_id``; the next task
        on that slot is judged. A sidecar load logged just before is picked up. ``since``: when the restore
        ended (``time.time()``; default now): a line read before it is an earlier task's."""
        exp = Expectation(slot_id, int(n_restored), session_name, sidecar_status, build_persists, ctx_checkpoints,
                          saved_tokens, sidecar_count)
        if since is not None:
            exp.since = since
        exp.behaviour, exp.prediction, exp.note = behaviour, prediction, note
        exp.parked_positions = parked_positions
        if sidecar_loaded is not None:
            exp.sidecar_loaded = sidecar_loaded
        elif slot_id in self._recent_sidecar:
            exp.sidecar_loaded = self._recent_sidecar.pop(slot_id)
        self._pending[slot_id] = exp
        return exp

    def cancel(self, slot_id: int) -> None:
        self._pending.pop(slot_id, None)
        self._recent_sidecar.pop(slot_id, None)

    def pending(self) -> dict[int, Expectation]:
        return dict(self._pending)

    def attach(self, supervisor) -> None:
        """Feed every line of a Supervisor's log to this watcher."""
        supervisor.on_line(self.feed)

    # -- events ------------------------------------------------------------
    def feed_lines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.feed(line)

    def feed(self, item) -> Verdict | None:
        """Consume a LogEvent, a supervisor LogLine or a raw log line.
        Returns the verdict when this event completed one."""
        ev = _as_event(item)
        if ev is None or ev.slot is None:
            return None
        slot = ev.slot
        if isinstance(ev, SidecarRestored):
            count = ev.count
            exp = self._pending.get(slot)
            if exp is not None and exp.task is None:
                exp.sidecar_loaded = count
            else:
                self._recent_sidecar[slot] = count
            return None
        exp = self._pending.get(slot)
        if exp is None:
            if ev.kind == Kind.NEW_PROMPT:
                self._recent_sidecar.pop(slot, None)
            return None
        at = getattr(item, "at", None)
        if exp.task is None and isinstance(at, float) and at < exp.since:
            return None  # read before the restore was registered: an earlier task's line
        if exp.task is None:
            if isinstance(ev, NewPrompt):
                exp.task = ev.task
                exp.n_tokens = ev.n_tokens
                exp.events.append(ev.line)
            elif ev.kind in (Kind.PROMPT_EVAL, Kind.RELEASE) and ev.task is not None and ev.task >= 0:
                # no trace lines: the first task we see is the one
                exp.task = ev.task
            else:
                return None
        if ev.task is not None and exp.task is not None and ev.task != exp.task:
            return None
        if ev.kind == Kind.FULL_REPROCESS:
            exp.full_reprocess = True
        elif isinstance(ev, CheckpointRestored):
            exp.checkpoint = ev.checkpoint
        elif ev.kind == Kind.RAW and exp.cached_first is None:
            m = _CACHED.search(ev.text)
            if m:
                exp.cached_first = int(m.group(1))
        if ev.kind in (Kind.FULL_REPROCESS, Kind.CHECKPOINT_RESTORED):
            exp.events.append(ev.line)
        if isinstance(ev, PromptEval):
            exp.prompt_ms = ev.ms
            exp.prompt_n = ev.n_tokens
            exp.events.append(ev.line)
            return self._finish(exp)
        if ev.kind == Kind.RELEASE:
            exp.events.append(ev.line)
            return self._finish(exp)
        return None

    def _finish(self, exp: Expectation) -> Verdict:
        self._pending.pop(exp.slot_id, None)
        cache_n = None
        total = exp.n_tokens
        if total is not None and exp.prompt_n is not None:
            cache_n = max(0, total - exp.prompt_n)
        elif exp.cached_first is not None:
            cache_n = exp.cached_first
        prompt_n = exp.prompt_n
        if prompt_n is None and total is not None and cache_n is not None:
            prompt_n = total - cache_n
        loaded = exp.sidecar_loaded
        if loaded is None and self.log_has_sidecar_lines and exp.n_tokens is not None:
            loaded = 0  # the log shows such lines, and none came
        v = judge(Reuse(exp.n_restored, cache_n, prompt_n, prompt_total=total, prompt_ms=exp.prompt_ms,
                           restored=True, full_reprocess_logged=exp.full_reprocess,
                           checkpoint_restored=exp.checkpoint, sidecar_status=exp.sidecar_status,
                           sidecar_loaded_count=loaded, sidecar_count=exp.sidecar_count,
                           build_persists=exp.build_persists, ctx_checkpoints=exp.ctx_checkpoints,
                           behaviour=exp.behaviour, prediction=exp.prediction,
                           parked_positions=exp.parked_positions))
        if exp.note:
            note, cp = exp.note, exp.checkpoint
            if cp is not None and not loaded and exp.n_restored and cp.n_tokens is not None \
                    and cp.n_tokens < exp.n_restored:
                # no checkpoint of this session came with the restore: the one used is the other chat's
                note = (f"{note}; the server rolled back onto that chat's checkpoint at token {cp.n_tokens:,}, so "
                        "the reused tokens carry the other conversation's state and the answer may be wrong")
            v = dataclasses.replace(v, reason=f"{v.reason} (note: {note})")
        self.verdicts.append((exp.slot_id, exp.session_name, v))
        self._verdicts.emit(exp.slot_id, exp.session_name, v)
        return v


def _as_event(item) -> LogEvent | None:
    if isinstance(item, LogEvent):
        return item
    if isinstance(item, str):
        return parse_line(item)
    ev = getattr(item, "event", None)
    return ev if isinstance(ev, LogEvent) else None


@dataclass(frozen=True)
class LogScan:
    """What the log says about one query after a restore (:func:`scan_events`)."""

    sidecar_loaded: int | None = None  # N of the last ``restored N context checkpoints from sidecar``
    full_reprocess: bool = False
    checkpoint: CheckpointFigures | None = None  # the last ``restored context checkpoint (...)``
    prompt_eval: PromptEval | None = None


def scan_events(events: Iterable) -> LogScan:
    """What the log says about one query after a restore: sidecar loads, a forced
    full re-processing, the checkpoint used. For the app's own probes."""
    loaded: int | None = None
    full = False
    checkpoint: CheckpointFigures | None = None
    prompt_eval: PromptEval | None = None
    for item in events:
        ev = _as_event(item)
        if isinstance(ev, SidecarRestored):
            loaded = ev.count
        elif isinstance(ev, FullReprocess):
            full = True
        elif isinstance(ev, CheckpointRestored):
            checkpoint = ev.checkpoint
        elif isinstance(ev, PromptEval):
            prompt_eval = ev
    return LogScan(loaded, full, checkpoint, prompt_eval)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def judge_from_completion(n_restored: int, response: dict, *, sidecar_status=None,
                          sidecar_loaded_count: int | None = None, build_persists: bool | None = None,
                          ctx_checkpoints: int | None = 32, log_events: Iterable | None = None,
                          saved_tokens: list[int] | None = None, prompt_tokens: list[int] | None = None,
                          sidecar_count: int | None = None, behaviour=None, prediction=None,
                          parked_positions: tuple | None = None) -> Verdict:
    """Judge the app's own first query from its ``/completion`` response timings
    (plus the server log lines of that query, when the app has them). ``parked_positions``: the
    park's own checkpoint positions, so a rollback to another one is called out."""
    t = Timings.of(response)
    cache_n, prompt_n = t.cache_n, t.prompt_n
    total = response.get("tokens_evaluated")
    if total is None and cache_n is not None and prompt_n is not None:
        total = cache_n + prompt_n
    scan = scan_events(log_events) if log_events is not None else None
    loaded = sidecar_loaded_count
    full = False
    checkpoint = None
    if scan is not None:
        if loaded is None:
            loaded = scan.sidecar_loaded
        full = scan.full_reprocess
        checkpoint = scan.checkpoint
    common = None
    if saved_tokens is not None and prompt_tokens is not None:
        common = common_prefix(saved_tokens, prompt_tokens)
    return judge(Reuse(n_restored, cache_n, prompt_n, prompt_total=total, prompt_ms=t.prompt_ms, restored=True,
                          full_reprocess_logged=full, checkpoint_restored=checkpoint, common_prefix=common,
                          sidecar_status=sidecar_status, sidecar_loaded_count=loaded, sidecar_count=sidecar_count,
                          build_persists=build_persists, ctx_checkpoints=ctx_checkpoints, behaviour=behaviour,
                          prediction=prediction, parked_positions=parked_positions))


class FileLogBuffer(LogBuffer):
    """A LogBuffer fed from a server log file (attach mode: the server was started
    elsewhere with its log redirected to a file). New lines are read on
    :meth:`poll` and on every :meth:`since`."""

    def __init__(self, path: str | Path, capacity: int = 20000, *, from_start: bool = False,
                 on_line: Callable[[LogLine], None] | None = None):
        super().__init__(capacity)
        self.path = Path(path)
        self._partial = b""
        self._on_line = on_line
        try:
            self._pos = 0 if from_start else self.path.stat().st_size
        except OSError:
            self._pos = 0

    def poll(self) -> int:
        """Read what was appended since the last poll; returns the number of new lines."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._pos)
                data = f.read()
        except OSError:
            return 0
        if not data:
            return 0
        self._pos += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        for raw in lines:
            item = self.append(raw.decode("utf-8", errors="replace"))
            if self._on_line is not None:
                self._on_line(item)
        return len(lines)

    def since(self, seq: int) -> list[LogLine]:
        self.poll()
        return super().since(seq)
