"""What a restore needs, from the model's memory kind and the flags of the server it runs on.

One answer for every face (park warnings, the resume preflight, ``doctor``'s profile rules, the
built-server offer, the session's sidecar status, the proxy's restore decision):

* dense attention keeps every position, so a restore can roll back anywhere: no checkpoints;
* sliding-window attention keeps only a window, so a rollback needs a context checkpoint, unless
  the server runs ``--swa-full`` (a full-size window cache: every position is kept, as dense;
  build 11434 then sets ``n_swa = 0``, ``shared/reference/llama-server.md``);
* recurrent and hybrid-recurrent state cannot be rolled back at all: only a checkpoint helps.
"""

from __future__ import annotations

#: memory kinds whose rollback needs a context checkpoint (before the flags are looked at)
CHECKPOINTED_KINDS = frozenset({"sliding-window", "recurrent-hybrid"})


def _kind(memory_kind) -> str:
    return str(getattr(memory_kind, "value", memory_kind) or "unknown")


def effective_kind(memory_kind, *, swa_full: bool) -> str:
    """The memory kind as a restore meets it on a server with these flags: a sliding-window
    model under ``--swa-full`` keeps every position, as a dense one does."""
    kind = _kind(memory_kind)
    return "dense" if kind == "sliding-window" and swa_full else kind


def needs_checkpoints(memory_kind, *, swa_full: bool) -> bool:
    """Whether a resume can only roll back to a context checkpoint (so a park without its
    checkpoints re-prefills everything on the first query after a restart)."""
    return effective_kind(memory_kind, swa_full=swa_full) in CHECKPOINTED_KINDS
