"""The window as the app builds it, on a fake-server profile: shared by the GUI tests."""

from __future__ import annotations

from app.core.profile import LaunchProfile
from app.store.profiles import ProfileStore
from app.ui.main_window import MainWindow
from app.ui.panels import build_window
from tests.fake_server.profiles import fake_profile  # noqa: F401  (the GUI tests take it from here too)


def make_window(qtbot, tmp_path, *, show: bool = True, **profile_fields) -> tuple[MainWindow, LaunchProfile]:
    """A MainWindow with its panels wired as in the app, answering "Yes" to its questions,
    with the fake-server profile "fake" selected."""
    profile = fake_profile(tmp_path, **profile_fields)
    w = build_window(ProfileStore())
    w.confirm_quit = False
    w.sessions_panel.controller.questions.confirm = lambda title, text: True
    w.health_panel.questions.confirm = lambda title, text: True
    qtbot.addWidget(w)
    if show:
        w.show()
    w.profiles.set_profiles([profile], select="fake")
    return w, profile


async def walk_guide(qtbot, guide, steps, timeout: float = 180) -> list[str]:
    """Press the first-run guide's Next through ``steps``; each step's result text."""
    import asyncio

    from PySide6.QtCore import Qt

    from tests.conftest import signal_future

    results = []
    for i, (title, _text) in enumerate(steps):
        done = signal_future(guide.sig_step_done, lambda index, text, i=i: index == i)
        assert guide.next_button.text() == title
        qtbot.mouseClick(guide.next_button, Qt.LeftButton)
        _index, text = await asyncio.wait_for(done, timeout)
        results.append(text)
    return results
