"""Benchmark: a move over SSH against scp of the same file, and a click on a remote host to its list.

Not a test. Runs the SSH tests' host (tests/ssh/conftest.py ``running_sshd``: a throwaway host key
and client key; another user with its own home in its own network and mount namespace, reached over
a veth pair, this checkout's real ``kv-valet`` there), in throw-away config/data folders (root), and times:

* **move throughput**: a parked session of ``--mib`` MiB (one state file with a real header,
  random payload) moved here -> ``box:there`` (SFTP writes) and back (SFTP reads) with
  :func:`app.move.transfer.move_session`, against ``scp`` of the same file each way with the same
  key and known_hosts (OpenSSH 9's scp speaks SFTP too). Interleaved (move up, move down, scp up,
  scp down) so all see the same machine load; ``--runs`` of each (default 5), medians. MB/s of
  the transfer phase (first byte to last, from the move's progress) and of the whole move (the
  rules first: the host's one ``kv-valet sessions move-host`` process for the move starts and
  answers its facts; then the rest of the target's SHA-256 read back, its catalog row, the
  source's delete), and scp's whole run (its handshake included). Like with
  like: the move's whole against scp's whole run; the move's transfer phase against scp's
  transfer, which is scp's run less the run of an empty file's scp (the same start, handshake and
  log-in, interleaved with the others), medians of each;
* **a click on a remote host to its Sessions list**: cold (a new ``RemoteHost``: connect, verify
  the host key, log in, ``kv-valet sessions list --json`` there) and warm (the same connection
  asked again), against the same command run on the host without SSH (the CLI's own start-up, timed there).

Prints one line per figure and, last, one JSON object of every figure. Compiles the checkout's
bytecode first (:func:`bytecode_for_the_host`).

``--ci`` is the quick mode CI runs (.ci/run): 5 runs of a 32 MiB session, 5 list runs; ``--json PATH``
also writes the figures there.

    .venv/bin/python tests/bench/bench_move.py [--runs 5] [--mib 128] [--list-runs 10] [--ci] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MB = 1e6
#: run on the host (``python -c``): ``argv[2:]`` ``argv[1]`` times, each run's seconds as JSON
TIME_ON_HOST = """
import json, subprocess, sys, time
out = []
for _ in range(int(sys.argv[1])):
    t0 = time.perf_counter()
    subprocess.run(sys.argv[2:], check=True, capture_output=True, timeout=120)
    out.append(time.perf_counter() - t0)
print(json.dumps(out))
"""


def bytecode_for_the_host() -> None:
    """Compile this checkout's bytecode here, before the host runs it: the host's user cannot write
    its ``__pycache__``, so a module edited since this side last imported it is compiled again by
    every ``kv-valet`` the host runs (a cold click on a host's row measured 1.2 s without the
    bytecode, 0.73-0.83 s with it, the same tree; a move's host process likewise)."""
    import compileall

    compileall.compile_dir(str(ROOT / "app"), quiet=1)


def _scp(sshd, src: str, dst: str) -> float:
    """Seconds for ``scp SRC DST`` with the fixture's key and known_hosts (no ~/.ssh/config, no agent)."""
    argv = ["scp", "-q", "-F", "/dev/null", "-P", str(sshd.port), "-i", str(sshd.client_key),
            "-o", f"UserKnownHostsFile={sshd.known_hosts}", "-o", "StrictHostKeyChecking=yes",
            "-o", "BatchMode=yes", "-o", "IdentityAgent=none", src, dst]
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, timeout=600)
    return time.perf_counter() - t0


class _Clock:
    """The move's progress: when the first and the last byte crossed."""

    def __init__(self):
        self.first = self.last = None

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        if done >= total:
            self.last = now


async def _move(source, target) -> tuple[float, float, int]:
    """(whole seconds, transfer seconds, bytes) of one move of "big"."""
    from app.move.transfer import move_session

    clock = _Clock()
    t0 = time.perf_counter()
    result = await move_session(source, "big", target, on_progress=clock)
    whole = time.perf_counter() - t0
    assert result.moved and clock.first is not None and clock.last is not None
    return whole, clock.last - clock.first, result.bytes


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


