"""Moving or copying a parked session between targets, here or on another host over SSH.

Above :mod:`app.tools` and :mod:`app.sessions`; below :mod:`app.servers`.
"""
