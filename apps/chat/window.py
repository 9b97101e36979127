"""The chat window: streams the answer (the stable prefix of the beams) off the UI thread as Markdown with the
draft's characters highlighted, Stop within one target pass, Regenerate, system prompt, model/draft pickers,
decoding settings (remembered in QSettings), and a status line."""
from __future__ import annotations

import time
from pathlib import Path

import re
import sqlite3

from PySide6.QtCore import QByteArray, QSettings, QStandardPaths, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import (QAction, QColor, QDesktopServices, QGuiApplication, QKeySequence, QTextCharFormat,
                           QTextCursor)
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QFileDialog, QFormLayout, QHBoxLayout,
                               QInputDialog, QLabel, QLineEdit, QListWidget, QListWidgetItem, QMainWindow, QMenu,
                               QMessageBox, QPlainTextEdit, QPushButton, QSizePolicy, QSpinBox, QSplitter,
                               QTextBrowser, QVBoxLayout, QWidget)

from specbeam_edge import Engine, fetch
from specbeam_edge.config import (AHEAD_MIN_PATH_PROB, DEFAULT_BUDGET, GenerationConfig, ModelConfig,
                                  SpeculativeConfig)
from specbeam_edge.flags import parse_size, speculative_config, streaming_note
from specbeam_edge.prompting import CHAT_MAX_NEW_TOKENS, has_chat_template
from specbeam_edge.shipped import missing_message, models_root
from specbeam_edge.tokenizer import ChatTemplateError

from .render import COPY_SCHEME, CURSOR, code_text, insert_answer
from .store import ChatStore, StoreLocked
from .worker import Answer, Generation

SPECULATION_DEFAULTS = SpeculativeConfig()     # the panel sets the budget; the rest are the engine's defaults

MODES = ("beam search (exact)", "beam sampling (DSBD)")
NO_TEMPLATE = ("This model has no chat template: each message is sent alone in the model's prompt format, "
               "so a system prompt would have no effect.")
DAMAGED = ("Part of this conversation could not be read from the database: what could be read is shown, and "
           "new messages are saved.")
NO_TEMPLATE_HINT = "No system prompt: this model has no chat template"   # fits the field; the tooltip says more
SETTINGS_WIDTH = 330               # the settings column's most: a long model name elides instead of widening it
SPECULATE_TIP = "Off: plain beam search on the target alone (same output, for comparison)"
MEMORY_TIP = ("Memory the target's weights may use, in MB (or with a unit: 400MB, 1.5GB). Empty: every layer "
              "resident. A split-layout model streams the layers that do not fit from disk on every pass (exact, "
              "slower per pass; speculation then pays most). Applied by Load models (or Enter here).")
RETRY_MS = 2000                    # a change kept while another program locks the database is tried again this often
CHAT_MODELS = ("qwen2.5-coder-1.5b", "smollm2")   # fetched chat models the app opens on, best first


def pair_name(model: str, draft: str, head: bool = False) -> str:
    """'ende (target + draft)' for a shipped pair; 'qwen + qwen-draft' for two unrelated folders; a model
    without a draft says whether its own lookahead head drafts instead (head)."""
    m = Path(model)
    base = m.parent.name if m.name == "target" else m.name
    if not draft:
        return f"{base} (no draft; own lookahead head)" if head else f"{base} (no draft)"
    d = Path(draft)
    return f"{base} ({m.name} + {d.name})" if d.parent == m.parent else f"{base} + {d.name}"


def speculation(engine, beams: int, sample: bool) -> tuple[str | None, str]:
    """What drafts for these settings: "draft", "head" (the target's own lookahead head: greedy search only,
    cli.configs says why) or None, and why not when None. The one state the Speculate box, the Loaded label, the
    status line and the search itself follow."""
    if engine is None:
        return None, "no model is loaded"
    if engine.draft is not None:
        return "draft", ""
    if getattr(engine.target, "ahead", None) is None:
        return None, "this model has no draft and no lookahead head"
    if sample:
        return None, "its lookahead head drafts for exact search only, not beam sampling"
    if beams > 1:
        return None, f"its lookahead head drafts for one beam only (Beams is {beams})"
    return "head", ""


