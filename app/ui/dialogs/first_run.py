"""The first run: a short, skippable walk through what KV Valet is for, on the default model.

Start the default server, fill a slot with a sample chat, park it, restart the
server, resume it, send the next question and read the verdict. Each step
presses the window's own buttons (nothing is done behind the user's back), and
"Skip" closes the guide for good.

On the stock server the verdict of a sliding-window model is DISCARDED: the
server keeps no context checkpoints past a restart. The guide then offers to
build the checkpoint-persisting server (app.ui.dialogs.build), switches the
default profile to it, and walks the same steps again (:data:`BUILT_STEPS`), to
a HIT shown next to the DISCARDED run with the measured speed-up.
"""

from __future__ import annotations

import asyncio
import logging

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QDialog, QHBoxLayout, QLabel, QPushButton, QVBoxLayout

from app.core.background import track
from app.core.profile import BUILT_MARKER
from app.core.states import ServerState
from app.core.timings import Timings
from app.ui.operations import Operation

log = logging.getLogger(__name__)

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
# After "Build a checkpoint-persisting server…": the same walk on the built server.
BUILT_STEPS = [
    ("Restart on the built server", "The default profile now runs the checkpoint-persisting server; this "
                                    "restarts the server with it."),
    ("Fill slot 0 again", "Sends the same conversation to slot 0."),
    ("Park it again", "Saves slot 0 as 'first chat (built)': this time its context checkpoints are saved too."),
    ("Restart it", "Stops and starts the built server: what was in its memory is gone."),
    ("Resume it again", "Restores 'first chat (built)' into slot 0, checkpoints included."),
    ("Ask the same question", "Sends the same next turn; the verdict should now be a HIT."),
]


