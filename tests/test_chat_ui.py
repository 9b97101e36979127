"""The chat window's layout and commands (offscreen Qt): a settings column that a long model name cannot widen,
a system-prompt hint that fits, conversations renamed and deleted from the list's context menu and the menu
bar, shortcuts, Export's default file, and a default model that chats instead of translating."""
import os
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

from PySide6.QtCore import QSettings, QStandardPaths, Qt  # noqa: E402
from PySide6.QtWidgets import QMessageBox  # noqa: E402

from apps.chat.store import ChatStore  # noqa: E402
from apps.chat.window import NO_TEMPLATE, ChatWindow  # noqa: E402
from specbeam_edge import Engine  # noqa: E402
from specbeam_edge.shipped import models_root  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def window(qtbot, tmp_path, folders=None, show=True, factory=Engine):
    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    if folders:
        settings.setValue("model", folders[0])
        settings.setValue("draft", folders[1])
    win = ChatWindow(ChatStore(tmp_path / "chat.sqlite"), engine_factory=factory, settings=settings)
    qtbot.addWidget(win)
    if show:
        win.show()
        qtbot.waitExposed(win)
    return win


def test_a_long_model_name_elides_instead_of_widening_the_settings(qtbot, tmp_path, pair):
    short = window(qtbot, tmp_path / "a", pair)
    widths = [short.split.widget(i).width() for i in range(3)]
    long_dir = tmp_path / ("a-model-folder-with-a-very-long-descriptive-name-" * 3 + "v2")
    long_dir.symlink_to(pair[0])
    win = window(qtbot, tmp_path / "b", (str(long_dir), pair[1]))
    assert win.engine is not None
    assert win.split.widget(2).width() <= max(330, widths[2])         # before: the column grew to fit the name
    assert win.split.widget(1).width() >= widths[1] - 5                # and the transcript kept its width
    assert win.pair.toolTip() == win.engine_name and "…" in win.pair.text()


def test_the_system_prompt_hint_fits_its_field(qtbot, tmp_path):
    ende = models_root() / "ende"
    win = window(qtbot, tmp_path, (str(ende / "target"), str(ende / "draft")))
    assert not win.system.isEnabled()
    hint = win.system.placeholderText()
    assert win.system.fontMetrics().horizontalAdvance(hint) <= win.system.width() - 8   # before: cut off
    assert win.system.toolTip() == NO_TEMPLATE


def conversations(win):
    return [win.convs.item(i).text() for i in range(win.convs.count())]


def test_rename_and_delete_from_the_context_menu_and_the_menu_bar(qtbot, tmp_path, pair, monkeypatch):
    win = window(qtbot, tmp_path, pair)
    first = win.current()
    win.store.set_title(first, "first")
    win.new_chat()
    second = win.current()
    monkeypatch.setattr("apps.chat.conversations.QInputDialog.getText", lambda *a, **kw: ("  Java   generics ", True))
    rect = win.convs.visualItemRect(win.convs.item(1))
    win._conversation_menu(rect.center())                              # right-click on the older one
    assert win.current() == first
    texts = [a.text() for a in win._menu.actions()]
    assert texts[:2] == ["Re&name conversation…", "&Delete conversation…"]
    win._menu.actions()[0].trigger()
    assert win.store.title(first) == "Java generics" and conversations(win) == ["New chat", "Java generics"]
    asked = []
    monkeypatch.setattr("apps.chat.conversations.QMessageBox.question",
                        lambda parent, title, text: asked.append(text) or QMessageBox.StandardButton.No)
    win.actions["delete"].trigger()
    assert "Java generics" in asked[0] and len(win.store.conversations()) == 2     # "No" keeps it
    monkeypatch.setattr("apps.chat.conversations.QMessageBox.question",
                        lambda parent, title, text: QMessageBox.StandardButton.Yes)
    win.actions["delete"].trigger()
    assert [c for c, _ in win.store.conversations()] == [second] and conversations(win) == ["New chat"]
    win.actions["delete"].trigger()                                    # the last one: a fresh chat replaces it
    assert len(win.store.conversations()) == 1 and win.store.conversations()[0][0] != second


def test_deleting_the_conversation_being_answered_stops_the_answer(qtbot, tmp_path, pair, monkeypatch):
    win = window(qtbot, tmp_path, pair)
    win.max_new.setValue(300)
    win.input.setPlainText("hello")
    win.send_btn.click()
    cid = win.current()
    assert win.gen is not None
    win.delete_conversation(cid)
    assert win.gen is None and win.convs.count() == 1 and len(win.store.conversations()) == 1
    assert win.store.messages(win.current()) == [] and win.store.title(win.current()) == "New chat"


