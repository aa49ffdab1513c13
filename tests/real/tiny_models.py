"""Tiny random-weight models of every memory kind, made here (no downloads), for the real-server tests.

llama.cpp's own ``tests/test-llama-archs.cpp`` (built with the sidecar test server in the same compile:
``tests/sidecar-server/build --tool test-llama-archs``) saves a model of any architecture with
``-a ARCH -o DIR``: random weights and llama.cpp's test tokenizer, so the text is nonsense but the
token counts, timings and context checkpoints are exact. Each is a few MB and made in about a second.

Their training context is 128 tokens; :func:`make_model` raises ``<arch>.context_length`` in the
file's metadata (in place, with the ``gguf`` package) so a server can run long chats on them.

The families the tests cover (what a restore needs differs for each; docs/guide/sidecars.md):

====================  ==============  ============================================================
family                architecture    memory
====================  ==============  ============================================================
dense                 ``llama``       KV cache only: a restore can roll back to any position
sliding-window        ``gemma3``      a window of the KV cache: needs checkpoints (or ``--swa-full``)
hybrid recurrent      ``qwen35``      the seeds' Qwen3.5/3.6: recurrent state + attention layers
hybrid (short conv)   ``lfm2``        another hybrid, short-convolution state
recurrent             ``mamba2``      recurrent state only
====================  ==============  ============================================================
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from app.core.states import MemoryKind

#: family -> (architecture, the memory kind KV Valet must read from the file)
FAMILIES: dict[str, tuple[str, MemoryKind]] = {
    "dense": ("llama", MemoryKind.DENSE),
    "sliding-window": ("gemma3", MemoryKind.SLIDING_WINDOW),
    "hybrid": ("qwen35", MemoryKind.RECURRENT_HYBRID),
    "hybrid-conv": ("lfm2", MemoryKind.RECURRENT_HYBRID),
    "recurrent": ("mamba2", MemoryKind.RECURRENT_HYBRID),
}
#: the context a made model declares (the server's -c may not exceed what a test needs anyway)
CONTEXT_LENGTH = 65536
MAKE_TIMEOUT_S = 120


class TinyModelError(RuntimeError):
    pass


def make_model(tool: Path, arch: str, folder: Path, *, seed: int = 1,
               context_length: int = CONTEXT_LENGTH) -> Path:
    """``folder/<arch>-dense.gguf`` (or ``-moe`` where the architecture has no dense form), made by
    ``tool`` (test-llama-archs) with ``seed``, its context length raised to ``context_length``."""
    folder.mkdir(parents=True, exist_ok=True)
    made = [p for p in (folder / f"{arch}-dense.gguf", folder / f"{arch}-moe.gguf") if p.is_file()]
    if not made:
        r = subprocess.run([str(tool), "-a", arch, "-s", str(seed), "-o", str(folder)], capture_output=True,
                           text=True, timeout=MAKE_TIMEOUT_S, stdin=subprocess.DEVNULL)
        made = [p for p in (folder / f"{arch}-dense.gguf", folder / f"{arch}-moe.gguf") if p.is_file()]
        if r.returncode != 0 or not made:
            raise TinyModelError(f"{tool.name} -a {arch} made no model (exit {r.returncode}): "
                                 f"{(r.stderr or r.stdout).strip()[-2000:]}")
    path = made[0]
    set_context_length(path, arch, context_length)
    return path


def set_context_length(path: Path, arch: str, n: int) -> None:
    """Raise ``<arch>.context_length`` in place (a scalar of the file's own type: the size is kept)."""
    import gguf

    reader = gguf.GGUFReader(path, "r+")
    field = reader.get_field(f"{arch}.context_length")
    if field is None:
        raise TinyModelError(f"{path.name} has no {arch}.context_length")
    field.parts[field.data[0]][0] = n
    del reader  # the memory map is flushed when it goes