class FirstRunGuide(QDialog):
    sig_step_done = Signal(int, str)  # step index, what happened
    sig_built = Signal(bool, str)  # the offered build ended: ok, what happened

    def __init__(self, window):
        super().__init__(window)
        self.window = window
        self.setWindowTitle("Welcome to KV Valet")
        self.setModal(False)
        self.step = 0
        self.steps = STEPS  # BUILT_STEPS once the checkpoint-persisting server is built
        self.session_name = "first chat"
        self.prefill_ms: dict[str, float] = {}  # verdict kind -> the next question's prefill (ms)
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
        self.build_button = QPushButton("Build a checkpoint-persisting server…")
        self.build_button.hide()  # offered when the verdict is DISCARDED for lack of a sidecar
        self.build_button.clicked.connect(self._on_build)
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        buttons.addWidget(self.build_button)
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
        if self.step >= len(self.steps):
            self.step_label.setText("<b>Done.</b> Park before a reboot, resume after it, and watch the verdict.")
            self.next_button.setText("Close")
            return
        title, text = self.steps[self.step]
        self.step_label.setText(f"<b>Step {self.step + 1} of {len(self.steps)}: {title}</b><br>{text}")
        self.next_button.setText(title)

    def _on_next(self) -> None:
        if self.step >= len(self.steps):
            self.finish()
            return
        if self._task is not None and not self._task.done():
            return
        self.next_button.setEnabled(False)
        self._task = track(self._run_step(self.step), f"first-run step {self.step + 1}")

    async def _run_step(self, index: int) -> None:
        try:
            first = self._start if self.steps is STEPS else self._restart_built
            text = await (first, self._fill, self._park, self._restart, self._resume, self._ask)[index]()
            self.result_label.setText(text)
            self.step += 1
            self.sig_step_done.emit(index, text)
        except Exception as e:  # report: say it; the user may retry the step
            log.exception("first-run step %d failed", index + 1)
            self.result_label.setText(f"That did not work: {e}")
        finally:
            self.next_button.setEnabled(True)
            self._show_step()

    # -- the steps: the window's own buttons ----------------------------------------
    async def _connected(self):
        ctl = self.window.sessions_panel.controller
        if ctl.service is not None:
            return ctl.service
        return await self._next_service()

    async def _next_service(self, click=None):
        """The next session service the Sessions tab connects (after ``click``, if given)."""
        ctl = self.window.sessions_panel.controller
        fut = asyncio.get_running_loop().create_future()

        def connected(svc) -> None:
            if svc is not None and not fut.done():
                fut.set_result(svc)

        ctl.service_changed.connect(connected)
        try:
            if click is not None:
                click()
            return await asyncio.wait_for(fut, 600)
        finally:
            ctl.service_changed.disconnect(connected)

    async def _start(self) -> str:
        w = self.window
        w.reload_profiles(select="default")
        if w.controller.state != ServerState.READY:
            w.profiles.start_button.click()
        await self._connected()
        return f"The server is ready at {w.controller.url}."

    async def _fill(self) -> str:
        svc = await self._connected()
        t = Timings.of(await svc.target.client.completion(SAMPLE, slot_id=0, n_predict=8))
        return f"Slot 0 holds the chat: {t.prompt_n or 0:,} tokens prefilled in {t.prompt_ms or 0.0:,.0f} ms."

    async def _outcome(self, succeeded, op, act):
        """Do ``act`` on the Sessions tab; the result its controller's ``succeeded`` signal carries,
        or the error its ``failed(op, why)`` says."""
        panel = self.window.sessions_panel
        ctl = panel.controller
        fut = asyncio.get_running_loop().create_future()

        def done(result) -> None:
            if not fut.done():
                fut.set_result(result)

        def failed(what, why: str) -> None:
            if what is op and not fut.done():
                fut.set_exception(RuntimeError(why))

        succeeded.connect(done)
        ctl.failed.connect(failed)
        try:
            self.window.tabs.setCurrentWidget(panel)
            act()
            return await asyncio.wait_for(fut, 300)
        finally:
            succeeded.disconnect(done)
            ctl.failed.disconnect(failed)

    async def _park(self) -> str:
        panel = self.window.sessions_panel
        panel.slot.setCurrentIndex(max(0, panel.slot.findData(0)))
        panel.name.setText(self.session_name)
        r = await self._outcome(panel.controller.parked, Operation.PARK, panel.park_chosen)
        return (f"Parked slot {r.slot_id} as '{r.record.name}': {r.record.n_tokens:,} tokens in "
                f"{r.record.save_ms:,.0f} ms.")

    async def _restart(self) -> str:
        await self._next_service(self.window.profiles.restart_button.click)
        return "The server restarted: its memory is empty, the parked chat is on disk."

    async def _resume(self) -> str:
        panel = self.window.sessions_panel
        panel.select(self.session_name)
        panel.slot.setCurrentIndex(max(0, panel.slot.findData(0)))
        questions = panel.controller.questions
        before, questions.confirm = questions.confirm, _always_yes  # the next step explains the re-prefill warning
        try:
            r = await self._outcome(panel.controller.resumed, Operation.RESUME, panel.resume_selected)
        finally:
            questions.confirm = before
        return (f"Resumed '{r.record.name}' into slot {r.slot_id}: {r.n_restored:,} tokens in {r.restore_ms:,.0f} ms. "
                "The verdict comes with the next query on that slot.")

    async def _ask(self) -> str:
        svc = await self._connected()
        fut = asyncio.get_running_loop().create_future()
        svc.on_verdict(lambda slot, session, v: fut.done() or slot != 0 or fut.set_result(v))
        r = await svc.target.client.completion(SAMPLE + " Where is the car?", slot_id=0, n_predict=8)
        v = await asyncio.wait_for(fut, 120)
        if (prompt_ms := Timings.of(r).prompt_ms) is not None:
            self.prefill_ms[str(v.kind)] = prompt_ms
        text = f"Verdict: {v.kind} — {v.reason}."
        if self.steps is BUILT_STEPS:
            return text + self._comparison()
        if self._lacks_sidecar(v):
            from app.tools.server_build import estimate_text

            self.build_button.show()
            return (text + " The stock server keeps no context checkpoints past a restart, so this resume "
                    "re-prefilled. KV Valet can build a server that keeps them (" + estimate_text() + "), then "
                    "repeat these steps on it: Build a checkpoint-persisting server….")
        return text + (" On this build a DISCARDED resume re-prefilled; a build with checkpoint sidecars turns "
                       "it into a HIT (see Check resume… and A/B check…)." if v.kind == "DISCARDED" else "")

    def _lacks_sidecar(self, v) -> bool:
        """DISCARDED because the server did not persist the checkpoints (not for another reason),
        on a profile that does not run the built server yet."""
        if v.kind != "DISCARDED" or not ("sidecar" in v.reason or "persist context checkpoints" in v.reason):
            return False
        from app.core.profile import ProfileError

        try:
            return self.window.store.load("default").server_binary != BUILT_MARKER
        except ProfileError:
            return False

    def _comparison(self) -> str:
        hit, stock = self.prefill_ms.get("HIT"), self.prefill_ms.get("DISCARDED")
        if hit is None or stock is None:
            return ""
        speedup = f", {stock / hit:,.0f}× faster" if hit > 0 else ""
        return (f" The next question's prefill took {hit:,.0f} ms on the checkpoint-persisting server, against "
                f"{stock:,.0f} ms after the stock server's DISCARDED resume{speedup}.")

    # -- the checkpoint-persisting server --------------------------------------------
    def _on_build(self) -> None:
        from app.ui.dialogs.build import SWITCH_ANSWER_KEY, open_build_dialog

        # building it here is the answer to "use it for the default profile?": the guide switches it
        self.window._layout_settings().setValue(SWITCH_ANSWER_KEY, "yes")
        dialog = open_build_dialog(self.window)
        if not getattr(dialog, "_guide_connected", False):
            dialog.sig_finished.connect(self._on_built)
            dialog._guide_connected = True
        self.build_button.setEnabled(False)
        if dialog.start() is None and not dialog.running:
            self.build_button.setEnabled(True)

    def _on_built(self, ok: bool, text: str, _result) -> None:
        self.build_button.setEnabled(True)
        if ok:
            from app.tools.server_build import use_built_server
            from app.store.profiles import DEFAULT_PROFILE_NAME

            use_built_server(self.window.store, DEFAULT_PROFILE_NAME)
            self.window.reload_profiles(select=DEFAULT_PROFILE_NAME)
            self.build_button.hide()
            self.steps, self.step, self.session_name = BUILT_STEPS, 0, "first chat (built)"
            self.result_label.setText(text)
            self._show_step()
        else:
            self.result_label.setText(text)
        self.sig_built.emit(ok, text)

    async def _restart_built(self) -> str:
        w = self.window
        w.reload_profiles(select="default")
        button = w.profiles.restart_button if w.controller.state == ServerState.READY else w.profiles.start_button
        await self._next_service(button.click)
        binary = getattr(getattr(w.controller, "plan", None), "binary", "")
        return f"The checkpoint-persisting server is ready at {w.controller.url}" + (f" ({binary})." if binary
                                                                                     else ".")

    def finish(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self.window._layout_settings().setValue("first_run_done", True)
        self.close()


def _always_yes(title: str, text: str) -> bool:
    return True


def first_run_pending(window) -> bool:
    return str(window._layout_settings().value("first_run_done", "false")).lower() != "true"


def greet(window, fresh_install: bool) -> None:
    """What a start of the window opens: on a fresh install the guide (not modal, kept as
    ``window.first_run``); and, once, the question whether the default profile should run a
    checkpoint-persisting server built meanwhile (app.ui.dialogs.build.offer_built_server), never
    on top of the guide (which offers the build itself): after the guide is closed."""
    from PySide6.QtCore import QTimer

    from app.ui.dialogs.build import offer_built_server

    if fresh_install and first_run_pending(window):
        window.first_run = FirstRunGuide(window)
        window.first_run.finished.connect(lambda _r: offer_built_server(window))
        window.first_run.show()
    else:
        QTimer.singleShot(0, lambda: offer_built_server(window))
