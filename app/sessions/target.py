"""The server a job works on: owned (launched from a profile) or attached (a URL).

Everything a park/resume/check needs to know about the server, gathered once:
its client, its --slot-save-path folder, its build, model and KV cache types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from app.core.observers import Observers
from app.core.profile import LaunchProfile
from app.core.sidecar_behaviour import Behaviour
from app.sessions.queue import OperationQueue
from app.monitor.slots import LastTask, RestoredSlot, SlotRow, SlotsUnavailable, slot_rows
from app.server.client import LlamaClient, ServerError
from app.server.supervisor import LogBuffer
from app.store.catalog import Catalog


class RouterSlots(ServerError):
    """A router's /slots: its children's, by model, none of its own (said in plain words)."""

    def __init__(self):
        super().__init__(400, SlotsUnavailable.ROUTER, path="/slots")

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class HeldSession:
    """The session a slot was last parked as or restored from, in this server process."""

    name: str
    n_tokens: int
    id_task: int | None  # /slots id_task then: a different one means a task ran since (None: not known)


@dataclass
class ServerTarget:
    client: LlamaClient
    url: str
    save_dir: Path | None  # the server's --slot-save-path (files go to save_dir / filename); None: not known
    catalog: Catalog
    profile_name: str  # the profile's name, or the URL in attach mode
    profile: LaunchProfile | None = None  # None in attach mode
    build: str = "unknown"  # /props build_info, else --version
    model_path: str = ""  # /props model_path
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    flash_attn: str = "auto"
    swa_full: bool = False
    ctx_checkpoints: int = 32
    # what this build does with checkpoint sidecars (app.core.sidecar_behaviour.Behaviour)
    behaviour: Behaviour = Behaviour.UNKNOWN
    # the memory kind the server's own log reported at load (``print_info``): it wins over the GGUF's
    model_kind_from_log: str | None = None
    log: LogBuffer | None = None  # the server log, when the app launched the server
    queue: OperationQueue = field(default_factory=OperationQueue)
    # After a restore /slots does not show the restored tokens, so the app keeps them.
    restored: dict[int, RestoredSlot] = field(default_factory=dict)
    # Each slot's last task from the log (/slots zeroes its figures at release).
    last_tasks: dict[int, LastTask] = field(default_factory=dict)
    # Whose context checkpoints each slot holds (a session's name, or "the chat of task N"):
    # on a build that keeps them across restores (the fork) they matter to the next resume.
    checkpoint_owners: dict[int, str] = field(default_factory=dict)
    # What each slot was last parked as or restored from (app.sessions.park_choice.choose_parks).
    held_as: dict[int, HeldSession] = field(default_factory=dict)
    # The parks this server process made (a session's name -> its row's id and updated_at then): a restore of
    # one into it needs no look at the model file (app.sessions.resume.preflight). Emptied with the process.
    parked_here: dict[str, tuple[int | None, float]] = field(default_factory=dict)
    # When the server process started (epoch s; None: not known): parks and restores another
    # KV Valet process recorded since then describe what its slots hold.
    started_at: float | None = None
    # a router (no model of its own; /props "role": "router"): its slots are its child servers'
    router: bool = False
    # told the rows of every read of /slots a decision made (a park, a resume, a check): the server's
    # one slot picture takes them (its sampler's, app.monitor.sampler.Sampler.feed_slots), not a read more
    slots_read: Observers[[list[SlotRow]]] = field(default_factory=lambda: Observers("the slots were read"),
                                                   compare=False, repr=False)

    # the rows of the last /slots read of this server process (:meth:`slot_rows`): which slots there are and
    # each one's n_ctx, fixed for the process; what a slot held then, and its task id, may have changed since
    last_rows: list[SlotRow] | None = field(default=None, compare=False, repr=False)

    async def slot_rows(self) -> list[SlotRow]:
        """``GET /slots`` as typed rows, with what the app knows that /slots does not (a router has none
        of its own: RouterSlots); :attr:`slots_read` is told them."""
        if self.router:
            raise RouterSlots()
        data = await self.client.slots()
        if not isinstance(data, list):
            from app.server.client import ServerError

            raise ServerError(200, "GET /slots did not answer a list", path="/slots")
        rows = slot_rows(data, self.restored, self.last_tasks)
        self.last_rows = list(rows)
        self.slots_read.emit(list(rows))
        return rows

    @classmethod
    async def connect(cls, client: LlamaClient, catalog: Catalog, *, profile: LaunchProfile | None = None,
                      save_dir: str | Path | None = None, log: LogBuffer | None = None,
                      build: str | None = None) -> "ServerTarget":
        """Read /props and fill in what the profile does not say."""
        props = await client.props()
        if not save_dir and profile is not None:
            from app.server.launcher import slot_save_path_for

            save_dir = slot_save_path_for(profile)
        p = profile
        return cls(
            client=client,
            url=client.base_url,
            save_dir=Path(save_dir) if save_dir else None,
            catalog=catalog,
            profile_name=p.name if p else client.base_url,
            profile=p,
            # The server's own word first, so the CLI, the window and attach mode
            # key "does this build persist checkpoints?" the same way.
            build=str(props.get("build_info") or build or "unknown"),
            model_path=str(props.get("model_path") or (p.model if p else "")),
            cache_type_k=(p.cache_type_k if p and p.cache_type_k else "f16"),
            cache_type_v=(p.cache_type_v if p and p.cache_type_v else "f16"),
            flash_attn=(p.flash_attn if p and p.flash_attn else "auto"),
            swa_full=bool(p.swa_full) if p else False,
            ctx_checkpoints=(p.ctx_checkpoints if p and p.ctx_checkpoints is not None else 32),
            log=log,
            router=props.get("role") == "router",
        )
