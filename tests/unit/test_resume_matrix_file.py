"""The resume matrix's data file, its tables and its bounds, without a server (issue #36 item 6).

tests/real/test_resume_matrix.py compares every measured cell with ``app/core/resume_matrix.json``; these
check what needs no server: the tables README and the guide show are rendered from the file, the guide states
the bounds the real test compares the figures within, the file's verdicts are the judge's word on its own
figures (a verdict edited by hand, or a judge that changed, shows here at once), and the figures add up.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict

import pytest

from app.core.resume_matrix import (BUILDS, CONFIGS, DATA_FILE, FAMILIES, PROBES, TABLE_BUILD_WORDS, Observed, expect,
                                    render_table)
from tests.real import resume_matrix as rm

GUIDE = rm.REPO / "docs" / "guide" / "resume-matrix.md"


def _between_markers(text: str) -> str:
    assert text.count(rm.TABLE_BEGIN) == 1 and text.count(rm.TABLE_END) == 1
    return text[text.index(rm.TABLE_BEGIN) + len(rm.TABLE_BEGIN): text.index(rm.TABLE_END)]


@pytest.mark.parametrize("page", rm.TABLE_FILES, ids=lambda p: p.name)
def test_the_table_a_page_embeds_is_the_one_rendered_from_the_file(page):
    text = page.read_text(encoding="utf-8")
    assert _between_markers(text) == "\n" + render_table() + "\n", (
        f"{page.name}'s table is not the file's: .venv/bin/python tests/real/resume_matrix.py --write "
        f"--from-kept writes it")
    assert rm.embed_table(text, render_table()) == text


def test_the_table_says_what_ran_for_every_cell():
    """Every cell measured, and the build column names what ran: KV Valet's patch in fork mode, not "the fork"."""
    table = render_table().splitlines()
    assert len(table) == 2 + len(FAMILIES) * len(BUILDS)
    for row in table[2:]:
        family, build, *cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == len(CONFIGS) and "–" not in cells
        assert build in TABLE_BUILD_WORDS.values()
    assert "KV Valet" in TABLE_BUILD_WORDS["fork"] and "fork mode" in TABLE_BUILD_WORDS["fork"]


def _guide_bounds() -> dict[str, str]:
    """figure -> its bound, from the guide's table "What the test compares, and within what"."""
    text = GUIDE.read_text(encoding="utf-8")
    section = text[text.index("### What the test compares"):]
    out = {}
    for m in re.finditer(r"^\| `?(\w+)`? \| [^|]* \| ([^|]+) \|$", section, re.M):
        out[m.group(1)] = m.group(2).strip()
    return out


def test_the_guide_states_the_bounds_the_real_test_compares_within():
    stated = _guide_bounds()
    assert set(rm.FIGURES) <= set(stated), stated
    for name, bound in rm.FIGURE_BOUNDS.items():
        said = stated[name]
        if name == "full_reprocess":  # a yes or no
            assert bound == 0 and said == "the same"
        elif bound == 0:
            assert said.startswith("exact"), (name, said)
        else:
            assert said.startswith(f"within {bound} "), (name, said)
    assert stated["verdict"] == "the same"


def test_a_figure_off_by_one_token_is_named_and_the_same_figures_pass():
    filed = expect("sliding-window", "fork", "default", "chat")
    assert filed is not None
    same = rm.Cell("sliding-window", "fork", "default", "chat", verdict=filed.verdict,
                   **{f: getattr(filed, f) for f in rm.FIGURES})
    assert rm.figure_differences(same, filed) == []

    same.prompt_n += 1
    same.cache_n -= 1
    said = rm.figure_differences(same, filed)
    assert len(said) == 2 and said[0].startswith(f"prompt_n measured {filed.prompt_n + 1}, the file says "
                                                 f"{filed.prompt_n}")

    unlogged = rm.Cell("sliding-window", "fork", "default", "chat", verdict=filed.verdict,
                       **{**{f: getattr(filed, f) for f in rm.FIGURES}, "sidecar_loaded": None})
    assert [d.split()[0] for d in rm.figure_differences(unlogged, filed)] == ["sidecar_loaded"]


def _file_cells() -> dict[tuple[str, ...], Observed]:
    data = json.loads(DATA_FILE.read_text(encoding="utf-8"))
    return {tuple(k.split("/")): Observed(**v) for k, v in data["cells"].items()}


def test_the_file_holds_every_cell_with_every_figure():
    cells = _file_cells()
    assert set(cells) == {(f, b, c, p) for f in FAMILIES for b in BUILDS for c in CONFIGS for p in PROBES}
    data = json.loads(DATA_FILE.read_text(encoding="utf-8"))
    assert all(set(v) == {"verdict", *rm.FIGURES} for v in data["cells"].values())
    assert all(c.n_restored and c.prompt_n is not None and c.cache_n is not None for c in cells.values())


def test_the_files_verdicts_are_the_judges_word_on_its_own_figures():
    wrong = [f"{'/'.join(k)}: the file says {c.verdict}, the judge says {rm.judge_figures(c).kind.name}"
             for k, c in _file_cells().items() if rm.judge_figures(c).kind.name != c.verdict]
    assert not wrong, "\n".join(wrong)


def test_the_files_figures_add_up():
    """One chat per family, so on every build and configuration: the same restored tokens, and for each probe
    the same prompt (re-processed plus reused); no sidecar line where none was read; nothing reused where the
    server said it re-processed everything; a checkpoint rolled back to only where a sidecar brought it."""
    totals: dict[tuple[str, str], set[int]] = defaultdict(set)
    restored: dict[str, set[int]] = defaultdict(set)
    for (family, build, config, probe), c in _file_cells().items():
        name = "/".join((family, build, config, probe))
        totals[family, probe].add(c.prompt_n + c.cache_n)
        restored[family].add(c.n_restored)
        if build == "stock" or probe == "hidden" or config == "ctx-checkpoints-0":
            assert c.sidecar_loaded is None, name
        if c.full_reprocess:
            assert c.cache_n == 0, name
        if c.checkpoint_used is not None:
            assert c.sidecar_loaded is not None and c.checkpoint_used <= c.n_restored, name
        assert c.cache_n <= c.n_restored, name
    assert all(len(v) == 1 for v in totals.values()), {k: v for k, v in totals.items() if len(v) > 1}
    assert all(len(v) == 1 for v in restored.values()), restored
