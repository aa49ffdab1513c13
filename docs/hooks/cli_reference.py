"""MkDocs hook: the command-line reference, generated from ``app.cli.build_parser()``.

At every build, :func:`on_page_markdown` replaces the marker ``<!-- cli-reference -->`` in
``reference/cli.md`` with every command and subcommand of the parser: its one-line help, its
description, its usage and each argument with its help. The reference cannot drift from the
program: it *is* the program's parser. ``tests/unit/test_docs.py`` checks that no command is
left out. Qt-free and offline, like every ``kv-valet`` command but the window.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[2]
PAGE = "reference/cli.md"
MARKER = "<!-- cli-reference -->"
#: usage lines are wrapped at this width, whatever the terminal that runs the build
WIDTH = 96


def build_parser() -> argparse.ArgumentParser:
    """The parser of the checkout this file belongs to (not of whatever ``app`` is installed)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from app.cli import build_parser as build

    return build()


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser, str]]:
    """(name, parser, one-line help) of each direct subcommand, in the parser's order."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            out += [(name, sub, helps.get(name, "")) for name, sub in action.choices.items()]
    return out


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
             ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser, str]]:
    """Every command below ``parser``, depth first: (its words after ``kv-valet``, its parser, its help)."""
    for name, sub, help_text in _subcommands(parser):
        yield (*path, name), sub, help_text
        yield from commands(sub, (*path, name))


def _formatter(parser: argparse.ArgumentParser) -> argparse.HelpFormatter:
    return argparse.HelpFormatter(parser.prog, width=WIDTH)


def usage(parser: argparse.ArgumentParser) -> str:
    fmt = _formatter(parser)
    fmt.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    return fmt.format_help().strip()


def _text(s: str) -> str:
    """argparse help as Markdown text: one line, no HTML, no stray emphasis."""
    s = " ".join(s.split())
    for ch in "\\`*_<>[]":
        s = s.replace(ch, "\\" + ch)
    return s


def arguments(parser: argparse.ArgumentParser) -> list[tuple[str, str]]:
    """(how it is written, its help) of every argument a user may give, in the parser's order."""
    fmt = _formatter(parser)
    out = []
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, (argparse._SubParsersAction,
                                                                   argparse._HelpAction)):
            continue
        invocation = fmt._format_action_invocation(action)
        help_text = fmt._expand_help(action) if action.help else ""
        if action.choices is not None and not isinstance(action.choices, dict) \
                and "%(choices)" not in (action.help or ""):
            help_text += f" (one of: {', '.join(map(str, action.choices))})"
        out.append((invocation, help_text.strip()))
    return out


def _anchor(path: tuple[str, ...]) -> str:
    return "-".join(("kv-valet", *path)).lower()


def _section(path: tuple[str, ...], parser: argparse.ArgumentParser, help_text: str) -> list[str]:
    name = " ".join(("kv-valet", *path))
    level = "#" * min(2 + max(len(path), 1), 6)
    lines = [f"{level} `{name}` {{#{_anchor(path)}}}", ""]
    if help_text:
        sentence = _text(help_text[:1].upper() + help_text[1:])
        lines += [sentence if sentence.endswith(".") else sentence + ".", ""]
    if parser.description:
        lines += [_text(parser.description), ""]
    lines += ["```text", usage(parser), "```", ""]
    args = arguments(parser)
    if args:
        lines += [f"- `{inv}`" + (f": {_text(h)}" if h else "") for inv, h in args] + [""]
    subs = _subcommands(parser)
    if subs:
        lines += ["Subcommands: " + ", ".join(f"[`{n}`](#{_anchor((*path, n))})" for n, _, _ in subs) + ".", ""]
    if parser.epilog:
        lines += [_text(parser.epilog), ""]
    return lines


def reference_markdown(parser: argparse.ArgumentParser | None = None) -> str:
    """The whole reference: a table of every command, then one section per command."""
    parser = parser if parser is not None else build_parser()
    every = list(commands(parser))
    lines = ["| command | what it does |", "|---|---|"]
    lines += [f"| [`{' '.join(('kv-valet', *path))}`](#{_anchor(path)}) | {_text(h).replace('|', '&#124;')} |"
              for path, _, h in every]
    lines += [""] + _section((), parser, "")  # the program itself: its description, its own options
    for path, sub, help_text in every:
        lines += _section(path, sub, help_text)
    return "\n".join(lines).rstrip() + "\n"


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        from mkdocs.exceptions import PluginError

        raise PluginError(f"{PAGE} lacks the marker {MARKER} where the command reference goes")
    return markdown.replace(MARKER, reference_markdown())
