"""The documentation: README.md stays a front page that CI can read its two commands from, the
site's navigation holds every page, and the generated CLI reference lists every command."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 250


def load_hook():
    spec = importlib.util.spec_from_file_location("cli_reference_hook", DOCS / "hooks" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sh_block_after(text: str, marker: str) -> str | None:
    """What .ci/run extracts: the first ```sh block after the line that is exactly the marker."""
    lines = text.splitlines()
    if marker not in lines:
        return None
    block: list[str] | None = None
    for line in lines[lines.index(marker) + 1:]:
        if block is None:
            if line.startswith("```sh"):
                block = []
        elif line.startswith("```"):
            return "\n".join(block)
        else:
            block.append(line)
    return None


# -- README.md ----------------------------------------------------------------------------------

def test_readme_fits_on_a_page():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move detail to docs/"


@pytest.mark.parametrize("marker, must_run", [("<!-- install-command -->", "kv-valet"),
                                              ("<!-- test-command -->", "pytest")])
def test_readme_keeps_the_set_up_commands_for_ci(marker, must_run):
    command = sh_block_after(README.read_text(), marker)
    assert command, f"README.md lacks a ```sh block after {marker} (.ci/run runs it)"
    assert must_run in command


def test_the_marker_reader_sees_a_missing_block():
    assert sh_block_after("<!-- test-command -->\ntext\n", "<!-- test-command -->") is None
    assert sh_block_after("```sh\nx\n```\n", "<!-- test-command -->") is None
    assert sh_block_after("<!-- m -->\n\n```sh\na && b\n```\n", "<!-- m -->") == "a && b"


def test_readme_links_lead_to_files_that_exist():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    relative = [link for link in links if "://" not in link]
    assert relative, "README.md links to no page of the manual"
    missing = [link for link in relative if not (ROOT / link).exists()]
    assert missing == []


# -- the site ------------------------------------------------------------------------------------

def nav_pages(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [p for item in node for p in nav_pages(item)]
    if isinstance(node, dict):
        return [p for value in node.values() for p in nav_pages(value)]
    return []


def test_every_page_is_in_the_navigation_and_every_nav_entry_exists():
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with mkdocs (the test extra)")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = nav_pages(config["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(nav) == pages
    assert "docs/hooks/cli_reference.py" in config["hooks"]


def test_no_wrapped_line_turns_into_a_heading():
    """Python-Markdown needs no space after '#': a prose line wrapped before "#31391" is a heading."""
    offenders = []
    for page in [README, *DOCS.rglob("*.md")]:
        in_code = False
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                in_code = not in_code
            elif not in_code and re.match(r"#+[^#\s]", line):
                offenders.append(f"{page.relative_to(ROOT)}:{n}: {line}")
    assert offenders == []


# -- the generated CLI reference -------------------------------------------------------------------

def every_command(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Walked here, not by the generator: what the parser has, to hold the generator to."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += [(*path, name), *every_command(sub, (*path, name))]
    return out


def section(markdown: str, path: tuple[str, ...]) -> str:
    """The text of one command's section of the reference."""
    start = markdown.index(f"`{' '.join(('kv-valet', *path))}` {{#")
    nxt = re.search(r"^#{3,6} `kv-valet", markdown[start + 1:], re.M)
    return markdown[start: start + 1 + nxt.start()] if nxt else markdown[start:]


def test_the_cli_reference_lists_every_command_and_option():
    hook = load_hook()
    parser = hook.build_parser()
    markdown = hook.reference_markdown(parser)
    paths = every_command(parser)
    assert len(paths) > 40  # profiles, sessions, hosts … and their subcommands
    for path in paths:
        words = " ".join(("kv-valet", *path))
        assert f"[`{words}`](#" in markdown, f"{words} is not in the reference's table"
        text = section(markdown, path)
        sub = parser
        for word in path:
            sub = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction)).choices[word]
        for action in sub._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            for option in action.option_strings:
                assert f"`{option}" in text or f", {option}" in text, f"{words}: {option} is missing"


def test_a_new_command_shows_up_in_the_reference():
    hook = load_hook()
    parser = hook.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    new = sub.add_parser("zz-new", help="a command added after the docs were written")
    new.add_subparsers(dest="zz").add_parser("deeper", help="its own subcommand").add_argument(
        "--zz-flag", metavar="N", help="what the flag does")
    markdown = hook.reference_markdown(parser)
    assert "[`kv-valet zz-new deeper`](#kv-valet-zz-new-deeper)" in markdown
    assert "- `--zz-flag N`: what the flag does" in section(markdown, ("zz-new", "deeper"))
    assert "A command added after the docs were written." in section(markdown, ("zz-new",))


def test_the_hook_fills_the_cli_page_and_leaves_the_others():
    hook = load_hook()
    page_text = (DOCS / hook.PAGE).read_text()
    assert hook.MARKER in page_text

    def page(uri):
        return SimpleNamespace(file=SimpleNamespace(src_uri=uri))

    filled = hook.on_page_markdown(page_text, page(hook.PAGE), None, None)
    assert hook.MARKER not in filled and "`kv-valet sessions move` {#kv-valet-sessions-move}" in filled
    assert hook.on_page_markdown("x " + hook.MARKER, page("index.md"), None, None) == "x " + hook.MARKER
