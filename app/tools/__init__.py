"""Tools around a server: the load check, diagnosis (``doctor``), Cache health, remedies and
the build of the checkpoint-persisting server.

Above :mod:`app.sessions` and :mod:`app.remote`; below :mod:`app.move` and :mod:`app.servers`.
"""
