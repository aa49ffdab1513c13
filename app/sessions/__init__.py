"""Sessions: the steps on one server's slots (park, resume, check, the A/B) and
:class:`app.sessions.service.SessionService`, the Qt-free service both faces use.

Below :mod:`app.tools`, :mod:`app.move` and :mod:`app.servers`; above the server,
monitor, store and core layers. Nothing here imports a floor above it.
"""
