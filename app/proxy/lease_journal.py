"""The lease journal of one server's slots: every change written to the conversation store before the
backend call that depends on it, the journal compacted to a snapshot of the slots, and the slots read
back from it at a start after a crash.

**Journal first** (the rule of :mod:`app.proxy.leases`): "saving" before the save, "restoring" before the
restore, "acquired" before the request is sent, with the lease fields of the conversations it touched,
in one transaction: after a crash :meth:`LeaseJournal.recover` finds an interrupted save ("saving" never
followed by "saved") and drops that park. A store that cannot be written (full disk) is logged and does
not stop the requests. The store is written synchronously on the loop (a WAL commit without fsync, well
under a millisecond): the order of the journal is the order of the changes, which a write from a worker
thread would not guarantee.

**Held entries** (issue #38: a commit is ~0.1 ms on a request's path): an entry a crash cannot make wrong
is written ``later``: kept in order and committed with the next entry written at once, or by
:meth:`LeaseJournal.flush`, which the proxy calls once the request is sent upstream (its bytes handed to
the connection: the commit then runs while the server works). Two entries are held: "acquired" of a slot
that keeps its dirty conversation (lost, the journal still says that conversation is there, dirty: a
recovery that keeps the slot saves it before anyone takes it, as it must anyway) and "restored" (lost,
the journal's last word on the slot is "restoring": a recovery takes the slot as FREE, its content
unknown).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from app.core import conversation as model
from app.core.conversation import Cause, Conversation
from app.proxy.lease_table import IDLE, LeaseTable, Slot, SlotState, park_name
from app.store.conversations import ConversationStore, ConversationStoreError, JournalEntry

log = logging.getLogger(__name__)
#: The journal is rewritten as a snapshot of the slots after this many entries.
JOURNAL_COMPACT_EVERY = 2000


def open_conversation_store(path: str | Path | None = None) -> ConversationStore:
    """The conversation store with the proxy's value types (``<data>/conversations.sqlite3`` by default)."""
    return ConversationStore(path, values=model)


@dataclass(frozen=True)
class RecoveryReport:
    """What :meth:`SlotLeases.recover` found in the journal."""

    interrupted_saves: tuple[str, ...] = ()  # conversations whose save never finished: park dropped
    kept: dict[int, str] = field(default_factory=dict)  # slot -> conversation trusted to be in it still
    lost: tuple[str, ...] = ()  # conversations stored as in a slot that are no longer

    def messages(self) -> list[str]:
        out = [f"conversation {c}: its save was interrupted, the park is dropped" for c in self.interrupted_saves]
        out += [f"slot {i}: still holds conversation {c}" for i, c in sorted(self.kept.items())]
        return out + [f"conversation {c}: no longer in a slot" for c in self.lost]