async def transfers(sshd, runs: int, mib: int, work: Path) -> dict:
    from app.move.endpoints import LocalEndpoint, RemoteEndpoint
    from tests.ssh.test_ssh_move import remote_profile
    from tests.unit.move_helpers import model_file, open_catalog, park_file, profile

    model = model_file(work)
    here = profile(work, "here", model)
    there = remote_profile(sshd, model, "there")
    catalog = open_catalog()
    rec = park_file(catalog, here, "big", sidecar=False, payload=mib << 20, hashed=True)  # as a park records it
    size = rec.state_size
    scp_copy = work / "scp-source.bin"  # the same bytes as the session's file, for scp
    scp_copy.write_bytes(rec.state_path.read_bytes())
    remote_dst = sshd.remote_home / "scp-dest.bin"
    back_dst = work / "scp-back.bin"
    empty = work / "scp-empty.bin"  # scp's fixed cost: start, handshake, log-in, no payload
    empty.write_bytes(b"")
    remote_empty, back_empty = sshd.remote_home / "scp-empty.bin", work / "scp-empty-back.bin"
    figures: dict[str, list[float]] = {k: [] for k in (
        "move_up_s", "move_up_transfer_s", "move_down_s", "move_down_transfer_s", "scp_up_s", "scp_down_s",
        "scp_empty_up_s", "scp_empty_down_s")}
    try:
        async with sshd.remote_host() as host:
            local, remote = LocalEndpoint(catalog, "here"), RemoteEndpoint(host, "box", "there")
            for i in range(runs):
                # each timed copy starts with no dirty pages of the last one still to write (untimed): a move
                # syncs what it wrote (its commit's fsync), scp does not, and the disk would otherwise write
                # scp's gigabyte during whatever comes next
                os.sync()
                whole, xfer, n = await _move(local, remote)
                assert n == size
                figures["move_up_s"].append(whole)
                figures["move_up_transfer_s"].append(xfer)
                os.sync()
                whole, xfer, n = await _move(remote, local)
                figures["move_down_s"].append(whole)
                figures["move_down_transfer_s"].append(xfer)
                os.sync()
                figures["scp_up_s"].append(await asyncio.to_thread(
                    _scp, sshd, str(scp_copy), f"{sshd.destination}:{remote_dst}"))
                os.sync()
                figures["scp_down_s"].append(await asyncio.to_thread(
                    _scp, sshd, f"{sshd.destination}:{remote_dst}", str(back_dst)))
                figures["scp_empty_up_s"].append(await asyncio.to_thread(
                    _scp, sshd, str(empty), f"{sshd.destination}:{remote_empty}"))
                figures["scp_empty_down_s"].append(await asyncio.to_thread(
                    _scp, sshd, f"{sshd.destination}:{remote_empty}", str(back_empty)))
                assert back_dst.stat().st_size == size and back_empty.stat().st_size == 0
                sshd.run("rm", "-f", "--", str(remote_dst), str(remote_empty))  # the host's files: through SSH
                for f in (back_dst, back_empty):
                    f.unlink()
                print(f"run {i + 1}/{runs}: move up {figures['move_up_s'][-1]:.2f} s, down "
                      f"{figures['move_down_s'][-1]:.2f} s; scp up {figures['scp_up_s'][-1]:.2f} s, down "
                      f"{figures['scp_down_s'][-1]:.2f} s", file=sys.stderr)
    finally:
        catalog.close()
    assert sshd.listdir(there.slot_save_path) == []  # every move there moved back: nothing left on the host
    med = {k: _med(v) for k, v in figures.items()}
    for way in ("up", "down"):  # scp's transfer: its run less an empty file's (floored: noise can invert them)
        med[f"scp_{way}_transfer_s"] = max(med[f"scp_{way}_s"] - med[f"scp_empty_{way}_s"], 1e-6)
    rate = {k.replace("_s", "_mb_s"): size / MB / v for k, v in med.items() if "empty" not in k}
    out = {"bytes": size, "runs": runs, "median_s": med, "median_mb_s": rate, "all_s": figures,
           "ratio_move_transfer_vs_scp": {"up": rate["move_up_transfer_mb_s"] / rate["scp_up_transfer_mb_s"],
                                          "down": rate["move_down_transfer_mb_s"] / rate["scp_down_transfer_mb_s"]},
           "ratio_move_whole_vs_scp": {"up": rate["move_up_mb_s"] / rate["scp_up_mb_s"],
                                       "down": rate["move_down_mb_s"] / rate["scp_down_mb_s"]}}
    for way in ("up", "down"):
        print(f"move {way:<4} {size / MB:,.0f} MB: transfer {rate[f'move_{way}_transfer_mb_s']:7.1f} MB/s, whole "
              f"{rate[f'move_{way}_mb_s']:7.1f} MB/s ({med[f'move_{way}_s']:.2f} s) | scp transfer "
              f"{rate[f'scp_{way}_transfer_mb_s']:7.1f} MB/s, whole {rate[f'scp_{way}_mb_s']:7.1f} MB/s "
              f"({med[f'scp_{way}_s']:.2f} s, an empty file {med[f'scp_empty_{way}_s']:.2f} s) | "
              f"transfer/scp transfer {out['ratio_move_transfer_vs_scp'][way]:.2f}x, "
              f"whole/scp {out['ratio_move_whole_vs_scp'][way]:.2f}x  (median of {runs})")
    return out


