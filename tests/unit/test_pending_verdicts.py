"""Verdicts across processes: a resume leaves a note in the catalog; whoever reads the log judges it, once.

``kv-valet resume`` runs in its own process; ``kv-valet serve`` (or the window) reads the server's
log. The note is keyed by the session's id, so a rename while it waits keeps it; two watchers of the
same restore write the verdict once; a note older than the server's start is dropped.
"""

from __future__ import annotations

import logging
import time

import pytest

from app.core.verdict import RESTORED_NOT_JUDGED, VerdictKind
from app.sessions.resume import ResumeResult, pending_verdict
from app.sessions.service import SessionService
from app.sessions.target import ServerTarget
from app.server.client import LlamaClient
from app.server.logparse import parse_line
from app.server.supervisor import LogBuffer
from app.store.catalog import Catalog, HistoryEvent, PendingVerdict, SessionRecord

URL = "http://127.0.0.1:9"
# a query after restoring 2,729 tokens into slot 1: 21 new tokens processed, the rest reused
QUERY = [
    "0.20.000.000 I slot operator(): id  1 | task 60 | new prompt, n_ctx_slot = 4096, n_keep = 0, task.n_tokens = 2750",
    "0.20.000.050 I slot update_slots: id  1 | task 60 | n_past = 2729, memory_seq_rm [2729, end)",
    "0.20.500.000 I slot print_timing: id  1 | task 60 | prompt eval time =     50.00 ms /    21 tokens",
    "0.20.600.000 I slot      release: id  1 | task 60 | stop processing: n_tokens = 2760, truncated = 0",
]


class FakeSupervisor:
    """What attach_verdicts needs of the server a process runs: its start time and its log (each line kept in
    its buffer, then given to the listeners, as the supervisor delivers it)."""

    def __init__(self, started_at: float):
        self.started_at = started_at
        self.cbs = []
        self.log = LogBuffer()

    def on_line(self, cb) -> None:
        self.cbs.append(cb)

    def emit(self, line: str, at: float | None = None) -> None:
        item = self.log.append_event(parse_line(line), time.time() if at is None else at)
        for cb in self.cbs:
            cb(item)


@pytest.fixture
def db(tmp_path):
    return tmp_path / "catalog.sqlite"


def add_session(cat: Catalog, name: str = "chat") -> SessionRecord:
    return cat.add_or_replace(SessionRecord(name=name, profile="p", state_file=f"{name}.bin", save_dir="/s",
                                            n_tokens=2729, slot_id=1, sidecar_status="present", sidecar_count=2))


def service(cat: Catalog, supervisor: FakeSupervisor | None = None, profile: str = "p") -> SessionService:
    """A service of ``profile`` as connect() makes it, without a server to ask."""
    svc = SessionService(ServerTarget(client=LlamaClient(URL), url=URL, save_dir=None, catalog=cat,
                                      profile_name=profile))
    if supervisor is not None:
        from app.sessions.wiring import attach_verdicts

        attach_verdicts(svc, supervisor)
    return svc


def resumed(svc: SessionService, rec: SessionRecord, slot: int = 1, n: int = 2729,
            ended: float | None = None) -> PendingVerdict | None:
    """What a resume does once the server restored the state file: its record and note in one commit
    (app.sessions.resume), then the service's relay. ``ended``: when the restore ended (default now)."""
    ended = time.time() if ended is None else ended
    noted = svc.catalog.note_restore(HistoryEvent(session_id=rec.id, kind="resume", at=ended, restore_ms=5.0),
                                     n, RESTORED_NOT_JUDGED, pending=pending_verdict(svc.target, rec, slot, n, ended))
    return svc.relay.note_restore(ResumeResult(rec, slot, n, 5.0, noted=noted, restored_at=ended))


def test_a_note_round_trips_and_settles_once(db):
    with Catalog(db) as cat:
        rec = add_session(cat)
        note, replaced = cat.add_pending_verdict(PendingVerdict(
            session_id=rec.id, profile="p", server_url=URL, slot_id=1, n_restored=2729, sidecar_status="present",
            sidecar_count=None, ctx_checkpoints=0, build_persists=False, created_at=123.5))
        assert replaced == []
        assert cat.pending_verdicts("p") == [note] == cat.pending_verdicts("p", 1)
        assert cat.pending_verdicts("p", 0) == [] and cat.pending_verdicts("q") == []
        assert (note.session_id, note.server_url, note.slot_id, note.n_restored, note.sidecar_status,
                note.sidecar_count, note.ctx_checkpoints, note.build_persists, note.created_at) == \
            (rec.id, URL, 1, 2729, "present", None, 0, False, 123.5)

        assert cat.settle_pending_verdict(note.id, VerdictKind.HIT, "resumed", 2.5)
        assert not cat.settle_pending_verdict(note.id, VerdictKind.DISCARDED, "again", 0.0)
        stored = cat.get_by_id(rec.id)
        assert (stored.last_verdict, stored.last_verdict_reason) == (VerdictKind.HIT, "resumed")
        assert stored.time_saved_s == stored.last_time_saved_s == 2.5
        assert cat.pending_verdicts("p") == []


