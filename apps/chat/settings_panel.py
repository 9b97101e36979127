"""The settings column on the right of the chat window: the known models, the Model and Draft folders, the Memory
budget, Load models, the loaded pair's name and kind, and the decoding settings (Speculate, mode, beams, tree
budget, max new tokens, temperature, highlight). The Speculate box and the status line's "ready" follow one state,
model_folders.speculation."""
from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QFileDialog, QFormLayout, QHBoxLayout, QLabel,
                               QLineEdit, QMessageBox, QPushButton, QSizePolicy, QSpinBox)

from specbeam_edge.commands.flags import streaming_note

from .model_folders import explain, known_models, memory_budget, model_kind, pair_name, speculation, whole_layout

MODES = ("beam search (exact)", "beam sampling (DSBD)")
NO_TEMPLATE = ("This model has no chat template: each message is sent alone in the model's prompt format, "
               "so a system prompt would have no effect.")
NO_TEMPLATE_HINT = "No system prompt: this model has no chat template"   # fits the field; the tooltip says more
SETTINGS_WIDTH = 330               # the settings column's most: a long model name elides instead of widening it
SPECULATE_TIP = "Off: plain beam search on the target alone (same output, for comparison)"
MEMORY_TIP = ("Memory the target's weights may use, in MB (or with a unit: 400MB, 1.5GB). Empty: every layer "
              "resident. A split-layout model streams the layers that do not fit from disk on every pass (exact, "
              "slower per pass; speculation then pays most). Applied by Load models (or Enter here).")


class ElidedLabel(QLabel):
    """A one-line label that elides its text to the width it is given (the whole text in its tooltip) instead
    of growing the column it is in."""

    def __init__(self, text: str = ""):
        super().__init__()
        self._full = ""
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.setMinimumWidth(40)
        self.setText(text)

    def setText(self, text: str):           # noqa: N802 (Qt's name)
        self._full = text
        self.setToolTip(text)
        self._elide()

    def fullText(self) -> str:               # noqa: N802
        return self._full

    def resizeEvent(self, event):            # noqa: N802
        super().resizeEvent(event)
        self._elide()

    def _elide(self):
        width = max(self.width(), self.minimumWidth())
        super().setText(self.fontMetrics().elidedText(self._full, Qt.TextElideMode.ElideMiddle, width))


class KnownModels(QComboBox):
    """The model picker's list of known models; read again each time it opens (a model fetched while the app
    runs shows up). It shows the entry of the models loaded (the placeholder when they are none of its
    entries)."""
    PROMPT = "Known models…"

    def __init__(self):
        super().__init__()
        self.loaded: tuple[str, str] | None = None
        self.refresh()

    def refresh(self):
        self.clear()
        self.addItem(self.PROMPT, None)
        for label, model, draft in known_models():
            self.addItem(label, (model, draft) if model else None)
            if not model:                         # not there: shown, not choosable
                self.model().item(self.count() - 1).setEnabled(False)
        self.show_loaded(self.loaded)

    def show_loaded(self, folders: tuple[str, str] | None):
        """Show the entry of these (model, draft) folders, the placeholder when none is theirs."""
        self.loaded = folders
        found = [i for i in range(1, self.count()) if folders and self.itemData(i) == tuple(folders)]
        self.setCurrentIndex(found[0] if found else 0)

    def showPopup(self):                          # noqa: N802 (Qt's name)
        self.refresh()
        super().showPopup()


