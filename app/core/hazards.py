"""Flag combinations known to crash or stall llama-server (from the seeds).

Warnings, not errors: the user may know their build has the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.core.profile import LaunchProfile, exposure_warning


@dataclass(frozen=True)
class Hazard:
    key: str
    text: str


def hazards(p: LaunchProfile) -> list[Hazard]:
    out: list[Hazard] = []
    slots = p.parallel if p.parallel is not None else -1
    cache_on = p.effective_cache_ram != 0
    if p.rpc and cache_on and (slots >= 2 or slots == -1):
        # Seed 002, llama.cpp #26128: prompt-cache save with KV on an RPC backend aborts
        # with GGML_ASSERT(tensor->data != NULL && "tensor not allocated") once -np >= 2.
        out.append(Hazard("rpc-prompt-cache",
                          "RPC workers with several slots and the prompt cache on: the first idle-slot save can "
                          "abort the server (GGML_ASSERT \"tensor not allocated\", llama.cpp #26128). "
                          "Use --cache-ram 0 or -np 1."))
    if p.kv_unified and p.cache_idle_slots is not False and cache_on:
        # Seed 004, llama.cpp #30252 (fixed by #31391): each idle-slot save stalls all streams.
        out.append(Hazard("kvu-idle-slots",
                          "Unified KV (-kvu) with idle-slot caching: each idle-slot save can stall every stream "
                          "for about a second (llama.cpp #30252, fixed by #31391). Use a build with the fix, "
                          "--no-cache-idle-slots, or drop -kvu."))
    if p.ctx_checkpoints == 0:
        out.append(Hazard("no-checkpoints",
                          "--ctx-checkpoints 0: on sliding-window or hybrid models every resume re-prefills, "
                          "and a checkpoint sidecar is not loaded."))
    if p.ctx_size and p.parallel and p.parallel > 1 and not p.kv_unified:
        per_slot = p.ctx_size // p.parallel
        out.append(Hazard("ctx-split", f"-c {p.ctx_size} is split across {p.parallel} slots: "
                                       f"each slot holds at most {per_slot:,} tokens."))
    exposure = exposure_warning(p)
    if exposure:
        out.append(Hazard("exposed", exposure))
    return out