def test_a_newer_restore_into_the_slot_replaces_the_note_and_a_deleted_session_takes_its_note(db, caplog):
    with Catalog(db) as cat:
        a, b = add_session(cat, "a"), add_session(cat, "b")
        cli = service(cat)
        first = resumed(cli, a)
        with caplog.at_level(logging.WARNING, logger="app.sessions.wiring"):
            second = resumed(cli, b)
        assert [n.id for n in cat.pending_verdicts("p")] == [second.id] != [first.id]
        assert "no verdict for the restore of session 'a' into slot 1" in caplog.text
        assert "a newer restore into the same slot replaced it" in caplog.text
        cat.delete("p", "b")
        assert cat.pending_verdicts("p") == []


async def test_a_resume_in_another_process_is_judged_by_the_process_that_reads_the_log(db):
    with Catalog(db) as cli_cat, Catalog(db) as serve_cat:
        rec = add_session(cli_cat)
        serve_cat.record_prefill("p", 1000, 1000.0)  # 1,000 tokens/s
        sup = FakeSupervisor(started_at=time.time())
        serve = service(serve_cat, sup)
        seen = []
        serve.on_verdict(lambda slot, name, v: seen.append((slot, name, v.kind)))
        cli = service(cli_cat)  # `kv-valet resume`: it reads no log
        resumed(cli, rec)
        await cli.aclose()  # the resume command is over long before the query comes
        for line in QUERY:
            sup.emit(line)
        await serve.aclose()
        assert seen == [(1, "chat", VerdictKind.HIT)]
        stored = serve_cat.get_by_id(rec.id)
        assert stored.last_verdict is VerdictKind.HIT and "2,729" in stored.last_verdict_reason
        assert stored.last_time_saved_s == pytest.approx(2.729)
        assert serve_cat.pending_verdicts("p") == []


async def test_a_watch_armed_after_its_query_ran_takes_the_lines_already_fed(db):
    """The proxy arms a restore's watch once the request it is for was sent (issue #38). A quick server can run
    that query, and the reader thread deliver its lines, before the watch is armed (seen 2 times in 36 under
    load on the fake): the watch takes the slot's lines read since the restore ended from the log it was fed,
    and the earlier task's lines, read before that, stay out."""
    earlier = ["0.10.000.000 I slot print_timing: id  1 | task 50 | prompt eval time =    4513.00 ms /  2736 tokens",
               "0.10.000.100 I slot      release: id  1 | task 50 | stop processing: n_tokens = 2737, truncated = 0"]
    with Catalog(db) as cat:
        rec = add_session(cat)
        sup = FakeSupervisor(started_at=time.time() - 10)
        serve = service(cat, sup)
        seen = []
        serve.on_verdict(lambda slot, name, v: seen.append((slot, name, v.kind, v.cache_n)))
        ended = time.time() - 1.0
        for line in earlier:  # read before the restore ended (a late batch of the slot's last task)
            sup.emit(line, at=ended - 0.5)
        for line in QUERY:  # the query's lines, read and fed before the watch is armed
            sup.emit(line, at=ended + 0.1)
        sup.emit("0.21.000.000 I slot print_timing: id  0 | task 61 | prompt eval time =  9.00 ms / 9 tokens",
                 at=ended + 0.2)  # another slot's task: not this watch's
        assert seen == []
        resumed(serve, rec, ended=ended)
        assert seen == [(1, "chat", VerdictKind.HIT, 2729)]  # the query's: 21 processed, 2,729 reused
        for line in QUERY:  # the same lines again, live: nothing more to judge
            sup.emit(line)
        await serve.aclose()
        assert len(seen) == 1
        assert cat.get_by_id(rec.id).last_verdict is VerdictKind.HIT and cat.pending_verdicts("p") == []


async def test_a_resume_that_named_the_server_by_its_url_is_judged_too(db):
    with Catalog(db) as cat:
        rec = add_session(cat)
        sup = FakeSupervisor(started_at=time.time())
        serve = service(cat, sup)
        cli = service(cat, profile=URL)  # `kv-valet resume http://127.0.0.1:9 chat --save-dir …`
        resumed(cli, rec)
        await cli.aclose()
        for line in QUERY:
            sup.emit(line)
        await serve.aclose()
        assert cat.get_by_id(rec.id).last_verdict is VerdictKind.HIT and cat.pending_verdicts("p") == []


async def test_a_rename_while_it_waits_keeps_the_note(db):
    with Catalog(db) as cat:
        rec = add_session(cat, "before")
        sup = FakeSupervisor(started_at=time.time())
        serve = service(cat, sup)
        seen = []
        serve.on_verdict(lambda slot, name, v: seen.append(name))
        cli = service(cat)
        resumed(cli, rec)
        await cli.aclose()
        cat.rename("p", "before", "after")
        for line in QUERY:
            sup.emit(line)
        await serve.aclose()
        assert seen == ["after"]
        assert cat.get("p", "after").last_verdict is VerdictKind.HIT and cat.get("p", "before") is None


