"""The app side of the fault matrix: a KV Valet process the test can SIGKILL at an exact point.

    python -m tests.faults.driver '{"op": "park", "profile": "real", "slot": 0, "name": "x", "pause": "commit"}'

It connects to the profile's running server as ``kv-valet park`` does (the CLI's
``connect``: the pid record, the profile's key, recovery of what an earlier crash left)
and runs one workflow of :class:`app.sessions.service.SessionService`. With ``pause`` it
stops at one point of that workflow, says so on stdout (``at POINT``) and blocks on
stdin with everything frozen as it is: the test kills it there with SIGKILL, so the
kill lands at that point every time, not "about then" after a sleep.

Pause points (each wraps the app function the workflow really calls):

* park ``saved``: the server wrote and answered the temporary state file; the app has
  not verified it (journal: saving);
* park ``commit``: the new state file replaced the old one (the old copy renamed aside),
  the catalog row not written yet (journal: commit);
* resume ``restored``: the server restored the slot and the app wrote the restore
  figures, not the history event;
* ab ``hidden``: the A/B moved the checkpoint sidecar aside for its second arm.

``op: loop``: park and delete in a loop (the two-process cell); it waits for ``go`` on
stdin so two drivers start together. ``op: delete``: delete a session. With
``report_lock_waits`` it says ``waiting for the lock`` when another process holds the
catalog's files lock (app.sessions.files_lock), so a test can order two processes exactly.

stdout lines: ``connected``, ``at POINT``, ``done JSON``, ``failed MESSAGE``.
"""

from __future__ import annotations

import asyncio
import json
import sys


def say(line: str) -> None:
    print(line, flush=True)


def freeze_here(point: str) -> None:
    """Say where we are and block (the event loop too): the test SIGKILLs us here."""
    say(f"at {point}")
    sys.stdin.readline()
    say(f"released at {point}")  # a test that lets it go on (never the kill cells)


def report_lock_waits() -> None:
    """Say ``waiting for the lock`` the first time a flock finds another process holding it
    (app.sessions.files_lock): the test then knows this process is blocked behind the other."""
    import fcntl

    original = fcntl.flock
    said = []

    def flock(fd, op):
        try:
            return original(fd, op)
        except BlockingIOError:
            if not said:
                said.append(True)
                say("waiting for the lock")
            raise

    fcntl.flock = flock


def install_pause(op: str, point: str | None) -> None:
    if not point:
        return
    import app.sessions.ab as ab_mod
    from app.server.client import LlamaClient
    from app.store.catalog import Catalog

    if (op, point) == ("park", "saved"):
        original_save = LlamaClient.save_slot

        async def save_slot(self, *a, **kw):
            resp = await original_save(self, *a, **kw)
            freeze_here(point)
            return resp

        LlamaClient.save_slot = save_slot
    elif (op, point) == ("park", "commit"):
        original_add = Catalog.add_or_replace

        def add_or_replace(self, rec):
            freeze_here(point)
            return original_add(self, rec)

        Catalog.add_or_replace = add_or_replace
    elif (op, point) == ("resume", "restored"):  # the server restored; the catalog is told next
        original_note = Catalog.note_restore

        def note_restore(self, ev, *a, **kw):
            freeze_here(point)
            return original_note(self, ev, *a, **kw)

        Catalog.note_restore = note_restore
    elif (op, point) == ("ab", "hidden"):
        original_hide = ab_mod.hide_sidecar

        def hide_sidecar(catalog, sidecar):
            out = original_hide(catalog, sidecar)
            freeze_here(point)
            return out

        ab_mod.hide_sidecar = hide_sidecar
    else:
        raise SystemExit(f"unknown pause point {op}/{point}")


async def loop_parks(svc, slot: int, tag: str, n: int) -> dict:
    """Two of these run at once on one catalog and one save folder."""
    from app.sessions.service import ServiceError
    from app.store.catalog import CatalogError

    counts = {"parked": 0, "park_failed": 0, "deleted": 0, "delete_failed": 0, "errors": []}

    async def park(name: str) -> None:
        try:
            await svc.park(slot, name)
            counts["parked"] += 1
        except ServiceError as e:
            counts["park_failed"] += 1
            counts["errors"].append(f"park {name}: {e}")

    def delete(name: str) -> None:
        try:
            svc.delete(name)
            counts["deleted"] += 1
        except CatalogError as e:  # the other process deleted it first: expected
            counts["delete_failed"] += 1
            if "no session named" not in str(e):
                counts["errors"].append(f"delete {name}: {e}")

    for i in range(n):
        await park("shared")  # both processes re-park this name: one state file, two writers
        await park(f"{tag} {i}")
        await park(f"{tag}-{i}")  # the same file name as the one above ("a 1" and "a-1" slug alike)
        if i:
            delete(f"{tag} {i - 1}")
        if i % 3 == 2:
            delete("shared")
    return counts


async def main(spec: dict) -> int:
    from app.cli.connect import connect, open_catalog

    op = spec["op"]
    install_pause(op, spec.get("pause"))
    if spec.get("report_lock_waits"):
        report_lock_waits()
    catalog = open_catalog()
    try:
        svc = await connect(catalog, spec["profile"])  # recovery notes go to stderr, as the CLI's
        say("connected")
        if spec.get("wait_go"):
            sys.stdin.readline()  # connected (and recovered) first; the test says when to go on
        try:
            if op == "park":
                r = await svc.park(spec.get("slot"), spec["name"])
                out = {"name": r.record.name, "n_tokens": r.record.n_tokens, "state_file": r.record.state_file,
                       "warnings": r.warnings}
            elif op == "delete":
                out = {"removed": [str(p) for p in svc.delete(spec["name"])]}
            elif op == "resume":
                r = await svc.resume(spec["name"], spec.get("slot"), force=True)
                out = {"n_restored": r.n_restored}
            elif op == "ab":
                r = await svc.ab(spec["name"], spec.get("slot"), force=True, output_check=False)
                out = {"note": r.note}
            elif op == "loop":
                sys.stdin.readline()  # "go"
                out = await loop_parks(svc, spec["slot"], spec["tag"], int(spec["n"]))
            else:
                raise SystemExit(f"unknown op {op}")
        except Exception as e:  # ServiceError, CatalogError...: what the CLI would print
            say(f"failed {e}")
            return 1
        finally:
            await svc.aclose()
        say("done " + json.dumps(out))
        return 0
    finally:
        catalog.close()


if __name__ == "__main__":
    sys.exit(asyncio.run(main(json.loads(sys.argv[1]))))
