"""Why a restore's tokens were not reused: the reason a DISCARDED verdict gives, in its order.

:func:`app.core.verdict.judge` decides the verdict; when it is DISCARDED (a restore whose tokens
the first query did not reuse), :func:`why_discarded` picks the reason the user needs from what
is known, trying the reasons in this order (the first that fits is said):

1. the build's own sidecar loader refused the sidecar (:mod:`app.core.sidecar_behaviour`);
2. no sidecar, and the build made a tip checkpoint instead (it cannot serve a rollback);
3. no sidecar on a build that keeps no checkpoints across a restore;
4. a sidecar is there but the server runs with ``--ctx-checkpoints 0`` (it is not read);
5. no sidecar on a build that does not persist context checkpoints;
6. no sidecar next to the state file;
7. the sidecar is invalid;
8. the sidecar is there and the server did not load it (or this build does not persist checkpoints);
9. checkpoints were loaded, none covers the resume point (the new prompt diverged, when known);
10. the sidecar was not used: none covers the resume point, or the build does not read sidecars;
11. the new prompt diverged early from the saved tokens;
12. a dense model (no checkpoint needed) did not reuse the tokens;
13. the log said it forced a full re-processing;
14. else: the server did not reuse the restored tokens.

A proxied request's causes (a slot taken, a restart, an edited message ...) have their own order
in :mod:`app.proxy.explain`. Pure: no I/O.
"""

from __future__ import annotations

from typing import Any, Protocol

TAIL = "so the restored cache was discarded"


def count(x: int | None) -> str:
    return f"{x:,}" if x is not None else "?"


def plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def status_of(s) -> str:
    """A sidecar status (a :class:`app.core.states.SidecarStatus` or its text) as lower-case text."""
    s = getattr(s, "value", s)
    return str(s or "").lower()


class RestoreFacts(Protocol):
    """What :func:`why_discarded` reads of a restore: the fields of :class:`app.core.verdict.Reuse`
    that say why. Named here, so that the judge imports its reasons and not the reverse."""

    @property
    def reusable(self) -> int | None: ...
    @property
    def common_prefix(self) -> int | None: ...
    @property
    def full_reprocess_logged(self) -> bool: ...
    @property
    def sidecar_status(self) -> Any: ...
    @property
    def sidecar_loaded_count(self) -> int | None: ...
    @property
    def sidecar_count(self) -> int | None: ...
    @property
    def build_persists(self) -> bool | None: ...
    @property
    def ctx_checkpoints(self) -> int | None: ...
    @property
    def behaviour(self) -> Any: ...
    @property
    def prediction(self) -> Any: ...


def why_discarded(e: RestoreFacts, diverged: bool) -> str:
    """The reason a restore of ``e.reusable`` tokens was discarded, ending in :data:`TAIL`.
    ``diverged``: the new prompt left the saved tokens before the tolerance of their end."""
    from app.core.sidecar_behaviour import Behaviour, discard_reason

    status, loaded, n = status_of(e.sidecar_status), e.sidecar_loaded_count, e.reusable
    present = status.startswith("present")
    b = Behaviour(str(getattr(e.behaviour, "value", e.behaviour) or "unknown"))
    refused = discard_reason(b, e.prediction) if not loaded else None
    tip = e.prediction is not None and getattr(e.prediction, "tip", False) and not loaded
    if refused:
        return f"{refused}, {TAIL}"
    if status == "missing" and tip:
        return (f"there is no checkpoint sidecar next to the state file: this build made a tip checkpoint "
                f"over the restored tokens instead, which cannot serve a rollback before the tip, {TAIL}")
    if status == "missing" and b is Behaviour.NONE:
        return f"this build does not persist context checkpoints (no sidecar), {TAIL}"
    if present and e.ctx_checkpoints == 0:
        return f"the sidecar was not loaded because the server runs with --ctx-checkpoints 0, {TAIL}"
    if status == "missing" and e.build_persists is False:
        return f"this build does not persist context checkpoints (no sidecar), {TAIL}"
    if status == "missing":
        return f"there is no checkpoint sidecar next to the state file, {TAIL}"
    if status == "invalid":
        return f"the checkpoint sidecar is invalid, {TAIL}"
    if present and not loaded and (e.build_persists is False or loaded == 0):
        if e.build_persists is False:
            return f"this build does not persist context checkpoints (it did not load the sidecar), {TAIL}"
        return f"the server did not load the sidecar's checkpoints, {TAIL}"
    if present and loaded and diverged:
        return (f"no loaded checkpoint covers the resume point: the new prompt leaves the saved tokens at "
                f"token {count(e.common_prefix)} of {count(n)}, {TAIL}")
    if present and loaded:
        return f"none of the {plural(loaded, 'loaded checkpoint')} covers the resume point, {TAIL}"
    if present and not diverged:
        held = f" ({plural(e.sidecar_count, 'checkpoint')} in the file)" if e.sidecar_count else ""
        return (f"the server did not use the sidecar's checkpoints{held}: none covers the resume point, "
                f"or this build does not read sidecars, {TAIL}")
    if diverged:
        return f"the new prompt diverged from the saved tokens at token {count(e.common_prefix)} of {count(n)}, {TAIL}"
    if status == "not needed":
        return f"the server did not reuse the restored tokens (a dense model needs no checkpoint), {TAIL}"
    if e.full_reprocess_logged:
        return f"the server logged a forced full prompt re-processing, {TAIL}"
    return f"the server did not reuse the restored tokens, {TAIL}"