async def test_a_rename_in_the_resuming_process_while_it_waits_lands_the_verdict_on_the_renamed_session(db):
    """The window resumes and reads the log itself; the user renames the session before the next
    query: the note (keyed by the session's id) survives the rename, and the verdict, the time saved
    and the name the front ends are told are the renamed session's."""
    with Catalog(db) as cat:
        rec = add_session(cat, "before")
        cat.record_prefill("p", 1000, 1000.0)
        sup = FakeSupervisor(started_at=time.time())
        window = service(cat, sup)
        seen = []
        window.on_verdict(lambda slot, name, v: seen.append((slot, name, v.kind)))
        note = resumed(window, rec)
        assert note is not None and note.session_id == rec.id
        renamed = window.rename("before", "after")
        assert renamed.id == rec.id
        assert [(n.id, n.session_id) for n in cat.pending_verdicts("p")] == [(note.id, rec.id)]  # still waiting
        for line in QUERY:
            sup.emit(line)
        await window.aclose()
        assert seen == [(1, "after", VerdictKind.HIT)]
        stored = cat.get_by_id(rec.id)
        assert stored.name == "after" and stored.last_verdict is VerdictKind.HIT and "2,729" in stored.last_verdict_reason
        assert stored.last_time_saved_s == pytest.approx(2.729)
        assert cat.get("p", "before") is None and cat.pending_verdicts("p") == []


async def test_two_watchers_of_one_restore_write_the_verdict_once(db):
    with Catalog(db) as cat1, Catalog(db) as cat2:
        rec = add_session(cat1)
        cat1.record_prefill("p", 1000, 1000.0)
        sup = FakeSupervisor(started_at=time.time())
        # the window resumed it and reads the log itself; a second process reads the same log
        window, other = service(cat1, sup), service(cat2, sup)
        seen = []
        window.on_verdict(lambda slot, name, v: seen.append(("window", v.kind)))
        other.on_verdict(lambda slot, name, v: seen.append(("other", v.kind)))
        resumed(window, rec)
        for line in QUERY:
            sup.emit(line)  # each line reaches both watchers: both judge the task
        await window.aclose()
        await other.aclose()
        assert sorted(seen) == [("other", VerdictKind.HIT), ("window", VerdictKind.HIT)]
        stored = cat1.get_by_id(rec.id)
        assert stored.time_saved_s == stored.last_time_saved_s == pytest.approx(2.729)  # counted once
        assert cat1.pending_verdicts("p") == []


async def test_a_second_watcher_that_comes_after_the_verdict_judges_nothing(db):
    with Catalog(db) as cat1, Catalog(db) as cat2:
        rec = add_session(cat1)
        first, late = FakeSupervisor(time.time()), FakeSupervisor(time.time())
        a, b = service(cat1, first), service(cat2, late)
        seen = []
        b.on_verdict(lambda *args: seen.append(args))
        cli = service(cat1)
        resumed(cli, rec)
        await cli.aclose()
        for line in QUERY:
            first.emit(line)
        for line in QUERY:
            late.emit(line)
        await a.aclose()
        await b.aclose()
        assert seen == [] and b.watcher.pending() == {}
        assert cat1.get_by_id(rec.id).last_verdict is VerdictKind.HIT


async def test_a_note_older_than_the_server_start_is_dropped(db, caplog):
    with Catalog(db) as cat:
        old, newer = add_session(cat, "old"), add_session(cat, "newer")
        cat.update_verdict(old.id, VerdictKind.UNKNOWN, "no query on this slot since the restore yet")
        cat.add_pending_verdict(PendingVerdict(session_id=old.id, profile="p", slot_id=0, n_restored=2729,
                                               created_at=100.0))
        restored_later = cat.add_pending_verdict(PendingVerdict(session_id=newer.id, profile="p", slot_id=1,
                                                                n_restored=2729, created_at=300.0))[0]
        sup = FakeSupervisor(started_at=200.0)  # the server (re)started between the two restores
        with caplog.at_level(logging.WARNING, logger="app.sessions.wiring"):
            serve = service(cat, sup)
        assert "no verdict for the restore of session 'old' into slot 0" in caplog.text
        assert "the server restarted since" in caplog.text
        assert cat.pending_verdicts("p") == [restored_later]

        sup.started_at = 400.0  # an auto-restart while this service still reads the log
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="app.sessions.wiring"):
            for line in QUERY:
                sup.emit(line)
        await serve.aclose()
        assert "session 'newer' into slot 1" in caplog.text and "the server restarted since" in caplog.text
        assert cat.pending_verdicts("p") == [] and serve.watcher.verdicts == []
        assert cat.get_by_id(old.id).last_verdict is VerdictKind.UNKNOWN
        assert cat.get_by_id(newer.id).last_verdict is None
