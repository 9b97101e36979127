"""The chat window: streams the answer (the stable prefix of the beams) off the UI thread, Stop within one
target pass, Regenerate, system prompt, model/draft pickers, decoding settings, and a status line."""
from __future__ import annotations

import html
import time
from pathlib import Path

from PySide6.QtCore import QObject, Qt, QThread, Signal, Slot
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QFileDialog, QFormLayout, QHBoxLayout, QLabel,
                               QLineEdit, QListWidget, QListWidgetItem, QMainWindow, QMessageBox, QPlainTextEdit,
                               QPushButton, QSpinBox, QSplitter, QTextBrowser, QVBoxLayout, QWidget)

from specbeam_edge import Engine, SpeculativeConfig

from .store import ChatStore

DEFAULT_MODELS = Path(__file__).resolve().parents[2] / "models" / "ende"


class Worker(QObject):
    """Runs Engine.stream in a QThread; `stop` takes effect at the next target pass."""
    chunk = Signal(str)
    done = Signal(str, dict)
    failed = Signal(str)

    def __init__(self, engine, prompt, kwargs, spec):
        super().__init__()
        self.engine, self.prompt, self.kwargs, self.spec = engine, prompt, kwargs, spec
        self.stop_requested = False

    @Slot()
    def run(self):
        text, stats = "", {}
        try:
            for c in self.engine.stream(self.prompt, speculative=self.spec, **self.kwargs):
                text += c.text
                stats = c.stats.as_dict(per_step=True)
                if c.result is not None:
                    stats["tokens"] = c.result.hypotheses[0].tokens
                if c.text:
                    self.chunk.emit(c.text)
                if self.stop_requested:
                    stats["stopped"] = True
                    break
        except Exception as e:  # shown in the window, never a crash of the UI
            self.failed.emit(f"{type(e).__name__}: {e}")
            return
        self.done.emit(text, stats)


