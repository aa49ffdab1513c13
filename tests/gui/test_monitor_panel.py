"""The Monitor tab fed with synthetic snapshots (fake NVML, recorded /slots JSON); no server."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from app.core.states import Health
from app.monitor.gpu import GpuMonitor
from app.monitor.process import HostSample, ProcessSample
from app.monitor.slots import RestoredSlot, SlotsUnavailable, slot_rows
from app.monitor.snapshot import Snapshot
from app.monitor.units import GiB, MiB
from app.monitor.warnings import CRITICAL, WARNING, compute_warnings
from app.ui.monitor.panel import FILL_ROLE, RESTORED_TOOLTIP, ROW_ROLE, MonitorPanel, SlotsTableModel
from tests.conftest import B11434
from tests.doubles.fake_nvml import CHILD_PID, NVML_ERROR_LIBRARY_NOT_FOUND, SERVER_PID, FakeNvml, two_gpus

pytestmark = pytest.mark.gui

RESPONSES = json.loads((B11434 / "responses.json").read_text())
SLOTS_AFTER_TASK = RESPONSES["slots_after_task"]["body"]
SLOTS_AFTER_RESTORE = RESPONSES["slots_after_restore"]["body"]
C = SlotsTableModel


def make_snapshot(*, slots_json=SLOTS_AFTER_TASK, restored=None, gpu=None, slots_error=None,
                  host=HostSample(64 * GiB, 20 * GiB, 44 * GiB), cache_ram_mib=8192, taken_at=None,
                  process=ProcessSample(SERVER_PID, True, 12.5, 3 * GiB, 17, 3725.0, (CHILD_PID,))):
    if gpu is None:
        gpu = GpuMonitor(nvml=two_gpus()).sample({SERVER_PID, CHILD_PID})
    snap = Snapshot(
        taken_at=time.time() if taken_at is None else taken_at,
        url="http://127.0.0.1:8080",
        health=Health.OK,
        slots=() if slots_error else tuple(slot_rows(slots_json, restored or {})),
        slots_error=slots_error,
        gpu=gpu,
        process=process,
        host=host,
        cache_ram_mib=cache_ram_mib,
    )
    return dataclasses.replace(snap, warnings=tuple(compute_warnings(snap)))


@pytest.fixture
def panel(qtbot):
    p = MonitorPanel()
    qtbot.addWidget(p)
    p.resize(1100, 800)
    p.show()
    return p


def cell(model, row, col, role=None):
    from PySide6.QtCore import Qt

    return model.index(row, col).data(Qt.DisplayRole if role is None else role)


def test_slot_rows_from_recorded_slots_json(panel, qtbot):
    snap = make_snapshot()
    with qtbot.waitSignal(panel.sig_snapshot, check_params_cb=lambda s: s is snap):
        panel.apply_snapshot(snap)
    m = panel.slots_model
    assert m.rowCount() == 2 and m.columnCount() == len(C.COLUMNS)
    from PySide6.QtCore import Qt

    assert [m.headerData(i, Qt.Horizontal) for i in range(m.columnCount())][:4] == ["Slot", "State", "n_ctx", "Tokens held"]
    # Slot 0 never ran a task: nothing held, no task.
    assert [cell(m, 0, c) for c in (C.COL_SLOT, C.COL_STATE, C.COL_NCTX, C.COL_TOKENS, C.COL_FILL, C.COL_TASK)] \
        == ["0", "idle", "4,096", "-", "-", "-"]
    # Slot 1 ran task 1 with a 336-token prompt and 0 decoded.
    assert [cell(m, 1, c) for c in range(m.columnCount())] == \
        ["1", "idle", "4,096", "336", "8%", "0", "0", "0", "1", ""]
    assert cell(m, 1, C.COL_FILL, FILL_ROLE) == pytest.approx(336 / 4096)
    assert cell(m, 1, C.COL_SLOT, ROW_ROLE).id_task == 1
    assert panel.slots_error_label.isHidden()


def test_restored_tokens_marked_with_tooltip(panel):
    from PySide6.QtCore import Qt

    snap = make_snapshot(slots_json=SLOTS_AFTER_RESTORE, restored={0: RestoredSlot(336, "chat-a")})
    panel.apply_snapshot(snap)
    m = panel.slots_model
    assert cell(m, 0, C.COL_TOKENS) == "336 (restored)"
    assert cell(m, 0, C.COL_TOKENS, Qt.ToolTipRole) == RESTORED_TOOLTIP
    assert cell(m, 0, C.COL_SESSION) == "chat-a"
    # Slot 1 has its own task counts: no marker, no tooltip.
    assert cell(m, 1, C.COL_TOKENS) == "336"
    assert cell(m, 1, C.COL_TOKENS, Qt.ToolTipRole) is None


def test_same_row_count_updates_in_place(panel, qtbot):
    panel.apply_snapshot(make_snapshot())
    busy = json.loads(json.dumps(SLOTS_AFTER_TASK))
    busy[1]["is_processing"] = True
    busy[1]["next_token"][0]["n_decoded"] = 40
    busy[1]["n_prompt_tokens"] = 376  # build 11434 counts each decoded token in the prompt tokens
    resets = []
    panel.slots_model.modelReset.connect(lambda: resets.append(1))
    with qtbot.waitSignal(panel.slots_model.dataChanged,
                          check_params_cb=lambda tl, br, *roles: (tl.row(), br.row(), br.column())
                          == (1, 1, len(C.COLUMNS) - 1)):
        panel.apply_snapshot(make_snapshot(slots_json=busy))
    assert not resets
    assert cell(panel.slots_model, 1, C.COL_STATE) == "processing"
    assert cell(panel.slots_model, 1, C.COL_TOKENS) == "376"
    assert cell(panel.slots_model, 1, C.COL_DECODED) == "40"
    # A different slot count resets the model.
    with qtbot.waitSignal(panel.slots_model.modelReset):
        panel.apply_snapshot(make_snapshot(slots_json=SLOTS_AFTER_TASK[:1]))
    assert panel.slots_model.rowCount() == 1


def test_two_gpus_then_one_lost(panel):
    mon = GpuMonitor(nvml=two_gpus(lost_after=1))
    pids = {SERVER_PID, CHILD_PID}
    t0 = time.time()
    panel.apply_snapshot(make_snapshot(gpu=mon.sample(pids), taken_at=t0))
    assert sorted(panel.gpu_cards) == [0, 1]
    p100, titan = panel.gpu_cards[0], panel.gpu_cards[1]
    assert "GPU 0" in p100.title_label.text() and "Tesla P100-PCIE-16GB" in p100.title_label.text()
    assert "00000000:03:00.0" in p100.bus_label.text()
    assert p100.mem_label.text() == "used 10.0 GiB / total 16.0 GiB · free 6.0 GiB"
    assert titan.mem_label.text() == "used 4.0 GiB / total 12.0 GiB · free 8.0 GiB"
    assert p100.util_label.text() == "util 87 %"
    assert p100.temp_label.text() == "temp 61 °C"
    assert p100.power_label.text() == "power 144 W"
    assert p100.server_label.text() == "used by the server 7.0 GiB"  # server pid 6 GiB + its child 1 GiB
    assert titan.server_label.text() == "used by the server 2.0 GiB"
    assert p100.mem_bar.value() == 625 and titan.mem_bar.value() == 333
    assert p100.state_label.text() == titan.state_label.text() == "ok"
    assert panel.gpu_message_label.isHidden()
    assert "535.183.01" in panel.driver_label.text()

    # Second sample: the Titan X is lost; the P100 keeps reporting.
    panel.apply_snapshot(make_snapshot(gpu=mon.sample(pids), taken_at=t0 + 1.0))
    assert panel.gpu_cards[1] is titan  # same cards, updated in place
    assert titan.state_label.text() == "LOST"
    assert "NVIDIA TITAN X (Pascal)" in titan.title_label.text()  # last known identity
    assert titan.util_label.text() == "util N/A" and titan.server_label.text() == "used by the server -"
    assert p100.state_label.text() == "ok" and p100.util_label.text() == "util 87 %"
    assert not panel.gpu_message_label.isHidden()
    assert "GPU lost: #1" in panel.gpu_message_label.text()
    assert any("GPU 1" in t and "was lost" in t for t in panel.warning_texts())
    # The history keeps one point per tick; the lost reading is a gap.
    assert [(m, u) for _, m, u in titan.chart.points] == [(4 * GiB, 12), (None, None)]
    assert [u for _, _, u in p100.chart.points] == [87, 87]


def test_no_gpu_is_one_clear_label_and_the_rest_works(panel):
    mon = GpuMonitor(nvml=FakeNvml(init_error=NVML_ERROR_LIBRARY_NOT_FOUND))
    panel.apply_snapshot(make_snapshot(gpu=mon.sample()))
    assert not panel.gpu_message_label.isHidden()
    assert panel.gpu_message_label.text().startswith("no NVIDIA GPU found")
    assert panel.gpu_cards == {}
    assert panel.driver_label.isHidden()
    assert panel.slots_model.rowCount() == 2
    assert panel.proc_labels["rss"].text() == "3.0 GiB"
    # A GPU appearing later (driver loaded) gets cards; the label goes away.
    panel.apply_snapshot(make_snapshot())
    assert sorted(panel.gpu_cards) == [0, 1] and panel.gpu_message_label.isHidden()


def test_process_and_host_figures_with_cache_ram_budget(panel):
    panel.apply_snapshot(make_snapshot())
    P, H = panel.proc_labels, panel.host_labels
    assert (P["pid"].text(), P["cpu"].text(), P["rss"].text(), P["threads"].text(), P["uptime"].text()) == \
        (str(SERVER_PID), "12.5 %", "3.0 GiB", "17", "01:02:05")
    assert (H["used"].text(), H["available"].text(), H["total"].text()) == ("20.0 GiB", "44.0 GiB", "64.0 GiB")
    assert H["server_rss"].text() == "3.0 GiB" and H["cache_ram"].text() == "8.0 GiB"
    assert panel.host_bar.value() == 312
    panel.apply_snapshot(make_snapshot(cache_ram_mib=-1, process=ProcessSample(SERVER_PID, False)))
    assert H["cache_ram"].text() == "unlimited"
    assert P["rss"].text() == "-" and H["server_rss"].text() == "-"
    assert panel.proc_note.text() == f"pid {SERVER_PID}: not running"


def test_warnings_are_listed(panel):
    assert panel.warnings_box.isHidden()
    full = json.loads(json.dumps(SLOTS_AFTER_TASK))
    full[1]["n_prompt_tokens"] = 4000
    snap = make_snapshot(slots_json=full, host=HostSample(16 * GiB, 14 * GiB, 2 * GiB), cache_ram_mib=8192)
    panel.apply_snapshot(snap)
    texts = panel.warning_texts()
    assert len(texts) == 2 and not panel.warnings_box.isHidden()
    assert "slot 1 holds 4,000 of 4,096 tokens" in texts[0]
    assert "below the server's --cache-ram budget 8.0 GiB" in texts[1]
    assert panel.warning_levels() == [WARNING, WARNING]
    # Over n_ctx is critical; a clean snapshot empties and hides the list.
    full[1]["n_prompt_tokens"] = 4096
    panel.apply_snapshot(make_snapshot(slots_json=full))
    assert panel.warning_levels()[0] == CRITICAL
    panel.apply_snapshot(make_snapshot())
    assert panel.warning_texts() == [] and panel.warnings_box.isHidden()


def test_slots_unavailable_is_a_label_not_a_traceback(panel):
    panel.apply_snapshot(make_snapshot())
    panel.apply_snapshot(make_snapshot(slots_error=SlotsUnavailable.NO_SLOTS))
    assert not panel.slots_error_label.isHidden()
    assert panel.slots_error_label.text() == "the server was started with --no-slots: slot monitoring is off"
    assert panel.slots_model.rowCount() == 0
    assert "Traceback" not in panel.slots_error_label.text()
    panel.apply_snapshot(make_snapshot())
    assert panel.slots_error_label.isHidden() and panel.slots_model.rowCount() == 2


def test_error_snapshot_is_shown(panel):
    from app.monitor.snapshot import error_snapshot

    panel.apply_snapshot(error_snapshot("http://127.0.0.1:8080", RuntimeError("boom"), 8192))
    assert "error: RuntimeError: boom" in panel.status_label.text()
    assert panel.slots_error_label.text() == "not sampled: RuntimeError: boom"
    assert any("sampling failed" in t for t in panel.warning_texts())


def test_history_chart_keeps_one_point_per_second(panel):
    t0 = 1_700_000_000.0
    for k in range(6):  # 4 Hz while busy: only whole seconds are kept
        panel.apply_snapshot(make_snapshot(taken_at=t0 + k * 0.25))
    assert len(panel.gpu_cards[0].chart.points) == 2
    assert panel.gpu_cards[0].chart.points[0][1] == 10 * GiB
    assert 512 * MiB < panel.gpu_cards[1].chart.points[0][1]
