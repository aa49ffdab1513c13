"""Cache health: what the running server's own log says about its caches.

The two field reports in the seeds took their users days: llama-server
aborting with ``GGML_ASSERT(tensor->data != NULL && "tensor not allocated")``
when the prompt cache saves an idle slot whose KV lives on an RPC backend
(seed 002, llama.cpp #26128), and every stream stalling while idle slots are
saved with ``-kvu --cache-idle-slots`` (seed 004, #30252, fixed by #31391).
:class:`CacheHealth` is fed every parsed log line (and the crash outcome) and
keeps, Qt-free:

* **findings** (app.core.findings) with the known issue and its remedy: the
  crash cause, an idle-slot save that stalled the streams, a slot forced into a
  full re-processing;
* **figures**: idle-slot save durations (a histogram), forced full
  re-processings per slot, checkpoints created / erased / restored (also from a
  sidecar), and how each request picked its slot (similarity vs LRU vs id).

The window's Cache health panel and the Monitor's badge show them; a remedy is
applied by :func:`app.tools.remedy.apply_remedy`.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable

from app.core.observers import Observers
from app.core.findings import Finding, Remedy, Severity
from app.server.logparse import Kind, LogEvent, PromptCacheUpdate, SidecarRestored, SlotSelected, parse_line

log = logging.getLogger(__name__)

#: An idle-slot save this long stalls every stream noticeably (seed 004: 0.7-0.9 s per save).
STALL_MS = 200.0
#: Histogram bucket upper bounds (ms) of idle-slot save durations.
BUCKETS_MS = (10, 50, 100, 200, 500, 1000, 2000, float("inf"))
#: Idle-slot saves kept one by one (the newest); the count, the histogram and the worst cover every one.
#: A busy multi-slot server logs one per request switch: kept all, the list grew without end (the
#: window's soak: 0.3 MB a minute under a log flood) and every figures tick walked all of it.
IDLE_SAVES_KEPT = 1000

ASSERT_TENSOR = "tensor not allocated"
REMEDIES_RPC_ASSERT = (Remedy("Turn the prompt cache off (--cache-ram 0)", {"cache_ram": 0}),
                       Remedy("Use one slot (-np 1)", {"parallel": 1}))
REMEDIES_IDLE_STALL = (Remedy("Stop saving idle slots (--no-cache-idle-slots)", {"cache_idle_slots": False}),
                       Remedy("Give each slot its own KV buffer (drop -kvu)", {"kv_unified": False}))

_ERASED = re.compile(r"(erasing old|erased invalidated|erasing) context checkpoint")
_SELECTED = re.compile(r"selected slot by (LCP similarity|LRU|id)")


def elapsed_seconds(stamp: str) -> float | None:
    """llama.cpp's log clock: ``mm.ss.ms.us`` (``0.13.116.678``) or ``s.us`` (``20.410333``)."""
    parts = stamp.split(".")
    try:
        if len(parts) == 4:
            m, s, ms, us = (int(p) for p in parts)
            return m * 60 + s + ms / 1e3 + us / 1e6
        if len(parts) == 2:
            return float(stamp)
    except ValueError:
        return None
    return None


@dataclass
class IdleSave:
    slot: int | None
    ms: float
    at: float  # epoch seconds when seen


@dataclass
class HealthFigures:
    idle_saves: deque[IdleSave] = field(default_factory=lambda: deque(maxlen=IDLE_SAVES_KEPT))  # the newest
    idle_save_count: int = 0  # every idle-slot save seen
    full_reprocess: Counter = field(default_factory=Counter)  # slot -> count
    checkpoints_created: int = 0
    checkpoints_erased: int = 0
    checkpoints_restored: int = 0  # rolled back to a checkpoint for a request
    sidecar_checkpoints_loaded: int = 0  # restored from a sidecar at slot restore
    slot_selection: Counter = field(default_factory=Counter)  # "similarity" / "LRU" / "id" -> count

    idle_buckets: list[int] = field(default_factory=lambda: [0] * len(BUCKETS_MS))  # counts per BUCKETS_MS
    worst_idle_save_ms: float | None = None

    def add_idle_save(self, save: IdleSave) -> None:
        self.idle_saves.append(save)
        self.idle_save_count += 1
        if self.worst_idle_save_ms is None or save.ms > self.worst_idle_save_ms:
            self.worst_idle_save_ms = save.ms
        for i, bound in enumerate(BUCKETS_MS):
            if save.ms <= bound:
                self.idle_buckets[i] += 1
                break

    def histogram(self) -> list[tuple[float, int]]:
        """(bucket upper bound in ms, idle-slot saves that took at most that long and more than the previous)."""
        return list(zip(BUCKETS_MS, self.idle_buckets))


