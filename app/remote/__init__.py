"""Remote hosts over SSH (issue #20): a host is reached the way its owner reaches it (asyncssh with
their keys, agent, ~/.ssh/config and known_hosts); it runs the real ``kv-valet`` CLI (``--json``)
and its server as a systemd user unit. Qt-free. See :mod:`app.remote.host`."""
