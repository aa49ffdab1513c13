"""The server a job works on: owned (launched from a profile) or attached (a URL).

Everything a park/resume/check needs to know about the server, gathered once:
its client, its --slot-save-path folder, its build, model and KV cache types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from app.core.profile import LaunchProfile
from app.jobs.queue import OperationQueue
from app.server.client import LlamaClient
from app.server.supervisor import LogBuffer
from app.store.catalog import Catalog


@dataclass
class ServerTarget:
    client: LlamaClient
    url: str
    save_dir: Path  # the server's --slot-save-path (files go to save_dir / filename)
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
    log: LogBuffer | None = None  # the server log, when the app launched the server
    queue: OperationQueue = field(default_factory=OperationQueue)
    # slot id -> (n_tokens, session name, id_task seen in /slots at restore time):
    # after a restore /slots shows no task for the slot, so the app keeps the count.
    restored: dict[int, tuple[int, str | None, int | None]] = field(default_factory=dict)

    @classmethod
    async def connect(cls, client: LlamaClient, catalog: Catalog, *, profile: LaunchProfile | None = None,
                      save_dir: str | Path | None = None, log: LogBuffer | None = None,
                      build: str | None = None) -> "ServerTarget":
        """Read /props and fill in what the profile does not say."""
        props = await client.props()
        if save_dir is None:
            if profile is None:
                raise ValueError("attach mode needs the server's --slot-save-path folder")
            from app.server.launcher import slot_save_path_for

            save_dir = slot_save_path_for(profile)
        p = profile
        return cls(
            client=client,
            url=client.base_url,
            save_dir=Path(save_dir),
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
        )
