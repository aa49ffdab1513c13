"""The first run: a short, skippable walk through what KV Valet is for, on the default model.

Start the default server, fill a slot with a sample chat, park it, restart the
server, resume it, send the next question and read the verdict. Each step
presses the window's own buttons (nothing is done behind the user's back), and
"Skip" closes the guide for good.
"""

from __future__ import annotations

import asyncio

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QDialog, QHBoxLayout, QLabel, QPushButton, QVBoxLayout

from app.server.supervisor import ServerState

SAMPLE = ("The valet parks each car in a numbered bay and writes the bay on a ticket. "
          "When the owner returns, the valet reads the ticket and fetches the car without searching. ") * 20

STEPS = [
    ("Start the server", "Starts llama-server with the default profile (Gemma 3 270M, a sliding-window model)."),
    ("Fill slot 0 with a sample chat", "Sends a ~700-token conversation to slot 0, as a chat client would."),
    ("Park it", "Saves slot 0's KV cache to disk as the session 'first chat'."),
    ("Restart the server", "Stops and starts llama-server: what was in its memory is gone."),
    ("Resume it", "Restores 'first chat' into slot 0."),
    ("Ask the next question", "Sends the next turn; the verdict says whether the resume skipped the prefill."),
]


class FirstRunGuide(QDialog):
    sig_step_done = Signal(int, str)  # step index, what happened

    def __init__(self, window):
        super().__init__(window)
        self.window = window
        self.setWindowTitle("Welcome to KV Valet")
        self.setModal(False)
        self.step = 0
        self._task: asyncio.Task | None = None
        intro = QLabel("KV Valet parks llama-server chats to disk and resumes them, and proves with real "
                       "timings whether a resume skipped the prefill. Six steps on the default model show "
                       "it (about a minute on a laptop CPU). You can skip this at any time.")
        intro.setWordWrap(True)
        self.step_label = QLabel()
        self.step_label.setWordWrap(True)
        self.result_label = QLabel("")
        self.result_label.setWordWrap(True)
        self.result_label.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.next_button = QPushButton()
        self.skip_button = QPushButton("Skip")
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        buttons.addWidget(self.skip_button)
        buttons.addWidget(self.next_button)
        lay = QVBoxLayout(self)
        lay.addWidget(intro)
        lay.addWidget(self.step_label)
        lay.addWidget(self.result_label)
        lay.addLayout(buttons)
        self.next_button.clicked.connect(self._on_next)
        self.skip_button.clicked.connect(self.finish)
        self.resize(560, 260)
        self._show_step()

    def _show_step(self) -> None:
        if self.step >= len(STEPS):
            self.step_label.setText("<b>Done.</b> Park before a reboot, resume after it, and watch the verdict.")
            self.next_button.setText("Close")
            return
        title, text = STEPS[self.step]
        self.step_label.setText(f"<b>Step {self.step + 1} of {len(STEPS)}: {title}</b><br>{text}")
        self.next_button.setText(title)

    def _on_next(self) -> None:
        if self.step >= len(STEPS):
            self.finish()
            return
        if self._task is not None and not self._task.done():
            return
        self.next_button.setEnabled(False)
        self._task = asyncio.ensure_future(self._run_step(self.step))

    async def _run_step(self, index: int) -> None:
        try:
            text = await (self._start, self._fill, self._park, self._restart, self._resume, self._ask)[index]()
            self.result_label.setText(text)
            self.step += 1
            self.sig_step_done.emit(index, text)
        except Exception as e:  # say it; the user may retry the step
            self.result_label.setText(f"That did not work: {e}")
        finally:
            self.next_button.setEnabled(True)
            self._show_step()

    # -- the steps: the window's own buttons ----------------------------------------
    async def _connected(self):
        panel = self.window.sessions_panel
        if panel.service is not None:
            return panel.service
        fut = asyncio.get_running_loop().create_future()
        panel.sig_service.connect(lambda s: fut.done() or s is None or fut.set_result(s))
        return await asyncio.wait_for(fut, 600)

    async def _start(self) -> str:
        w = self.window
        w.reload_profiles(select="default")
        if w.controller.state != ServerState.READY:
            w.profiles.start_button.click()
        await self._connected()
        return f"The server is ready at {w.controller.url}."

    async def _fill(self) -> str:
        svc = await self._connected()
        r = await svc.target.client.completion(SAMPLE, slot_id=0, n_predict=8)
        return f"Slot 0 holds the chat: {r['timings']['prompt_n']:,} tokens prefilled in " \
               f"{r['timings']['prompt_ms']:,.0f} ms."

    async def _press(self, button, label: str) -> str:
        panel = self.window.sessions_panel
        fut = asyncio.get_running_loop().create_future()
        panel.sig_done.connect(lambda lab, ok, text: fut.done() or not lab.startswith(label)
                               or fut.set_result((ok, text)))
        self.window.tabs.setCurrentWidget(panel)
        button.click()
        ok, text = await asyncio.wait_for(fut, 300)
        if not ok:
            raise RuntimeError(text)
        return text

    async def _park(self) -> str:
        panel = self.window.sessions_panel
        panel.slot.setCurrentIndex(max(0, panel.slot.findData(0)))
        panel.name.setText("first chat")
        return await self._press(panel.park_button, "Park")

    async def _restart(self) -> str:
        w = self.window
        fut = asyncio.get_running_loop().create_future()
        w.sessions_panel.sig_service.connect(lambda s: fut.done() or s is None or fut.set_result(s))
        w.profiles.restart_button.click()
        await asyncio.wait_for(fut, 600)
        return "The server restarted: its memory is empty, the parked chat is on disk."

    async def _resume(self) -> str:
        panel = self.window.sessions_panel
        panel.select("first chat")
        panel.slot.setCurrentIndex(max(0, panel.slot.findData(0)))
        before, panel.confirm = panel.confirm, _always_yes  # the next step explains the re-prefill warning
        try:
            return await self._press(panel.resume_button, "Resume")
        finally:
            panel.confirm = before

    async def _ask(self) -> str:
        svc = await self._connected()
        fut = asyncio.get_running_loop().create_future()
        svc.on_verdict(lambda slot, session, v: fut.done() or slot != 0 or fut.set_result(v))
        await svc.target.client.completion(SAMPLE + " Where is the car?", slot_id=0, n_predict=8)
        v = await asyncio.wait_for(fut, 120)
        return (f"Verdict: {v.kind} — {v.reason}. On this build a DISCARDED resume re-prefilled; a build "
                "with checkpoint sidecars turns it into a HIT (see Check resume… and A/B check…).")

    def finish(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self.window._layout_settings().setValue("first_run_done", True)
        self.close()


def _always_yes(title: str, text: str) -> bool:
    return True


def first_run_pending(window) -> bool:
    return str(window._layout_settings().value("first_run_done", "false")).lower() != "true"