class CacheHealth:
    """Runtime detectors over one server's log (and its crash outcome)."""

    def __init__(self, *, stall_ms: float = STALL_MS, clock: Callable[[], float] = time.time):
        self.stall_ms = stall_ms
        self.clock = clock
        self.figures = HealthFigures()
        self.findings: list[Finding] = []
        self._listeners: Observers[[Finding]] = Observers("cache health findings")
        self._pending_idle: tuple[int | None, float | None] | None = None  # (slot, elapsed s) of a save in progress
        self._reprocess_reported: set[int] = set()

    def on_finding(self, cb: Callable[[Finding], None]) -> None:
        self._listeners.add(cb)

    def _add(self, finding: Finding) -> None:
        self.findings.append(finding)
        self._listeners.emit(finding)  # a listener that fails is logged (with the finding): log handling goes on

    # -- feeding ------------------------------------------------------------------
    def feed_lines(self, lines) -> None:
        for line in lines:
            self.feed(line)

    def feed(self, item) -> None:
        """A LogEvent, a supervisor LogLine or a raw line."""
        ev = item if isinstance(item, LogEvent) else getattr(item, "event", None)
        if ev is None:
            ev = parse_line(str(item))
        self._close_idle_save(ev)
        kind = ev.kind
        if kind is Kind.IDLE_SLOT_SAVE:
            self._pending_idle = (ev.slot, elapsed_seconds(ev.elapsed))
        elif isinstance(ev, PromptCacheUpdate):
            # the other call site (a slot taken over by LRU): the server times it itself
            self._idle_save(None, ev.ms)
        elif kind is Kind.FULL_REPROCESS and ev.slot is not None:
            self.figures.full_reprocess[ev.slot] += 1
            if ev.slot not in self._reprocess_reported:
                self._reprocess_reported.add(ev.slot)
                self._add(Finding(
                    "forced-full-reprocess", Severity.WARNING,
                    f"slot {ev.slot} re-processed its whole prompt: the cache could not be rolled back (a "
                    "sliding-window or hybrid model with no covering context checkpoint). After a resume this "
                    "means the restore bought nothing; during a chat it means the client changed earlier text.",
                    source="llama.cpp #25913, turboquant #206", slot=ev.slot, at=self.clock()))
        elif kind is Kind.CHECKPOINT_CREATED:
            self.figures.checkpoints_created += 1
        elif kind is Kind.CHECKPOINT_RESTORED:
            self.figures.checkpoints_restored += 1
        elif isinstance(ev, SidecarRestored):
            self.figures.sidecar_checkpoints_loaded += ev.count
        elif isinstance(ev, SlotSelected):
            how = ev.how.split(",")[0].split(" (")[0].strip()
            self.figures.slot_selection["similarity" if "similarity" in how else how or "other"] += 1
        elif kind is Kind.GGML_ASSERT:
            pass  # judged with the outcome: the process is gone then
        else:
            text = ev.text or ev.line
            if "checkpoint" in text and _ERASED.search(text):  # substring first: a flood is mostly other lines
                self.figures.checkpoints_erased += 1
            elif kind is Kind.RAW and "selected slot" in text and _SELECTED.search(text):
                self.figures.slot_selection[_SELECTED.search(text).group(1).replace("LCP ", "")] += 1

    def _close_idle_save(self, ev: LogEvent) -> None:
        """An idle-slot save lasts until the server's next line (build 11434 logs no end line)."""
        if self._pending_idle is None or ev.kind is Kind.IDLE_SLOT_SAVE and ev.elapsed == "":
            return
        if ev.func.strip() == "prompt_save" or "saving prompt with length" in ev.text:
            return  # logged before the copy starts: the save lasts until the line after it
        if ev.kind is Kind.PROMPT_CACHE_UPDATE:
            self._pending_idle = None  # another save, timed by the server itself
            return
        slot, start = self._pending_idle
        end = elapsed_seconds(ev.elapsed) if ev.elapsed else None
        if start is None or end is None:
            return  # an untimestamped continuation line: keep waiting
        self._pending_idle = None
        if 0.0 <= end - start < 3600.0:  # else a clock from another run: no figure
            self._idle_save(slot, (end - start) * 1000.0)

    def _idle_save(self, slot: int | None, ms: float) -> None:
        self.figures.add_idle_save(IdleSave(slot, ms, self.clock()))
        if ms >= self.stall_ms:
            self._add(Finding(
                "idle-slot-save-stall", Severity.WARNING,
                f"saving an idle slot to the prompt cache took {ms:,.0f} ms, and every stream waits meanwhile "
                "(unified KV with --cache-idle-slots; seed 004 measured 0.7-0.9 s per save). A build with "
                "llama.cpp #31391 fixes it; until then drop one of the two.",
                REMEDIES_IDLE_STALL, "seed 004, llama.cpp #30252 (fixed by #31391)", slot=slot, at=self.clock(),
                details={"ms": ms}))

    def crashed(self, outcome) -> Finding:
        """The server died: the cause mapped to the known issue and its remedy."""
        text = " ".join([outcome.detail or "", *getattr(outcome, "last_lines", ())])
        if ASSERT_TENSOR in text:
            f = Finding(
                "rpc-prompt-cache-assert", Severity.ERROR,
                "llama-server aborted with GGML_ASSERT(tensor->data != NULL && \"tensor not allocated\"): the "
                "prompt cache saved an idle slot whose KV cache is on a backend it cannot read directly (RPC "
                "workers), which happens once there are two or more slots. --no-cache-prompt does not help; "
                "--cache-ram 0 (or -np 1) does, and in-slot prefix reuse keeps working.",
                REMEDIES_RPC_ASSERT, "seed 002, llama.cpp #26128", at=self.clock(),
                details={"summary": outcome.summary()})
        else:
            f = Finding("server-crashed", Severity.ERROR, f"the server stopped unexpectedly: {outcome.summary()}",
                        at=self.clock(), details={"summary": outcome.summary()})
        self._add(f)
        return f

    @property
    def worst(self) -> Severity | None:
        return max((f.severity for f in self.findings), key=lambda s: s.rank, default=None)
