"""The profile form: edits update the preview; errors name the field; secrets stay masked."""

from __future__ import annotations

import pytest

from app.core.profile import LaunchProfile
from app.store.profiles import ProfileStore
from app.ui.panels import build_window

pytestmark = pytest.mark.gui


@pytest.fixture
def window(qtbot, qloop, tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    store = ProfileStore()
    store.save(LaunchProfile(name="mine", model=str(model), port=8099))
    w = build_window(store, tabs=False)
    qtbot.addWidget(w)
    w.profiles.set_profiles(store.load_all()[0], select="mine")
    return w


def test_editing_the_form_updates_the_preview(window, qtbot):
    p = window.profiles
    assert "--port 8099" in p.preview.toPlainText()
    p.w["parallel"].clear()
    qtbot.keyClicks(p.w["parallel"], "4")
    p.w["cache_type_k"].setCurrentText("q8_0")
    p.w["kv_unified"].setCurrentText("on")
    text = p.preview.toPlainText()
    assert "-np 4" in text and "-ctk q8_0" in text and "-kvu" in text
    assert "kvu" in p.warnings.text().lower() or "unified" in p.warnings.text().lower()


def test_bad_value_names_the_field_and_secret_is_masked(window, qtbot):
    p = window.profiles
    p.w["parallel"].setText("-3")
    assert "Slots:" in p.errors.text() and "negative" in p.errors.text()
    p.w["parallel"].setText("two")
    assert "Slots: 'two' is not a whole number" in p.errors.text()
    p.w["parallel"].setText("1")
    p.w["api_key"].setText("hunter2")
    p.w["extra_args"].setText("--api-key hunter2 --jinja")
    assert "hunter2" not in p.preview.toPlainText()
    assert p.errors.text() == ""


def test_save_writes_the_profile_file(window, qtbot):
    p = window.profiles
    p.w["ctx_size"].setText("32768")
    qtbot.mouseClick(p.save_button, _left())
    assert ProfileStore().load("mine").ctx_size == 32768


def _left():
    from PySide6.QtCore import Qt

    return Qt.LeftButton


def test_import_command_line_fills_the_form(window, qtbot, tmp_path):
    p = window.profiles
    model = tmp_path / "Qwen-27B.gguf"
    model.write_bytes(b"GGUF")
    prof = p.import_command_line(f"llama-server -m {model} -ngl 99 -c 102400 -np 1 -ctk q8_0 --jinja")
    assert prof.name == "Qwen-27B"
    assert p.w["ctx_size"].text() == "102400" and p.w["cache_type_k"].currentText() == "q8_0"
    assert p.w["extra_args"].text() == "--jinja"
    assert "-c 102400" in p.preview.toPlainText()
    assert p.import_command_line("llama-server -m 'oops") is None
    assert "Import: cannot split" in p.errors.text()


def test_a_command_line_without_a_model_imports_as_a_router_and_saves_as_one(window, qtbot):
    from PySide6.QtCore import QPoint

    """The user pastes their router's command line: the form ticks Router mode, shows no error for the
    missing model, previews no -m, and Save writes a router profile; unticking it asks for a model."""
    p = window.profiles
    prof = p.import_command_line("llama-server --models-dir /srv/models --models-max 2 --port 8090")
    assert prof.router and p.w["router"].isChecked()
    assert p.errors.text() == "" and " -m " not in p.preview.toPlainText()
    p.w["name"].setText("my-router")
    qtbot.mouseClick(p.save_button, _left())
    saved = ProfileStore().load("my-router")
    assert saved.router and saved.model == "" and "--models-dir" in saved.extra_args
    box = p.w["router"]
    box.ensurePolished()
    qtbot.mouseClick(box, _left(), pos=QPoint(box.style().pixelMetric(box.style().PixelMetric.PM_IndicatorWidth) // 2,
                                              box.height() // 2))  # on its tick box
    assert not p.w["router"].isChecked() and "Model file:" in p.errors.text()
