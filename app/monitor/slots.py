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

__all__ = ["SlotRow", "slot_rows", "SlotsUnavailable", "slots_state_from_error"]


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
    restored: Mapping[int, tuple[int, str | None]] | None = None,
) -> list[SlotRow]:
    """One :class:`SlotRow` per slot object; never raises on odd JSON.

    ``restored[slot_id] = (n_tokens, session_name)`` from the app's restore
    responses. When the slot JSON carries a prompt count (the slot ran a task)
    that count wins; otherwise the restored count is shown and marked
    ``tokens_known_from_restore=True``.
    """
    restored = restored or {}
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
        r_tokens: int | None = None
        r_session: str | None = None
        if isinstance(entry, (tuple, list)) and entry:
            r_tokens = _int(entry[0])
            r_session = entry[1] if len(entry) > 1 and isinstance(entry[1], str) else None

        if n_prompt is not None:
            tokens_held: int | None = n_prompt + (n_decoded or 0)
            from_restore = False
        elif r_tokens is not None:
            tokens_held = r_tokens
            from_restore = True
        else:
            tokens_held = None
            from_restore = False

        rows.append(
            SlotRow(
                id=sid,
                n_ctx=_int(slot.get("n_ctx")),
                busy=_busy(slot),
                tokens_held=tokens_held,
                tokens_known_from_restore=from_restore,
                n_prompt_tokens=n_prompt,
                n_cached=_int(slot.get("n_prompt_tokens_cache")),
                n_processed=_int(slot.get("n_prompt_tokens_processed")),
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
    FAILED_PREFIX = "GET /slots failed: "

    @classmethod
    def failed(cls, reason: str) -> str:
        return f"{cls.FAILED_PREFIX}{reason}"


_NO_SLOTS_MARKERS = ("does not support slots endpoint", "not_supported_error")


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
