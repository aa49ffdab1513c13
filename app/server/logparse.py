"""The one llama-server log parser: a line in, a typed event out.

Line format (build 11434): ``<elapsed> <L> <component> <func>: <text>``, e.g.
``0.56.866.079 I slot      release: id 31 | task 0 | stop processing: ...``.
Slot lines carry ``id N | task M |``. Unknown lines become ``RAW`` events and
are never an error: builds drift and forks add lines.

Every event is a frozen :class:`LogEvent` (``kind``, ``slot``, ``task``, ``line``,
``text``, ...); a kind that carries figures is a subclass with them as typed
attributes (:data:`EVENT_CLASSES`): ``isinstance(ev, PromptEval)`` then
``ev.n_tokens`` and ``ev.ms``.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from app.core.checkpoints import CheckpointFigures


class Kind(str, enum.Enum):
    RAW = "raw"
    MODEL_LOADED = "model_loaded"
    LISTENING = "listening"
    ALL_IDLE = "all_idle"
    CLEANING_UP = "cleaning_up"  # "cleaning up before exit": the server's loop has ended (a SIGTERM)
    SLOT_SELECTED = "slot_selected"
    TASK_STARTED = "task_started"
    NEW_PROMPT = "new_prompt"
    PROMPT_PROGRESS = "prompt_progress"
    PROMPT_EVAL = "prompt_eval"
    EVAL = "eval"
    TOTAL = "total"
    RELEASE = "release"
    FULL_REPROCESS = "full_reprocess"
    CHECKPOINT_RESTORED = "checkpoint_restored"
    CHECKPOINT_CREATED = "checkpoint_created"
    IDLE_SLOT_SAVE = "idle_slot_save"
    PROMPT_CACHE_UPDATE = "prompt_cache_update"
    SIDECAR_SAVED = "sidecar_saved"
    SIDECAR_RESTORED = "sidecar_restored"
    SIDECAR_WRITE_FAILED = "sidecar_write_failed"
    SIDECAR_IGNORED = "sidecar_ignored"  # a strict loader refused the file (not every build says so)
    SIDECAR_MODE = "sidecar_mode"  # KV Valet's build: "checkpoint sidecars: v2|fork|port" at start
    GGML_ASSERT = "ggml_assert"
    BIND_FAILED = "bind_failed"
    MODEL_LOAD_FAILED = "model_load_failed"
    OUT_OF_MEMORY = "out_of_memory"
    SLOT_CONTEXT = "slot_context"
    BUILD_INFO = "build_info"
    ERROR = "error"


@dataclass(frozen=True)
class LogEvent:
    """One parsed line. A kind with figures is a subclass below with them as typed
    attributes (``isinstance(ev, PromptEval)`` and ``ev.n_tokens``); a kind without
    figures (RAW, MODEL_LOADED, ALL_IDLE, ...) is a plain LogEvent."""

    kind: Kind
    text: str  # the message part (or the whole line for RAW)
    line: str
    level: str = ""  # I W E D, "" when unknown
    elapsed: str = ""
    component: str = ""
    func: str = ""
    slot: int | None = None
    task: int | None = None


@dataclass(frozen=True, kw_only=True)
class TimingLine(LogEvent):
    """``prompt eval time = 11052.83 ms / 2885 tokens (...)`` and its two siblings."""

    ms: float
    n_tokens: int
    tokens_per_s: float | None  # None when the line says 0 ms


@dataclass(frozen=True, kw_only=True)
class PromptEval(TimingLine):
    """``prompt eval time = ... ms / N tokens``: the prompt tokens a task processed."""


@dataclass(frozen=True, kw_only=True)
class Eval(TimingLine):
    """``eval time = ... ms / N tokens``: the tokens a task generated."""


@dataclass(frozen=True, kw_only=True)
class Total(TimingLine):
    """``total time = ... ms / N tokens``."""


@dataclass(frozen=True, kw_only=True)
class PromptProgress(LogEvent):
    n_tokens: int
    progress: float


@dataclass(frozen=True, kw_only=True)
class FullReprocess(LogEvent):
    reason: str  # after ``forcing full prompt re-processing due to``


@dataclass(frozen=True, kw_only=True)
class CheckpointRestored(LogEvent):
    checkpoint: CheckpointFigures


@dataclass(frozen=True, kw_only=True)
class CheckpointCreated(LogEvent):
    index: int  # ``created context checkpoint INDEX of LIMIT (...)``
    limit: int
    checkpoint: CheckpointFigures


@dataclass(frozen=True, kw_only=True)
class SidecarSaved(LogEvent):
    count: int  # ``saved N context checkpoints to sidecar``


@dataclass(frozen=True, kw_only=True)
class SidecarRestored(LogEvent):
    count: int  # ``restored N context checkpoints from sidecar``


@dataclass(frozen=True, kw_only=True)
class SidecarWriteFailed(LogEvent):
    path: str


@dataclass(frozen=True, kw_only=True)
class SidecarIgnored(LogEvent):
    reason: str  # ``ignoring checkpoint sidecar: REASON (PATH)``
    path: str


@dataclass(frozen=True, kw_only=True)
class SidecarMode(LogEvent):
    mode: str  # ``checkpoint sidecars: v2|fork|port``


@dataclass(frozen=True, kw_only=True)
class PromptCacheUpdate(LogEvent):
    ms: float


@dataclass(frozen=True, kw_only=True)
class Release(LogEvent):
    n_tokens: int  # ``stop processing: n_tokens = N``


@dataclass(frozen=True, kw_only=True)
class SlotSelected(LogEvent):
    how: str  # after ``selected slot by``


@dataclass(frozen=True, kw_only=True)
class NewPrompt(LogEvent):
    n_ctx_slot: int
    n_keep: int
    n_tokens: int  # ``task.n_tokens``: the whole prompt


@dataclass(frozen=True, kw_only=True)
class SlotContext(LogEvent):
    n_ctx: int


@dataclass(frozen=True, kw_only=True)
class Listening(LogEvent):
    url: str


@dataclass(frozen=True, kw_only=True)
class BindFailed(LogEvent):
    host: str
    port: int


@dataclass(frozen=True, kw_only=True)
class ModelLoadFailed(LogEvent):
    detail: str


@dataclass(frozen=True, kw_only=True)
class GgmlAssert(LogEvent):
    assertion: str  # the ``GGML_ASSERT(...) failed`` / ``GGML_ABORT`` / ``terminate called`` text


#: The class of each kind that carries figures; every other kind is a plain LogEvent.
EVENT_CLASSES: dict[Kind, type[LogEvent]] = {
    Kind.PROMPT_EVAL: PromptEval, Kind.EVAL: Eval, Kind.TOTAL: Total, Kind.PROMPT_PROGRESS: PromptProgress,
    Kind.FULL_REPROCESS: FullReprocess, Kind.CHECKPOINT_RESTORED: CheckpointRestored,
    Kind.CHECKPOINT_CREATED: CheckpointCreated, Kind.SIDECAR_SAVED: SidecarSaved,
    Kind.SIDECAR_RESTORED: SidecarRestored, Kind.SIDECAR_WRITE_FAILED: SidecarWriteFailed,
    Kind.SIDECAR_IGNORED: SidecarIgnored, Kind.SIDECAR_MODE: SidecarMode,
    Kind.PROMPT_CACHE_UPDATE: PromptCacheUpdate, Kind.RELEASE: Release, Kind.SLOT_SELECTED: SlotSelected,
    Kind.NEW_PROMPT: NewPrompt, Kind.SLOT_CONTEXT: SlotContext, Kind.LISTENING: Listening,
    Kind.BIND_FAILED: BindFailed, Kind.MODEL_LOAD_FAILED: ModelLoadFailed, Kind.GGML_ASSERT: GgmlAssert,
}


_PREFIX = re.compile(
    r"^(?P<elapsed>\d+\.\d+\.\d+\.\d+|\d+\.\d+)\s+(?P<level>[IWED])\s+"
    r"(?P<component>\S+)\s+(?P<func>[^:]+?):\s?(?P<text>.*)$"
)
_SLOT = re.compile(r"^id\s+(?P<slot>-?\d+)\s*\|\s*task\s+(?P<task>-?\d+)\s*\|\s?(?P<rest>.*)$")
_NUM = r"(-?\d+(?:\.\d+)?)"


def _f(s: str) -> float | int:
    return float(s) if "." in s else int(s)


_KV = re.compile(r"(?<!\w)(\w+)\s*=\s*" + _NUM)  # (?<!\w): a key starts a word (else quadratic on a long word)


def _kv(text: str) -> dict:
    return {k: _f(v) for k, v in _KV.findall(text)}


# (kind, pattern) tried in order against the message text.
_RULES: list[tuple[Kind, re.Pattern]] = [
    (Kind.PROMPT_EVAL, re.compile(r"^\s*prompt eval time =\s*" + _NUM + r" ms /\s*(\d+) tokens")),
    (Kind.EVAL, re.compile(r"^\s*eval time =\s*" + _NUM + r" ms /\s*(\d+) tokens")),
    (Kind.TOTAL, re.compile(r"^\s*total time =\s*" + _NUM + r" ms /\s*(\d+) tokens")),
    (Kind.PROMPT_PROGRESS, re.compile(r"prompt processing, n_tokens =\s*(\d+), progress =\s*" + _NUM)),
    (Kind.FULL_REPROCESS, re.compile(r"forcing full prompt re-processing due to (.*)")),
    (Kind.CHECKPOINT_RESTORED, re.compile(r"restored context checkpoint \((.*)\)")),
    (Kind.CHECKPOINT_CREATED, re.compile(r"created context checkpoint (\d+) of (\d+) \((.*)\)")),
    (Kind.SIDECAR_SAVED, re.compile(r"saved (\d+) context checkpoints? to sidecar")),
    (Kind.SIDECAR_RESTORED, re.compile(r"restored (\d+) context checkpoints? from sidecar")),
    (Kind.SIDECAR_WRITE_FAILED, re.compile(r"failed to write checkpoint sidecar\s*(.*)")),
    (Kind.SIDECAR_IGNORED, re.compile(r"ignoring checkpoint sidecar: (.*) \((.*)\)\s*$")),
    (Kind.SIDECAR_MODE, re.compile(r"^checkpoint sidecars: (\w+)")),
    (Kind.IDLE_SLOT_SAVE, re.compile(r"saving idle slot to prompt cache")),
    (Kind.PROMPT_CACHE_UPDATE, re.compile(r"prompt cache update took " + _NUM + r" ms")),
    (Kind.RELEASE, re.compile(r"stop processing: n_tokens =\s*(\d+)")),
    (Kind.SLOT_SELECTED, re.compile(r"selected slot by (.*)")),
    (Kind.TASK_STARTED, re.compile(r"processing task")),
    (Kind.NEW_PROMPT, re.compile(r"new prompt, n_ctx_slot =\s*(\d+), n_keep =\s*(\d+), task\.n_tokens =\s*(\d+)")),
    (Kind.SLOT_CONTEXT, re.compile(r"new slot, n_ctx =\s*(\d+)")),
    (Kind.MODEL_LOADED, re.compile(r"^model loaded")),
    (Kind.LISTENING, re.compile(r"listening on (\S+)")),
    (Kind.ALL_IDLE, re.compile(r"all slots are idle")),
    (Kind.CLEANING_UP, re.compile(r"cleaning up before exit")),
    (Kind.BIND_FAILED, re.compile(r"couldn't bind HTTP server socket, hostname: (\S+), port: (\d+)")),
    (Kind.MODEL_LOAD_FAILED, re.compile(r"(failed to load model|error loading model|exiting due to model loading error)(.*)")),
    (Kind.OUT_OF_MEMORY, re.compile(r"(out of memory|failed to allocate|unable to allocate|cudaMalloc failed)", re.I)),
    (Kind.BUILD_INFO, re.compile(r"build (\d+|info)\b.*?(\(\w+\))?")),
]
_ASSERT = re.compile(r"(GGML_ASSERT\((.*)\) failed|GGML_ABORT\(?(.*)|ggml_abort|terminate called after throwing.*)")
# One cheap search that every rule above needs to match first: a -lv 4 flood is mostly
# lines no rule wants, and 25 searches a line cost the server log reader 10 us a line.
_ANY_RULE = re.compile(r"eval time|total time|prompt processing|forcing full|context checkpoint|checkpoint sidecar|idle slot|"
                       r"prompt cache update|stop processing|selected slot|processing task|new prompt|new slot|"
                       r"model loaded|load model|loading model|model loading|listening on|slots are idle|bind|"
                       r"out of memory|allocate|cudaMalloc|build|cleaning up", re.I)


def parse_line(line: str) -> LogEvent:
    line = line.rstrip("\r\n")
    m = _PREFIX.match(line)
    if m:
        level, component, func, text = m.group("level"), m.group("component"), m.group("func").strip(), m.group("text")
        elapsed = m.group("elapsed")
    else:
        level, component, func, text, elapsed = "", "", "", line, ""
    slot = task = None
    sm = _SLOT.match(text)
    # ids, not numbers of thousands of digits (int() refuses more than 4,300)
    if sm and len(sm.group("slot")) + len(sm.group("task")) <= 40:
        slot, task, text_body = int(sm.group("slot")), int(sm.group("task")), sm.group("rest")
    else:
        text_body = text

    am = _ASSERT.search(line) if ("GGML" in line or "abort" in line or "terminate" in line) else None
    if am:
        return GgmlAssert(Kind.GGML_ASSERT, am.group(0), line, level or "E", elapsed, component, func, slot, task,
                          assertion=am.group(0))

    for kind, rx in (_RULES if _ANY_RULE.search(text_body) else ()):
        r = rx.search(text_body)
        if not r:
            continue
        try:
            fields = _fields(kind, r, text_body)
        except (ValueError, OverflowError):  # over 4,300 digits, or past a float: not a line this rule knows
            continue
        if kind == Kind.BUILD_INFO and not (component == "cmn" or "common_params_print_info" in line):
            continue
        return EVENT_CLASSES.get(kind, LogEvent)(kind, text_body, line, level, elapsed, component, func, slot, task,
                                                 **fields)
    if level == "E":
        return LogEvent(Kind.ERROR, text_body, line, level, elapsed, component, func, slot, task)
    if not m and _looks_like_error(line):
        return LogEvent(Kind.ERROR, line, line)
    return LogEvent(Kind.RAW, text_body, line, level, elapsed, component, func, slot, task)


def _fields(kind: Kind, r: re.Match, text: str) -> dict:
    """The keyword arguments of the kind's class (EVENT_CLASSES) from the rule's match."""
    g = r.groups()
    if kind in (Kind.PROMPT_EVAL, Kind.EVAL, Kind.TOTAL):
        ms, n = float(g[0]), int(g[1])
        return {"ms": ms, "n_tokens": n, "tokens_per_s": (n / ms * 1000.0) if ms > 0 else None}
    if kind == Kind.PROMPT_PROGRESS:
        return {"n_tokens": int(g[0]), "progress": float(g[1])}
    if kind == Kind.FULL_REPROCESS:
        return {"reason": g[0]}
    if kind == Kind.CHECKPOINT_RESTORED:
        return {"checkpoint": CheckpointFigures.from_pairs(_kv(g[0]))}
    if kind == Kind.CHECKPOINT_CREATED:
        return {"index": int(g[0]), "limit": int(g[1]), "checkpoint": CheckpointFigures.from_pairs(_kv(g[2]))}
    if kind in (Kind.SIDECAR_SAVED, Kind.SIDECAR_RESTORED):
        return {"count": int(g[0])}
    if kind == Kind.SIDECAR_WRITE_FAILED:
        return {"path": g[0].strip()}
    if kind == Kind.SIDECAR_IGNORED:
        return {"reason": g[0].strip(), "path": g[1].strip()}
    if kind == Kind.SIDECAR_MODE:
        return {"mode": g[0]}
    if kind == Kind.PROMPT_CACHE_UPDATE:
        return {"ms": float(g[0])}
    if kind == Kind.RELEASE:
        return {"n_tokens": int(g[0])}
    if kind == Kind.SLOT_SELECTED:
        return {"how": g[0]}
    if kind == Kind.NEW_PROMPT:
        return {"n_ctx_slot": int(g[0]), "n_keep": int(g[1]), "n_tokens": int(g[2])}
    if kind == Kind.SLOT_CONTEXT:
        return {"n_ctx": int(g[0])}
    if kind == Kind.LISTENING:
        return {"url": g[0]}
    if kind == Kind.BIND_FAILED:
        return {"host": g[0].rstrip(","), "port": int(g[1])}
    if kind == Kind.MODEL_LOAD_FAILED:
        return {"detail": text}
    return {}


def _looks_like_error(line: str) -> bool:
    low = line.lower()
    return low.startswith("error") or "error:" in low or "illegal instruction" in low
