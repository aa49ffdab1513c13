"""The host's ``kv-valet`` with a pause in a move's commit (tests/ssh/test_ssh_commit_cut.py).

    python -m tests.ssh.host_pause POINT FIFO_DIR KV-VALET-ARGS...

The test puts a two-line wrapper on the host that runs this, and gives it to the move as the host's
``kv_valet``. Any command runs as ``kv-valet`` does; in ``sessions move-host PROFILE`` (a move's
host process, app.move.host_side) the commit stops at POINT: it writes ``at POINT PID`` into the
FIFO ``FIFO_DIR/at`` and blocks reading the FIFO ``FIFO_DIR/go``, everything frozen as it is (the
files lock held where the commit holds it). The test kills the SSH connection there (and this
process, or lets it go on).

Points (each wraps the function the commit really calls; app.move.receive ``adopt``/``_commit``):

* ``verified``: the copied files checked (size, SHA-256, header); the files lock not taken yet;
* ``journaled``: the journal entry written, nothing renamed;
* ``sidecar-placed``: the sidecar renamed into place, the state file not;
* ``renamed``: both files in place, the catalog row not written;
* ``listed``: the row written, the journal entry not ended;
* ``answered``: the commit done, its answer not printed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

POINTS = ("verified", "journaled", "sidecar-placed", "renamed", "listed", "answered")


def install(point: str, fifos: Path) -> None:
    import app.move.receive as receive
    from app.move.host_side import HostSide
    from app.sessions.journal import Journal, MoveInJournal
    from app.store.catalog import Catalog

    frozen = []

    def freeze(at: str) -> None:
        if at != point or frozen:
            return
        frozen.append(at)
        with open(fifos / "at", "w") as f:
            f.write(f"at {at} {os.getpid()}\n")
        with open(fifos / "go") as f:
            f.readline()

    verify = receive._verify_temps

    def _verify_temps(*a, **kw):
        verify(*a, **kw)
        freeze("verified")

    receive._verify_temps = _verify_temps
    begin = Journal.begin

    def journal_begin(self, entry):
        jid = begin(self, entry)
        if isinstance(entry, MoveInJournal):
            freeze("journaled")
        return jid

    Journal.begin = journal_begin
    replace = os.replace

    def os_replace(src, dst, *a, **kw):
        replace(src, dst, *a, **kw)
        if Path(src).name.startswith("kvv-move-") and str(dst).endswith((".ckpt", ".checkpoints")):
            freeze("sidecar-placed")

    os.replace = os_replace
    add = Catalog.add_or_replace

    def add_or_replace(self, rec):
        freeze("renamed")
        out = add(self, rec)
        freeze("listed")
        return out

    Catalog.add_or_replace = add_or_replace
    answer = HostSide.answer

    def answer_then_freeze(self, req):
        out = answer(self, req)
        if req.get("op") == "commit":
            freeze("answered")
        return out

    HostSide.answer = answer_then_freeze


def main(argv: list[str]) -> int:
    point, fifos, args = argv[0], Path(argv[1]), argv[2:]
    if point not in POINTS:
        raise SystemExit(f"unknown pause point {point!r}")
    if args[:2] == ["sessions", "move-host"]:
        install(point, fifos)
    from app.cli import main as kv_valet

    return kv_valet(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
