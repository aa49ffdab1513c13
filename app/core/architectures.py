"""llama.cpp's architecture lists: what each architecture keeps of its past positions."""

from __future__ import annotations

# What a model keeps of its past positions is a property of its architecture in llama.cpp, not of
# the metadata keys a file happens to carry: llama.cpp's own tiny test models
# (tests/test-llama-archs.cpp) write ``<arch>.ssm.*`` and ``<arch>.attention.sliding_window`` for every
# architecture, a dense ``llama`` among them. The reference lists are llama.cpp's
# ``llm_arch_is_recurrent`` and ``llm_arch_is_hybrid`` (src/llama-arch.cpp); the running server's log
# confirms the kind (``print_info: arch`` and ``is_swa_any``: :func:`kind_from_server_log`).

#: ``llm_arch_is_recurrent``: the whole memory is recurrent state (it cannot be rolled back at all).
RECURRENT_ARCHITECTURES = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
#: ``llm_arch_is_hybrid``: recurrent layers beside attention layers (the seeds' Qwen3.5/3.6 is ``qwen35``).
HYBRID_ARCHITECTURES = frozenset({
    "jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h", "nemotron_h_moe",
    "qwen3next", "kimi-linear", "qwen35", "qwen35moe", "deepseek4",
})
#: Architectures whose attention slides over a window when the file gives one (llama.cpp sets their
#: ``swa_type`` from ``<arch>.attention.sliding_window``). Any other architecture ignores that key: a
#: model of one llama.cpp learned to slide later is read as dense here until its server's log says
#: ``is_swa_any = 1`` (:func:`kind_from_server_log`), which then wins.
SWA_ARCHITECTURES = frozenset({
    "gemma2", "gemma3", "gemma3n", "gemma4", "gemma-embedding", "cohere2", "cohere2moe", "llama4", "gpt-oss",
    "exaone4", "phi3", "mimo2", "step35", "smallthinker",
})
