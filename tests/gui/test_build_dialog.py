"""The "Build a checkpoint-persisting server…" dialog and the profile form's Server binary field,
on the fake sdist (tests/doubles/fake_sdist.py): a real CMake build of a tiny tree in seconds."""

from __future__ import annotations

import shutil

import psutil
import pytest
from PySide6.QtCore import Qt

from app.tools.server_build import BuildRequest
from app.core.profile import BUILT_MARKER
from app.serverbuild.cache import BuildOptions, cache_root, find_built
from app.store.profiles import ProfileStore
from app.ui.dialogs.build import BUILT_LABEL, OTHER_LABEL, STOCK_LABEL, BuildDialog, offer_built_server
from tests.conftest import run, signal_future
from tests.doubles.fake_sdist import fake_patch, make_fake_sdist

pytestmark = [pytest.mark.gui,
              pytest.mark.skipif(not (shutil.which("cmake") and shutil.which("cc") and shutil.which("patch")),
                                 reason="needs cmake, a C compiler and patch (apt-get install cmake gcc patch)")]

CPU = (BuildOptions(), "CPU, for the test")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    src = tmp_path / "src"
    return BuildRequest(sdist=make_fake_sdist(src), patch=fake_patch(src), jobs=2)


def test_the_dialog_shows_the_progress_and_the_built_server(qtbot, qloop, fake):
    d = BuildDialog(request=fake, detected=CPU)
    qtbot.addWidget(d)
    d.show()
    assert "about" in d.estimate_label.text() and d.backend_label.text() == CPU[1]
    seen: list[tuple[str, int, int, int]] = []
    d.sig_progress.connect(lambda p: seen.append((p.step, d.progress.value(), d.progress.maximum(), p.total)))
    finished = signal_future(d.sig_finished)
    qtbot.mouseClick(d.build_button, Qt.LeftButton)
    assert d.running and not d.build_button.isEnabled() and d.cancel_button.isEnabled()
    ok, text, result = run(qloop, finished, 120)
    assert ok and text.startswith("Built") and str(result.binary) in text
    compile_rows = [(v, m) for step, v, m, total in seen if step == "compile" and total]
    assert compile_rows and all(m == compile_rows[0][1] for _v, m in compile_rows)  # the bar counts N/M
    assert [v for v, _m in compile_rows] == sorted(v for v, _m in compile_rows)
    assert ("link", compile_rows[0][1], compile_rows[0][1], compile_rows[0][1]) in seen
    assert d.progress.value() == d.progress.maximum() == 1
    assert d.build_button.isEnabled() and not d.cancel_button.isEnabled() and d.output.isHidden()
    assert find_built().path == result.binary


def test_cancel_stops_the_build_and_caches_nothing(qtbot, qloop, fake):
    from dataclasses import replace

    d = BuildDialog(request=replace(fake), detected=CPU)
    qtbot.addWidget(d)
    d.show()
    d.extra.setText("-DFAKE_HANG=ON")  # the fake tree's link then never ends
    said: list[tuple[int, str]] = []  # what the user saw when the first file compiled (a busy loop may have linked since)
    compiling = signal_future(d.sig_progress, lambda p: p.step == "compile" and p.done >= 1
                              and not said.append((d.progress.maximum(), d.step_label.text())))
    finished = signal_future(d.sig_finished)
    # what this worker already runs (an earlier test's session fixture: the SSH group's sshd) is not the build's
    before = set(psutil.Process().children(recursive=True))
    qtbot.mouseClick(d.build_button, Qt.LeftButton)
    run(qloop, compiling, 120)
    assert said[0][0] > 1 and "Compiling" in said[0][1]
    children = [c for c in psutil.Process().children(recursive=True) if c not in before]
    assert children  # cmake, ninja, the compiler or the never-ending pre-link step
    qtbot.mouseClick(d.cancel_button, Qt.LeftButton)
    ok, text, result = run(qloop, finished, 120)
    assert not ok and result is None and text.startswith("Cancelled")
    assert d.step_label.text() == text and d.build_button.isEnabled() and not d.cancel_button.isEnabled()
    _gone, alive = psutil.wait_procs(children, timeout=120)
    assert [p for p in alive if p.status() != psutil.STATUS_ZOMBIE] == []
    assert [p.name for p in cache_root().iterdir() if not p.name.startswith(".")] == []
    assert not list(cache_root().glob(".build-*")) and find_built() is None