def memory_budget(text: str) -> int | None:
    """The Memory budget field in bytes: empty is None (every layer resident), a bare number is MB, else a size
    with its unit (400MB, 1.5GB); ValueError says what is wrong."""
    t = text.strip()
    if not t:
        return None
    try:
        float(t)
        t += "MB"
    except ValueError:
        pass
    try:
        return parse_size(t)
    except Exception as e:            # argparse.ArgumentTypeError
        raise ValueError(f"Memory budget: {e}") from None


def model_kind(tokenizer, model: str) -> str:
    """What the loaded model does with a message, for the label under the pair's name."""
    if tokenizer.chat_template:
        return "chat model (chat template)"
    if Path(model).parent == models_root() / "ende":
        return "translator: each message is translated into German"
    fmt = tokenizer.prompt_format or "{source}"
    if fmt.rstrip().endswith("{source}"):
        return "completion: each message is continued"
    return f"fixed prompt format {fmt!r}: each message is sent on its own"


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


def known_models() -> list[tuple[str, str, str]]:
    """(label, model folder, draft folder) of the models this installation has: the shipped pairs that are there
    and the fetched models (`specbeam fetch NAME`, in the per-user data folder); a fetchable model that is not
    fetched yet comes with an empty folder and says how to fetch it."""
    found = []
    for pair, what in (("text", "shipped pair, continues text"), ("ende", "shipped pair, en->de")):
        root = models_root() / pair
        if (root / "target").is_dir():
            draft = root / "draft"
            found.append((f"{pair} ({what})", str(root / "target"), str(draft) if draft.is_dir() else ""))
    have = fetch.fetched()
    for name, src in fetch.SOURCES.items():
        if name in have:
            paying = fetch.default_draft(name)       # its own draft, or another fetched model (qwen 0.5B)
            if paying:
                found.append((f"{src.folder} (fetched, with its draft)", str(have[name]), paying))
                continue
            draft = fetch.draft_path(name)
            head = " with its lookahead head" if fetch.has_ahead(name) else ""
            found.append((f"{src.folder} (fetched{head}{'' if draft or head else ', no draft'})", str(have[name]),
                          ""))
            if draft:        # offered, not the default: measured slower than plain search (models/<name>/README)
                found.append((f"{src.folder} with its draft (trained here; slower than plain so far)",
                              str(have[name]), str(draft)))
        else:
            found.append((f"{name}: not fetched (run: specbeam fetch {name})", "", ""))
    return found


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


class MessageEdit(QPlainTextEdit):
    """The message box: Enter sends, Shift+Enter starts a new line."""
    submitted = Signal()

    def keyPressEvent(self, event):
        enter = event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter)
        if enter and not event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            self.submitted.emit()
            return
        super().keyPressEvent(event)


