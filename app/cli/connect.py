"""How a command reaches the catalog and a server's session service: one way for every
``kv-valet`` command (``sessions``, ``park``, ``resume``, ``check``, ``move``)."""

from __future__ import annotations

from app.cli.errors import CliError, Exit, note


def open_catalog():
    from app import paths
    from app.store.catalog import Catalog

    return Catalog(paths.catalog_path())


async def connect(catalog, target_arg: str, *, save_dir: str | None = None, api_key: str | None = None,
                  log_buffer=None):
    """The session service of a profile's server or a server URL, through the server service
    (app.servers.service: the one target resolver); recovery notes go to stderr."""
    from app.servers.service import ServerService

    if "://" in target_arg and not save_dir:
        raise CliError("--save-dir is required with a server URL (the server's --slot-save-path)", Exit.USAGE)
    servers = ServerService(catalog, connect_sessions=False)
    try:
        handle = servers.reach(target_arg, save_dir=save_dir, api_key=api_key)
        svc = await servers.sessions(handle.id, log_buffer=log_buffer)
    except BaseException:
        await servers.aclose()
        raise
    svc.close_with(servers.aclose)
    for msg in svc.recovery_messages:
        note(msg)
    return svc
