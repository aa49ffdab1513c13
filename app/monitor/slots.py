"""Pure functions over the JSON of llama-server's ``GET /slots``.

Shape (build 11434, see shared/reference/llama-server.md): one object per slot
with ``id``, ``n_ctx``, ``speculative``, ``is_processing`` always, and
``id_task``, ``n_prompt_tokens``, ``n_prompt_tokens_processed``,
``n_prompt_tokens_cache``, ``params``, ``next_token[0].n_decoded`` only once
the slot has run a task. Older builds had ``n_tokens`` (and ``n_past``)
instead of ``n_prompt_tokens`` and ``next_token`` as a plain object.

After ``POST /slots/{id}?action=restore`` the slot has no task, so ``/slots``
does not show the restored tokens: the app keeps ``n_restored`` from the
restore response and passes it here as ``restored``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from app.core.verdict import Verdict

__all__ = ["SlotRow", "slot_rows", "RestoredSlot", "LastTask", "SlotsUnavailable", "slots_state_from_error",
           "held_tokens", "is_held", "held_count"]


@dataclass
class RestoredSlot:
    """What the app restored into a slot: /slots cannot show it (no task ran yet)."""

    n_tokens: int
    session: str | None = None
    # id_task /slots showed at restore time: build 11434 keeps the previous task's
    # id and counts after a restore, so only a *different* id means a task ran since.
    id_task: int | None = None
    verdict: Verdict | None = None

    @property
    def caption(self) -> str | None:
        """The session, with its verdict once the first query was judged."""
        if self.verdict is None:
            return self.session
        figures = ""
        if self.verdict.prompt_n is not None and self.verdict.cache_n is not None:
            figures = f" (cache_n {self.verdict.cache_n:,}, prompt_n {self.verdict.prompt_n:,})"
        return f"{self.session or 'restored'} — {self.verdict.kind}{figures}"


@dataclass(frozen=True)
class LastTask:
    """A slot's last task as the log tells it: /slots reports 0 cached and 0
    processed once the task is released (build 11434)."""

    task: int
    n_prompt: int | None = None
    n_cached: int | None = None
    n_processed: int | None = None


@dataclass(frozen=True)
class SlotRow:
    id: int | None
    n_ctx: int | None
    busy: bool
    # prompt + decoded tokens of the last task, or the restored count, or
    # None when unknown (a slot that never ran a task and was not restored).
    tokens_held: int | None
    tokens_known_from_restore: bool
    n_prompt_tokens: int | None
    n_cached: int | None
    n_processed: int | None
    n_decoded: int | None
    id_task: int | None
    session: str | None

    @property
    def fill_fraction(self) -> float | None:
        if self.tokens_held is None or not self.n_ctx:
            return None
        return self.tokens_held / self.n_ctx


def held_tokens(row: SlotRow) -> int:
    """Tokens the slot holds (the restored count while no task ran since the restore); 0 when unknown."""
    return int(row.tokens_held or 0)


def is_held(row: SlotRow) -> bool:
    """The one "held" rule: a slot is held (in use) when it runs a task or holds tokens. The status
    line, the server list's rows, a host's status and the Monitor count slots by it."""
    return bool(row.busy) or held_tokens(row) > 0


def held_count(rows) -> int:
    """How many of ``rows`` are held (:func:`is_held`)."""
    return sum(1 for r in rows if is_held(r))


def _int(v: Any) -> int | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            return None
    return None


def _n_decoded(slot: Mapping[str, Any]) -> int | None:
    nt = slot.get("next_token")
    if isinstance(nt, list):
        nt = nt[0] if nt else None
    if isinstance(nt, Mapping):
        return _int(nt.get("n_decoded"))
    return None


def _busy(slot: Mapping[str, Any]) -> bool:
    if "is_processing" in slot:
        return bool(slot.get("is_processing"))
    # Builds before is_processing had "state": 0 idle, 1 processing.
    return _int(slot.get("state")) not in (None, 0)


def slot_rows(
    slots_json: Any,
    restored: Mapping[int, RestoredSlot] | None = None,
    last_tasks: Mapping[int, LastTask] | None = None,
) -> list[SlotRow]:
    """One :class:`SlotRow` per slot object; never raises on odd JSON.

    ``restored[slot_id]`` comes from the app's restore responses: while no task
    ran on the slot since the restore, its count is shown and marked
    ``tokens_known_from_restore=True``; after one, the live counts win.
    ``last_tasks[slot_id]`` (from the log) fills the cached/processed counts
    that /slots zeroes when a task is released.
    """
    restored = restored or {}
    last_tasks = last_tasks or {}
    if not isinstance(slots_json, (list, tuple)):
        return []
    rows: list[SlotRow] = []
    for slot in slots_json:
        if not isinstance(slot, Mapping):
            continue
        sid = _int(slot.get("id"))
        n_prompt = _int(slot.get("n_prompt_tokens"))
        if n_prompt is None:
            n_prompt = _int(slot.get("n_tokens"))  # older builds
        if n_prompt is None:
            n_prompt = _int(slot.get("n_past"))  # older still
        n_decoded = _n_decoded(slot)
        id_task = _int(slot.get("id_task"))
        if id_task is not None and id_task < 0:
            id_task = None  # older builds: -1 = no task
        entry = restored.get(sid) if sid is not None else None
        r_session = entry.caption if entry is not None else None
        # A task ran since the restore when /slots shows a task id other than the
        # one it showed at restore time: then the live counts are the truth.
        fresh = entry is not None and (id_task is None or id_task == entry.id_task)

        if fresh:
            tokens_held: int | None = entry.n_tokens
            from_restore = True
        elif n_prompt is not None:
            # build 11434 adds each sampled token to the prompt tokens as it goes:
            # n_prompt_tokens already counts what was decoded
            tokens_held = n_prompt
            from_restore = False
        else:
            tokens_held = None
            from_restore = False
        n_cached = _int(slot.get("n_prompt_tokens_cache"))
        n_processed = _int(slot.get("n_prompt_tokens_processed"))
        last = last_tasks.get(sid) if sid is not None else None
        if last is not None and not _busy(slot) and (id_task is None or last.task == id_task) and not from_restore:
            # released: /slots says 0 and 0, the log kept the real figures
            n_cached = last.n_cached if last.n_cached is not None else n_cached
            n_processed = last.n_processed if last.n_processed is not None else n_processed

        rows.append(
            SlotRow(
                id=sid,
                n_ctx=_int(slot.get("n_ctx")),
                busy=_busy(slot),
                tokens_held=tokens_held,
                tokens_known_from_restore=from_restore,
                n_prompt_tokens=n_prompt,
                n_cached=n_cached,
                n_processed=n_processed,
                n_decoded=n_decoded,
                id_task=id_task,
                session=r_session,
            )
        )
    return rows


class SlotsUnavailable:
    """Why the slot table is empty: the reason strings the UI/CLI show."""

    # llama.cpp answers GET /slots with 501 not_supported_error "This server
    # does not support slots endpoint. Start it with `--slots`" (older builds
    # stop after "endpoint.") when started with --no-slots.
    NO_SLOTS = "the server was started with --no-slots: slot monitoring is off"
    # a router (a server started without a model) answers /slots only for a "model" it is asked of
    ROUTER = ("the server is a router (started without a model): each model's slots are in its own child "
              "server, which the router starts and stops; KV Valet does not show, park or resume them")
    FAILED_PREFIX = "GET /slots failed: "

    @classmethod
    def failed(cls, reason: str) -> str:
        return f"{cls.FAILED_PREFIX}{reason}"


_NO_SLOTS_MARKERS = ("does not support slots endpoint", "not_supported_error")
#: a router's answer to GET /slots without ?model= (build 11434, server-models.cpp router_validate_model)
ROUTER_MARKER = "model name is missing from the request"


def _message_of(x: Any) -> str:
    msg = getattr(x, "message", None)
    if msg is None and isinstance(x, Mapping):
        err = x.get("error")
        if isinstance(err, Mapping):
            msg = err.get("message")
            typ = err.get("type")
            if typ and msg:
                msg = f"{msg} ({typ})"
        elif isinstance(err, str):
            msg = err
    if msg is None and isinstance(x, BaseException):
        msg = str(x) or type(x).__name__
    if msg is None and isinstance(x, str):
        msg = x
    return "" if msg is None else str(msg)


def slots_state_from_error(exc_or_status: Any) -> str:
    """Turn a failed ``GET /slots`` into a reason string.

    Accepts an exception (``.status``/``.status_code`` and ``.message`` read
    with getattr), an HTTP status int, an error body dict, or a string.
    """
    x = exc_or_status
    if isinstance(x, bool):
        x = None
    status = x if isinstance(x, int) else None
    if status is None:
        status = _int(getattr(x, "status", None))
    if status is None:
        status = _int(getattr(x, "status_code", None))
    if status is None and isinstance(x, Mapping) and isinstance(x.get("error"), Mapping):
        status = _int(x["error"].get("code"))
    message = "" if isinstance(x, int) else _message_of(x)
    if status == 501 or any(m in message.lower() for m in _NO_SLOTS_MARKERS):
        return SlotsUnavailable.NO_SLOTS
    if status == 400 and ROUTER_MARKER in message.lower():
        return SlotsUnavailable.ROUTER
    if status is not None and message:
        reason = f"HTTP {status}: {message}"
    elif status is not None:
        reason = f"HTTP {status}"
    elif message:
        if isinstance(x, BaseException) and type(x).__name__ not in message:
            reason = f"{type(x).__name__}: {message}"
        else:
            reason = message
    else:
        reason = "unknown error"
    return SlotsUnavailable.failed(reason)