def test_menu_bar_and_shortcuts(qtbot, tmp_path, pair, monkeypatch):
    win = window(qtbot, tmp_path, pair)
    found = {}
    for menu_action in win.menuBar().actions():
        for act in menu_action.menu().actions():
            if act.text():
                found[act.text().replace("&", "")] = act.shortcut().toString()
    assert {k: found[k] for k in ("New chat", "Export Markdown…", "Quit", "Stop", "Regenerate", "Send",
                                  "Rename conversation…", "Delete conversation…", "Load models")} == {
        "New chat": "Ctrl+N", "Export Markdown…": "Ctrl+E", "Quit": "Ctrl+Q", "Stop": "Esc", "Regenerate": "Ctrl+R",
        "Send": "Ctrl+Return", "Rename conversation…": "F2", "Delete conversation…": "Ctrl+Shift+D",
        "Load models": "Ctrl+L"}
    with qtbot.waitActive(win):
        win.activateWindow()
    win.input.setFocus()
    qtbot.keyClick(win.input, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier)
    assert len(win.store.conversations()) == 2                          # Ctrl+N: a new chat
    win.max_new.setValue(300)
    win.input.setPlainText("the quick brown fox")
    qtbot.keyClick(win.input, Qt.Key.Key_Return)
    assert win.gen is not None
    qtbot.keyClick(win.input, Qt.Key.Key_Escape)                       # Esc: Stop
    assert win.gen is None or win.gen._stop.is_set()
    qtbot.waitUntil(lambda: win.gen is None, timeout=20000)
    assert win.store.messages(win.current())[-1]["stats"]["stopped"]
    qtbot.keyClick(win.input, Qt.Key.Key_Q, Qt.KeyboardModifier.ControlModifier)
    assert not win.isVisible()                                          # Ctrl+Q: quit (the window closes)


def test_export_defaults_to_documents_with_the_title(qtbot, tmp_path, pair, monkeypatch):
    win = window(qtbot, tmp_path, pair, show=False)
    win.rename_conversation(win.current(), 'Java: List<String> / "generics"?')
    asked = []
    target = tmp_path / "out.md"
    monkeypatch.setattr("apps.chat.conversations.QFileDialog.getSaveFileName",
                        lambda parent, caption, start, filters: asked.append(start) or (str(target), filters))
    win.actions["export"].trigger()
    default = Path(asked[0])
    docs = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.DocumentsLocation)
    assert default.name == "Java_ List_String_ _ _generics_.md"        # before: chat.md in the working folder
    assert default.parent in ({Path(docs)} if docs and Path(docs).is_dir() else set()) | {Path.home()}
    assert target.read_text().startswith('# Java: List<String> / "generics"?')
    assert win.status.text() == f"exported to {target}"


def test_export_to_a_folder_that_cannot_be_written_is_a_message(qtbot, tmp_path, pair, monkeypatch):
    shown = []
    monkeypatch.setattr("apps.chat.window.QMessageBox.warning", lambda parent, title, text: shown.append(text))
    win = window(qtbot, tmp_path, pair, show=False)
    win.export_markdown(str(tmp_path / "no" / "such" / "folder.md"))
    assert len(shown) == 1 and shown[0].startswith(f"Cannot write {tmp_path / 'no' / 'such' / 'folder.md'}: ")


