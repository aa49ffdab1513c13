"""A host's side of a move over SSH: one ``kv-valet sessions move-host PROFILE`` process per move.

The sender (:class:`app.move.endpoints.RemoteEndpoint`) starts it once, on the move's SSH
connection, and asks it everything the move needs from that host, one JSON object a line on its
stdin; each answer is one line on its stdout, ``{"ok": {...}}`` or ``{"error": "message"}`` (with
``"checksum"``: ``{file, got, expected}`` when a file read back is not the one expected). A
Python start and the imports cost more than any one step (about 0.2 s), so one process answers all:

* ``describe``: PROFILE's facts as a move's target (:func:`app.move.facts.describe_target`);
* ``facts`` ``{name}``: the session ``name`` of PROFILE as a move's source: its row, facts, files;
* ``written`` ``{move_id, suffix, upto}`` (no answer): the sender's bytes of that temporary file are
  written up to ``upto``: this process reads them back from its disk and hashes them now, while the
  rest travels (:class:`app.move.receive.ReadBack`);
* ``commit`` ``{manifest}``: :func:`app.move.receive.adopt` (sizes and the SHA-256 read back here,
  the header, the renames and the row under the journal); its row;
* ``abort`` ``{move_id}``: :func:`app.move.receive.settle`: the row when the commit listed the session,
  else None (its files removed), and what recovery did;
* ``delete`` ``{name}``: the session deleted here (its target listed it).

End of input ends the process. A sender that loses this process (a cut connection) settles its
commit with ``kv-valet sessions receive PROFILE --abort ID`` on a new one.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import asdict
from typing import IO, Any

from app.move.facts import describe_target, receiving_folder, source_session
from app.move.receive import ReadBack, adopt, settle
from app.move.values import ChecksumMismatch, MoveError, check_move_id
from app.sessions.move_in import temp_name
from app.store.catalog import Catalog

log = logging.getLogger(__name__)


class HostSide:
    """The answers of one move's host process for ``profile`` (a request at a time)."""

    def __init__(self, catalog: Catalog, profile: str):
        self.catalog = catalog
        self.profile = profile
        self._folder: tuple | None = None  # (save dir, model path), read once
        self._read_back: dict[tuple[str, str], ReadBack] = {}

    def folder(self):
        if self._folder is None:
            self._folder = receiving_folder(self.profile)
        return self._folder

    def answer(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        if op == "describe":
            facts = asyncio.run(describe_target(self.catalog, self.profile, where=f"profile '{self.profile}'"))
            return {"target": facts.to_dict()}
        if op == "facts":
            s = source_session(self.catalog, str(req["name"]), self.profile)
            return {"record": asdict(s.record), "facts": s.facts.to_dict(),
                    "files": [{"suffix": f.suffix, "path": f.path, "size": f.size} for f in s.files]}
        if op == "commit":
            manifest = dict(req["manifest"])
            move_id = check_move_id(manifest.get("move_id", ""))
            save_dir, model_path = self.folder()
            read = {s: rb for (m, s), rb in self._read_back.items() if m == move_id}
            try:
                rec = adopt(self.catalog, self.profile, save_dir, manifest, model_path=model_path, read_back=read)
            finally:
                self._forget(move_id)
            return {"record": asdict(rec)}
        if op == "abort":
            move_id = check_move_id(req["move_id"])
            self._forget(move_id)
            listed, messages = settle(self.catalog, move_id, self.folder()[0])
            return {"committed": asdict(listed) if listed is not None else None, "messages": messages}
        if op == "delete":
            from app.sessions.records import delete_session

            return {"deleted": [str(p) for p in delete_session(self.catalog, str(req["name"]), self.profile)]}
        raise MoveError(f"unknown request {op!r}: is this kv-valet as recent as the sender's?")

    def written(self, req: dict[str, Any]) -> None:
        """A ``written`` request: read back what the sender wrote so far. It has no answer, so it never
        fails: a file it cannot follow is read back whole at the commit."""
        try:
            key = (check_move_id(req["move_id"]), str(req["suffix"]))
            if key not in self._read_back:
                self._read_back[key] = ReadBack(self.folder()[0] / temp_name(*key))
            self._read_back[key].advance(int(req["upto"]))
        except (MoveError, KeyError, TypeError, ValueError) as e:
            log.info("move: cannot read back as it comes: %s", e)

    def _forget(self, move_id: str) -> None:
        for key in [k for k in self._read_back if k[0] == move_id]:
            self._read_back.pop(key).close()

    def close(self) -> None:
        for rb in self._read_back.values():
            rb.close()
        self._read_back.clear()


def say(out: IO[bytes], data: dict[str, Any]) -> None:
    """One answer line (tests/ssh/host_pause.py stops a commit before its answer here)."""
    out.write(json.dumps(data, ensure_ascii=False).encode() + b"\n")
    out.flush()


def serve(catalog: Catalog, profile: str, requests: IO[bytes], out: IO[bytes]) -> None:
    """Answer the requests on ``requests`` until its end (see the module's text)."""
    from app.sessions.records import AmbiguousName
    from app.store.catalog import CatalogError

    side = HostSide(catalog, profile)
    try:
        for line in requests:
            if not line.strip():
                continue
            try:
                req = json.loads(line)
                if not isinstance(req, dict):
                    raise MoveError("a request is a JSON object")
                if req.get("op") == "written":
                    side.written(req)
                    continue
                answer = side.answer(req)
            except ChecksumMismatch as e:  # the sender tells a changed park from other failures by it
                answer = {"error": str(e), "checksum": {"file": e.file, "got": e.got, "expected": e.expected}}
            except (MoveError, AmbiguousName, CatalogError, OSError, KeyError, TypeError, ValueError) as e:
                answer = {"error": str(e) or type(e).__name__}
            else:
                answer = {"ok": answer}
            say(out, answer)
    finally:
        side.close()