class ChatWindow(QMainWindow):
    def __init__(self, store: ChatStore | None = None, engine_factory=Engine, settings: QSettings | None = None):
        super().__init__()
        self.store = store or ChatStore()
        self.settings = settings or QSettings("specbeam-edge", "chat")
        self.engine_factory, self.engine, self.engine_name = engine_factory, None, ""
        self.engine_budget: int | None = None     # the loaded engine's max_memory
        self.gen: Generation | None = None
        self.gen_conv: int | None = None
        self.replacing: int | None = None    # the answer a running Regenerate replaces once it finishes
        self.partial, self.partial_steps = Answer(), 0
        self._answer_at = 0            # document position where the streaming answer starts
        self.retry_timer = QTimer(self, singleShot=True, interval=RETRY_MS)     # a locked database, tried again
        self.retry_timer.timeout.connect(self._retry_store)
        self.notices: list[str] = [self.store.notice] if self.store.notice else []
        self.setWindowTitle("specbeam chat")
        self.resize(980, 640)
        self._build()
        self._restore_settings()
        self._load_conversations()
        if self.notices:           # what start-up had to repair: said once, the app starts anyway
            QMessageBox.warning(self, "specbeam chat", "\n\n".join(self.notices))
        self.load_models()
        if self.notices and self.store.read_only:
            self.status.setText(self.status.text() + " · conversations are not saved (read-only database)")
        self.input.setFocus()

    # -- layout ----------------------------------------------------------------------------------------------
    def _build(self):
        self.convs = QListWidget()
        self.convs.currentItemChanged.connect(self._show_conversation)
        self.convs.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.convs.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)   # long titles elide
        self.convs.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.convs.customContextMenuRequested.connect(self._conversation_menu)
        new_btn = QPushButton("New chat")
        new_btn.clicked.connect(self.new_chat)
        export_btn = QPushButton("Export Markdown…")
        export_btn.clicked.connect(self._export_clicked)
        left = QVBoxLayout()
        for w in (new_btn, self.convs, export_btn):
            left.addWidget(w)
        self.transcript = QTextBrowser()
        self.transcript.setOpenLinks(False)            # _link_clicked: a code block's copy link, or the browser
        self.transcript.anchorClicked.connect(self._link_clicked)
        self.system = QLineEdit()
        self.system.setPlaceholderText("System prompt (optional)")
        self.system.editingFinished.connect(self._save_system)
        self.input = MessageEdit()
        self.input.setPlaceholderText("Type a message… (Enter sends, Shift+Enter adds a line)")
        self.input.setMaximumHeight(90)
        self.input.submitted.connect(self.send)
        self.send_btn, self.stop_btn, self.regen_btn = QPushButton("Send"), QPushButton("Stop"), QPushButton("Regenerate")
        for b, slot in ((self.send_btn, self.send), (self.stop_btn, self.stop), (self.regen_btn, self.regenerate)):
            b.clicked.connect(slot)
            b.setFocusPolicy(Qt.FocusPolicy.TabFocus)   # a click leaves the focus in the message box
        self.stop_btn.setEnabled(False)
        buttons = QHBoxLayout()
        for b in (self.send_btn, self.stop_btn, self.regen_btn):
            buttons.addWidget(b)
        center = QVBoxLayout()
        for w in (self.system, self.transcript, self.input):
            center.addWidget(w)
        center.addLayout(buttons)
        self.split = QSplitter()
        self.columns = []
        for layout in (left, center, self._build_settings()):
            w = QWidget()
            w.setLayout(layout)
            self.split.addWidget(w)
            self.columns.append(w)
        self.columns[2].setMaximumWidth(SETTINGS_WIDTH)
        self.split.setStretchFactor(1, 1)              # the transcript takes what the window gains
        self.split.setSizes([200, 560, 280])
        self.setCentralWidget(self.split)
        self.status = QLabel("")
        self.statusBar().addWidget(self.status)
        self._build_menus()

    def _build_menus(self):
        """The menu bar; every action has its shortcut (Esc stops, Ctrl+N a new chat, Ctrl+Q quits, ...)."""
        self.actions: dict[str, QAction] = {}

        def add(menu, name, text, slot, keys):
            act = QAction(text, self)
            act.setShortcuts([QKeySequence(k) for k in keys])
            act.setShortcutContext(Qt.ShortcutContext.WindowShortcut)
            act.triggered.connect(slot)
            menu.addAction(act)
            self.addAction(act)
            self.actions[name] = act
            return act
        bar = self.menuBar()
        file = bar.addMenu("&File")
        add(file, "new", "&New chat", self.new_chat, ["Ctrl+N"])
        add(file, "export", "&Export Markdown…", self._export_clicked, ["Ctrl+E"])
        file.addSeparator()
        add(file, "quit", "&Quit", self.close, ["Ctrl+Q"])
        chat = bar.addMenu("&Chat")
        add(chat, "send", "&Send", self.send, ["Ctrl+Return"])
        add(chat, "stop", "S&top", self.stop, ["Esc"])
        add(chat, "regenerate", "&Regenerate", self.regenerate, ["Ctrl+R"])
        chat.addSeparator()
        add(chat, "rename", "Re&name conversation…", self.rename_clicked, ["F2"])
        add(chat, "delete", "&Delete conversation…", self.delete_clicked, ["Ctrl+Shift+D"])
        models = bar.addMenu("&Models")
        add(models, "load", "&Load models", self.load_models, ["Ctrl+L"])
        add(models, "pick_model", "Choose the &model folder…", self._pick_model, [])
        add(models, "pick_draft", "Choose the &draft folder…", self._pick_draft, [])

    def _conversation_menu(self, pos):
        item = self.convs.itemAt(pos)
        if item is None:
            return
        self.convs.setCurrentItem(item)
        menu = QMenu(self)
        menu.addAction(self.actions["rename"])
        menu.addAction(self.actions["delete"])
        menu.addAction(self.actions["export"])
        menu.popup(self.convs.viewport().mapToGlobal(pos))
        self._menu = menu                     # kept for the tests (and alive while it is shown)

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

    # -- settings (QSettings: the platform's usual place) --------------------------------------------------
    def _restore_settings(self):
        """Every value is checked: one that is not a number or out of range is replaced by its default (or the
        nearest allowed value) and named in `notices`; a damaged settings file never stops the app."""
        s, bad = self.settings, []

        def number(key, default, widget, cast=int):
            raw = s.value(key, default)
            lo, hi = widget.minimum(), widget.maximum()
            try:
                value = cast(raw)
                if value != value:                   # NaN
                    raise ValueError
            except (TypeError, ValueError, OverflowError):
                bad.append(f"{key}={_shown(raw)} is not a number (using {default})")
                return default
            if not lo <= value <= hi:
                near = min(max(value, lo), hi)
                bad.append(f"{key}={_shown(raw)} is outside {lo}..{hi} (using {near})")
                return near
            return value

        def flag(key, default):
            raw = s.value(key, default)
            if isinstance(raw, bool) or str(raw).lower() in ("true", "false"):
                return _bool(raw)
            bad.append(f"{key}={_shown(raw)} is not true or false (using {str(default).lower()})")
            return default

        # earlier versions kept the folders in the conversation database: carry them over once
        model, draft = default_folders()
        self.model_edit.setText(str(s.value("model", self.store.get("model") or model)))
        self.draft_edit.setText(str(s.value("draft", self.store.get("draft", draft))))
        budget = str(s.value("max_memory", "") or "")
        try:
            memory_budget(budget)
        except ValueError:
            bad.append(f"max_memory={_shown(budget)} is not a size (using none: every layer resident)")
            budget = ""
        self.memory.setText(budget)
        mode = s.value("mode", 0)
        if str(mode) not in ("0", "1"):
            bad.append(f"mode={_shown(mode)} is not 0 or 1 (using 0)")
            mode = 0
        self.mode.setCurrentIndex(int(mode))
        self.beams.setValue(number("beams", 4 if s.contains("beams") else default_beams(self.model_edit.text()),
                                   self.beams))
        self.budget.setValue(number("budget", DEFAULT_BUDGET, self.budget))
        self.max_new.setValue(number("max_new_tokens", 128 if s.contains("max_new_tokens")
                                     else default_max_new(self.model_edit.text()), self.max_new))
        self.temperature.setValue(number("temperature", 1.0, self.temperature, float))
        self.highlight.setChecked(flag("highlight", True))
        self.want_speculate = flag("speculate", True)
        self.speculate.setChecked(self.want_speculate)
        self._mode_changed(self.mode.currentIndex())
        if isinstance(s.value("geometry"), QByteArray):
            self.restoreGeometry(s.value("geometry"))
        if isinstance(s.value("splitter"), QByteArray):
            self.split.restoreState(s.value("splitter"))
        if bad:
            where = s.fileName()
            self.notices.append(f"Settings ({where}): " + "; ".join(bad) + ".")

    def save_settings(self):
        s = self.settings
        for key, value in (("mode", self.mode.currentIndex()), ("beams", self.beams.value()),
                           ("budget", self.budget.value()), ("max_new_tokens", self.max_new.value()),
                           ("temperature", self.temperature.value()), ("highlight", self.highlight.isChecked()),
                           ("speculate", self.want_speculate), ("max_memory", self.memory.text().strip()),
                           ("geometry", self.saveGeometry()),
                           ("splitter", self.split.saveState())):
            s.setValue(key, value)
        s.sync()

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
            QMessageBox.critical(self, "Cannot load the models", f"{_explain(e, model, draft)}\n\n{kept}")
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

    # -- conversations ---------------------------------------------------------------------------------------
    def _load_conversations(self):
        self.convs.clear()
        for cid, title in self.store.conversations():
            item = QListWidgetItem(title)
            item.setToolTip(title)
            item.setData(Qt.ItemDataRole.UserRole, cid)
            self.convs.addItem(item)
        if self.convs.count() == 0:
            self.new_chat()
        else:
            self.convs.setCurrentRow(0)

    def current(self) -> int:
        return self.convs.currentItem().data(Qt.ItemDataRole.UserRole)

    # -- a database another program holds locked: the change waits, the user is told in one line ----------------
    def _stored(self, write, *args) -> bool:
        """Run a store write; False when the database is locked (said in the status bar; a kept change is saved
        by the next write or the retry timer)."""
        try:
            write(*args)
            return True
        except StoreLocked as e:
            self.status.setText(str(e))
            self.retry_timer.start()
            return False

    def _retry_store(self):
        if self._stored(self.store.retry):
            self.status.setText("the conversation database is free again; every change is saved")
            self._show_conversation()

    def new_chat(self):
        try:
            cid = self.store.new_conversation()
        except StoreLocked as e:        # nothing typed yet: nothing to keep; the user clicks again
            self.status.setText(str(e))
            return
        item = QListWidgetItem("New chat")
        item.setData(Qt.ItemDataRole.UserRole, cid)
        self.convs.insertItem(0, item)
        self.convs.setCurrentRow(0)
        self.input.setFocus()

    def _item(self, cid: int) -> QListWidgetItem | None:
        for row in range(self.convs.count()):
            if self.convs.item(row).data(Qt.ItemDataRole.UserRole) == cid:
                return self.convs.item(row)
        return None

    def rename_clicked(self):
        if not self.convs.currentItem():
            return
        cid = self.current()
        title, ok = QInputDialog.getText(self, "Rename conversation", "Title:", text=self.store.title(cid))
        if ok:
            self.rename_conversation(cid, title)

    def rename_conversation(self, cid: int, title: str):
        title = " ".join(title.split())[:200]
        if not title:
            return
        self._stored(self.store.set_title, cid, title)
        item = self._item(cid)
        if item is not None:
            item.setText(title)
            item.setToolTip(title)

    def delete_clicked(self):
        if not self.convs.currentItem():
            return
        cid = self.current()
        answer = QMessageBox.question(self, "Delete conversation",
                                      f"Delete “{self.store.title(cid)}” and its messages? This cannot be undone.")
        if answer == QMessageBox.StandardButton.Yes:
            self.delete_conversation(cid)

    def delete_conversation(self, cid: int):
        """Delete a conversation (an answer streaming into it is stopped first); the list always keeps one."""
        if self.gen is not None and self.gen_conv == cid:
            self.gen.stop()
            self._collect()
        self._stored(self.store.delete_conversation, cid)
        item = self._item(cid)
        if item is not None:
            self.convs.takeItem(self.convs.row(item))
        if self.convs.count() == 0:
            self.new_chat()
        self._show_conversation()

    def _save_system(self):
        if self.convs.currentItem():
            self._stored(self.store.set_system, self.current(), self.system.text())

    def _show_conversation(self, *_):
        if not self.convs.currentItem():
            return
        cid = self.current()
        self.system.setText(self.store.system(cid))
        self.transcript.clear()
        cursor = QTextCursor(self.transcript.document())
        generating = self.gen is not None and self.gen_conv == cid
        messages = self.store.messages(cid)
        if cid in self.store.damaged:
            cursor.insertText(DAMAGED, _note_format())
        for m in messages:
            if generating and m["id"] == self.replacing:     # the new answer streams in its place
                continue
            self._insert_message(cursor, m["role"], m["content"], (m["stats"] or {}).get("draft_spans", []))
        self._answer_at = cursor.position()
        if generating:
            self._show_partial()
        self._scroll_to_end()

    def _insert_message(self, cursor: QTextCursor, role: str, text: str, spans: list):
        if cursor.position() > 0:
            cursor.insertBlock()
        cursor.insertHtml("<b>You:</b>" if role == "user" else "<b>Assistant:</b>")
        cursor.insertBlock()
        cursor.setCharFormat(QTextCharFormat())    # the header's bold stops here
        if role == "user":
            cursor.insertText(text)          # what was typed, as typed
        elif text:
            insert_answer(cursor, text, spans, self.highlight.isChecked())
        else:
            cursor.insertText("(no text)", _note_format())

    def _show_partial(self):
        """Replace the streaming answer at the end of the transcript with its latest text."""
        doc = self.transcript.document()
        cursor = QTextCursor(doc)
        cursor.setPosition(min(self._answer_at, doc.characterCount() - 1))
        cursor.movePosition(QTextCursor.MoveOperation.End, QTextCursor.MoveMode.KeepAnchor)
        cursor.removeSelectedText()
        self._insert_message(cursor, "assistant", self.partial.text + CURSOR, self.partial.spans)
        if self.gen is not None and self.gen.kwargs.get("num_beams", 1) > 1:
            # several beams: the text above is what all of them agree on; the rest is still being searched
            cursor.insertBlock()
            cursor.insertText(searching_text(self.gen.kwargs["num_beams"], self.partial_steps), _note_format())

    def _link_clicked(self, url: QUrl):
        """A code block's copy link copies that block's text; any other link opens in the browser."""
        if url.scheme() == COPY_SCHEME:
            try:
                text = code_text(self.transcript.document(), int(url.path()))
            except ValueError:
                return
            QGuiApplication.clipboard().setText(text)
            n = text.count("\n") + 1
            self.status.setText(f"copied the code block ({n} line{'s' if n > 1 else ''})")
        elif url.scheme() in ("http", "https", "mailto"):
            QDesktopServices.openUrl(url)

    def _scroll_to_end(self):
        bar = self.transcript.verticalScrollBar()
        bar.setValue(bar.maximum())

    def _export_clicked(self):
        self.export_markdown()

    def export_markdown(self, path: str | None = None):
        """Write the conversation as Markdown; the dialog starts in the user's documents folder (or home) with
        the conversation's title as the file name."""
        cid = self.current()
        path = path or QFileDialog.getSaveFileName(self, "Export Markdown", str(export_folder() / file_name(
            self.store.title(cid))), "Markdown (*.md)")[0]
        if not path:
            return
        try:
            Path(path).write_text(self.store.export_markdown(cid), encoding="utf-8")
        except OSError as e:
            QMessageBox.warning(self, "Export failed", f"Cannot write {path}: {e.strerror or e}")
            return
        self.status.setText(f"exported to {path}")

    # -- generation ------------------------------------------------------------------------------------------
    def _prompt(self, cid: int) -> str:
        """The conversation in the model's chat template; when it is longer than the model's context (less room
        for the answer), the earliest messages are left out (`left_out` counts them; the system prompt stays)."""
        msgs = [{"role": m["role"], "content": m["content"]} for m in self.store.messages(cid)
                if m["id"] != self.replacing]
        system = self.store.system(cid)
        head = [{"role": "system", "content": system}] if system and self.engine.tokenizer.chat_template else []
        ctx = self.engine.target.cfg.context_length
        prompt, left_out = self.engine.chat_prompt(head + msgs, room=min(self.max_new.value(), ctx // 4))
        self.left_out = left_out if self.engine.tokenizer.chat_template else 0
        return prompt

    def send(self):
        text = self.input.toPlainText().strip()
        self.input.setFocus()
        if not text or self.gen is not None or not self.convs.currentItem():    # (none: a locked database)
            return
        cid = self.current()
        try:
            if not self.store.messages(cid):
                self.rename_conversation(cid, text[:40])
            self.store.add(cid, "user", text)
        except StoreLocked as e:                # the message stays in the box, to be sent again
            self.status.setText(f"{e}; your message stays in the box")
            return
        except sqlite3.DatabaseError as e:      # the message stays in the box
            QMessageBox.warning(self, "Cannot save the message", f"The conversation database {self.store.path} "
                                f"refused it ({e}); start with --db another file.")
            return
        self.input.clear()
        self._generate(cid)

    def regenerate(self):
        """A new answer to the last message. The old answer stays stored until the new one has finished; a
        stopped or failed regeneration keeps it (and stores the partial new answer after it)."""
        self.input.setFocus()
        if self.gen is not None:
            return
        cid = self.current()
        msgs = self.store.messages(cid)
        replacing = msgs[-1]["id"] if msgs and msgs[-1]["role"] == "assistant" else None
        if [m for m in msgs if m["id"] != replacing]:
            self._generate(cid, replacing)

    def _generate(self, cid: int, replacing: int | None = None):
        if self.engine is None and not self.load_models():
            self._show_conversation()
            return
        self.replacing = replacing
        sample = self.mode.currentIndex() == 1
        kwargs = dict(num_beams=self.beams.value(), max_new_tokens=self.max_new.value(), do_sample=sample)
        if sample:
            kwargs.update(temperature=self.temperature.value(), seed=int(time.time()))
        spec = None
        # the model's own lookahead head (no draft): greedy search only, on every pass (cli.configs says why)
        how = self._speculates()
        head = how == "head"
        if how:
            d = SPECULATION_DEFAULTS
            spec = speculative_config(drafter="ahead" if head else "sample" if sample else "beam",
                                      budget=max(self.budget.value(), self.beams.value()), max_depth=d.max_depth,
                                      max_branch_width=d.max_branch_width, draft_width=None, always_speculate=head,
                                      min_path_prob=AHEAD_MIN_PATH_PROB if head else d.min_path_prob)
        self.save_settings()
        try:
            prompt = self._prompt(cid)
        except ChatTemplateError as e:      # the model's template refused this conversation, or broke
            self._show_conversation()
            self.status.setText("not answered: the model's chat template failed (see the message)")
            QMessageBox.warning(self, "The chat template failed", f"{e}\n\nYour message is kept; change the "
                                f"conversation (e.g. the system prompt) or fix the model folder's template, then "
                                f"Regenerate.")
            return
        self.gen_conv, self.partial, self.partial_steps = cid, Answer(), 0
        self.gen = Generation(self.engine, prompt, kwargs, spec, self.engine_name)
        self.gen.progress.connect(self._on_progress)
        self.gen.answered.connect(self._on_answered)
        self._show_conversation()
        self._set_busy(True)
        stream = streaming_note(self.engine, self.engine_budget)
        self.status.setText(f"generating with {self.engine_name}" + ("" if spec else " (no speculation)") + "…"
                            + (f" · {stream}; the first words can take a few seconds" if stream else "")
                            + self._left_out_note())
        self.gen.start()

    def _set_busy(self, busy: bool):
        self.send_btn.setEnabled(not busy)
        self.regen_btn.setEnabled(not busy)
        self.stop_btn.setEnabled(busy)

    def stop(self):
        self.input.setFocus()
        if self.gen is not None:
            self.gen.stop()
            self.status.setText("stopping after this target pass…")

    def _on_progress(self, text: str, spans: list, steps: int):
        if self.gen is None:
            return
        self.partial, self.partial_steps = Answer(text, spans), steps
        if self.convs.currentItem() and self.current() == self.gen_conv:
            self._show_partial()
            self._scroll_to_end()

    def _on_answered(self):
        if self.gen is None:                   # already collected (the window was closed meanwhile)
            return
        self._collect()
        self._show_conversation()

    def _collect(self) -> Answer:
        """Wait for the generation thread and store its answer: a finished one (even an empty one), and the
        best text of a stopped or failed one. A finished Regenerate replaces the old answer; a stopped or
        failed one keeps it."""
        gen, self.gen = self.gen, None
        gen.wait()
        answer, self.partial = gen.answer, Answer()
        replacing, self.replacing = self.replacing, None
        self._set_busy(False)
        complete = not answer.error and not answer.stats.get("stopped")
        try:
            if answer.text or complete:
                stats = dict(answer.stats, draft_spans=answer.spans)
                if answer.error:
                    stats["error"] = answer.error
                self._stored(lambda: self.store.add(self.gen_conv, "assistant", answer.text, stats, keep=True))
            if complete and replacing is not None:
                self._stored(self.store.delete_message, replacing)
        except sqlite3.DatabaseError as e:      # say so, and show the answer where it can be copied
            QMessageBox.warning(self, "Cannot save the answer", f"The conversation database {self.store.path} "
                                f"refused it ({e}). The answer:\n\n{answer.text}")
        kept = " (the previous answer is kept)" if replacing is not None and not complete else ""
        if answer.error:
            self.status.setText("generation failed" + kept)
            QMessageBox.warning(self, "Generation failed", answer.error)
        else:
            self.status.setText(status_text(answer.stats) + kept + self._left_out_note())
        return answer

    def _left_out_note(self) -> str:
        n = getattr(self, "left_out", 0)
        return (f" · the earliest {n} message{'s' if n > 1 else ''} left out to fit the model's context"
                if n else "")

    def closeEvent(self, event):
        """Stop a running answer and keep what was streamed, remember the settings, close the database."""
        if self.gen is not None:
            self.gen.stop()
            self._collect()
        self.save_settings()
        if self.store.pending and not self._stored(self.store.retry):
            QMessageBox.warning(self, "Changes not saved", f"{self.status.text()}: {len(self.store.pending)} "
                                f"change(s) made while it was locked could not be saved.")
        self.store.close()
        super().closeEvent(event)


def status_text(stats: dict) -> str:
    """One line about the last answer, with the numbers it really had (a stopped answer counts its tokens)."""
    n, tps = stats.get("generated_tokens", 0), stats.get("tokens_per_second", 0.0)
    parts = [f"{n} tokens in {stats.get('wall_seconds', 0):.1f} s ({tps:.1f} tok/s)"]
    if stats.get("speculative"):
        steps = max(1, stats.get("beam_steps", 0))
        parts += [f"{stats.get('beam_steps_per_pass', 0):.2f} beam steps per target pass",
                  f"draft supplied {stats.get('steps_from_draft', 0) / steps:.0%} of steps"]
    else:
        parts.append("no speculation")
    reason = stats.get("finish_reason")
    if reason == "length":
        parts.append("cut at Max new tokens: raise it to let the answer finish")
    elif reason == "context":
        parts.append("cut by the model's context length")
    text = " · ".join(parts)
    return f"stopped after {text}" if stats.get("stopped") else text


def export_folder() -> Path:
    """The user's documents folder when there is one, else the home folder."""
    docs = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.DocumentsLocation)
    return Path(docs) if docs and Path(docs).is_dir() else Path.home()


def file_name(title: str) -> str:
    """A file name from a conversation's title: characters that no file system takes become '_'."""
    name = re.sub(r'[\x00-\x1f/\\:*?"<>|]+', "_", " ".join(title.split())).strip(" .")[:80]
    return f"{name or 'chat'}.md"


def searching_text(beams: int, steps: int) -> str:
    """The note under a streaming answer while several beams have not agreed on more text."""
    return f"searching {beams} beams… {steps} tokens so far"


def _note_format() -> QTextCharFormat:
    fmt = QTextCharFormat()
    fmt.setFontItalic(True)
    fmt.setForeground(QColor("#808080"))
    return fmt


def _explain(error: Exception, model: str, draft: str) -> str:
    """The loader's message; for a shipped pair's folder that this installation lacks, what to do instead."""
    for folder in (model, draft):
        if folder and not Path(folder).is_dir() and Path(folder).parent.parent == models_root():
            return missing_message(Path(folder)).replace("--model (and --draft)", "the Model and Draft fields")
    return str(error)


def default_folders() -> tuple[str, str]:
    """A fetched chat model when there is one (CHAT_MODELS' order; with the draft that pays for it, as
    `--model NAME` takes it), else the shipped text pair, which continues what you write. (The en->de pair
    translates each message into German; it is one Model/Draft choice away.)"""
    have = fetch.fetched()
    for name in CHAT_MODELS:
        if name in have:
            return str(have[name]), fetch.default_draft(name) or ""
    root = models_root() / "text"
    return str(root / "target"), str(root / "draft")


def default_beams(model: str) -> int:
    """Beams on a first start: a fetched chat model searches as `specbeam chat` does (its generation config's
    num_beams, greedy where it names none: beam search loops on small chat models); other models 4."""
    if model not in [str(p) for p in fetch.fetched().values()]:
        return 4
    try:
        return int(ModelConfig.load(model).generation.get("num_beams", 1))
    except Exception:
        return 1


def default_max_new(model: str) -> int:
    """Max new tokens on a first start: the engine's default for the folder (its generation config's, else 512
    for a chat model, whose code 128 cut mid-line, else 128)."""
    try:
        own = ModelConfig.load(model).generation.get("max_new_tokens")
    except Exception:
        own = None
    if isinstance(own, int) and own >= 1:
        return own
    return CHAT_MAX_NEW_TOKENS if has_chat_template(model) else GenerationConfig().max_new_tokens


def whole_layout(model: str) -> bool:
    """The folder's config says the whole layout (no layer streaming); False when it cannot be read (the
    engine then says what is wrong)."""
    try:
        return ModelConfig.load(model).layout == "whole"
    except Exception:
        return False


def _shown(value) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _bool(value) -> bool:
    """QSettings' INI files give booleans back as the strings 'true'/'false'."""
    return value if isinstance(value, bool) else str(value).lower() == "true"
