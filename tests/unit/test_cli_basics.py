"""The entry point without a display, and usage errors, from a shell's point of view."""

import os
import subprocess
import sys


def _run(args, **env_changes):
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    env.update(env_changes)
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, env=env,
                          timeout=60)


def test_no_display_says_what_to_do_instead():
    r = _run([])
    assert r.returncode == 2
    assert "no display" in r.stderr and "kv-valet serve default" in r.stderr


def test_unknown_profile_is_a_clear_error_not_a_traceback():
    r = _run(["serve", "no-such-profile"])
    assert r.returncode == 1
    assert "no profile named 'no-such-profile'" in r.stderr and "Traceback" not in r.stderr


def test_status_of_a_server_that_is_not_there():
    r = _run(["status", "http://127.0.0.1:9", "--json"])
    assert r.returncode == 1 and "Traceback" not in r.stderr
    import json

    snap = json.loads(r.stdout)
    assert snap["health"].startswith("unreachable")


def test_status_of_a_dead_server_says_why_not_http_0():
    """Regression: "unreachable: HTTP 0" for a server that does not answer at all."""
    r = _run(["status", "http://127.0.0.1:9"])
    assert r.returncode == 1
    assert "HTTP 0" not in r.stdout and "unreachable" in r.stdout


def test_no_option_puts_an_api_key_on_the_command_line():
    """An --api-key argument would show the key to `ps`: the CLI has none."""
    for cmd in (["status", "http://x"], ["park", "p", "--slot", "0"], ["resume", "p", "s"], ["check", "p", "s"]):
        r = _run(cmd + ["--api-key", "sekret"])
        assert r.returncode == 2 and "--api-key would show the key to every user" in r.stderr


def test_start_opens_the_window_only_so_it_is_refused_with_a_command(capsys):
    """``kv-valet --start PROFILE`` opens the window; given with a command it would be ignored
    silently, so it is refused with the usage error and nothing runs."""
    import pytest

    from app.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--start", "default", "profiles", "list"])
    assert e.value.code == 2
    assert "--start opens the window: give it without a command" in capsys.readouterr().err


def test_serve_of_a_hosts_profile_says_what_it_needs():
    """``serve HOST:PROFILE`` is the proxy here in front of a host's server: without --proxy, with an
    unknown host, or --port for a profile here, each is a clear error (exit 1), never a traceback."""
    r = _run(["serve", "box:there"])
    assert r.returncode == 1 and "--proxy" in r.stderr and "kv-valet hosts start box there" in r.stderr
    r = _run(["serve", "nohost:there", "--proxy"])
    assert r.returncode == 1 and "no host named 'nohost'" in r.stderr and "Traceback" not in r.stderr
    r = _run(["serve", "default", "--port", "9000"])
    assert r.returncode == 1 and "--port is for HOST:PROFILE" in r.stderr
