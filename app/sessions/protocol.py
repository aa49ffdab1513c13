"""One face of a server's parked sessions, whatever kind of server it is (issue #27).

The Sessions tab drives :class:`Sessions` and nothing else: a server here, launched or
attached (:class:`app.sessions.service.SessionService`), and a remote host's server
(:class:`app.servers.remote_sessions.RemoteSessions`, through that host's own ``kv-valet``
over SSH) answer the same calls with the same results (app.sessions.park.ParkResult,
app.sessions.resume.ResumeResult). What a kind cannot do is said by its :class:`Capabilities`,
never by asking which kind it is: the tab enables its controls from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:
    from app.core.profile import LaunchProfile
    from app.monitor.slots import SlotRow
    from app.sessions.park import ParkResult
    from app.sessions.resume import ResumeResult
    from app.store.catalog import SessionRecord


@dataclass(frozen=True)
class Capabilities:
    """What a server's sessions can do from here (True: the tab offers it)."""

    park: bool = True  # park one slot
    resume: bool = True  # resume a session into a slot (with the confirmation a hazard asks)
    park_all: bool = True  # park every slot that holds tokens
    park_and_stop: bool = False  # park every slot, then stop the server (one KV Valet launched)
    resume_all: bool = True  # the resume plan left by a park-all-and-stop or a sleep
    check: bool = True  # "Check resume" and the A/B: probes whose report the window shows
    check_across_restarts: bool = False  # the A/B restarts the server between its arms
    local_files: bool = True  # history, rename, delete, show in folder: this machine's catalog and files
    choose_save_dir: bool = True  # a server whose --slot-save-path is not known asks for it at the first park


#: a host's server, through its kv-valet: park and resume there; its files, its catalog and its
#: checks stay the host's (no report crosses back, no restart from here)
REMOTE = Capabilities(resume_all=False, check=False, local_files=False, choose_save_dir=False)


@runtime_checkable
class Sessions(Protocol):
    """A server's parked sessions: the records, the slots, park, resume, check."""

    #: the host the server runs on, None for this machine
    host: str | None
    recovery_messages: list[str]

    @property
    def capabilities(self) -> Capabilities: ...

    @property
    def profile_name(self) -> str: ...

    @property
    def profile(self) -> "LaunchProfile | None": ...

    @property
    def save_dir(self) -> PurePath | None: ...

    @property
    def running(self) -> bool:
        """Its server runs: park and resume can be asked."""

    def describe(self) -> str:
        """One line under the tab's controls: where the sessions are parked, or the server's state."""

    def sessions(self) -> "list[SessionRecord]":
        """The records as known now (no I/O)."""

    async def slot_rows(self) -> "list[SlotRow]": ...

    async def park(self, slot_id: int | None = None, name: str | None = None, *,
                   on_progress: "Callable[[str], None] | None" = None,
                   budget_bytes: int | None = None) -> "ParkResult":
        """Park ``slot_id`` (None: the default slot) as ``name``; raises ServiceError. ``on_progress``
        hears each step, where the implementation can tell them; ``budget_bytes``: this machine's most a
        park may take (a park here predicted larger is refused before it runs)."""

    async def resume(self, name: str, slot_id: int | None = None, *, force: bool = False,
                     avoid_hazard: bool = False, avoid_useless: str | None = None,
                     avoid_mismatch: bool = False, leased: bool = False,
                     later: "Callable[[Callable[[], None]], None] | None" = None) -> "ResumeResult":
        """Resume ``name``; raises ResumeRefused, NeedsConfirmation (unless ``force``), ResumeFailed.
        Even with ``force``, a caller that re-processes instead asks to leave it parked (ResumeHazard,
        ResumeUseless for the ``avoid_useless`` probe "chat" or "exact", ResumeMismatch). ``leased``: the
        caller holds ``slot_id`` (the proxy's lease), so what it holds now need not be read first.
        ``later``: takes the restore's bookkeeping (its catalog note, the verdict's watch armed) to run
        once the caller has sent the request the restore is for (the proxy: before the server can answer
        it); without it, that runs before this returns."""

    async def check(self, name: str, slot_id: int | None = None, *, force: bool = False):
        """Restore ``name`` and judge a first query (capabilities.check); raises ServiceError."""

    async def restore_judged(self, name: str, slot_id: int | None = None, *,
                             output_check: bool = True) -> "dict[str, Any]":
        """Restore ``name`` whatever the slot holds and judge a first query (a move's "restore there",
        any kind of server): the check's report as JSON (app.sessions.check_export.report_dict: its
        ``slot_id``, ``n_restored``, ``verdict``). ``output_check`` False: no comparison with a cold
        prefill. Raises ServiceError (a host's RemoteError when it does not answer)."""

    async def ab(self, name: str, slot_id: int | None = None, *, force: bool = False, baseline: bool = False):
        """The A/B: with its sidecar and with it hidden (capabilities.check); raises ServiceError."""

    def park_bytes(self, name: str) -> int:
        """Bytes the park ``name`` takes (its sidecar included); 0 if not known."""

    def discard(self, name: str) -> None:
        """Delete the park ``name`` (its files and its record): here at once, on a host in the background;
        a failure is logged (the conversation proxy's parks past its disk budget, a restore that failed)."""

    async def parked_tokens(self, name: str) -> "list[int] | None":
        """The park's own tokens, read from its state file where this machine can read it (None: a host's
        park, or no such park). Raises OSError or StateFileError for a file that cannot be read."""

    async def park_all(self, prefix: str | None = None, *, remember: bool = False) -> "list[ParkResult]":
        """Park every slot that holds tokens (capabilities.park_all)."""

    async def park_all_and_stop(self, prefix: str | None = None):
        """Park every slot, then stop the server (capabilities.park_and_stop); raises ServiceError."""

    async def resume_all(self) -> list:
        """Resume the sessions of :meth:`resume_plan` (capabilities.resume_all)."""

    def on_this_server(self, rec: "SessionRecord") -> str | None:
        """What this server will do with ``rec``'s sidecar, as a sentence (None: nothing to say)."""

    def resume_plan(self) -> list:
        """The sessions a park-all left to resume (capabilities.resume_all)."""

    def queue_labels(self) -> list[str]:
        """The slot operations running or waiting, in order."""

    def on_change(self, cb: Callable[[], None]) -> None:
        """Call ``cb`` when the records or the slots changed."""

    async def reload(self) -> None:
        """List the records again (they changed from outside: a move); the observers hear it."""

    def on_queue(self, cb: Callable[[], None]) -> None:
        """Call ``cb`` when the operations queue changed."""

    def on_restored(self, cb) -> None: ...

    def on_verdict(self, cb) -> None: ...

    async def warm_model_identity(self) -> None: ...

    async def verify_sidecar_hashes(self, records=None) -> bool: ...
