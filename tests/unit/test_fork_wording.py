"""What ran, said so (issue #36 item 6): the turboquant fork's own binary never ran here.

Every "fork" figure of this project was measured on KV Valet's sidecar build run in the fork's behaviour
(``KVV_SIDECAR_MODE=fork``, *fork mode*). A sentence of README or the docs that says something was measured,
reproduced, seen or tested on "the fork" (or "the real fork", "the fork build") must name fork mode; "the
fork" stays where it describes the real fork's documented behaviour (shared/reference: what its source does).
The resume matrix's own words (its data file, its table, the prediction every face says) name it too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from app.core.resume_matrix import DATA_FILE, TABLE_BUILD_WORDS, predict, render_table
from tests.real import resume_matrix as rm

REPO = Path(__file__).resolve().parents[2]

#: a claim that something ran on "the fork": a measuring verb before "on/in/with/as ... the (real)
#: (turboquant) fork", "the real fork", "the fork('s) build/binary/server", a resume on the fork, or the fork
#: paired with v2 (only KV Valet's build runs both)
CLAIM = re.compile(r"""
    \b(?:measured|reproduced|seen|tested|observed|captured|recorded|ran|run|runs|running)\b[^.;]{0,80}?
        \b(?:on|with|against|in|by|for|as)\s+(?:the\s+)?(?:real\s+)?(?:turboquant\s+)?fork\b(?!\s+mode)
  | \breal\s+(?:turboquant\s+)?fork\b
  | \bfork(?:['’]s)?\s+(?:build|binary|server)\b
  | \b(?:resume|restore|check|probe|arm|server)s?\s+on\s+the\s+(?:turboquant\s+)?fork\b
  | \bthe\s+(?:turboquant\s+)?fork\s+(?:and|or)\s+(?:of\s+|as\s+|in\s+)?v2\b
""", re.I | re.X)
#: a sentence that names what ran: fork mode (or "the fork and v2 modes")
NAMES_WHAT_RAN = re.compile(r"\bfork\s+mode|\bfork\s+(?:and|or)\s+v2\s+modes\b", re.I)


def sentences(text: str) -> list[tuple[int, str]]:
    """(the first line of its paragraph, sentence) of a Markdown page: paragraphs and list items joined across
    their lines, table rows and headings one each, fenced code left out."""
    blocks: list[tuple[int, list[str]]] = []
    in_code = False
    for i, line in enumerate(text.splitlines(), 1):
        bare = line.strip()
        if bare.startswith("```"):
            in_code = not in_code
            continue
        if in_code or not bare:
            blocks.append((i, []))
            continue
        if bare.startswith(("|", "#")) or re.match(r"^(?:[-*+]|\d+\.)\s", bare):
            blocks.append((i, [bare]))
            if bare.startswith(("|", "#")):
                blocks.append((i, []))
            continue
        if blocks and blocks[-1][1]:
            blocks[-1][1].append(bare)
        else:
            blocks.append((i, [bare]))
    out = []
    for start, lines in blocks:
        if lines:
            out += [(start, s) for s in re.split(r"(?<=[.!?])\s+(?=[A-Z`*(\"])", " ".join(lines))]
    return out


def unnamed_claims(text: str) -> list[tuple[int, str]]:
    return [(n, s) for n, s in sentences(text) if CLAIM.search(s) and not NAMES_WHAT_RAN.search(s)]


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def test_no_page_says_something_ran_on_the_fork_without_naming_fork_mode():
    found = [f"{p.relative_to(REPO)}:{n}: {s}" for p in pages()
             for n, s in unnamed_claims(p.read_text(encoding="utf-8"))]
    assert not found, "say what ran (KV Valet's sidecar build in fork mode):\n" + "\n".join(found)


def test_no_line_of_the_app_says_something_ran_on_the_fork_without_naming_fork_mode():
    """The app's strings and comments, line by line (what a docstring says across lines, the pages' test reads
    whole): the same rule."""
    found = [f"{p.relative_to(REPO)}:{n}: {line.strip()}" for p in sorted((REPO / "app").rglob("*.py"))
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if CLAIM.search(line) and not NAMES_WHAT_RAN.search(line)]
    assert not found, "say what ran (KV Valet's sidecar build in fork mode):\n" + "\n".join(found)


@pytest.mark.parametrize("claim", [
    "Reproduced on the fork: a 1,400-token session rolled back.",
    "Seen on the real fork build (`tests/real/test_real_output_check.py`): A loads B's checkpoints.",
    "With the park's sidecar gone on the fork build, the proxy leaves the park.",
    "## On the fork's build",
    "Whether a chat resumes was measured on the turboquant fork with tiny models.",
    "A correct resume on the\nfork moved a token by 0.207 nats.",
    "On Gemma 3 the tip checkpoint of the fork and of v2 served neither probe.",
    "- the tooltip predicts the load, and the real fork loads exactly that many.",
    "`test_real_sidecar_modes.py` runs the same binary as the turboquant fork and as v2.",
])
def test_the_phrasings_found_in_the_pages_are_caught(claim):
    assert unnamed_claims(claim), claim
    named = claim.rstrip(".") + " (KV Valet's sidecar build in fork mode)."
    assert not unnamed_claims(named), named


@pytest.mark.parametrize("fact", [
    "The fork keeps a slot's checkpoints across a restore, so a later arm reuses them.",
    "On the turboquant fork a restore keeps the slot's checkpoints.",
    "# What your server does with sidecars: stock, the fork, v2",
    "A fork of one chat stays apart from the original (the proxy's identity).",
    "The fork does not check its state write: it answers `n_written: 0` as a success.",
])
def test_the_forks_documented_behaviour_stays_as_it_is(fact):
    assert not unnamed_claims(fact), fact


def test_the_matrix_says_fork_mode_wherever_it_names_the_fork_build():
    sentence = predict("hybrid", "fork", "default").sentence
    assert "fork mode" in sentence and "KV Valet" in sentence and "on the turboquant fork" not in sentence
    assert "fork mode" in TABLE_BUILD_WORDS["fork"]
    assert all(TABLE_BUILD_WORDS["fork"] in row for row in render_table().splitlines() if "fork" in row)
    measured_on = json.loads(DATA_FILE.read_text(encoding="utf-8"))["measured_on"]
    assert "fork mode" in measured_on and measured_on == rm.to_data([])["measured_on"]