def test_the_default_model_chats_and_the_translator_says_so(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBEAM_MODELS", str(ROOT / "models"))
    monkeypatch.setenv("SPECBEAM_DATA_DIR", str(tmp_path / "data"))    # no fetched model
    win = window(qtbot, tmp_path, None, show=False)                    # first start: no settings
    assert win.model_edit.text() == str(ROOT / "models" / "text" / "target")   # before: the en->de translator
    assert win.draft_edit.text() == str(ROOT / "models" / "text" / "draft")
    assert win.engine is not None and win.kind.text() == "completion: each message is continued"
    win.model_edit.setText(str(ROOT / "models" / "ende" / "target"))
    win.draft_edit.setText(str(ROOT / "models" / "ende" / "draft"))
    assert win.load_models()
    assert win.kind.text() == "translator: each message is translated into German"


def test_the_documentation_screenshot_renders_the_code_answer(qtbot, tmp_path, monkeypatch):
    from apps.chat import screenshot

    monkeypatch.setenv("SPECBEAM_MODELS", str(ROOT / "models"))
    out = tmp_path / "shot.png"
    text = screenshot.render(out)
    assert "List<String> names = new ArrayList<>();" in text and '<div id="names"></div> stays visible' in text
    assert "a<b, &amp; and <script>alert(1)</script>." in text
    from PySide6.QtGui import QImage

    image = QImage(str(out))
    assert image.width() == 1100 and image.height() == 720


def test_app_counts_the_answers_tokens_and_says_when_it_was_cut(qtbot, tmp_path, exported):
    """Before: the app's tok/s divided the search's beam steps (20% high under beam search) and a cut answer
    looked finished (issue 49 items 6, 7)."""
    from apps.chat.window import status_text

    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    settings.setValue("model", str(exported("llama", std=0.3, seed=3)))
    settings.setValue("draft", "")
    win = ChatWindow(ChatStore(tmp_path / "chat.sqlite"), settings=settings)
    qtbot.addWidget(win)
    win.engine.eos = list(range(0, win.engine.target.cfg.vocab_size, 2))   # answers end early; beams go on
    win.beams.setValue(4)
    win.max_new.setValue(24)
    win.input.setPlainText("hello")
    win.send_btn.click()
    qtbot.waitUntil(lambda: win.gen is None, timeout=30000)
    st = win.store.messages(win.current())[-1]["stats"]
    eos = set(win.engine.eos)
    assert st["finish_reason"] == "stop" and st["beam_steps"] > st["generated_tokens"]
    assert st["generated_tokens"] == sum(1 for t in st["tokens"] if t not in eos)
    assert st["tokens_per_second"] * st["wall_seconds"] == pytest.approx(st["generated_tokens"], abs=0.5)
    cut = dict(generated_tokens=6, wall_seconds=1.0, tokens_per_second=6.0, finish_reason="length")
    assert status_text(cut) == "6 tokens in 1.0 s (6.0 tok/s) · no speculation · cut at Max new tokens: raise it " \
                               "to let the answer finish"


def test_a_template_error_is_a_dialog_and_the_status_says_so(qtbot, tmp_path, exported, monkeypatch):
    """Before: Send with a template that raises (e.g. Mistral-style "roles must alternate" with a system prompt)
    stored the message and nothing else, the status said "ready", the traceback went to stderr only (issue 50
    row 20)."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(exported("llama", std=0.3, seed=3), model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% if messages[0].role == 'system' %}{{ raise_exception('Conversation roles must "
                            "alternate user/assistant/user/assistant/...') }}{% endif %}{{ messages[-1].content }}")
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    settings.setValue("model", str(model))
    settings.setValue("draft", "")
    win = ChatWindow(ChatStore(tmp_path / "chat.sqlite"), settings=settings)
    qtbot.addWidget(win)
    shown = []
    monkeypatch.setattr("apps.chat.window.QMessageBox.warning", lambda parent, title, text: shown.append(text))
    win.system.setText("be brief")
    win._save_system()
    win.input.setPlainText("hello")
    win.send_btn.click()
    assert win.gen is None and len(shown) == 1 and "roles must alternate" in shown[0], shown
    assert str(model / "tokenizer_config.json") in shown[0]
    assert "chat template failed" in win.status.text()
    assert [m["content"] for m in win.store.messages(win.current())] == ["hello"]     # the message is kept


def fetched_as(data, name, source_folder):
    """A tiny model placed where `specbeam fetch NAME` puts its folder (complete: with fetched.json)."""
    from helpers import chat_defaults_folder
    from specbeam_edge import fetch

    dst = data / "models" / fetch.SOURCES[name].folder
    chat_defaults_folder(source_folder, dst)     # a GGUF's export names no beams or length of its own
    (dst / fetch.MARKER).write_text("{}")
    return dst


def test_the_app_opens_on_a_fetched_chat_model(qtbot, tmp_path, pair, monkeypatch):
    """Before: a first start opened the shipped demo completion pair even with SmolLM2 (or Qwen2.5-Coder)
    fetched (issue 49 item 9)."""
    monkeypatch.setenv("SPECBEAM_MODELS", str(ROOT / "models"))
    data = tmp_path / "data"
    monkeypatch.setenv("SPECBEAM_DATA_DIR", str(data))
    smol = fetched_as(data, "smollm2", pair[0])
    win = window(qtbot, tmp_path / "a", None, show=False)
    assert (win.model_edit.text(), win.draft_edit.text()) == (str(smol), "")
    assert win.engine is not None and win.beams.value() == 1          # greedy, as `specbeam chat` searches it
    assert win.known.currentText() == "smollm2-135m-instruct (fetched, no draft)"
    qwen = fetched_as(data, "qwen2.5-coder-1.5b", pair[0])            # preferred, with its fetched 0.5B drafting
    draft = fetched_as(data, "qwen2.5-coder-0.5b", pair[1])
    win = window(qtbot, tmp_path / "b", None, show=False)
    assert (win.model_edit.text(), win.draft_edit.text()) == (str(qwen), str(draft))
    assert win.engine is not None and win.engine.draft is not None
    assert win.known.currentText() == "qwen2.5-coder-1.5b-instruct (fetched, with its draft)"


@pytest.fixture(scope="module")
def with_head(exported, tmp_path_factory):
    """The tiny target with a (random) lookahead head and no draft, as a fetched SmolLM2 is."""
    import shutil

    import numpy as np

    from export import ahead
    from specbeam_edge.execution.model import OnnxCausalLM

    plain = exported("llama", output="both", std=0.3, seed=3)
    folder = tmp_path_factory.mktemp("ahead") / "target"
    shutil.copytree(plain, folder)
    cfg = OnnxCausalLM(plain).cfg
    tokens = np.sort(np.random.default_rng(5).choice(cfg.vocab_size, 40, replace=False))
    ahead.attach(folder, ahead.random_weights(cfg.hidden_size, seed=1, scale=0.3), tokens, guesses=2, depth=3,
                 digest="test")
    return str(folder)


def test_speculate_box_status_and_loaded_label_agree(qtbot, tmp_path, with_head):
    """Before: a model whose lookahead head drafts (greedy only) with Beams 4 showed Speculate checked while the
    answer's status said "no speculation" and Loaded said "(no draft)" (issue 49 item 9)."""
    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    for key, value in (("model", with_head), ("draft", ""), ("beams", 4), ("speculate", True)):
        settings.setValue(key, value)
    win = ChatWindow(ChatStore(tmp_path / "chat.sqlite"), settings=settings)
    qtbot.addWidget(win)
    assert win.engine.draft is None and win.engine.target.ahead is not None
    assert "lookahead head" in win.pair.text()
    assert not win.speculate.isChecked() and not win.speculate.isEnabled()
    assert "one beam only" in win.speculate.toolTip() and "no speculation" in win.status.text()
    win.max_new.setValue(4)
    win.input.setPlainText("hello")
    win.send_btn.click()
    qtbot.waitUntil(lambda: win.gen is None, timeout=30000)
    assert win.store.messages(win.current())[-1]["stats"]["speculative"] is False
    assert "no speculation" in win.status.text() and not win.speculate.isChecked()
    win.beams.setValue(1)                        # the head drafts now: the box shows the user's choice again
    assert win.speculate.isChecked() and win.speculate.isEnabled() and win.speculate.text().endswith("head)")
    win.input.setPlainText("hello")
    win.send_btn.click()
    qtbot.waitUntil(lambda: win.gen is None, timeout=30000)
    assert win.store.messages(win.current())[-1]["stats"]["speculative"] is True
    assert "no speculation" not in win.status.text()
    win.mode.setCurrentIndex(1)                  # beam sampling: the head does not draft for it
    assert not win.speculate.isChecked() and not win.speculate.isEnabled()
    win.close()
    assert _bool_setting(settings, "speculate")  # the user's choice is kept, not the disabled box's state


def _bool_setting(settings, key):
    return str(settings.value(key)).lower() == "true"


def test_known_models_keeps_showing_the_choice(qtbot, tmp_path, pair, monkeypatch):
    """Before: the Known models box snapped back to its placeholder after a choice (issue 49 item 9)."""
    monkeypatch.setenv("SPECBEAM_MODELS", str(ROOT / "models"))
    monkeypatch.setenv("SPECBEAM_DATA_DIR", str(tmp_path / "data"))
    win = window(qtbot, tmp_path, pair, show=False)
    assert win.known.currentIndex() == 0                                # the loaded pair is none of its entries
    labels = [win.known.itemText(i) for i in range(win.known.count())]
    i = next(n for n, t in enumerate(labels) if t.startswith("text ("))
    win.known.setCurrentIndex(i)
    win.known.activated.emit(i)                                         # what choosing it does
    assert win.model_edit.text() == str(ROOT / "models" / "text" / "target")
    assert win.known.currentIndex() == i and win.known.currentText() == labels[i]
    win.known.refresh()                                                 # what opening the list again does
    assert win.known.currentIndex() == i
    win.model_edit.setText(pair[0])
    win.draft_edit.setText(pair[1])
    assert win.load_models() and win.known.currentIndex() == 0


def test_code_blocks_render_as_code_with_a_copy_link(qtbot, tmp_path, pair):
    """Before: fenced code had no background and no way to copy it (issue 49 item 9)."""
    from PySide6.QtCore import QUrl
    from PySide6.QtGui import QGuiApplication

    from apps.chat.render import CODE_BACKGROUND, COPY_SCHEME, is_code

    win = window(qtbot, tmp_path, pair, show=False)
    cid = win.current()
    win.store.add(cid, "user", "two snippets")
    win.store.add(cid, "assistant", "First:\n\n```python\ndef f():\n    return a<b\n```\n\nThen:\n\n```\nls -l\n```\n"
                                    "done", {})
    win._show_conversation()
    doc = win.transcript.document()
    code, links, block = [], [], doc.begin()
    while block.isValid():
        if is_code(block):
            assert block.blockFormat().background().color() == CODE_BACKGROUND
            assert block.begin().fragment().charFormat().fontFixedPitch()
            code.append(block.text())
        it = block.begin()
        while not it.atEnd():
            fmt = it.fragment().charFormat()
            if fmt.isAnchor() and fmt.anchorHref().startswith(COPY_SCHEME + ":"):
                links.append((it.fragment().text(), fmt.anchorHref()))
            it += 1
        block = block.next()
    assert code == ["def f():", "    return a<b", "ls -l"]
    assert [t for t, _ in links] == ["Copy code", "Copy code"]
    assert "done" in win.transcript.toPlainText().split("Copy code")[-1]
    for (_, href), text in zip(links, ("def f():\n    return a<b", "ls -l")):
        win.transcript.anchorClicked.emit(QUrl(href))
        assert QGuiApplication.clipboard().text() == text
    assert win.status.text() == "copied the code block (1 line)"


def test_an_answer_that_opens_with_code_has_its_first_line_in_the_code(qtbot, tmp_path, pair):
    """Issue 66: the answer's first block merged into the empty line under "Assistant:", which kept its own
    format, so the first line of an answer opening with a fence was drawn outside the code background (the
    coder's screenshot) and left out of Copy code."""
    import re

    win = window(qtbot, tmp_path, pair, show=False)
    cid = win.current()
    win.store.add(cid, "user", "a function")
    win.store.add(cid, "assistant", "```python\ndef f():\n    return 1\n```\nThen:\n\n```\nls -l\n```", {})
    win._show_conversation()
    html = win.transcript.document().toHtml()
    shaded = [re.sub(r"<[^>]+>", "", m) for m in re.findall(r'<pre style="[^"]*background-color:[^"]*">(.*?)</pre>',
                                                           html)]
    assert shaded == ["def f():", "    return 1", "ls -l"], html
    assert "Assistant:</span></p>" in html.replace("\n", "")


def test_memory_budget_streams_layers_and_the_status_says_so(qtbot, tmp_path, exported, monkeypatch):
    """Issue 46 item 4: the app's memory budget reloads the engine with max_memory; the status says how many
    layers stream. Before: no such setting."""
    from specbeam_edge.execution.model import OnnxCausalLM

    split = str(exported("llama", "fp32", "split", layers=4, std=0.3, seed=3))
    place = OnnxCausalLM(split).runner.placement
    budget = place.resident_minimum + 3 * place.layer_bytes       # embeddings/head, 2 buffers, 1 resident layer
    win = window(qtbot, tmp_path, (split, ""), show=False)
    assert win.engine.target.streamed_layers() == 0 and "stream" not in win.status.text()
    win.memory.setText(f"{budget}B")
    assert win.load_models()
    assert win.engine.target.streamed_layers() == 3
    assert "3 of 4 layers stream from disk each pass (budget" in win.status.text()
    win.max_new.setValue(4)
    win.input.setPlainText("hello")
    win.send_btn.click()
    assert "layers stream from disk" in win.status.text()
    qtbot.waitUntil(lambda: win.gen is None, timeout=30000)
    assert win.store.messages(win.current())[-1]["content"]
    win.close()
    again = window(qtbot, tmp_path, None, show=False)              # remembered
    assert again.memory.text() == f"{budget}B" and again.engine.target.streamed_layers() == 3
    shown = []
    monkeypatch.setattr("apps.chat.window.QMessageBox.critical", lambda parent, title, text: shown.append(text))
    again.memory.setText("lots")
    assert not again.load_models() and "Memory budget" in shown[0]
    again.memory.setText("")                                       # empty: every layer resident
    assert again.load_models() and again.engine.target.streamed_layers() == 0
