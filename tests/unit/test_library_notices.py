"""Third-party notices the app hides (app/__init__.py), and only those."""

from __future__ import annotations

import subprocess
import sys

NOTICE = ("import app, warnings\n"
          "warnings.warn_explicit('DSA is deprecated and support will be removed in a future release.', "
          "UserWarning, 'misc.py', 32, module={module!r})\n")


def run(module: str) -> str:
    return subprocess.run([sys.executable, "-c", NOTICE.format(module=module)], capture_output=True, text=True,
                          check=True).stderr


def test_asyncssh_s_dsa_notice_is_not_printed_and_any_other_one_is():
    """cryptography 51 warns when asyncssh names DSA key types at import: a CLI command that reaches a host
    printed it before its own first line (tests/ssh/test_cli_host_flags.py caught it in a fresh CI venv)."""
    assert run("asyncssh.crypto.misc") == ""
    assert "DSA is deprecated" in run("someone.else")