async def listing(sshd, runs: int) -> dict:
    """A click on a remote host: connect + ``sessions()``, cold and warm; the CLI's own start-up here."""
    cold, cold_connect, warm = [], [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        async with sshd.remote_host() as host:
            t1 = time.perf_counter()
            await host.sessions()
            cold.append(time.perf_counter() - t0)
            cold_connect.append(t1 - t0)
    async with sshd.remote_host() as host:
        await host.sessions()
        for _ in range(runs):
            t0 = time.perf_counter()
            await host.sessions()
            warm.append(time.perf_counter() - t0)
    # the same command on the host without SSH: timed there (its files are readable there only), runs in a row
    timed = sshd.run("python", "-c", TIME_ON_HOST, str(runs), "kv-valet", "sessions", "list", "--json")
    local = json.loads(timed.stdout)
    ms = {"cold_ms": _med(cold) * 1000, "cold_connect_ms": _med(cold_connect) * 1000, "warm_ms": _med(warm) * 1000,
          "same_cli_here_ms": _med(local) * 1000}
    print(f"sessions list of a host (median of {runs}): cold {ms['cold_ms']:.0f} ms (connect "
          f"{ms['cold_connect_ms']:.0f} ms), warm {ms['warm_ms']:.0f} ms; the same kv-valet command run on the host "
          f"without SSH {ms['same_cli_here_ms']:.0f} ms")
    return {"runs": runs, "median": ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--mib", type=int, default=None, help="the session's size (64-256 MiB; 32 with --ci)")
    ap.add_argument("--list-runs", type=int, default=None, help="default 10; 5 with --ci")
    ap.add_argument("--ci", action="store_true", help="the quick mode CI runs: a 32 MiB session, 5 list runs")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures there")
    args = ap.parse_args()
    if args.mib is None:
        args.mib = 32 if args.ci else 128
    if args.list_runs is None:
        args.list_runs = 5 if args.ci else 10
    if args.runs < 5:
        ap.error("--runs must be at least 5")
    bytecode_for_the_host()
    with tempfile.TemporaryDirectory(prefix="kvv-bench-") as d:
        for k, sub in (("KV_VALET_CONFIG_DIR", "config"), ("KV_VALET_DATA_DIR", "data"),
                       ("KV_VALET_STATE_DIR", "state")):
            os.environ[k] = os.path.join(d, sub)
        from tests.ssh.conftest import running_sshd

        work, base = Path(d) / "work", Path(d) / "sshd"
        work.mkdir()
        base.mkdir()
        with running_sshd(base) as sshd:
            figures = {"move": asyncio.run(transfers(sshd, args.runs, args.mib, work)),
                       "sessions_list": asyncio.run(listing(sshd, args.list_runs))}
    text = json.dumps(figures, indent=1)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
