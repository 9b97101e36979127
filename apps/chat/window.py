"""The chat window: streams the answer (the stable prefix of the beams) off the UI thread as Markdown with the
draft's characters highlighted, Stop within one target pass, Regenerate, system prompt, model/draft pickers,
decoding settings (remembered in QSettings), and a status line.

The window's parts live beside it: the conversation list (conversations.py), the transcript (transcript.py), the
settings column (settings_panel.py) and the settings remembered between runs (settings_store.py); this module
lays them out and controls the generation."""
from __future__ import annotations

import sqlite3
import time

from PySide6.QtCore import QSettings, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (QHBoxLayout, QLabel, QLineEdit, QListWidget, QMainWindow, QMessageBox, QPlainTextEdit,
                               QPushButton, QSplitter, QTextBrowser, QVBoxLayout, QWidget)

from specbeam_edge import Engine
from specbeam_edge.config import AHEAD_MIN_PATH_PROB, SpeculativeConfig
from specbeam_edge.commands.flags import speculative_config, streaming_note
from specbeam_edge.text.tokenizer import ChatTemplateError

from .conversations import ConversationList
from .model_folders import pair_name
from .settings_panel import NO_TEMPLATE, SETTINGS_WIDTH, SettingsPanel
from .settings_store import SavedSettings
from .store import ChatStore, StoreLocked
from .transcript import DAMAGED, Transcript, searching_text
from .worker import Answer, Generation

# the tests import these from here (DAMAGED, NO_TEMPLATE, pair_name and searching_text live beside it)
__all__ = ["ChatWindow", "DAMAGED", "NO_TEMPLATE", "pair_name", "searching_text", "status_text"]

SPECULATION_DEFAULTS = SpeculativeConfig()     # the panel sets the budget; the rest are the engine's defaults
RETRY_MS = 2000                    # a change kept while another program locks the database is tried again this often


class MessageEdit(QPlainTextEdit):
    """The message box: Enter sends, Shift+Enter starts a new line."""
    submitted = Signal()

    def keyPressEvent(self, event):
        enter = event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter)
        if enter and not event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            self.submitted.emit()
            return
        super().keyPressEvent(event)


class ChatWindow(ConversationList, Transcript, SettingsPanel, SavedSettings, QMainWindow):
    """The window: its layout, menu bar and the generation (Send, Stop, Regenerate); the conversation list, the
    transcript, the settings column and their persistence come from the classes it mixes in."""

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
        # the model's own lookahead head (no draft): greedy search only, on every pass (commands.options.configs says why)
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