class LeaseJournal:
    """The journal of one server's :class:`LeaseTable`, in the conversation store (none: not kept)."""

    def __init__(self, store: ConversationStore | None, profile: str, clock: Callable[[], float],
                 table: LeaseTable) -> None:
        self._store = store
        self.profile = profile
        self._clock = clock
        self._table = table
        self._writes = 0
        self._held: list[tuple[JournalEntry, list[Conversation]]] = []  # written ``later``, in order
        #: told ``(event, conversation)`` of every journaled change (the proxy's KV events follow them)
        self.on_change: Callable[[str, str | None], None] | None = None

    def entry(self, event: str, slot: Slot | None, *, conv_id: str | None = None, park: str | None = None,
              n_tokens: int | None = None, detail: str = "", state: SlotState | None = None) -> JournalEntry:
        if slot is not None:
            conv_id = conv_id or slot.holder
            n_tokens = slot.n_tokens if n_tokens is None else n_tokens
            state = state or slot.state
        return JournalEntry(profile=self.profile, event=event, slot=None if slot is None else slot.index,
                            conversation=conv_id, park=park, n_tokens=n_tokens,
                            state=None if state is None else state.value, detail=detail, at=self._clock())

    def write(self, event: str, slot: Slot | None, *, conv_id: str | None = None, park: str | None = None,
              n_tokens: int | None = None, detail: str = "", state: SlotState | None = None,
              touched: Iterable[Conversation | None] = (), later: bool = False) -> None:
        """``later``: held, written with the next entry or by :meth:`flush` (the module's doc says which)."""
        if self.on_change is not None:
            self.on_change(event, conv_id or (slot.holder if slot is not None else None))
        if self._store is None:
            return
        entry = self.entry(event, slot, conv_id=conv_id, park=park, n_tokens=n_tokens, detail=detail, state=state)
        self._held.append((entry, [c for c in touched if c is not None]))
        if not later:
            self.flush()

    @property
    def held(self) -> bool:
        return bool(self._held)

    def flush(self) -> None:
        """Write the held entries (none: nothing to do)."""
        if not self._held:
            return
        items, self._held = self._held, []
        assert self._store is not None
        try:
            self._store.append_journal(items)
        except ConversationStoreError as e:
            log.error("slot lease journal not written (%s): %s",
                      ", ".join(f"{entry.event} {entry.conversation}" for entry, _ in items), e)
            return
        self._writes += len(items)
        if self._writes >= JOURNAL_COMPACT_EVERY:
            self._compact()

    def _compact(self) -> None:
        """Rewrite the journal as what a replay of it gives: one entry per slot (a save in flight as
        its "saving" entry, so a crash during it is still found)."""
        entries = []
        for s in self._table.slots:
            if s.state is SlotState.SAVING and s.holder is not None:
                entries.append(self.entry("saving", s, park=park_name(s.holder)))
            elif s.holder is not None or s.state is not SlotState.FREE:
                entries.append(self.entry("snapshot", s))
        self._rewrite(entries, ())

    def _rewrite(self, entries: list[JournalEntry], touched: Iterable[Conversation]) -> None:
        self._writes = 0
        if self._store is None:
            return
        try:
            self._store.rewrite_journal(self.profile, entries, conversations=list(touched))
        except ConversationStoreError as e:
            log.error("slot lease journal not rewritten: %s", e)

    # -- start after a crash

    def recover(self, delete_park: Callable[[str], bool], server_same_process: bool = False) -> RecoveryReport:
        """Read the journal at start (before any acquire). A save that was interrupted ("saving" never
        followed by "saved") leaves a park that cannot be trusted: it is deleted (``delete_park``) and its
        conversation not parked. The slots are all FREE, unless ``server_same_process`` (the app crashed,
        the server did not): then the journal's last idle slot owners are kept (a slot busy at the crash
        is FREE). The journal is then rewritten as a snapshot of the slots."""
        table = self._table
        if table.leases or any(s.state is not SlotState.FREE for s in table.slots):
            raise RuntimeError("recover() is for a start: slots are already in use")
        if self._store is None:
            return RecoveryReport()
        last: dict[int, JournalEntry] = {}
        pending: dict[str, JournalEntry] = {}
        for e in self._store.journal_entries(self.profile):
            if e.event == "reset":
                last.clear()
            if e.event == "saving" and e.conversation:
                pending[e.conversation] = e
            elif e.event in ("saved", "save_failed") and e.conversation:
                pending.pop(e.conversation, None)
            if e.slot is not None and e.state is not None:
                last[e.slot] = e
        touched: dict[str, Conversation] = {}
        for conv_id, e in pending.items():
            conv = table.conv(conv_id)
            if conv is not None and conv.parked_as in (None, e.park):
                conv.parked_as = None
                touched[conv_id] = conv
            if e.park:
                delete_park(e.park)
        kept: dict[int, str] = {}
        if server_same_process:
            for index, e in sorted(last.items()):
                try:
                    state = SlotState(e.state)
                except ValueError:
                    continue
                if index >= len(table.slots) or not e.conversation or state not in IDLE | {SlotState.SAVING} \
                        or e.conversation in kept.values():
                    continue
                conv = table.conv(e.conversation)
                if conv is None:
                    continue
                s = table.slots[index]
                clean = state is SlotState.IDLE_CLEAN and conv.parked_as == park_name(conv.id)
                s.set(SlotState.IDLE_CLEAN if clean else SlotState.IDLE_DIRTY)
                s.holder, s.n_tokens = conv.id, e.n_tokens or 0
                conv.slot = index
                table.holders[conv.id] = conv
                touched[conv.id] = conv
                kept[index] = conv.id
        lost = []
        cause = Cause.UNKNOWN if server_same_process else Cause.SERVER_RESTARTED
        for conv_id in self._store.in_slots(self.profile):
            if conv_id in kept.values():
                continue
            conv = table.conv(conv_id)
            if conv is None:
                continue
            conv.slot = None
            table.note_lost(conv_id, cause, None)
            touched[conv_id] = conv
            lost.append(conv_id)
        entries = [self.entry("recovered", None, detail=f"server same process: {server_same_process}")]
        entries += [self.entry("kept", table.slots[i]) for i in sorted(kept)]
        self._rewrite(entries, touched.values())
        return RecoveryReport(tuple(pending), kept, tuple(lost))