def test_a_failed_build_shows_its_step_and_the_output_tail(qtbot, qloop, fake):
    d = BuildDialog(request=fake, detected=CPU)
    qtbot.addWidget(d)
    d.show()
    d.extra.setText("-DTHIS_IS_BROKEN=")
    finished = signal_future(d.sig_finished)
    qtbot.mouseClick(d.build_button, Qt.LeftButton)
    ok, text, _result = run(qloop, finished, 120)
    assert not ok and "failed at the configure step" in text and "stock one stays selected" in text
    assert d.output.isVisible() and d.output.isReadOnly()
    assert "THIS_IS_BROKEN is set" in d.output.toPlainText()
    assert find_built() is None
    d.extra.setText("-G Ninja")  # not an option CMake takes from here
    assert d.start() is None and "-DNAME=VALUE" in d.step_label.text()


def test_the_form_offers_stock_built_and_other(qtbot, qloop, fake, tmp_path):
    from app.ui.panels import build_window

    w = build_window(ProfileStore(), tabs=False)
    qtbot.addWidget(w)
    w.confirm_quit = False
    field = w.profiles.w["server_binary"]
    labels = [field.choice.itemText(i) for i in range(field.choice.count())]
    assert labels == [STOCK_LABEL, BUILT_LABEL, OTHER_LABEL]
    assert field.text() == "" and field.choice.currentText() == STOCK_LABEL  # the default profile: stock
    assert "not built yet" in field.status.text()

    # the form's button opens the build dialog
    qtbot.mouseClick(field.build_button, Qt.LeftButton)
    d = w.build_dialog
    assert d.isVisible()
    d.request = fake
    d.options = BuildOptions()
    finished = signal_future(d.sig_finished)
    asked: list[str] = []
    import app.ui.dialogs.build as bd

    original = bd.offer_built_server
    bd.offer_built_server = lambda window: original(window, ask=lambda t, x: asked.append(t) or True)
    try:
        qtbot.mouseClick(d.build_button, Qt.LeftButton)
        ok, _text, result = run(qloop, finished, 120)
    finally:
        bd.offer_built_server = original
    assert ok and asked == ["Use the checkpoint-persisting server?"]  # asked once, answered yes
    assert ProfileStore().load("default").server_binary == BUILT_MARKER
    assert field.choice.currentText() == BUILT_LABEL and "out of date" in field.status.text()  # fake 1.0.0
    assert str(result.binary) in w.profiles.preview.toPlainText().splitlines()[0]
    assert not offer_built_server(w, ask=lambda t, x: pytest.fail("asked twice"))

    # other…: a path of the user's own
    field.choice.setCurrentIndex(2)
    assert not field.path.isHidden()
    field.path.setText("/opt/llama/llama-server")
    assert w.profiles.profile().server_binary == "/opt/llama/llama-server"
    field.setText(BUILT_MARKER)
    assert w.profiles.profile().server_binary == BUILT_MARKER and field.path.isHidden()
    run(qloop, w.shutdown(), 120)


def test_at_a_start_the_question_does_not_block_and_is_asked_once(qtbot, qloop, fake):
    from PySide6.QtWidgets import QMessageBox

    from app.tools.server_build import build_server
    from app.ui.dialogs.build import SWITCH_ANSWER_KEY
    from app.ui.panels import build_window

    run(qloop, build_server(fake), 120)  # built meanwhile, e.g. by kv-valet build-server
    w = build_window(ProfileStore(), tabs=False)
    qtbot.addWidget(w)
    w.confirm_quit = False
    assert offer_built_server(w) is None  # a question box is open; nothing waits on it
    box = w.built_server_question
    assert box.isVisible() and "sliding window" in box.text()
    assert offer_built_server(w) is None and w.built_server_question is box  # one box, not two
    qtbot.mouseClick(box.button(QMessageBox.No), Qt.LeftButton)
    assert w.built_server_question is None
    assert w._layout_settings().value(SWITCH_ANSWER_KEY) == "no"
    assert ProfileStore().load("default").server_binary == ""  # the answer was no: still stock
    assert offer_built_server(w) is False  # asked once
    run(qloop, w.shutdown(), 120)
