"""Parked sessions: park, resume, check, delete, rename — one click each.

No business logic here: every action calls a Qt-free job (app.jobs.*) on the
asyncio loop; this widget only shows results, asks for confirmation, and keeps
the window responsive (busy bar, queue label, buttons restored in ``finally``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from pathlib import Path
from typing import Any

from PySide6.QtCore import QAbstractTableModel, QModelIndex, Qt, QUrl, Signal
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (QAbstractItemView, QComboBox, QFileDialog, QHBoxLayout, QHeaderView, QInputDialog,
                               QLabel, QLineEdit, QMessageBox, QProgressBar, QPushButton, QStyle, QTableView,
                               QVBoxLayout, QWidget)

from app import paths
from app.jobs.check import recover_hidden_sidecars
from app.jobs.park import ParkError, known_save_dirs, park_all, park_slot, recover_interrupted
from app.jobs.park_all_stop import clear_resume_plan, load_resume_plan, park_all_and_stop, resume_all
from app.jobs.resume import ResumeFailed, ResumeNeedsConfirmation, ResumeRefused, resume_session
from app.jobs.sessions import delete_session, rename_session
from app.jobs.target import ServerTarget
from app.jobs.verdict import Verdict
from app.jobs.watch import ResumeWatcher
from app.server.client import LlamaClient
from app.store.catalog import Catalog, CatalogError, SessionRecord
from app.store.profiles import ProfileStore

log = logging.getLogger(__name__)

SIDECAR_HELP = {
    "present": "A checkpoint sidecar was saved with this session: a resume after a restart can roll back a few "
               "tokens instead of re-reading the whole chat.",
    "missing": "No checkpoint sidecar: on this sliding-window/hybrid model the first query after a restart will "
               "re-prefill the whole session. A server build that writes sidecars (turboquant PR #206) fixes it.",
    "invalid": "The sidecar is damaged or does not belong to this state file, so it will not help the resume.",
    "not needed": "A dense model keeps every position: resumes need no checkpoint.",
    "present, unverified": "A companion checkpoint file is there, in a format KV Valet cannot check.",
}
COLUMNS = ["Name", "Model", "Tokens", "Size", "Age", "Sidecar", "Last restore", "Verdict"]


def _age(ts: float | None) -> str:
    if not ts:
        return "-"
    d = max(0, time.time() - ts)
    for unit, sec in (("d", 86400), ("h", 3600), ("min", 60)):
        if d >= sec:
            return f"{d / sec:.0f} {unit} ago"
    return "just now"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


class SessionsModel(QAbstractTableModel):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.records: list[SessionRecord] = []
        self.icon_for: dict = {}  # sidecar status -> QIcon, set by the panel from its style

    def set_records(self, records: list[SessionRecord]) -> None:
        self.beginResetModel()
        self.records = list(records)
        self.endResetModel()

    def rowCount(self, parent=QModelIndex()) -> int:  # noqa: N802
        return 0 if parent.isValid() else len(self.records)

    def columnCount(self, parent=QModelIndex()) -> int:  # noqa: N802
        return len(COLUMNS)

    def headerData(self, section, orientation, role=Qt.DisplayRole):  # noqa: N802
        if orientation == Qt.Horizontal and role == Qt.DisplayRole:
            return COLUMNS[section]
        return None

    def data(self, index: QModelIndex, role=Qt.DisplayRole) -> Any:
        if not index.isValid():
            return None
        r = self.records[index.row()]
        col = COLUMNS[index.column()]
        if role == Qt.DisplayRole:
            return {
                "Name": r.name,
                "Model": Path(r.model_path).name or "-",
                "Tokens": f"{r.n_tokens:,}",
                "Size": _size(r.state_size + r.sidecar_size),
                "Age": _age(r.created_at),
                "Sidecar": r.sidecar_status + (f" ({r.sidecar_count})" if r.sidecar_count else ""),
                "Last restore": (f"{r.last_restore_ms:,.0f} ms, {_age(r.last_restore_at)}"
                                 if r.last_restore_ms is not None else "never"),
                "Verdict": r.last_verdict or "-",
            }[col]
        if role == Qt.ToolTipRole:
            if col == "Sidecar":
                return f"{SIDECAR_HELP.get(r.sidecar_status, '')}\n\n{r.sidecar_reason}".strip()
            if col == "Verdict":
                return r.last_verdict_reason or "No query judged since the last resume."
            if col == "Model":
                return f"{r.model_path}\nKV cache: K {r.cache_type_k}, V {r.cache_type_v}; {r.memory_kind}"
            if col == "Name":
                return str(r.state_path)
        if role == Qt.DecorationRole and col == "Sidecar":
            return self.icon_for.get(r.sidecar_status)
        if role == Qt.ForegroundRole and col == "Verdict" and r.last_verdict:
            from PySide6.QtGui import QColor

            return QColor({"HIT": "#1a7f37", "PARTIAL": "#8a5a00", "DISCARDED": "#b00020"}.get(r.last_verdict,
                                                                                               "#666666"))
        if role == Qt.TextAlignmentRole and col in ("Tokens", "Size"):
            return int(Qt.AlignRight | Qt.AlignVCenter)
        return None


class SessionsPanel(QWidget):
    sig_changed = Signal()  # the catalog changed (parked, resumed, renamed, deleted)
    sig_done = Signal(str, bool, str)  # operation label, ok, message
    sig_restored = Signal(int, int, str)  # slot, n_restored, session name
    sig_verdict = Signal(int, str, object)  # slot, session, Verdict
    sig_target = Signal(object)  # ServerTarget once connected (None when gone)

    def __init__(self, parent=None, *, catalog: Catalog | None = None, store: ProfileStore | None = None,
                 confirm=None):
        super().__init__(parent)
        self.catalog = catalog or Catalog(paths.catalog_path())
        self.store = store or ProfileStore()
        self.target: ServerTarget | None = None
        self.controller = None
        self.watcher = ResumeWatcher(self._on_verdict)
        # confirm(title, text) -> bool; a test replaces the dialog.
        self.confirm = confirm or self._ask
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self._build()
        self.refresh()
        self._set_connected(False)

    # -- layout -----------------------------------------------------------
    def _build(self) -> None:
        self.model = SessionsModel(self)
        self.table = QTableView()
        self.table.setModel(self.model)
        self.table.setSelectionBehavior(QAbstractItemView.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SingleSelection)
        self.table.verticalHeader().hide()
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeToContents)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.doubleClicked.connect(lambda _i: self._on_resume())

        self.slot = QComboBox()
        self.slot.setToolTip("The slot to park from, or to resume into.")
        self.name = QLineEdit(placeholderText="session name (default: date, time and slot)")
        self.name.setToolTip("Name of the parked session. Parking under an existing name replaces it — only "
                             "after the new copy is safely on disk.")
        self.park_button = QPushButton("Park slot")
        self.park_button.setToolTip("Save the chosen slot's KV cache to disk as a session.")
        self.park_all_button = QPushButton("Park all")
        self.park_all_button.setToolTip("Park every slot that holds tokens.")
        self.park_stop_button = QPushButton("Park all && stop")
        self.park_stop_button.setToolTip("Park every non-empty slot, then stop the server: use it before a "
                                         "reboot. The next start of this profile offers to resume them all.")
        self.resume_button = QPushButton("Resume")
        self.resume_button.setToolTip("Load the selected session into the chosen slot (default: an empty one).")
        self.check_button = QPushButton("Check resume…")
        self.check_button.setToolTip("Resume and send a probe to measure whether the prefill was skipped.")
        self.ab_button = QPushButton("A/B check…")
        self.ab_button.setToolTip("Resume the same state file with its sidecar and with the sidecar hidden, and "
                                  "compare the first query's prompt time (the seeds' proof table).")
        self.history_button = QPushButton("History…")
        self.history_button.setToolTip("Every resume, check and A/B run of this session over time.")
        self.rename_button = QPushButton("Rename…")
        self.delete_button = QPushButton("Delete")
        self.folder_button = QPushButton("Show in folder")
        self.resume_all_button = QPushButton("Resume all")
        self.resume_all_button.hide()
        self.busy = QProgressBar()
        self.busy.setRange(0, 0)
        self.busy.setMaximumWidth(160)
        self.busy.hide()
        self.queue_label = QLabel("")
        self.queue_label.setToolTip("Slot operations run one at a time per server; the rest wait here.")
        self.message = QLabel("")
        self.message.setWordWrap(True)
        self.message.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.hint = QLabel("")
        self.hint.setWordWrap(True)
        self.hint.setStyleSheet("color: #666;")

        top = QHBoxLayout()
        top.addWidget(QLabel("Slot"))
        top.addWidget(self.slot)
        top.addWidget(self.name, 1)
        for b in (self.park_button, self.park_all_button, self.park_stop_button):
            top.addWidget(b)
        row2 = QHBoxLayout()
        for b in (self.resume_button, self.check_button, self.ab_button, self.history_button, self.rename_button,
                  self.delete_button, self.folder_button, self.resume_all_button):
            row2.addWidget(b)
        row2.addStretch(1)
        row2.addWidget(self.queue_label)
        row2.addWidget(self.busy)
        lay = QVBoxLayout(self)
        lay.addLayout(top)
        lay.addWidget(self.hint)
        lay.addWidget(self.table, 1)
        lay.addLayout(row2)
        lay.addWidget(self.message)

        self.park_button.clicked.connect(self._on_park)
        self.park_all_button.clicked.connect(lambda: self.spawn(self.park_all()))
        self.park_stop_button.clicked.connect(lambda: self.spawn(self.park_all_and_stop()))
        self.resume_button.clicked.connect(self._on_resume)
        self.check_button.clicked.connect(lambda: self._on_check(ab=False))
        self.ab_button.clicked.connect(lambda: self._on_check(ab=True))
        self.history_button.clicked.connect(self._on_history)
        self.rename_button.clicked.connect(self._on_rename)
        self.delete_button.clicked.connect(self._on_delete)
        self.folder_button.clicked.connect(self._on_folder)
        self.resume_all_button.clicked.connect(lambda: self.spawn(self.resume_planned()))

    # -- catalog ----------------------------------------------------------
    @property
    def profile_name(self) -> str | None:
        return self.target.profile_name if self.target else None

    def refresh(self) -> None:
        if self._closed:
            return
        selected = self.selected()
        profile = self.profile_name
        records = self.catalog.list(profile) if profile else self.catalog.list()
        self.model.set_records(records)
        style = self.style()
        icons = {"present": QStyle.SP_DialogApplyButton, "missing": QStyle.SP_MessageBoxWarning,
                 "invalid": QStyle.SP_MessageBoxCritical, "not needed": QStyle.SP_MessageBoxInformation}
        self.model.icon_for = {k: style.standardIcon(v) for k, v in icons.items()}
        if selected:
            self.select(selected.name)

    def selected(self) -> SessionRecord | None:
        rows = self.table.selectionModel().selectedRows() if self.table.selectionModel() else []
        return self.model.records[rows[0].row()] if rows else None

    def select(self, name: str) -> None:
        for i, r in enumerate(self.model.records):
            if r.name == name:
                self.table.selectRow(i)
                return

    # -- server -----------------------------------------------------------
    def attach(self, controller) -> None:
        self.controller = controller
        controller.sig_state.connect(self._on_server_state)

    def _on_server_state(self, state: str, detail: str) -> None:
        if self._closed:
            return
        if state == "Ready":
            self.spawn(self.connect_target())
        elif state in ("Stopped", "Crashed", "Stopping"):
            self._drop_target()

    def _drop_target(self) -> None:
        if self.target is not None:
            t, self.target = self.target, None
            self.watcher = ResumeWatcher(self._on_verdict)
            self.spawn(t.client.aclose())
            self.sig_target.emit(None)
        self._set_connected(False)
        self.refresh()

    async def connect_target(self) -> ServerTarget | None:
        c = self.controller
        if c is None or c.url is None:
            return None
        profile = c.profile if c.owned else None
        save_dir = c.plan.slot_save_path if c.owned and c.plan else None
        log_buffer = c.supervisor.log if c.owned and c.supervisor else None
        if not c.owned and c.attached and c.attached.leftover:
            try:
                profile = self.store.load(c.attached.leftover.profile)
                from app.server.launcher import slot_save_path_for

                save_dir = slot_save_path_for(profile)
            except Exception:
                profile = None
        api_key = profile.api_key if profile else None
        client = LlamaClient(c.url, api_key)
        if save_dir is None:
            self.hint.setText("Attached to a server KV Valet did not start: choose its --slot-save-path folder "
                              "(the first Park asks) to park and resume here.")
        try:
            target = await ServerTarget.connect(client, self.catalog, profile=profile,
                                                save_dir=save_dir or "", log=log_buffer,
                                                build=c.plan.build if c.owned and c.plan else None)
        except Exception as e:
            log.warning("cannot connect to %s", c.url, exc_info=True)
            await client.aclose()
            self._say(f"Cannot read the server's properties: {e}", ok=False)
            return None
        if save_dir is None:
            target.save_dir = Path("")
        self.target = target
        target.queue.on_change(self._on_queue)
        if c.owned and c.supervisor:
            self.watcher.attach(c.supervisor)
            c.supervisor.on_line(self._on_log_line)
        recovered = await asyncio.to_thread(self._recover, target)
        if target.model_path and Path(target.model_path).is_file():
            # Hash the model and read its memory kind now, in the background, so the
            # first Park does not wait for it (GGUFReader takes seconds on a big vocabulary).
            from app.jobs.park import model_identity

            self.spawn(model_identity(target.model_path))
        await self._fill_slots()
        self._set_connected(True)
        self.refresh()
        self.sig_target.emit(target)
        if recovered:
            self._say("Recovered after an interruption: " + "; ".join(recovered), ok=True)
        plan = load_resume_plan(target.profile_name)
        if plan:
            names = ", ".join(f"{e['session']} → slot {e['slot']}" for e in plan)
            if profile is not None and profile.resume_on_start:
                self.spawn(self.resume_planned())
            else:
                self.resume_all_button.setText(f"Resume all ({len(plan)})")
                self.resume_all_button.setToolTip(f"Parked by 'Park all & stop': {names}")
                self.resume_all_button.show()
        return target

    def _on_log_line(self, item) -> None:
        """Keep the profile's measured prefill rate from every prompt the server
        processes, whoever sent it (used by the re-prefill estimate on resume)."""
        ev = item.event
        if ev.kind.value == "prompt_eval" and self.target is not None and not self._closed:
            n, ms = ev.fields.get("n_tokens", 0), ev.fields.get("ms", 0.0)
            if n >= 32 and ms > 0:
                self.catalog.record_prefill(self.target.profile_name, n, ms)

    def _recover(self, target: ServerTarget) -> list[str]:
        msgs = recover_hidden_sidecars(self.catalog)
        dirs = known_save_dirs(self.catalog, [target.save_dir] if str(target.save_dir) else [])
        return msgs + recover_interrupted(self.catalog, dirs)

    async def _fill_slots(self) -> None:
        if not self.target:
            return
        try:
            slots = await self.target.client.slots()
        except Exception as e:
            self.hint.setText(f"Slots unavailable: {e}")
            slots = []
        current = self.slot.currentData()
        self.slot.clear()
        self.slot.addItem("first empty slot", None)
        for s in slots:
            n = s.get("n_prompt_tokens")
            known = self.target.restored.get(s["id"])
            held = f"{n:,} tokens" if n else (f"{known[0]:,} tokens (restored)" if known else "empty")
            self.slot.addItem(f"slot {s['id']} — {held}", s["id"])
        idx = self.slot.findData(current)
        self.slot.setCurrentIndex(idx if idx >= 0 else (1 if self.slot.count() > 1 else 0))

    def _set_connected(self, on: bool) -> None:
        for b in (self.park_button, self.park_all_button, self.park_stop_button, self.resume_button,
                  self.check_button, self.ab_button, self.slot, self.name):
            b.setEnabled(on)
        self.park_stop_button.setEnabled(on and bool(self.controller and self.controller.owned))
        if not on:
            self.hint.setText("Start or attach to a server to park and resume. Parked sessions stay listed.")
            self.resume_all_button.hide()
        elif self.target and str(self.target.save_dir):
            self.hint.setText(f"Sessions of '{self.target.profile_name}' are parked in {self.target.save_dir}")

    def _on_queue(self) -> None:
        labels = self.target.queue.labels() if self.target else []
        self.queue_label.setText(" · ".join(labels))
        self.busy.setVisible(bool(labels))

    # -- actions ----------------------------------------------------------
    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("session task failed", exc_info=task.exception())
            self._say(f"Failed: {task.exception()}", ok=False)

    def _say(self, text: str, ok: bool = True, label: str = "") -> None:
        self.message.setStyleSheet("" if ok else "color: #b00020;")
        self.message.setText(text)
        self.sig_done.emit(label, ok, text)

    async def _ensure_save_dir(self) -> bool:
        if self.target is None:
            self._say("Start or attach to a server first.", ok=False)
            return False
        if self.target and not str(self.target.save_dir):
            dlg = QFileDialog(self, "The server's --slot-save-path folder")
            dlg.setFileMode(QFileDialog.Directory)
            fut = asyncio.get_running_loop().create_future()
            dlg.finished.connect(lambda r: fut.done() or fut.set_result(
                dlg.selectedFiles()[0] if r and dlg.selectedFiles() else ""))
            dlg.open()  # not exec(): see _ask
            folder = await fut
            dlg.deleteLater()
            if not folder:
                return False
            self.target.save_dir = Path(folder)
        return self.target is not None

    def _on_park(self) -> None:
        slot = self.slot.currentData()
        if slot is None:
            self._say("Choose the slot to park.", ok=False)
            return
        self.spawn(self.park(slot, self.name.text().strip() or None))

    async def park(self, slot_id: int, name: str | None = None):
        if not await self._ensure_save_dir():
            return None
        label = f"Park slot {slot_id}"
        try:
            result = await park_slot(self.target, slot_id, name)
        except ParkError as e:
            self._say(f"{label}: {e}", ok=False, label=label)
            return None
        self.refresh()
        self.select(result.record.name)
        self.sig_changed.emit()
        text = (f"Parked slot {slot_id} as '{result.record.name}': {result.record.n_tokens:,} tokens, "
                f"{_size(result.record.state_size + result.record.sidecar_size)} in "
                f"{result.record.save_ms:,.0f} ms. Sidecar: {result.sidecar.reason if result.sidecar else '-'}")
        if result.warnings:
            text += "\n⚠ " + "\n⚠ ".join(result.warnings)
        self._say(text, ok=True, label=label)
        await self._fill_slots()
        return result

    async def park_all(self):
        if not await self._ensure_save_dir():
            return []
        results = await park_all(self.target)
        self._report_many("Park all", results)
        return results

    async def park_all_and_stop(self):
        if not self.controller or not self.controller.owned:
            return []
        from app.jobs.park_all_stop import StopSkipped

        target = self.target
        try:
            results = await park_all_and_stop(target, self.controller.supervisor)
        except StopSkipped as e:
            self._report_many("Park all & stop", e.args[0] if e.args else [])
            self._say(self.message.text() + "\nThe server keeps running: a slot could not be parked.", ok=False)
            return []
        self._report_many("Park all & stop", results)
        return results

    def _report_many(self, label: str, results) -> None:
        self.refresh()
        self.sig_changed.emit()
        lines = [(f"slot {r.slot_id}: '{r.record.name}' {r.record.n_tokens:,} tokens, sidecar {r.record.sidecar_status}"
                  if r.ok else f"slot {r.slot_id}: failed: {r.error}") for r in results]
        self._say(f"{label}: " + ("; ".join(lines) if lines else "no slot holds tokens"),
                  ok=all(r.ok for r in results), label=label)

    def _on_resume(self) -> None:
        rec = self.selected()
        if rec is None:
            self._say("Select a session to resume.", ok=False)
            return
        self.spawn(self.resume(rec.name, self.slot.currentData()))

    async def resume(self, name: str, slot_id: int | None = None, force: bool = False):
        label = f"Resume '{name}'"
        if self.target is None:
            self._say(f"{label}: start or attach to a server first.", ok=False, label=label)
            return None
        try:
            result = await resume_session(self.target, name, slot_id, force=force)
        except ResumeRefused as e:
            self._say(f"{label}: cannot resume: " + "; ".join(e.reasons), ok=False, label=label)
            return None
        except ResumeNeedsConfirmation as e:
            if not await self._confirmed("Resume session", "\n\n".join(e.warnings) + "\n\nResume anyway?"):
                self._say(f"{label}: cancelled.", ok=True, label=label)
                return None
            return await self.resume(name, slot_id, force=True)
        except ResumeFailed as e:
            self._say(f"{label}: the server refused the restore (the slot is now empty): {e}", ok=False,
                      label=label)
            return None
        rec = result.record
        # A new resume: its verdict is unknown until the next query on the slot.
        self.catalog.update_verdict(rec.id, "UNKNOWN", "no query on this slot since the restore yet")
        self.watcher.expect(result.slot_id, result.n_restored, rec.name, rec.sidecar_status,
                            build_persists=self.catalog.build_persists_checkpoints(self.target.build),
                            ctx_checkpoints=self.target.ctx_checkpoints, sidecar_count=rec.sidecar_count or None)
        self.sig_restored.emit(result.slot_id, result.n_restored, rec.name)
        self.refresh()
        self.sig_changed.emit()
        text = (f"Resumed '{rec.name}' into slot {result.slot_id}: {result.n_restored:,} tokens in "
                f"{result.restore_ms:,.0f} ms. The verdict comes with the next query on that slot.")
        if result.warnings:
            text += "\n⚠ " + "\n⚠ ".join(result.warnings)
        self._say(text, ok=True, label=label)
        await self._fill_slots()
        return result

    async def resume_planned(self):
        if not self.target:
            return []
        plan = load_resume_plan(self.target.profile_name)
        out = await resume_all(self.target, plan, force=True)
        for r in out:
            if r["ok"]:
                res = r["result"]
                self.sig_restored.emit(res.slot_id, res.n_restored, res.record.name)
        clear_resume_plan(self.target.profile_name)
        self.resume_all_button.hide()
        self.refresh()
        self._say("Resume all: " + "; ".join(
            f"{r['session']} → slot {r['slot']}: " + ("ok" if r["ok"] else r["error"]) for r in out),
            ok=all(r["ok"] for r in out), label="Resume all")
        await self._fill_slots()
        return out

    def _on_verdict(self, slot_id: int, session: str | None, verdict: Verdict) -> None:
        if session and self.target:
            rec = self.catalog.get(self.target.profile_name, session)
            if rec is not None:
                self.catalog.update_verdict(rec.id, verdict.kind.value, verdict.reason)
        self.refresh()
        self.sig_verdict.emit(slot_id, session or "", verdict)
        self._say(f"Slot {slot_id} ('{session}'): {verdict.kind.value} — {verdict.reason}",
                  ok=verdict.kind.value != "DISCARDED", label="verdict")

    def _on_check(self, ab: bool = False) -> None:
        rec = self.selected()
        if rec is None or self.target is None:
            self._say("Select a session to check.", ok=False)
            return
        self.spawn(self.check(rec.name, self.slot.currentData(), ab=ab))

    async def _check_slot(self, slot_id: int | None) -> int | None:
        """The slot a check restores into: the chosen one, else the first empty one."""
        slots = await self.target.client.slots()
        if slot_id is None:
            empty = [s["id"] for s in slots if not s.get("n_prompt_tokens") and s["id"] not in self.target.restored]
            if not empty:
                self._say("Check: every slot holds tokens; choose the slot to use (its tokens will be replaced).",
                          ok=False)
                return None
            return empty[0]
        held = next((s.get("n_prompt_tokens") for s in slots if s["id"] == slot_id), None)
        if held and not await self._confirmed("Check resume", f"Slot {slot_id} holds {held:,} tokens; the check restores "
                                                     "the session over them. Go on?"):
            return None
        return slot_id

    async def check(self, name: str, slot_id: int | None = None, *, ab: bool = False, baseline: bool = False):
        """'Check resume' (two probes) or the A/B with the sidecar hidden; shows the report."""
        from app.jobs.check import CheckError, ab_check, check_resume
        from app.ui.check_view import CheckDialog

        rec = self.catalog.get(self.target.profile_name, name) if self.target else None
        if rec is None:
            self._say(f"No session named '{name}' here.", ok=False)
            return None
        slot = await self._check_slot(slot_id)
        if slot is None:
            return None
        label = ("A/B check" if ab else "Check resume") + f" of '{name}' in slot {slot}"
        self._say(f"{label}: running… (a re-prefill of {rec.n_tokens:,} tokens can take a while)", label=label)
        try:
            report = await (ab_check(self.target, rec, slot, baseline=baseline) if ab
                            else check_resume(self.target, rec, slot))
        except CheckError as e:
            self._say(f"{label}: {e}", ok=False, label=label)
            return None
        self.refresh()
        self.sig_changed.emit()
        verdict = getattr(report, "verdict", None)
        self._say(f"{label}: done" + (f" — {verdict.kind.value}: {verdict.reason}" if verdict else ""),
                  ok=True, label=label)
        rec = self.catalog.get(self.target.profile_name, name)
        self.report_dialog = CheckDialog(report, self, history=self.catalog.history(rec.id) if rec else None)
        self.report_dialog.show()
        await self._fill_slots()
        return report

    def _on_history(self) -> None:
        rec = self.selected()
        if rec is None:
            return
        from PySide6.QtWidgets import QDialog

        from app.ui.check_view import HistoryChart

        dlg = QDialog(self)
        dlg.setWindowTitle(f"Resume history — {rec.name}")
        chart = HistoryChart(dlg)
        chart.set_events(self.catalog.history(rec.id))
        lay = QVBoxLayout(dlg)
        lay.addWidget(QLabel("Restore time and first-query prompt time of every resume, check and A/B run, "
                             "coloured by verdict: a regression after a server update shows here."))
        lay.addWidget(chart, 1)
        dlg.resize(720, 380)
        self.history_dialog = dlg
        dlg.show()

    def _on_rename(self) -> None:
        rec = self.selected()
        if rec is None:
            return
        new, ok = QInputDialog.getText(self, "Rename session", "New name:", text=rec.name)
        if ok and new.strip() and new.strip() != rec.name:
            self.rename(rec.name, new.strip(), rec.profile)

    def rename(self, old: str, new: str, profile: str | None = None) -> bool:
        try:
            rename_session(self.catalog, old, new, profile or self.profile_name)
        except (CatalogError, LookupError, ValueError) as e:
            self._say(f"Rename: {e}", ok=False, label="Rename")
            return False
        self.refresh()
        self.select(new)
        self.sig_changed.emit()
        return True

    def _on_delete(self) -> None:
        rec = self.selected()
        if rec is None:
            return
        async def confirm_then_delete():
            if await self._confirmed("Delete session", f"Delete '{rec.name}' ({rec.n_tokens:,} tokens) and its "
                                                       "files?"):
                self.delete(rec.name, rec.profile)

        self.spawn(confirm_then_delete())

    def delete(self, name: str, profile: str | None = None) -> bool:
        try:
            removed = delete_session(self.catalog, name, profile or self.profile_name)
        except (CatalogError, LookupError, ValueError, OSError) as e:
            self._say(f"Delete: {e}", ok=False, label="Delete")
            return False
        self.refresh()
        self.sig_changed.emit()
        self._say(f"Deleted '{name}' ({len(removed)} files).", label="Delete")
        return True

    def _on_folder(self) -> None:
        rec = self.selected()
        folder = Path(rec.save_dir) if rec else (self.target.save_dir if self.target else None)
        if folder:
            QDesktopServices.openUrl(QUrl.fromLocalFile(str(folder)))

    async def _ask(self, title: str, text: str) -> bool:
        """A question that does not block the event loop.

        A modal ``exec()`` inside a coroutine would spin a nested Qt loop and make
        qasync enter other tasks while this one runs; ``open()`` + a future does not.
        """
        box = QMessageBox(QMessageBox.Question, title, text, QMessageBox.Yes | QMessageBox.Cancel, self)
        fut = asyncio.get_running_loop().create_future()
        box.finished.connect(lambda _r: fut.done() or fut.set_result(
            box.standardButton(box.clickedButton()) == QMessageBox.Yes))
        self.question_box = box
        box.open()
        try:
            return await fut
        finally:
            self.question_box = None
            box.deleteLater()

    async def _confirmed(self, title: str, text: str) -> bool:
        answer = self.confirm(title, text)
        if inspect.isawaitable(answer):
            answer = await answer
        return bool(answer)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.controller is not None:
            self.controller.sig_state.disconnect(self._on_server_state)
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            try:
                await t
            except BaseException:
                pass
        if self.target:
            await self.target.client.aclose()
            self.target = None
        self.catalog.close()
