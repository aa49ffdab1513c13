"""After a move: the session restored at its target and judged by a first query (issue #37, one door
to a server's slots). Any kind of server through the Sessions protocol's
:meth:`~app.sessions.protocol.Sessions.restore_judged` (a server here: its check; a host's: its
``kv-valet check --json``), so the window and the CLI ask the same way wherever the target is."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from app.sessions.protocol import Sessions


async def restore_and_judge(sessions: Sessions, name: str, slot: int | None = None, *,
                            output_check: bool = True) -> dict[str, Any]:
    """Restore ``name`` through ``sessions`` (the target server's) and judge a first query:
    ``{"slot_id", "n_restored", "verdict": {"kind", "reason"}, "report"}``. ``output_check`` False
    leaves out the comparison with a cold prefill (``--no-output-check``): the verdict then rests on
    the tokens and checkpoints reused, and costs no second prefill of the chat."""
    d = await sessions.restore_judged(name, slot, output_check=output_check)
    return {"slot_id": d.get("slot_id"), "n_restored": d.get("n_restored"), "verdict": d.get("verdict") or {},
            "report": d}


def verdict_text(restored: dict[str, Any]) -> str:
    """The restore's outcome in one sentence."""
    v = restored.get("verdict") or {}
    n = restored.get("n_restored")
    return (f"Restored into slot {restored.get('slot_id')} ({n:,} tokens); first query: {v.get('kind', '?')}"
            + (f" — {v['reason']}" if v.get("reason") else "") + ".") if n is not None else \
        f"Restore: {v.get('kind', '?')} {v.get('reason', '')}".strip()