class ChatWindow(QMainWindow):
    def __init__(self, store: ChatStore | None = None, engine_factory=Engine):
        super().__init__()
        self.store = store or ChatStore()
        self.engine_factory, self.engine = engine_factory, None
        self.thread = self.worker = None
        self.partial = ""
        self.setWindowTitle("specbeam chat")
        self.resize(980, 640)
        self._build()
        self._load_conversations()
        self.load_models()

    # -- layout ----------------------------------------------------------------------------------------------
    def _build(self):
        self.convs = QListWidget()
        self.convs.currentItemChanged.connect(lambda *_: self._show_conversation())
        new_btn = QPushButton("New chat")
        new_btn.clicked.connect(self.new_chat)
        export_btn = QPushButton("Export Markdown…")
        export_btn.clicked.connect(self.export_markdown)
        left = QVBoxLayout()
        for w in (new_btn, self.convs, export_btn):
            left.addWidget(w)
        self.transcript = QTextBrowser()
        self.system = QLineEdit()
        self.system.setPlaceholderText("System prompt (optional)")
        self.system.editingFinished.connect(self._save_system)
        self.input = QPlainTextEdit()
        self.input.setPlaceholderText("Type a message…")
        self.input.setMaximumHeight(90)
        self.send_btn, self.stop_btn, self.regen_btn = QPushButton("Send"), QPushButton("Stop"), QPushButton("Regenerate")
        self.send_btn.clicked.connect(self.send)
        self.stop_btn.clicked.connect(self.stop)
        self.regen_btn.clicked.connect(self.regenerate)
        self.stop_btn.setEnabled(False)
        buttons = QHBoxLayout()
        for b in (self.send_btn, self.stop_btn, self.regen_btn):
            buttons.addWidget(b)
        center = QVBoxLayout()
        for w in (self.system, self.transcript, self.input):
            center.addWidget(w)
        center.addLayout(buttons)
        # settings
        self.model_edit = QLineEdit(self.store.get("model", str(DEFAULT_MODELS / "target")))
        self.draft_edit = QLineEdit(self.store.get("draft", str(DEFAULT_MODELS / "draft")))
        pick_m, pick_d = QPushButton("…"), QPushButton("…")
        pick_m.clicked.connect(lambda: self._pick(self.model_edit))
        pick_d.clicked.connect(lambda: self._pick(self.draft_edit))
        load_btn = QPushButton("Load models")
        load_btn.clicked.connect(self.load_models)
        self.mode = QComboBox()
        self.mode.addItems(["beam search (exact)", "beam sampling (DSBD)"])
        self.beams, self.budget, self.max_new = QSpinBox(), QSpinBox(), QSpinBox()
        self.beams.setRange(1, 16)
        self.beams.setValue(4)
        self.budget.setRange(1, 1024)
        self.budget.setValue(48)
        self.max_new.setRange(1, 1024)
        self.max_new.setValue(128)
        self.highlight = QCheckBox("Highlight tokens from the draft")
        self.highlight.setChecked(True)
        self.highlight.toggled.connect(lambda *_: self._show_conversation())
        self.temperature = QDoubleSpinBox()
        self.temperature.setRange(0.05, 5.0)
        self.temperature.setValue(1.0)
        form = QFormLayout()
        for label, w, btn in (("Model", self.model_edit, pick_m), ("Draft", self.draft_edit, pick_d)):
            row = QHBoxLayout()
            row.addWidget(w)
            row.addWidget(btn)
            form.addRow(label, row)
        form.addRow("", load_btn)
        form.addRow("Mode", self.mode)
        form.addRow("Beams", self.beams)
        form.addRow("Tree budget", self.budget)
        form.addRow("Max new tokens", self.max_new)
        form.addRow("Temperature", self.temperature)
        form.addRow("", self.highlight)
        split = QSplitter()
        for layout in (left, center, form):
            w = QWidget()
            w.setLayout(layout)
            split.addWidget(w)
        split.setSizes([200, 560, 280])
        self.setCentralWidget(split)
        self.status = QLabel("")
        self.statusBar().addWidget(self.status)

    def _pick(self, edit: QLineEdit):
        folder = QFileDialog.getExistingDirectory(self, "Model folder", edit.text())
        if folder:
            edit.setText(folder)

    # -- models ----------------------------------------------------------------------------------------------
    def load_models(self) -> bool:
        model, draft = self.model_edit.text().strip(), self.draft_edit.text().strip()
        try:
            self.engine = self.engine_factory(model, draft=draft or None)
        except Exception as e:
            self.engine = None
            QMessageBox.critical(self, "Cannot load the model", f"Folder: {model}\n\n{e}")
            self.status.setText("no model loaded")
            return False
        self.store.put("model", model)
        self.store.put("draft", draft)
        self.status.setText(f"loaded {Path(model).name}" + (f" + draft {Path(draft).name}" if draft else ""))
        return True

    # -- conversations ---------------------------------------------------------------------------------------
    def _load_conversations(self):
        self.convs.clear()
        for cid, title in self.store.conversations():
            item = QListWidgetItem(title)
            item.setData(Qt.UserRole, cid)
            self.convs.addItem(item)
        if self.convs.count() == 0:
            self.new_chat()
        else:
            self.convs.setCurrentRow(0)

    def current(self) -> int:
        return self.convs.currentItem().data(Qt.UserRole)

    def new_chat(self):
        cid = self.store.new_conversation()
        item = QListWidgetItem("New chat")
        item.setData(Qt.UserRole, cid)
        self.convs.insertItem(0, item)
        self.convs.setCurrentRow(0)

    def _save_system(self):
        if self.convs.currentItem():
            self.store.set_system(self.current(), self.system.text())

    def _show_conversation(self):
        if not self.convs.currentItem():
            return
        cid = self.current()
        self.system.setText(self.store.system(cid))
        parts = []
        for m in self.store.messages(cid):
            who = "You" if m["role"] == "user" else "Assistant"
            parts.append(f"<p><b>{who}:</b> {self._render(m)}</p>")
        if self.partial:
            parts.append(f"<p><b>Assistant:</b> {html.escape(self.partial)}▌</p>")
        self.transcript.setHtml("".join(parts))

    def _render(self, m: dict) -> str:
        """Assistant text with the tokens that came from the draft tree highlighted (when known)."""
        st = m.get("stats") or {}
        toks, flags = st.get("tokens"), st.get("from_draft")
        if not (toks and flags and self.engine and self.highlight.isChecked()) or st.get("stopped"):
            return html.escape(m["content"])
        dec, out, prev = self.engine.tokenizer.decode_stable, [], ""
        for i in range(len(toks)):
            cur = dec(toks[: i + 1])
            piece = html.escape(cur[len(prev):])
            prev = cur
            drafted = i < len(flags) and flags[i]
            out.append(f'<span style="background:#d8f0d8">{piece}</span>' if drafted and piece else piece)
        return "".join(out)

    def export_markdown(self, path: str | None = None):
        path = path or QFileDialog.getSaveFileName(self, "Export", "chat.md", "Markdown (*.md)")[0]
        if path:
            Path(path).write_text(self.store.export_markdown(self.current()), encoding="utf-8")

    # -- generation ------------------------------------------------------------------------------------------
    def _prompt(self, cid: int) -> str:
        tok = self.engine.tokenizer
        msgs = [{"role": m["role"], "content": m["content"]} for m in self.store.messages(cid)]
        if tok.chat_template:
            system = self.store.system(cid)
            return tok.apply_chat_template(([{"role": "system", "content": system}] if system else []) + msgs)
        return tok.format_prompt(msgs[-1]["content"])   # a translation model: translate the last message

    def send(self):
        text = self.input.toPlainText().strip()
        if not text or self.thread is not None:
            return
        cid = self.current()
        if not self.store.messages(cid):
            self.store.set_title(cid, text[:40])
            self.convs.currentItem().setText(text[:40])
        self.store.add(cid, "user", text)
        self.input.clear()
        self._generate(cid)

    def regenerate(self):
        if self.thread is not None:
            return
        cid = self.current()
        msgs = self.store.messages(cid)
        if msgs and msgs[-1]["role"] == "assistant":
            self.store.delete_message(msgs[-1]["id"])
        if self.store.messages(cid):
            self._generate(cid)

    def _generate(self, cid: int):
        if self.engine is None and not self.load_models():
            return
        sample = self.mode.currentIndex() == 1
        kwargs = dict(num_beams=self.beams.value(), max_new_tokens=self.max_new.value(), do_sample=sample,
                      temperature=self.temperature.value(), seed=int(time.time()) if sample else None)
        spec = None
        if self.engine.draft is not None:
            spec = SpeculativeConfig(drafter="sample" if sample else "beam",
                                     budget=max(self.budget.value(), self.beams.value()), adaptive=True)
        self.partial = ""
        self.worker = Worker(self.engine, self._prompt(cid), kwargs, spec)
        self.thread = QThread()
        self.worker.moveToThread(self.thread)
        self.thread.started.connect(self.worker.run)
        self.worker.chunk.connect(self._on_chunk)
        self.gen_conv = cid
        self.worker.done.connect(self._on_done)      # bound slots: queued to the UI thread
        self.worker.failed.connect(self._on_failed)
        self.send_btn.setEnabled(False)
        self.regen_btn.setEnabled(False)
        self.stop_btn.setEnabled(True)
        self.status.setText("generating…")
        self.thread.start()

    def stop(self):
        if self.worker is not None:
            self.worker.stop_requested = True

    @Slot(str)
    def _on_chunk(self, text: str):
        self.partial += text
        self._show_conversation()

    def _finish(self):
        self.thread.quit()
        self.thread.wait()
        self.thread = self.worker = None
        self.partial = ""
        self.send_btn.setEnabled(True)
        self.regen_btn.setEnabled(True)
        self.stop_btn.setEnabled(False)

    @Slot(str, dict)
    def _on_done(self, text: str, stats: dict):
        self._finish()
        self.store.add(self.gen_conv, "assistant", text, stats)
        self._show_conversation()
        flags = stats.get("from_draft") or []
        share = sum(flags) / max(1, len(flags))          # beam steps whose tokens the draft tree supplied
        self.status.setText(f"{stats.get('tokens_per_second', 0):.1f} tok/s · "
                            f"{stats.get('beam_steps_per_pass', 0):.2f} beam steps/pass · "
                            f"draft share {share:.0%}" + (" · stopped" if stats.get("stopped") else ""))

    @Slot(str)
    def _on_failed(self, message: str):
        self._finish()
        QMessageBox.warning(self, "Generation failed", message)
        self.status.setText("generation failed")
