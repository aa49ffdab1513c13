"""The Sessions tab says when a park's sidecar is not the one it parked (issue #36 item 1): another chat's
``.ckpt`` copied over this one's shows as "invalid" in the Sidecar column, and its tooltip names the file
and both last checkpoint positions (the words of app.core.park_files; the tab only shows them)."""

from __future__ import annotations

import shutil

import pytest

from app import paths
from app.store.catalog import Catalog
from app.store.profiles import ProfileStore
from app.ui.panels import sessions_panel
from app.ui.sessions.model import COL_NAME, COL_SIDECAR
from tests.conftest import run
from tests.unit.test_park_files import X_POSITIONS, Y_POSITIONS, _record, _write_park

pytestmark = pytest.mark.gui


def _row(view, name: str) -> int:
    m = view.model()
    return next(r for r in range(m.rowCount()) if m.index(r, COL_NAME).data() == name)


def test_a_sidecar_copied_from_another_chat_shows_invalid_with_the_parks_words(qtbot, qloop, tmp_path):
    slots = tmp_path / "slots"
    with Catalog(paths.catalog_path()) as cat:
        for name, positions in (("X", X_POSITIONS), ("Y", Y_POSITIONS)):
            _record(cat, _write_park(slots, f"{name}.bin", positions), name, memory_kind="sliding-window",
                    n_tokens=2197)
    shutil.copyfile(slots / "X.bin.ckpt", slots / "Y.bin.ckpt")  # X's sidecar over Y's, the window closed

    p = sessions_panel(catalog=Catalog(paths.catalog_path()), store=ProfileStore())
    qtbot.addWidget(p)
    p.resize(1100, 600)
    p.show()
    qtbot.waitExposed(p)
    try:
        view = p.table
        y, x = _row(view, "Y"), _row(view, "X")
        assert view.model().index(y, COL_SIDECAR).data().startswith("invalid")
        tip = view.model().index(y, COL_SIDECAR).data(role=3)  # Qt.ToolTipRole
        assert "not the sidecar this session parked (Y.bin.ckpt): last checkpoint at 1,923, parked with 2,185" in tip
        assert not view.model().index(x, COL_SIDECAR).data().startswith("invalid")
    finally:
        run(qloop, p.aclose(), 120)
