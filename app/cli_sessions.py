"""Session subcommands of ``kv-valet`` (park, resume, sessions, check)."""

from __future__ import annotations


def add_session_commands(sub) -> None:
    return None


def run_session_command(args) -> int:
    raise SystemExit(f"unknown command {args.command}")
