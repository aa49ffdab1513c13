"""Servers: :class:`app.servers.service.ServerService` (every server KV Valet runs, watches or
reaches), its events (:mod:`app.servers.events`), the launch path (:mod:`app.servers.launch`),
the list of every server here and on other hosts (:mod:`app.servers.server_list`), and a host's
server's sessions behind the one Sessions protocol (:mod:`app.servers.remote_sessions`).

Above :mod:`app.move`, :mod:`app.tools` and :mod:`app.sessions`; below the proxy and the faces.
"""
