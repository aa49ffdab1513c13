"""``kv-valet build-server`` on the real cache entry: found without building, the default profile
switches to it, and it runs.

Cache only: the entry is the one tests/sidecar-server/build made (the same pipeline and key, the
default CPU options); this test never downloads or compiles. Without it: skip, or fail under CI
(tests/real/sidecar_bin.py). The real cache is not written to: the lookup runs on a cache folder of
this test that links the real entry.
"""

from __future__ import annotations

import subprocess

import pytest

from app.core.profile import BUILT_MARKER
from app.cli import main
from app.tools.server_build import default_switch_wanted
from app.serverbuild import cache
from app.store.profiles import ProfileStore
from tests.real.helpers import link_real_build
from tests.real.sidecar_bin import sidecar_server_bin  # noqa: F401  (fixture)

pytestmark = pytest.mark.real_server


def test_the_cached_build_is_found_selected_and_runs(sidecar_server_bin, tmp_path, monkeypatch, capsys):  # noqa: F811
    real_entry = sidecar_server_bin.parent
    version = cache.installed_version()
    root = link_real_build(sidecar_server_bin, tmp_path, monkeypatch)  # this test's own cache folder

    store = ProfileStore()
    default = store.ensure_default()
    assert default.server_binary == ""  # stock, and Gemma 3 270M needs checkpoints to resume
    assert default_switch_wanted(store, None)  # the window would ask (once)

    assert main(["build-server", "--cached-only", "--backend", "cpu", "--use-in", "default"]) == 0
    out, err = capsys.readouterr()
    binary = out.strip().splitlines()[-1]
    assert binary == str(root / real_entry.name / "llama-server")
    assert "configure" not in err and "compile" not in err  # nothing was built
    assert store.load("default").server_binary == BUILT_MARKER
    assert not default_switch_wanted(store, None)

    from app.server.discovery import find_server_binary

    found = find_server_binary(BUILT_MARKER)
    assert found.path == binary and found.source == BUILT_MARKER
    r = subprocess.run([found.path, "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "version" in (r.stdout + r.stderr)
    assert cache.find_built().out_of_date(version, cache.sha256_file(cache_patch())) is None


def cache_patch():
    from app.serverbuild import PATCH

    return PATCH