class SettingsPanel:
    """ChatWindow's settings column and the loading of its models (a mixin: the window holds the engine, the
    status line and the conversation's system prompt field)."""

    def _build_settings(self) -> QFormLayout:
        self.model_edit, self.draft_edit = QLineEdit(), QLineEdit()
        self.memory = QLineEdit()
        self.memory.setPlaceholderText("all resident")
        self.memory.setToolTip(MEMORY_TIP)
        self.memory.returnPressed.connect(self.load_models)
        pick_m, pick_d = QPushButton("…"), QPushButton("…")
        pick_m.clicked.connect(self._pick_model)
        pick_d.clicked.connect(self._pick_draft)
        load_btn = QPushButton("Load models")
        load_btn.clicked.connect(self.load_models)
        self.known = KnownModels()
        self.known.setToolTip("The shipped pairs and the models fetched with `specbeam fetch`: choosing one fills "
                              "the Model and Draft fields and loads them")
        self.known.activated.connect(self._known_chosen)
        self.pair = ElidedLabel("no model loaded")
        self.kind = QLabel("")                 # wraps: what the model does with a message
        self.kind.setWordWrap(True)
        self.kind.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.speculate = QCheckBox("Speculate (draft or own head)")
        self.speculate.setToolTip(SPECULATE_TIP)
        self.want_speculate = True          # the user's choice; the box shows it where something can draft
        self.speculate.toggled.connect(self._speculate_toggled)
        self.mode = QComboBox()
        self.mode.addItems(MODES)
        self.mode.currentIndexChanged.connect(self._mode_changed)
        self.beams, self.budget, self.max_new = QSpinBox(), QSpinBox(), QSpinBox()
        self.beams.valueChanged.connect(self._sync_speculation)
        self.beams.setRange(1, 16)
        self.budget.setRange(1, 1024)
        self.max_new.setRange(1, 1024)
        self.temperature = QDoubleSpinBox()
        self.temperature.setRange(0.05, 5.0)
        self.temperature.setSingleStep(0.05)
        self.highlight = QCheckBox("Highlight text from the draft")
        self.highlight.toggled.connect(self._show_conversation)
        form = QFormLayout()
        form.addRow("", self.known)
        for label, w, btn in (("Model", self.model_edit, pick_m), ("Draft", self.draft_edit, pick_d)):
            row = QHBoxLayout()
            row.addWidget(w)
            row.addWidget(btn)
            form.addRow(label, row)
        form.addRow("Memory budget (MB)", self.memory)
        form.addRow("", load_btn)
        form.addRow("Loaded", self.pair)
        form.addRow(self.kind)
        form.addRow("", self.speculate)
        form.addRow("Mode", self.mode)
        form.addRow("Beams", self.beams)
        form.addRow("Tree budget", self.budget)
        form.addRow("Max new tokens", self.max_new)
        form.addRow("Temperature", self.temperature)
        form.addRow("", self.highlight)
        return form

    def _pick_model(self):
        """Another model folder: the draft field is cleared (a draft goes with its own target; the one there
        belonged to the previous model), so the pick loads as plain search until a draft is chosen for it."""
        old = self.model_edit.text()
        self._pick(self.model_edit)
        if self.model_edit.text() != old and self.draft_edit.text():
            self.draft_edit.clear()
            self.status.setText("draft cleared: it went with the previous model; pick one for this model, or load "
                                "it without")

    def _known_chosen(self, index: int):
        """Fill the fields with the chosen entry and load it; the list keeps showing it (the models loaded:
        the entry of the models still in use when loading failed)."""
        folders = self.known.itemData(index)
        if folders:
            self.model_edit.setText(folders[0])
            self.draft_edit.setText(folders[1])
            self.load_models()
        else:
            self.known.show_loaded(self.known.loaded)

    def _pick_draft(self):
        self._pick(self.draft_edit)

    def _pick(self, edit: QLineEdit):
        folder = QFileDialog.getExistingDirectory(self, "Model folder", edit.text())
        if folder:
            edit.setText(folder)

    def _mode_changed(self, index: int):
        self.temperature.setEnabled(index == 1)     # exact beam search has no temperature
        self._sync_speculation()

    def _speculation(self) -> tuple[str | None, str]:
        return speculation(self.engine, self.beams.value(), self.mode.currentIndex() == 1)

    def _speculate_toggled(self, on: bool):
        self.want_speculate = on                    # only the user's clicks: _sync_speculation blocks signals

    def _sync_speculation(self, *_):
        """The Speculate box from the one state (speculation()): enabled and showing the user's choice where
        something drafts for these settings, else cleared and disabled with the reason in its tooltip; an idle
        status line that says "ready" says the same."""
        how, why = self._speculation()
        self.speculate.blockSignals(True)
        self.speculate.setEnabled(how is not None)
        self.speculate.setChecked(how is not None and self.want_speculate)
        self.speculate.blockSignals(False)
        self.speculate.setText({"draft": "Speculate (draft)", "head": "Speculate (lookahead head)"}.get(
            how, "Speculate (draft or own head)"))
        self.speculate.setToolTip(SPECULATE_TIP if how else f"No speculation: {why}")
        if self.engine is not None and self.gen is None and self.status.text().startswith("ready: "):
            self.status.setText(self._ready_text())

    def _speculates(self) -> str | None:
        """What drafts for the next answer: the state's drafter when the box is on, else None."""
        how, _ = self._speculation()
        return how if how and self.speculate.isChecked() else None

    def _speculation_note(self) -> str:
        how, why = self._speculation()
        if how is None:
            return f" · no speculation: {why}" if self.engine is not None else ""
        return "" if self.speculate.isChecked() else " · no speculation (switched off)"

    def _ready_text(self) -> str:
        stream = streaming_note(self.engine, self.engine_budget)
        return f"ready: {self.engine_name}" + self._speculation_note() + (f" · {stream}" if stream else "")

    # -- models ----------------------------------------------------------------------------------------------
    def load_models(self) -> bool:
        """Load the folders in the Model/Draft fields; on failure the models loaded before stay in use."""
        model, draft = self.model_edit.text().strip(), self.draft_edit.text().strip()
        self.status.setText(f"loading {pair_name(model, draft)}…")
        unused = ""
        try:
            budget = memory_budget(self.memory.text())
            if budget is not None and whole_layout(model):
                budget, unused = None, " · memory budget not applied: this model's layout keeps every layer resident"
            engine = self.engine_factory(model, draft=draft or None,
                                         **({} if budget is None else {"max_memory": budget}))
        except Exception as e:
            kept = f"Still using {self.engine_name}." if self.engine else "No model is loaded."
            QMessageBox.critical(self, "Cannot load the models", f"{explain(e, model, draft)}\n\n{kept}")
            self.status.setText(f"could not load {pair_name(model, draft)}; "
                                + (f"still using {self.engine_name}" if self.engine else "no model loaded"))
            self.known.show_loaded(self.known.loaded)
            return False
        head = engine.draft is None and getattr(engine.target, "ahead", None) is not None
        self.engine, self.engine_name, self.engine_budget = engine, pair_name(model, draft, head), budget
        self.settings.setValue("model", model)
        self.settings.setValue("draft", draft)
        self.settings.setValue("max_memory", self.memory.text().strip())
        self.pair.setText(self.engine_name)
        self.kind.setText(model_kind(engine.tokenizer, model))
        self.known.show_loaded((model, draft))
        self._template_changed()
        self.status.setText("ready: ")
        self._sync_speculation()
        self.status.setText(self._ready_text() + unused)
        return True

    def _template_changed(self):
        has = bool(self.engine.tokenizer.chat_template)
        self.system.setEnabled(has)
        self.system.setToolTip("" if has else NO_TEMPLATE)
        self.system.setPlaceholderText("System prompt (optional)" if has else NO_TEMPLATE_HINT)
